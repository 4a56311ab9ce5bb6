"""Chaos runs against a broker in the network lab (tests/netlab.py), judged by the queue
checker (tests/checker.py).

A run: start the target's nodes in the lab's namespaces; QoS 1 publishers (asyncio, on the
host) each send unique ids (``p<k>-<seq>``) one at a time through whichever node answers: on a
lost connection or a PUBACK later than ``--ack-timeout`` they move to the next node and resend
the same id (DUP set), as an MQTT client resends an unacknowledged QoS 1 publish [MQTT-4.4.0-1].
Meanwhile a nemesis applies a fault schedule drawn from ``--seed``: kill -9 (then restart),
SIGSTOP/SIGCONT, a full partition, a one-way partition, random packet drops, each aimed at
the current leader or at a follower when the target can tell which node leads; after each it
heals and waits for publishes to be acknowledged again. At the end everything is healed, the
dead restarted, and one subscriber drains what the broker kept; the checker compares it with
what was acknowledged.

Targets (``--target``), each a small adapter (a ``Target`` subclass):

- ``nats``: NATS 2.9 (Debian ``nats-server``), three nodes, MQTT on JetStream with
  ``stream_replicas: 3``, cluster routes between the three. The drain is a persistent
  session (clean session off) subscribed to ``chaos/#`` at QoS 1 before the first publish.
- ``mqlog``: one mqlog node in one namespace with ``fsync = "always"``; faults kill -9 and
  restart it, or pause it. The drain subscribes to ``$replay/earliest/chaos/#``.

A replicated mqlog cluster is not here yet: its adapter is a ``Target`` that starts N
``mqlog serve`` processes with a ``[cluster]`` section, answers ``leader()`` from
``GET /api/v1/cluster`` and drains through ``$replay/earliest/chaos/#``. It will be written
with the cluster (issue 20); nothing stands in for it.

Usage (root; the lab needs ``ip`` and ``nft``)::

    python -m bench.chaos --target nats --faults 40 --seed 1
    python -m bench.chaos --target mqlog --faults 20 --seed 1

Prints the checker's table, one line per fault, and a JSON line (``--json FILE`` appends it);
the whole history (every publish, read and fault) goes to ``<workdir>/history.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import statistics
import struct
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import DISCONNECT, connect_packet, subscribe_packet, varint
from tests.checker import Fault, Publish, Read, Report, check, dumps
from tests.netlab import Lab, Node, Proc, wait_tcp

ROOT = Path(__file__).resolve().parents[1]
MQTT_PORT = 1883
TOPIC_PREFIX = "chaos"

# ============================================================== a minimal asyncio MQTT client


class MqttClient(asyncio.Protocol):
    """MQTT 3.1.1 client for the chaos workload and the cluster benchmark: QoS 1 publishes
    whose futures resolve to the monotonic time of their PUBACK, and QoS 1 deliveries passed
    to ``on_message(topic, payload)`` and acknowledged at once. A lost connection fails every
    pending future with ConnectionError. Runs on the loop that created it."""

    def __init__(self, on_message: Callable[[str, bytes], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.on_message = on_message
        self.connack: asyncio.Future[int] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.pending: dict[int, asyncio.Future[float]] = {}
        self.subacks: dict[int, asyncio.Future[int]] = {}
        self.next_pid = 0
        self.hello = b""

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        client_id: str,
        *,
        clean: bool = True,
        timeout: float = 2.0,
        on_message: Callable[[str, bytes], None] | None = None,
    ) -> MqttClient:
        """Connected up to a successful CONNACK, or ConnectionError/OSError/TimeoutError."""
        loop = asyncio.get_running_loop()
        client = cls(on_message)
        client.hello = connect_packet(client_id, clean, keepalive=0, username="chaos")
        try:
            await asyncio.wait_for(loop.create_connection(lambda: client, host, port), timeout)
            code = await asyncio.wait_for(asyncio.shield(client.connack), timeout)
        except BaseException:
            client.close()
            raise
        if code != 0:
            client.close()
            raise ConnectionError(f"CONNACK return code {code}")
        return client

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.hello)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        err = ConnectionError(f"connection lost: {exc}")
        futs: list[asyncio.Future[Any]] = [self.connack, *self.pending.values()]
        for fut in [*futs, *self.subacks.values()]:
            if not fut.done():
                fut.set_exception(err)
                fut.exception()  # mark retrieved: a dropped publish is not an error here
        self.pending.clear()
        self.subacks.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while True:
            i, rl, mult = pos + 1, 0, 1
            while i < len(buf) and buf[i] & 0x80:
                rl += (buf[i] & 0x7F) * mult
                mult <<= 7
                i += 1
            if i >= len(buf):
                break
            rl += buf[i] * mult
            i += 1
            if i + rl > len(buf):
                break
            self._packet(buf[pos] >> 4, buf[pos] & 0x0F, bytes(buf[i : i + rl]))
            pos = i + rl
        del buf[:pos]

    def _packet(self, kind: int, flags: int, body: bytes) -> None:
        if kind == 2:  # CONNACK
            if not self.connack.done():
                self.connack.set_result(body[1])
        elif kind == 4:  # PUBACK
            fut = self.pending.pop(struct.unpack_from(">H", body)[0], None)
            if fut is not None and not fut.done():
                fut.set_result(time.monotonic())
        elif kind == 9:  # SUBACK
            sub = self.subacks.pop(struct.unpack_from(">H", body)[0], None)
            if sub is not None and not sub.done():
                sub.set_result(body[2])
        elif kind == 3:  # PUBLISH
            tl = struct.unpack_from(">H", body)[0]
            topic = body[2 : 2 + tl].decode()
            j = 2 + tl
            if (flags >> 1) & 3:
                assert self.transport is not None
                self.transport.write(b"\x40\x02" + body[j : j + 2])
                j += 2
            if self.on_message is not None:
                self.on_message(topic, body[j:])

    # -- requests
    def _pid(self) -> int:
        for _ in range(65535):
            self.next_pid = self.next_pid % 65535 + 1
            if self.next_pid not in self.pending and self.next_pid not in self.subacks:
                return self.next_pid
        raise RuntimeError("65535 packet ids in flight")

    def publish(self, topic: str, payload: bytes, *, dup: bool = False) -> asyncio.Future[float]:
        """Send one QoS 1 PUBLISH; the future resolves to the PUBACK's monotonic time."""
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        if self.transport is None or self.transport.is_closing():
            fut.set_exception(ConnectionError("not connected"))
            return fut
        pid = self._pid()
        t = topic.encode()
        body = struct.pack(">H", len(t)) + t + struct.pack(">H", pid) + payload
        self.pending[pid] = fut
        self.transport.write(bytes([0x32 | (0x08 if dup else 0)]) + varint(len(body)) + body)
        return fut

    async def subscribe(self, topic_filter: str, timeout: float = 10.0) -> int:
        """SUBSCRIBE at QoS 1; the granted QoS (0x80: refused)."""
        assert self.transport is not None
        pid = self._pid()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.subacks[pid] = fut
        self.transport.write(subscribe_packet(topic_filter, 1, pid))
        return await asyncio.wait_for(fut, timeout)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            with contextlib.suppress(Exception):
                self.transport.write(DISCONNECT)
            self.transport.close()

    @property
    def is_closed(self) -> bool:
        return self.transport is None or self.transport.is_closing() or self.closed.done()


# ============================================================== targets


class Target:
    """A broker deployment in the lab: the interface an adapter fills.

    A subclass sets ``name`` and ``size`` (nodes) and implements ``argv(node)`` (the command
    that serves on ``addr(node)``, writing its config under ``workdir``) and
    ``drain_filter()``; it may override ``leader()`` (so faults can aim at the leader),
    ``before_run()`` (e.g. a durable subscription the drain reads), ``drain_connect()`` and
    ``after_kill()``. The base keeps one process per node and turns process faults into
    process-group signals (kill -9, SIGSTOP, SIGCONT); network faults are the lab's."""

    name = ""
    #: Nodes this target runs on (a lab of this size is built for it).
    size = 1
    ready_timeout = 30.0

    def __init__(self, lab: Lab, workdir: Path) -> None:
        self.lab = lab
        self.workdir = workdir
        self.procs: dict[str, Proc] = {}

    def argv(self, node: Node) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        return None

    def addr(self, node: Node) -> tuple[str, int]:
        return node.addr, MQTT_PORT

    def start(self, node: Node) -> None:
        """Start (or restart after a kill) the node's broker; returns once it listens."""
        self.procs[node.name] = self.lab.spawn(
            node,
            self.argv(node),
            log_path=self.workdir / f"{node.name}.log",
            env=self.env(),
            cwd=ROOT,
        )
        wait_tcp(*self.addr(node), timeout=self.ready_timeout)

    def start_all(self) -> None:
        for node in self.lab.nodes:
            self.procs[node.name] = self.lab.spawn(
                node,
                self.argv(node),
                log_path=self.workdir / f"{node.name}.log",
                env=self.env(),
                cwd=ROOT,
            )
        for node in self.lab.nodes:
            wait_tcp(*self.addr(node), timeout=self.ready_timeout)

    def kill(self, node: Node) -> None:
        self.procs[node.name].kill()
        self.after_kill(node)

    def after_kill(self, node: Node) -> None:
        """Until the killed node's resources are free for a restart."""

    def pause(self, node: Node) -> None:
        self.procs[node.name].pause()

    def resume(self, node: Node) -> None:
        self.procs[node.name].resume()

    def alive(self, node: Node) -> bool:
        p = self.procs.get(node.name)
        return p is not None and p.alive()

    def leader(self) -> Node | None:
        """The node leading the data the publishers write, if the target can tell."""
        return None

    def drain_filter(self) -> str:
        raise NotImplementedError

    async def before_run(self) -> None:
        """Called once the nodes listen, before the first publish."""

    async def drain(self, expect: set[str], quiet: float, timeout: float) -> list[Read]:
        """Read back everything under ``chaos/`` once, until every id of ``expect`` came
        and ``quiet`` seconds passed without a message, or ``timeout``."""
        reads: list[Read] = []
        got: set[str] = set()
        last = [time.monotonic()]

        def on_message(topic: str, payload: bytes) -> None:
            uid = payload.decode(errors="replace")
            reads.append(Read(uid, topic))
            got.add(uid)
            last[0] = time.monotonic()

        deadline = time.monotonic() + timeout
        client = await self._drain_client(on_message, deadline)
        try:
            while time.monotonic() < deadline and not client.is_closed:
                if expect <= got and time.monotonic() - last[0] > quiet:
                    break
                await asyncio.sleep(0.1)
        finally:
            client.close()
        return reads

    async def _drain_client(
        self, on_message: Callable[[str, bytes], None], deadline: float
    ) -> MqttClient:
        while True:
            for node in self.lab.nodes:
                try:
                    c = await self.drain_connect(node, on_message)
                    if await c.subscribe(self.drain_filter()) != 0x80:
                        return c
                    c.close()
                except (OSError, ConnectionError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("no node accepted the drain subscription")
            await asyncio.sleep(0.5)

    async def drain_connect(
        self, node: Node, on_message: Callable[[str, bytes], None]
    ) -> MqttClient:
        return await MqttClient.connect(*self.addr(node), "chaos-drain", on_message=on_message)


class MqlogTarget(Target):
    """One mqlog node; with ``fsync = "always"`` (the default here) every PUBACK follows an
    fsync of the append."""

    name = "mqlog"
    size = 1

    def __init__(self, lab: Lab, workdir: Path, workers: int = 1, fsync: str = "always") -> None:
        super().__init__(lab, workdir)
        self.workers = workers
        self.fsync = fsync

    def config(self, node: Node) -> Path:
        path = self.workdir / f"{node.name}.toml"
        data = self.workdir / f"{node.name}-data"
        path.write_text(
            f'[server]\nhost = "{node.addr}"\nport = {MQTT_PORT}\nsys_interval = 0\n'
            f'[commitlog]\ndata_dir = "{data}"\nfsync = "{self.fsync}"\n'
            f'[http]\nhost = "{node.addr}"\nport = 8080\n'
        )
        return path

    def argv(self, node: Node) -> list[str]:
        return [
            sys.executable,
            "-m",
            "broker.cli",
            "serve",
            "-c",
            str(self.config(node)),
            "--workers",
            str(self.workers),
        ]

    def env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH", "")
        return {**os.environ, "PYTHONPATH": f"{ROOT}:{path}" if path else str(ROOT)}

    def after_kill(self, node: Node) -> None:
        # workers killed with their supervisor exit a moment later, holding the data
        # directory's lock until then: the restart must not start before
        deadline = time.monotonic() + 10
        while self.procs[node.name].group_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def drain_filter(self) -> str:
        return f"$replay/earliest/{TOPIC_PREFIX}/#"


class NatsTarget(Target):
    """NATS 2.9 with MQTT on JetStream, three nodes, ``stream_replicas: 3``."""

    name = "nats"
    size = 3
    monitor_port = 8222

    def argv(self, node: Node) -> list[str]:
        routes = ", ".join(f"nats-route://{m.addr}:6222" for m in self.lab.peers(node))
        conf = self.workdir / f"{node.name}.conf"
        conf.write_text(
            f"server_name: {node.name}\n"
            f'listen: "{node.addr}:4222"\n'
            f'http: "{node.addr}:{self.monitor_port}"\n'
            f'jetstream {{ store_dir: "{self.workdir / node.name}" }}\n'
            f'cluster {{ name: chaos, listen: "{node.addr}:6222", routes: [{routes}] }}\n'
            f'mqtt {{ listen: "{node.addr}:{MQTT_PORT}", stream_replicas: 3 }}\n'
        )
        return [shutil.which("nats-server") or "nats-server", "-c", str(conf)]

    def leader(self) -> Node | None:
        """The leader of ``$MQTT_msgs`` (the stream every QoS 1 publish goes to): the node
        that reports itself as its leader; else the leader most nodes report (a node back
        from a kill or a partition may report a stale one); None if no node answers."""
        reports: dict[str, str] = {}
        for node in self.lab.nodes:
            url = f"http://{node.addr}:{self.monitor_port}/jsz?accounts=true&streams=true"
            try:
                with urllib.request.urlopen(url, timeout=0.5) as r:
                    doc = json.load(r)
            except (OSError, ValueError):
                continue
            for acc in doc.get("account_details") or []:
                for s in acc.get("stream_detail") or []:
                    if s.get("name") == "$MQTT_msgs":
                        lead = (s.get("cluster") or {}).get("leader")
                        if lead:
                            reports[node.name] = lead
        by_name = {n.name: n for n in self.lab.nodes}
        for name, lead in reports.items():
            if name == lead:
                return by_name[name]
        if reports:
            lead = Counter(reports.values()).most_common(1)[0][0]
            return by_name.get(lead)
        return None

    def drain_filter(self) -> str:
        return f"{TOPIC_PREFIX}/#"

    async def drain_connect(
        self, node: Node, on_message: Callable[[str, bytes], None]
    ) -> MqttClient:
        return await MqttClient.connect(
            *self.addr(node), "chaos-drain", clean=False, timeout=5.0, on_message=on_message
        )

    async def before_run(self) -> None:
        """The drain's durable subscription exists before the first publish (NATS keeps
        QoS 1 messages for a persistent session's subscription from then on)."""
        deadline = time.monotonic() + 60
        client = await self._drain_client(lambda t, p: None, deadline)
        client.close()
        await client.closed


TARGETS: dict[str, type[Target]] = {"nats": NatsTarget, "mqlog": MqlogTarget}

# ============================================================== workload


@dataclass
class History:
    publishes: list[Publish] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    last_ack: float = 0.0
    reconnects: int = 0


async def publisher(
    k: int,
    target: Target,
    topic: str,
    hist: History,
    stop: asyncio.Event,
    rate: float,
    ack_timeout: float,
) -> None:
    """One QoS 1 publisher, one message in flight: resend the same id on the next node
    after a failure, until it is acknowledged or the run stops."""
    nodes = target.lab.nodes
    at = k % len(nodes)
    client: MqttClient | None = None
    seq = 0
    pending: tuple[str, float] | None = None
    sent = 0.0
    period = 1.0 / rate if rate > 0 else 0.0
    next_t = time.monotonic()
    try:
        while not stop.is_set():
            if client is None or client.is_closed:
                try:
                    client = await MqttClient.connect(
                        *target.addr(nodes[at]), f"chaos-p{k}", timeout=ack_timeout
                    )
                except (OSError, ConnectionError, TimeoutError):
                    client = None
                    at = (at + 1) % len(nodes)
                    hist.reconnects += 1
                    await asyncio.sleep(0.05)
                    continue
            dup = pending is not None
            if pending is None:
                pending = (f"p{k}-{seq}", time.monotonic())
                seq += 1
            uid, start = pending
            sent = time.monotonic()
            try:
                end = await asyncio.wait_for(
                    client.publish(topic, uid.encode(), dup=dup), ack_timeout
                )
            except (ConnectionError, TimeoutError):
                client.close()
                client = None
                at = (at + 1) % len(nodes)
                hist.reconnects += 1
                continue
            hist.publishes.append(Publish(uid, f"p{k}", topic, 1, start, sent, end))
            hist.last_ack = max(hist.last_ack, end)
            pending = None
            if period:
                next_t = max(next_t + period, end - 1.0)
                if next_t > end:
                    await asyncio.sleep(next_t - end)
    finally:
        if pending is not None:
            uid, start = pending
            hist.publishes.append(Publish(uid, f"p{k}", topic, 1, start, sent, None))
        if client is not None:
            client.close()


# ============================================================== nemesis

KINDS_CLUSTER = ("kill", "pause", "isolate", "cut", "drop")
KINDS_SINGLE = ("kill", "pause")


@dataclass(frozen=True)
class Step:
    """One fault of the schedule: what, aimed at which role, held how long, then a rest."""

    kind: str
    role: str  # "leader" or "follower"
    hold: float
    rest: float
    percent: int
    salt: int


def schedule(seed: int, n: int, size: int) -> list[Step]:
    """``n`` faults drawn from ``seed`` (the same seed gives the same schedule). A fault is
    held 2-10 s: long enough, past an election timeout, for a cluster to fail over."""
    rng = random.Random(seed)
    kinds = KINDS_CLUSTER if size > 1 else KINDS_SINGLE
    steps = [
        Step(
            kind=rng.choice(kinds),
            role=rng.choice(("leader", "follower")) if size > 1 else "leader",
            hold=round(rng.uniform(2.0, 10.0), 2),
            rest=round(rng.uniform(1.0, 3.0), 2),
            percent=rng.choice((10, 20, 30, 50)),
            salt=rng.randrange(1 << 30),
        )
        for _ in range(n)
    ]
    if size == 1:  # a lone node killed restarts at once: down longer measures nothing
        steps = [dataclasses.replace(s, hold=0.0) if s.kind == "kill" else s for s in steps]
    return steps


def pick(target: Target, role: str, salt: int) -> Node:
    nodes = target.lab.nodes
    lead = target.leader()
    if lead is None:
        return nodes[salt % len(nodes)]
    if role == "leader":
        return lead
    others = [m for m in nodes if m != lead]
    return others[salt % len(others)]


async def apply(target: Target, step: Step, node: Node) -> Callable[[], Awaitable[None]]:
    """Start the fault; return what heals it."""
    lab = target.lab
    if step.kind == "kill":
        await asyncio.to_thread(target.kill, node)
        return lambda: asyncio.to_thread(target.start, node)
    if step.kind == "pause":
        target.pause(node)

        async def resume() -> None:
            target.resume(node)

        return resume
    if step.kind == "isolate":
        lab.isolate(node)
    elif step.kind == "cut":
        other = lab.peers(node)[step.salt % (len(lab.nodes) - 1)]
        if (step.salt >> 1) & 1:
            lab.cut(node, other)
        else:
            lab.cut(other, node)
    elif step.kind == "drop":
        lab.drop(node, step.percent)
    else:
        raise ValueError(f"unknown fault kind {step.kind!r}")

    async def heal() -> None:
        lab.heal()

    return heal


async def nemesis(
    target: Target, steps: list[Step], hist: History, log: Callable[[str], None]
) -> None:
    """Each step: wait until publishes are acknowledged again (at most 60 s) and rest,
    apply the fault, hold it, heal it."""
    t0 = time.monotonic()
    for i, step in enumerate(steps):
        mark = time.monotonic()
        while hist.last_ack < mark and time.monotonic() - mark < 60:
            await asyncio.sleep(0.05)
        await asyncio.sleep(step.rest)
        node = await asyncio.to_thread(pick, target, step.role, step.salt)
        start = time.monotonic()
        heal = await apply(target, step, node)
        await asyncio.sleep(step.hold)
        await heal()
        end = time.monotonic()
        what = step.kind + (f" {step.percent}%" if step.kind == "drop" else "")
        hist.faults.append(Fault(what, f"{step.role}:{node.name}", start, end))
        log(f"fault {i + 1}/{len(steps)} at {start - t0:7.2f}s: {what} {step.role} {node.name}")


# ============================================================== one run


@dataclass
class RunResult:
    target: str
    seed: int
    report: Report
    seconds: float
    reconnects: int
    workdir: str

    def summary(self) -> dict[str, Any]:
        r = self.report
        return {
            "bench": "chaos",
            "target": self.target,
            "seed": self.seed,
            "faults": r.faults,
            "acked": r.acked,
            "lost": r.lost,
            "unacked_seen": r.unacked_seen,
            "duplicates": r.duplicates,
            "unexpected": r.unexpected,
            "order_violations": r.order_violations,
            "unavailable_median_s": r.unavailable_median,
            "unavailable_max_s": r.unavailable_max,
            "never_available": r.never_available,
            "reconnects": self.reconnects,
            "unavailable_by_fault": by_kind(r),
            "seconds": round(self.seconds, 1),
        }


async def run_chaos(
    lab: Lab,
    target: Target,
    steps: list[Step],
    *,
    publishers: int = 6,
    topics: int = 3,
    rate: float = 100.0,
    ack_timeout: float = 2.0,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> RunResult:
    """One chaos run on a lab already holding ``target.size`` nodes."""
    t0 = time.monotonic()
    await asyncio.to_thread(target.start_all)
    await target.before_run()
    hist = History()
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(
            publisher(k, target, f"{TOPIC_PREFIX}/{k % topics}", hist, stop, rate, ack_timeout)
        )
        for k in range(publishers)
    ]
    try:
        await nemesis(target, steps, hist, log)
        mark = time.monotonic()  # a last stretch of load after the last fault
        while hist.last_ack < mark + 1.0 and time.monotonic() - mark < 60:
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        lab.heal()
        for node in lab.nodes:
            if target.alive(node):
                target.resume(node)
            else:
                await asyncio.to_thread(target.start, node)
    expect = {p.uid for p in hist.publishes if p.acked}
    reads = await target.drain(expect, quiet=2.0, timeout=120.0)
    # times from the start of the run, for the report
    pubs = [
        dataclasses.replace(
            p, start=p.start - t0, sent=p.sent - t0, end=None if p.end is None else p.end - t0
        )
        for p in hist.publishes
    ]
    faults = [dataclasses.replace(f, start=f.start - t0, end=f.end - t0) for f in hist.faults]
    report = check(pubs, reads, faults)
    write_history(target.workdir / "history.jsonl", t0, pubs, reads, faults)
    return RunResult(
        target.name, seed, report, time.monotonic() - t0, hist.reconnects, str(target.workdir)
    )


def write_history(
    path: Path, t0: float, pubs: list[Publish], reads: list[Read], faults: list[Fault]
) -> None:
    """The run's history, to locate a loss afterwards: a first line with the wall-clock time
    of t = 0 (to match broker logs), then one JSON array per record: ``["p", uid, client,
    topic, start, sent, end]``, ``["r", uid, topic]`` in read order, ``["f", kind, target,
    start, end]``; times in seconds from t = 0."""
    wall0 = time.time() - (time.monotonic() - t0)
    with open(path, "w") as f:
        f.write(
            json.dumps(
                {"t0_wall": wall0, "t0_utc": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall0))}
            )
            + "\n"
        )
        for p in pubs:
            f.write(json.dumps(["p", p.uid, p.client, p.topic, p.start, p.sent, p.end]) + "\n")
        for r in reads:
            f.write(json.dumps(["r", r.uid, r.topic]) + "\n")
        for x in faults:
            f.write(json.dumps(["f", x.kind, x.target, x.start, x.end]) + "\n")


def run(
    target_name: str,
    faults: int,
    seed: int,
    *,
    workdir: Path | None = None,
    log: Callable[[str], None] = print,
    **kw: Any,
) -> RunResult:
    """Build the lab, run, tear the lab down (always)."""
    cls = TARGETS[target_name]
    base = workdir or Path(tempfile.mkdtemp(prefix=f"chaos-{target_name}-"))
    base.mkdir(parents=True, exist_ok=True)
    with Lab(cls.size) as lab:
        target = cls(lab, base)
        steps = schedule(seed, faults, cls.size)
        return asyncio.run(run_chaos(lab, target, steps, seed=seed, log=log, **kw))


def by_kind(report: Report) -> dict[str, dict[str, Any]]:
    """Per fault kind and role: count, median and max unavailability (s; None: never)."""
    groups: dict[str, list[float | None]] = {}
    for w in report.windows:
        groups.setdefault(f"{w.kind} {w.target.split(':')[0]}", []).append(w.unavailable)
    out: dict[str, dict[str, Any]] = {}
    for key, vals in sorted(groups.items()):
        finite = [v for v in vals if v is not None]
        out[key] = {
            "n": len(vals),
            "median_s": round(statistics.median(finite), 2) if finite else None,
            "max_s": round(max(finite), 2) if finite else None,
            "never": len(vals) - len(finite),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), required=True)
    ap.add_argument("--faults", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1, help="seeds seed, seed+1, ...")
    ap.add_argument("--publishers", type=int, default=6)
    ap.add_argument("--topics", type=int, default=3)
    ap.add_argument("--rate", type=float, default=100.0, help="msg/s per publisher")
    ap.add_argument("--ack-timeout", type=float, default=2.0, help="s before a resend")
    ap.add_argument("--workdir", type=Path, help="logs and data (default: a new temp dir)")
    ap.add_argument("--json", type=Path, help="append each run's JSON line to this file")
    args = ap.parse_args(argv)
    results = []
    for i in range(args.runs):
        seed = args.seed + i
        wd = args.workdir / f"{args.target}-{seed}" if args.workdir else None
        res = run(
            args.target,
            args.faults,
            seed,
            workdir=wd,
            publishers=args.publishers,
            topics=args.topics,
            rate=args.rate,
            ack_timeout=args.ack_timeout,
        )
        print(res.report.table())
        line = {**res.summary(), "report": json.loads(dumps(res.report))}
        print(json.dumps(res.summary()))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")
        results.append(res)
    if len(results) > 1:
        print(
            f"\n{'seed':>5} {'faults':>6} {'acked':>7} {'lost':>5} {'dups':>5} "
            f"{'p50 s':>6} {'max s':>6}"
        )
        for r in results:
            s = r.summary()
            print(
                f"{s['seed']:>5} {s['faults']:>6} {s['acked']:>7} {s['lost']:>5} "
                f"{s['duplicates']:>5} {_f(s['unavailable_median_s'])} "
                f"{_f(s['unavailable_max_s'])}"
            )
        meds = [r.report.unavailable_median for r in results if r.report.unavailable_median]
        if meds:
            print(f"median of medians {statistics.median(meds):.2f} s")
    return 0 if all(r.report.ok for r in results) else 1


def _f(x: float | None) -> str:
    return f"{x:6.2f}" if x is not None else " never"


if __name__ == "__main__":
    raise SystemExit(main())
