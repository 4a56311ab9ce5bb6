"""An N-node mqlog cluster in the network lab (tests/netlab.py): one ``mqlog serve`` per
namespace, each with a ``[cluster]`` section naming the others, and the process faults the
cluster tests inflict on one node (kill -9, SIGSTOP, SIGCONT, restart).

Layout, for node ``i`` (0-based) of a lab whose namespaces are on ``10.77.K.0/24``::

    node_id   "n<i+1>"
    MQTT      <addr>:1883      HTTP <addr>:8080 (GET /api/v1/cluster: :meth:`MqlogCluster.status`)
    cluster   bind = <addr>, raft_port 7950, gossip_port 7946,
              seeds = every other node's gossip address "<addr>:7946"
    files     <workdir>/n<i+1>.toml, <workdir>/n<i+1>-data/, <workdir>/n<i+1>.log (appended
              across restarts), and one shared <workdir>/cluster.key (mode 0600)

Every node commits with ``fsync = "always"``: an acknowledgement follows an fsync, so a test
may count an acknowledged message lost if it is not read back.

Each node runs as ``ip netns exec NS <venv>/bin/mqlog serve -c nI.toml`` (the console script
of the interpreter running the tests, with this checkout first on PYTHONPATH so the nodes run
this code), in its own process group (:meth:`tests.netlab.Lab.spawn`), so a signal reaches its
workers too. The lab owns the processes: leaving the ``Lab`` context kills every one of them
and removes the namespaces; :meth:`MqlogCluster.stop` is the clean (SIGTERM) path.

Network faults (isolate, cut, drop, heal) are the lab's: pass ``member.node``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.netlab import Lab, Node, Proc

ROOT = Path(__file__).resolve().parents[1]
MQTT_PORT = 1883
HTTP_PORT = 8080
RAFT_PORT = 7950
GOSSIP_PORT = 7946
#: Seconds a node has from its start to accepting MQTT connections.
READY_TIMEOUT = 30.0
#: Seconds a killed node's workers have to exit (they hold the data directory's lock).
EXIT_TIMEOUT = 10.0


class ClusterLabError(RuntimeError):
    """A node did not start or stop as told; the message holds the end of its log."""


@dataclass
class Member:
    """One mqlog node of the cluster: ``node`` is its lab namespace, ``proc`` its current
    process (None before the first start)."""

    node: Node
    node_id: str
    config_path: Path
    data_dir: Path
    log_path: Path
    proc: Proc | None = None

    @property
    def addr(self) -> str:
        return self.node.addr

    def running(self) -> bool:
        """Its process has not exited (it may be paused)."""
        return self.proc is not None and self.proc.alive()

    def log(self, tail: int = 4000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-tail:]


class MqlogCluster:
    """``len(lab.nodes)`` mqlog nodes, one per namespace of ``lab``; files under ``workdir``.

    Construction writes the secret and every node's config; :meth:`start` starts them all.
    ``workers`` is each node's ``[router] workers``; ``extra`` is TOML appended to every
    node's config (more sections, e.g. ``[[streams]]``); ``cluster_extra`` is TOML appended to
    every node's ``[cluster]`` section (e.g. ``suspicion_mult = 3``). ``founders``: how many
    members (the first) form the cluster, each naming the others as seeds; the rest join it
    later (started with :meth:`start` when the test wants), naming only the first as seed
    (all of them form it when None). ``root``: the source tree the nodes run (this checkout;
    a benchmark may compare another, e.g. the code before a change)."""

    def __init__(
        self,
        lab: Lab,
        workdir: Path,
        *,
        workers: int = 1,
        extra: str = "",
        cluster_extra: str = "",
        founders: int | None = None,
        root: Path = ROOT,
    ) -> None:
        self.lab = lab
        self.root = root
        self.founders = founders if founders is not None else len(lab.nodes)
        self.workdir = workdir
        self.workers = workers
        self.extra = extra
        self.cluster_extra = cluster_extra
        self.mqlog = Path(sys.executable).parent / "mqlog"
        if not self.mqlog.exists():
            raise ClusterLabError(f"{self.mqlog} not found (pip install -e . in this venv)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.secret_file = workdir / "cluster.key"
        self._write_secret()
        self.members = [
            Member(
                node=node,
                node_id=f"n{node.index + 1}",
                config_path=workdir / f"n{node.index + 1}.toml",
                data_dir=workdir / f"n{node.index + 1}-data",
                log_path=workdir / f"n{node.index + 1}.log",
            )
            for node in lab.nodes
        ]
        for member in self.members:
            member.config_path.write_text(self.config(member))

    def _write_secret(self) -> None:
        """32 random bytes as hex, readable by the owner only (0600 from its creation)."""
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        os.chmod(self.secret_file, 0o600)  # O_CREAT's mode does not apply to an existing file

    def config(self, member: Member) -> str:
        """``member``'s TOML: its listeners on its own address, its data directory, fsync
        always, and ``[cluster]`` with every other founder as a seed (a joiner: the first)."""
        founders = self.members[: self.founders]
        if member not in founders:
            founders = founders[:1]
        seeds = ", ".join(f'"{m.addr}:{GOSSIP_PORT}"' for m in founders if m is not member)
        return (
            f'[server]\nhost = "{member.addr}"\nport = {MQTT_PORT}\nsys_interval = 0\n'
            f"[router]\nworkers = {self.workers}\n"
            f'[commitlog]\ndata_dir = "{member.data_dir}"\nfsync = "always"\n'
            f'[http]\nhost = "{member.addr}"\nport = {HTTP_PORT}\n'
            f'[cluster]\nnode_id = "{member.node_id}"\nbind = "{member.addr}"\n'
            f"seeds = [{seeds}]\ngossip_port = {GOSSIP_PORT}\nraft_port = {RAFT_PORT}\n"
            f'secret_file = "{self.secret_file}"\n{self.cluster_extra}\n' + self.extra
        )

    def member(self, node_id: str) -> Member:
        for m in self.members:
            if m.node_id == node_id:
                return m
        raise KeyError(node_id)

    # ------------------------------------------------------------------ processes

    def env(self) -> dict[str, str]:
        """The tests' environment with :attr:`root` first on PYTHONPATH."""
        path = os.environ.get("PYTHONPATH", "")
        return {
            **os.environ,
            "PYTHONPATH": f"{self.root}:{path}" if path else str(self.root),
            "PYTHONUNBUFFERED": "1",
        }

    @classmethod
    def started(cls, lab: Lab, workdir: Path, **kw: Any) -> MqlogCluster:
        """A cluster of every node of ``lab`` (``kw`` as the constructor's), started, each
        member seeing every other alive."""
        c = cls(lab, workdir, **kw)
        c.start()
        c.wait_all_alive()
        return c

    @classmethod
    def founded(cls, lab: Lab, workdir: Path, founders: int, **kw: Any) -> MqlogCluster:
        """A cluster of ``lab``'s nodes whose first ``founders`` formed it, started, each
        seeing the others alive; the rest are left to join (``kw`` as the constructor's)."""
        c = cls(lab, workdir, founders=founders, **kw)
        first = c.members[:founders]
        c.start(*first)
        c.wait_all_alive(first)
        return c

    def start(self, *members: Member, timeout: float = READY_TIMEOUT) -> None:
        """Start ``members`` (every member when none is named) and wait until each accepts
        TCP on its MQTT port. A member must not be running already."""
        chosen = members or tuple(self.members)
        for m in chosen:
            if m.proc is not None and m.proc.alive():
                raise ClusterLabError(f"{m.node_id} is already running (pid {m.proc.pid})")
            argv = [str(self.mqlog), "serve", "-c", str(m.config_path)]
            m.proc = self.lab.spawn(
                m.node, argv, log_path=m.log_path, env=self.env(), cwd=self.root
            )
        deadline = time.monotonic() + timeout
        for m in chosen:
            self._wait_ready(m, deadline)

    def _wait_ready(self, m: Member, deadline: float) -> None:
        assert m.proc is not None
        while True:
            if not m.proc.alive():
                raise ClusterLabError(
                    f"{m.node_id} exited with {m.proc.popen.returncode} before serving:\n{m.log()}"
                )
            try:
                with socket.create_connection((m.addr, MQTT_PORT), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise ClusterLabError(
                        f"{m.node_id}: nothing listens on {m.addr}:{MQTT_PORT}:\n{m.log()}"
                    ) from None
                time.sleep(0.05)

    def kill(self, m: Member) -> None:
        """kill -9 of ``m``'s whole process group; returns once every process of it is gone
        (its workers exit a moment after the supervisor, holding the data directory)."""
        if m.proc is None:
            raise ClusterLabError(f"{m.node_id} was never started")
        m.proc.kill()
        self._wait_gone(m)

    def pause(self, m: Member) -> None:
        """SIGSTOP to ``m``'s process group: it holds its sockets but answers nothing."""
        if m.proc is None:
            raise ClusterLabError(f"{m.node_id} was never started")
        m.proc.pause()

    def resume(self, m: Member) -> None:
        """SIGCONT to ``m``'s process group."""
        if m.proc is None:
            raise ClusterLabError(f"{m.node_id} was never started")
        m.proc.resume()

    def restart(self, m: Member, timeout: float = READY_TIMEOUT) -> None:
        """kill -9 of ``m`` if it still runs, then a start on the same data directory."""
        if m.running():
            self.kill(m)
        self.start(m, timeout=timeout)

    def stop(self, *members: Member, timeout: float = 15.0) -> dict[str, int]:
        """SIGTERM (the clean shutdown) to ``members`` (every running member when none is
        named); their exit statuses by node id. One that hangs past ``timeout`` is killed
        and reported as ClusterLabError."""
        chosen = members or tuple(m for m in self.members if m.running())
        statuses: dict[str, int] = {}
        for m in chosen:
            if m.proc is None:
                continue
            m.proc.signal_group(signal.SIGCONT)  # a paused node cannot act on SIGTERM
            m.proc.signal_group(signal.SIGTERM)
        for m in chosen:
            if m.proc is None:
                continue
            try:
                statuses[m.node_id] = m.proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                raise ClusterLabError(f"{m.node_id} did not stop on SIGTERM:\n{m.log()}") from None
            self._wait_gone(m)
        return statuses

    @staticmethod
    def _wait_gone(m: Member) -> None:
        assert m.proc is not None
        deadline = time.monotonic() + EXIT_TIMEOUT
        while m.proc.group_alive():
            if time.monotonic() > deadline:
                raise ClusterLabError(f"{m.node_id}: processes left {EXIT_TIMEOUT}s after kill")
            time.sleep(0.01)

    # ------------------------------------------------------------------ observation

    def status(self, m: Member, timeout: float = 2.0) -> dict[str, Any]:
        """``GET http://<addr>:8080/api/v1/cluster`` of ``m``, decoded (nodes; per partition
        its leader, replicas, follower lag, commit index, term: DESIGN.md "Cluster"). An HTTP
        error or an unreachable node raises (urllib's HTTPError / URLError)."""
        url = f"http://{m.addr}:{HTTP_PORT}/api/v1/cluster"
        with urllib.request.urlopen(url, timeout=timeout) as response:
            doc: dict[str, Any] = json.load(response)
        return doc

    # ------------------------------------------------------------------ gossip

    def gossip_view(self, m: Member, timeout: float = 2.0) -> dict[str, tuple[str, int]]:
        """``m``'s gossip view: each member's (state, incarnation) by node id (alive, suspect,
        dead or left), from ``GET /api/v1/cluster``'s ``members``."""
        return {
            e["id"]: (e["state"], e["incarnation"])
            for e in self.status(m, timeout).get("members", ())
        }

    def wait_all_alive(self, members: list[Member] | None = None, timeout: float = 30.0) -> None:
        """Until every member of ``members`` (all) sees every one of them alive."""
        chosen = members or self.members
        want = {m.node_id for m in chosen}
        deadline = time.monotonic() + timeout
        while True:
            try:
                views = [self.gossip_view(m) for m in chosen]
            except OSError:
                views = []
            if views and all(
                want <= {n for n, (state, _) in v.items() if state == "alive"} for v in views
            ):
                return
            if time.monotonic() > deadline:
                raise ClusterLabError(f"members not all alive within {timeout}s: {views}")
            time.sleep(0.1)

    def kill_and_time_death(
        self, victim: Member, timeout: float = 30.0, poll: float = 0.05, isolate: bool = False
    ) -> dict[str, float]:
        """kill -9 of ``victim`` (or, with ``isolate``, a full partition of it from the other
        nodes: a silent death, no connection closed), then the seconds until each running
        member's gossip view shows it dead (polled every ``poll`` s: the figures are that
        much late at most)."""
        survivors = [m for m in self.members if m is not victim and m.running()]
        start = time.monotonic()
        if isolate:
            self.lab.isolate(victim.node)
        else:
            self.kill(victim)
        seen: dict[str, float] = {}
        while len(seen) < len(survivors):
            for m in survivors:
                if m.node_id in seen:
                    continue
                try:
                    state = self.gossip_view(m, timeout=1.0).get(victim.node_id, ("?", 0))[0]
                except OSError:
                    continue
                if state == "dead":
                    seen[m.node_id] = time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise ClusterLabError(f"{victim.node_id} not declared dead everywhere: {seen}")
            time.sleep(poll)
        return seen
