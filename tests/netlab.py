"""A network lab on one Linux machine: N nodes, each a network namespace on its own address,
joined by a bridge, with the faults a replicated broker must survive.

Layout of one lab (``K`` is the first free third octet, ``P`` this process id, ``L`` a counter
of labs in this process)::

    host (clients)  10.77.K.1  on bridge nl<P>-<L>b
      veth nl<P>-<L>h<i>  <->  eth0 in namespace netlab-<P>-<L>-n<i>   10.77.K.<11+i>

Every namespace has its loopback up and one nftables table (``inet netlab``) with an input
chain where faults put their rules. Faults drop packets at the *receiver's* input hook, as a
lost packet on a wire would: a drop on output would hand the sender an EPERM, which no real
partition does. So:

- ``isolate(n)``: n drops everything from the other nodes and they drop everything from n
  (a full partition; ``clients=True`` also drops what the host sends to n);
- ``cut(src, dst)``: dst drops what src sends (src cannot reach dst, dst still reaches src;
  TCP cannot hold a connection either way, as with Jepsen's one-way partitions);
- ``drop(n, percent)``: n and its peers drop that share of each other's packets at random
  (``numgen random mod 100 < P``: this kernel has no netem);
- ``heal()`` flushes every rule; ``spawn`` runs a process in a node in its own process group,
  so ``kill`` (SIGKILL), ``pause`` (SIGSTOP) and ``resume`` (SIGCONT) reach its children too.

Invariant: leaving the ``Lab`` context (normally, on an exception, on Ctrl-C or on SIGTERM)
kills every process group it spawned and removes every namespace, veth and bridge it created;
the nftables tables live inside the namespaces and go with them. Entering it first sweeps the
leftovers of labs whose process is dead (a run killed with SIGKILL), by name.

Needs root, ``ip`` (iproute2) and ``nft`` (nftables); ``unavailable_reason()`` says what is
missing, for a test's skip message.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType

NS_PREFIX = "netlab-"
LINK_PREFIX = "nl"
SUBNET_BASE = "10.77"
FIRST_NODE_HOST = 11
NFT_TABLE = "netlab"
#: Serialises the choice of a free subnet between labs set up at the same moment.
LOCK_PATH = Path("/run/netlab.lock")

_NS_RE = re.compile(rf"^{NS_PREFIX}(\d+)-\d+-n\d+$")
_LINK_RE = re.compile(rf"^{LINK_PREFIX}(\d+)-\d+[bh]\d*$")
_lab_counter = itertools.count()


class NetlabError(RuntimeError):
    """A lab command failed; the message holds the command and its stderr."""


def unavailable_reason() -> str | None:
    """Why a lab cannot be built here (for ``pytest.skip``), or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the lab tests as root)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian package {package})"
    return None


def run(argv: Sequence[str], *, check: bool = True, stdin: str | None = None) -> str:
    """Run one command, return its stdout; a failure raises NetlabError naming the command."""
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetlabError(f"{' '.join(argv)} -> {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list``, ids stripped)."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line]


def list_links() -> list[str]:
    """Names of all links in the host namespace (a veth's ``@peer`` suffix stripped)."""
    out = run(["ip", "-o", "link", "show"])
    return [line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line]


def _kill_namespace_pids(ns: str) -> None:
    for pid in run(["ip", "netns", "pids", ns], check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def sweep_leftovers() -> list[str]:
    """Remove namespaces and links a dead lab left behind (its pid is in their names);
    return what was removed. A live lab's resources, in this or another process, are kept."""
    removed: list[str] = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace_pids(ns)
            run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    for link in list_links():
        m = _LINK_RE.match(link)
        if m and not _pid_alive(int(m.group(1))) and link in list_links():
            run(["ip", "link", "del", link], check=False)
            removed.append(link)
    return removed


@dataclass(frozen=True)
class Node:
    """One namespace of the lab: ``name`` is ``n<index>``, ``addr`` its IPv4 address."""

    index: int
    name: str
    ns: str
    addr: str


@dataclass
class Proc:
    """A process started in a node, leader of its own process group (pgid == pid)."""

    node: Node
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path | None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the whole group (the process and every child it forked)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def kill(self, timeout: float = 10.0) -> None:
        """kill -9 of the group, then reap the leader. Children still exiting may hold
        resources (a lock file) a moment after this returns."""
        self.signal_group(signal.SIGKILL)
        self.popen.wait(timeout)

    def pause(self) -> None:
        self.signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal_group(signal.SIGCONT)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM (continued first, should it be paused); SIGKILL after ``timeout``."""
        self.signal_group(signal.SIGCONT)
        self.signal_group(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.wait()

    def group_alive(self) -> bool:
        """Any process of the group still exists (zombies of the reaped leader aside)."""
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""


@dataclass
class Lab:
    """N namespaces on a bridge; a context manager (see the module docstring for the
    invariant on leaving it)."""

    n: int
    nodes: list[Node] = field(default_factory=list)
    host_addr: str = ""
    subnet: str = ""
    bridge: str = ""
    procs: list[Proc] = field(default_factory=list)
    #: Human-readable description of each fault in force (``heal`` empties it).
    faults: list[str] = field(default_factory=list)
    _veths: list[str] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)
    _old_sigterm: object = None

    def __enter__(self) -> Lab:
        reason = unavailable_reason()
        if reason is not None:
            raise NetlabError(reason)
        self._trap_sigterm()
        try:
            sweep_leftovers()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ set-up / tear-down

    def _trap_sigterm(self) -> None:
        """SIGTERM unwinds like Ctrl-C, through __exit__ (only the main thread may set it)."""

        def on_term(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        with contextlib.suppress(ValueError):
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                self._old_sigterm = signal.signal(signal.SIGTERM, on_term)

    def _build(self) -> None:
        lab_id = f"{os.getpid()}-{next(_lab_counter)}"
        self.bridge = f"{LINK_PREFIX}{lab_id}b"
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            k = _free_octet()
            self.subnet = f"{SUBNET_BASE}.{k}.0/24"
            self.host_addr = f"{SUBNET_BASE}.{k}.1"
            run(["ip", "link", "add", self.bridge, "type", "bridge"])
            run(["ip", "addr", "add", f"{self.host_addr}/24", "dev", self.bridge])
            run(["ip", "link", "set", self.bridge, "up"])
        for i in range(self.n):
            ns = f"{NS_PREFIX}{lab_id}-n{i}"
            veth = f"{LINK_PREFIX}{lab_id}h{i}"
            addr = f"{SUBNET_BASE}.{k}.{FIRST_NODE_HOST + i}"
            run(["ip", "netns", "add", ns])
            self._namespaces.append(ns)
            run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            self._veths.append(veth)
            run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            self._in(ns, "ip", "link", "set", "lo", "up")
            self._in(ns, "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
            self._in(ns, "ip", "link", "set", "eth0", "up")
            run(
                ["ip", "netns", "exec", ns, "nft", "-f", "-"],
                stdin=f"table inet {NFT_TABLE} {{\n chain input {{ type filter hook input "
                "priority 0; policy accept; }\n}\n",
            )
            self.nodes.append(Node(i, f"n{i}", ns, addr))

    def close(self) -> None:
        """Kill every spawned group, delete namespaces, veths and the bridge. Idempotent;
        every step runs even when an earlier one failed."""
        for p in self.procs:
            p.signal_group(signal.SIGCONT)
            p.signal_group(signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(10)
        for ns in self._namespaces:
            _kill_namespace_pids(ns)
            run(["ip", "netns", "del", ns], check=False)
        links = set(list_links())
        for link in [*self._veths, self.bridge]:
            if link and link in links:
                run(["ip", "link", "del", link], check=False)
        self._namespaces.clear()
        self._veths.clear()
        self.bridge = ""
        if self._old_sigterm is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._old_sigterm)  # type: ignore[arg-type]
            self._old_sigterm = None

    # ------------------------------------------------------------------ processes

    @staticmethod
    def _in(ns: str, *argv: str) -> str:
        return run(["ip", "netns", "exec", ns, *argv])

    def exec(self, node: Node, *argv: str, check: bool = True) -> str:
        """Run a short command in ``node`` and return its stdout."""
        return run(["ip", "netns", "exec", node.ns, *argv], check=check)

    def spawn(
        self,
        node: Node,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> Proc:
        """Start ``argv`` in ``node`` in a new session (its own process group); stdout and
        stderr go to ``log_path`` (appended) or are discarded."""
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", node.ns, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            if log_path:
                out.close()  # type: ignore[union-attr]
        proc = Proc(node, list(argv), popen, log_path)
        self.procs.append(proc)
        return proc

    # ------------------------------------------------------------------ faults

    def _block(self, dst: Node, srcs: Iterable[str], percent: int = 100) -> None:
        addrs = sorted(set(srcs))
        if not addrs:
            return
        if not 0 < percent <= 100:
            raise ValueError(f"drop percent must be in 1..100, got {percent}")
        rule = ["ip", "saddr", "{", ", ".join(addrs), "}"]
        if percent < 100:
            rule += ["numgen", "random", "mod", "100", "<", str(percent)]
        self.exec(dst, "nft", "add", "rule", "inet", NFT_TABLE, "input", *rule, "drop")

    def peers(self, node: Node) -> list[Node]:
        return [m for m in self.nodes if m != node]

    def isolate(self, node: Node, *, clients: bool = False) -> None:
        """Full partition of ``node`` from the other nodes (and from the host's clients
        too with ``clients``)."""
        srcs = [m.addr for m in self.peers(node)] + ([self.host_addr] if clients else [])
        self._block(node, srcs)
        for m in self.peers(node):
            self._block(m, [node.addr])
        self.faults.append(f"isolate {node.name}" + (" +clients" if clients else ""))

    def cut(self, src: Node, dst: Node) -> None:
        """One-way partition: packets from ``src`` to ``dst`` are lost; dst's reach src."""
        self._block(dst, [src.addr])
        self.faults.append(f"cut {src.name}->{dst.name}")

    def drop(self, node: Node, percent: int) -> None:
        """``percent`` of the packets between ``node`` and each other node are lost, at
        random, in both directions."""
        self._block(node, [m.addr for m in self.peers(node)], percent)
        for m in self.peers(node):
            self._block(m, [node.addr], percent)
        self.faults.append(f"drop {percent}% {node.name}")

    def heal(self) -> None:
        """Remove every network fault (processes paused or killed are the caller's)."""
        for node in self.nodes:
            self.exec(node, "nft", "flush", "chain", "inet", NFT_TABLE, "input")
        self.faults.clear()

    def rules(self, node: Node) -> str:
        """The node's fault rules as nft lists them (for a failure message)."""
        return self.exec(node, "nft", "list", "chain", "inet", NFT_TABLE, "input")


def _free_octet() -> int:
    """The lowest K such that no host address lies in 10.77.K.0/24."""
    used: set[int] = set()
    for line in run(["ip", "-4", "-o", "addr", "show"]).splitlines():
        parts = line.split()
        if "inet" in parts:
            ip = ipaddress.ip_interface(parts[parts.index("inet") + 1]).ip
            octets = str(ip).split(".")
            if ".".join(octets[:2]) == SUBNET_BASE:
                used.add(int(octets[2]))
    for k in range(256):
        if k not in used:
            return k
    raise NetlabError(f"no free /24 left in {SUBNET_BASE}.0.0/16")


def wait_tcp(addr: str, port: int, timeout: float = 20.0) -> None:
    """Until something accepts TCP on ``addr:port`` (from the host), or NetlabError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=0.5):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise NetlabError(f"nothing listens on {addr}:{port} after {timeout}s") from e
            time.sleep(0.05)
