"""Churn: devices connecting, taken over, cut off and coming back while a broker of several
workers hands their connections between workers (broker/workers/handoff.py), judged on two
properties a session must keep whatever races its moves.

Each device (client id ``dev<i>``) publishes QoS 1 runs of unique ids to its own topic
``churn/dev<i>/telemetry`` and, between runs, at random: connects again with the same
client id while its old connection still has publishes in flight (a takeover), aborts its
connection (no DISCONNECT), or disconnects. The even devices keep a persistent session
(clean session off) subscribed at QoS 1 to ``churn/cmd/dev<i>``, to which a commander
publishes commands throughout; the odd ones start clean each time. Afterwards every
persistent device connects once more to collect what was queued for it.

Checked:

- **no acknowledged publish lost**: every id whose PUBACK a device read is in the log
  (a ``$replay/earliest/churn/+/telemetry`` subscriber reads them all back);
- **one holder per client id** [MQTT-3.1.4-3]: a connection taken over is closed by the
  broker within :data:`CLOSE_SECONDS`;
- **no acknowledged command lost for a persistent session** [MQTT-3.1.2-4]: every command
  whose PUBACK the commander read reached a connection of its device (at least once),
  wherever the session was when the command was published;
- with ``--wills``, **no will lost** [MQTT-3.1.2-8]: each connection carries a will (QoS 1,
  ``churn/will/dev<i>``, its message naming the connection), and every connection that ended
  other than by the device's DISCONNECT (aborted, taken over, or closed by the broker: its
  worker killed, the broker restarted) has its will published, which a watcher subscribed to
  ``churn/will/#`` with a persistent session must get. Reported, not failed on: a will of a
  connection the device ended with DISCONNECT (the broker may have died before reading it)
  and wills that came twice;
- with ``--retained``, **no acknowledged retained message lost** [MQTT-3.3.1-5]: each
  device also publishes a retained QoS 1 message (a counter) to ``churn/state/dev<i>`` once
  per run of publishes, until a moment of the run it picks at random (so that the last one,
  the one checked, falls anywhere, near a fault too); afterwards a new subscriber to
  ``churn/state/+`` must be given, for each device, its last acknowledged one or one it
  published after it (not acknowledged: it may have been stored), never none and never an
  earlier one.

Run (starts a broker of this checkout on the shipped config, two workers)::

    python -m bench.churn --seconds 40 --devices 100 --seed 1 [--runs 3]

The function :func:`churn` runs the workload against any broker (tests/integration/
test_churn.py runs a short one in the suite).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.mqttclient import MqttClient
from bench.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
#: Seconds the broker has to close a connection taken over by a new one.
CLOSE_SECONDS = 5.0
#: Seconds a PUBACK may take before the publish counts as not acknowledged.
ACK_SECONDS = 5.0
#: The shared subscription of the group members (``shared``): every device's telemetry.
SHARED = "$share/churn/churn/+/telemetry"
#: Seconds before the end after which the nemesis kills nothing more.
SETTLE_SECONDS = 3.0
#: The report's lists that must be empty.
FAILURES = (
    "lost",
    "not_closed",
    "commands_lost",
    "sessions_lost",
    "shared_lost",
    "wills_lost",
    "retained_lost",
)
#: A stream of its own for the workload (every topic under ``churn/``), as the suite's test.
STREAMS = '[[streams]]\nname = "churn"\ntopic_filter = ["churn/#"]\npartitions = 4\n'
#: The topics of the devices' wills (``--wills``).
WILLS = "churn/will/{}"
#: The topics of the devices' retained messages (``--retained``).
STATES = "churn/state/{}"


class Nodes:
    """Where clients connect: one broker, or the nodes of a cluster, one picked at random
    (its own generator: the workload's draws stay those of a single broker) for each
    connection, so that a client id's next connection is often on another node (a takeover
    across nodes) and a client whose node is down finds another."""

    def __init__(self, addrs: list[tuple[str, int]], seed: int) -> None:
        self.addrs = addrs
        self.rng = random.Random(seed)

    def pick(self) -> tuple[str, int]:
        return self.addrs[0] if len(self.addrs) == 1 else self.rng.choice(self.addrs)

    async def connect(self, client_id: str, **kw: Any) -> MqttClient:
        host, port = self.pick()
        return await MqttClient.connect(host, port, client_id, timeout=ACK_SECONDS, **kw)


@dataclass
class ChurnReport:
    seconds: float
    devices: int
    seed: int
    connects: int = 0
    takeovers: int = 0
    aborts: int = 0
    acked: int = 0
    #: Publishes left unanswered by a connection that was taken over or cut (not lost).
    unanswered: int = 0
    #: Acknowledged publishes missing from the log (must be 0).
    lost: list[str] = field(default_factory=list)
    #: Client ids whose taken-over connection stayed open (must be empty).
    not_closed: list[str] = field(default_factory=list)
    commands_acked: int = 0
    #: Acknowledged commands a persistent device never received (must be 0).
    commands_lost: list[str] = field(default_factory=list)
    #: Acknowledged publishes no member of the shared subscription got (must be 0).
    shared_lost: list[str] = field(default_factory=list)
    #: Persistent sessions the broker no longer had when their device came back
    #: (``client id@seconds into the run``; must be empty).
    sessions_lost: list[str] = field(default_factory=list)
    #: What the nemesis killed, in order (``--kill-every``).
    kills: list[str] = field(default_factory=list)
    #: ``--wills``: connections that ended without the device's DISCONNECT (each owes a will).
    wills_expected: int = 0
    #: Their wills never published (``dev<i>#<connection>``; must be empty).
    wills_lost: list[str] = field(default_factory=list)
    #: Wills of connections the device ended with DISCONNECT (not a failure: see above).
    wills_after_disconnect: int = 0
    #: Wills that came more than once.
    wills_twice: int = 0
    #: ``--retained``: devices with an acknowledged retained message.
    retained_expected: int = 0
    #: Devices whose retained message was none, or older than their last acknowledged one
    #: (``dev<i>: got <n>, acked <m>``; must be empty).
    retained_lost: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.not_closed
            or self.commands_lost
            or self.sessions_lost
            or self.shared_lost
            or self.wills_lost
            or self.retained_lost
        )

    def summary(self) -> dict[str, object]:
        out = asdict(self)
        for key in (*FAILURES, "kills"):
            out[key] = len(out[key])  # the counts; the first few are in the table
        return {"bench": "churn", **out, "ok": self.ok}


class _Device:
    def __init__(
        self,
        i: int,
        nodes: Nodes,
        seed: int,
        report: ChurnReport,
        wills: bool = False,
        retained: bool = False,
    ) -> None:
        self.i = i
        self.cid = f"dev{i}"
        self.persistent = i % 2 == 0
        self.nodes = nodes
        self.rng = random.Random(seed * 100_003 + i)
        self.report = report
        self.acked: set[str] = set()
        self.commands: set[str] = set()
        self.subscribed = False
        self.seq = 0
        self.t0 = time.monotonic()
        self.wills = wills
        self.attempts = 0
        self.retained = retained
        #: The retained counter: the last sent, the last acknowledged (0: none).
        self.state_sent = 0
        self.state_acked = 0
        #: The will of each connection that got its CONNACK and has not been judged yet.
        self.will_of: dict[MqttClient, str] = {}
        #: Wills owed (the connection ended without DISCONNECT) and wills not owed.
        self.wills_owed: set[str] = set()
        self.wills_not_owed: set[str] = set()

    def _on_message(self, topic: str, payload: bytes) -> None:
        self.commands.add(payload.decode())

    async def connect(self) -> MqttClient:
        will = None
        self.attempts += 1
        if self.wills:  # named after the connection (a CONNECT without its CONNACK: unjudged)
            will = (WILLS.format(self.cid), f"{self.cid}#{self.attempts}".encode())
        client = await self.nodes.connect(
            self.cid, clean=not self.persistent, on_message=self._on_message, will=will
        )
        self.report.connects += 1
        if will is not None:
            self.will_of[client] = will[1].decode()
        if self.persistent and self.subscribed and not client.session_present:
            # The broker had this session (and its subscription): it must say so
            # [MQTT-3.2.2-2]. Subscribed again so that the run goes on.
            self.report.sessions_lost.append(f"{self.cid}@{time.monotonic() - self.t0:.1f}s")
            self.subscribed = False
        if self.persistent and not self.subscribed:
            await client.subscribe(f"churn/cmd/{self.cid}")
            self.subscribed = True  # the session keeps it from now on
        return client

    def _state_acked(self, n: int, fut: asyncio.Future[float]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.state_acked = max(self.state_acked, n)

    def ended(self, client: MqttClient, owed: bool) -> None:
        """``client`` 's connection ended: with its will owed (no DISCONNECT), or not."""
        will = self.will_of.pop(client, None)
        if will is not None:
            (self.wills_owed if owed else self.wills_not_owed).add(will)

    async def run(self, deadline: float) -> None:
        rng, report = self.rng, self.report
        client: MqttClient | None = None
        states_until = time.monotonic() + random.Random(self.i).random() * (
            deadline - time.monotonic()
        )
        while time.monotonic() < deadline:
            sent: list[tuple[str, asyncio.Future[float]]] = []
            try:
                if client is None or client.is_closed:
                    if client is not None:
                        self.ended(client, True)  # closed by the broker (if not judged)
                    client = await self.connect()
                if self.retained and time.monotonic() < states_until:
                    self.state_sent += 1
                    n = self.state_sent
                    topic = STATES.format(self.cid)
                    state = client.publish(topic, str(n).encode(), retain=True)
                    state.add_done_callback(functools.partial(self._state_acked, n))
                for _ in range(rng.randint(1, 15)):
                    self.seq += 1
                    uid = f"{self.cid}-{self.seq}"
                    sent.append((uid, client.publish(f"churn/{self.cid}/telemetry", uid.encode())))
                    if rng.random() < 0.3:
                        await asyncio.sleep(rng.random() * 0.01)
                x = rng.random()
                if x < 0.15:  # a second connection while publishes are in flight
                    old, client = client, await self.connect()
                    report.takeovers += 1
                    self.ended(old, True)  # closed by the broker [MQTT-3.1.4-3]
                    try:
                        await asyncio.wait_for(asyncio.shield(old.closed), CLOSE_SECONDS)
                    except TimeoutError:
                        report.not_closed.append(self.cid)
                        old.close()
                elif x < 0.25 and client.transport is not None:
                    client.transport.abort()
                    report.aborts += 1
                    self.ended(client, True)
                for uid, fut in sent:
                    try:
                        await asyncio.wait_for(asyncio.shield(fut), ACK_SECONDS)
                        self.acked.add(uid)
                    except (ConnectionError, TimeoutError):
                        report.unanswered += 1
                if x > 0.9 and not client.is_closed:
                    self.ended(client, False)
                    client.close()
                await asyncio.sleep(rng.random() * 0.2)
            except (ConnectionError, OSError, TimeoutError):
                for _, fut in sent:  # not answered: the next connect failed first
                    if fut.done():
                        fut.exception()  # retrieved: no "never retrieved" warning
                    else:
                        fut.cancel()
                report.unanswered += sum(uid not in self.acked for uid, _ in sent)
                await asyncio.sleep(0.05)
        if client is not None:
            self.ended(client, client.is_closed)
            client.close()

    async def collect(self) -> None:
        """A persistent device's last connection: what its session queued comes out."""
        await _last_visit(self.connect, self.commands, quiet=1.0)
        for client in list(self.will_of):
            self.ended(client, False)  # closed with DISCONNECT


class _WillWatcher:
    """``--wills``: a persistent session subscribed to every device's will, there from the
    start and connected again whenever its connection is lost (what was published meanwhile
    is kept for it); ``got`` counts each will's arrivals."""

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes
        self.got: dict[str, int] = {}
        self.seen: set[str] = set()
        self.subscribed = False
        self.client: MqttClient | None = None

    def _on_message(self, topic: str, payload: bytes) -> None:
        will = payload.decode()
        self.got[will] = self.got.get(will, 0) + 1
        self.seen.add(will)

    async def connect(self) -> MqttClient:
        client = await self.nodes.connect("will-watcher", clean=False, on_message=self._on_message)
        if not self.subscribed:
            await client.subscribe(WILLS.format("#"))
            self.subscribed = True
        self.client = client
        return client

    async def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if self.client is None or self.client.is_closed:
                    await self.connect()
            except (ConnectionError, OSError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
        if self.client is not None:
            self.client.close()

    async def collect(self) -> None:
        await _last_visit(self.connect, self.seen, quiet=2.0)


class _Member:
    """A member of the shared subscription ``$share/churn/churn/+/telemetry`` with a
    persistent session (``member<k>``): it comes and goes (aborts, then connects again a
    moment later) and records every telemetry id it is given."""

    def __init__(self, k: int, nodes: Nodes, seed: int) -> None:
        self.cid = f"member{k}"
        self.nodes = nodes
        self.rng = random.Random(seed * 7919 + k)
        self.got: set[str] = set()
        self.subscribed = False
        self.client: MqttClient | None = None

    def _on_message(self, topic: str, payload: bytes) -> None:
        self.got.add(payload.decode())

    async def connect(self) -> MqttClient:
        client = await self.nodes.connect(self.cid, clean=False, on_message=self._on_message)
        if not self.subscribed:
            await client.subscribe(SHARED)
            self.subscribed = True
        self.client = client
        return client

    async def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if self.client is None or self.client.is_closed:
                    await self.connect()
                await asyncio.sleep(1.0 + 3.0 * self.rng.random())
                if self.client is not None and self.client.transport is not None:
                    self.client.transport.abort()  # in-flight deliveries go unacknowledged
                await asyncio.sleep(0.5 * self.rng.random())
            except (ConnectionError, OSError, TimeoutError):
                await asyncio.sleep(0.1)

    async def collect(self) -> None:
        """Connect once more and take what the group still has for this member."""
        await _last_visit(self.connect, self.got, quiet=2.0)


async def _last_visit(
    connect: Callable[[], Awaitable[MqttClient]], received: set[str], quiet: float
) -> None:
    """Connect once more (up to 20 tries 0.5 s apart: a worker killed last may be starting
    again) and stay until ``received`` has not grown for ``quiet`` seconds."""
    for attempt in range(20):
        try:
            client = await connect()
            break
        except (ConnectionError, OSError, TimeoutError):
            if attempt == 19:
                raise
            await asyncio.sleep(0.5)
    seen = -1
    while len(received) != seen:
        seen = len(received)
        await asyncio.sleep(quiet)
    client.close()


async def _commander(
    nodes: Nodes, devices: list[_Device], deadline: float, acked: dict[str, str]
) -> None:
    """Commands to the persistent devices, round robin, one in flight at a time."""
    targets = [d for d in devices if d.persistent]
    n = 0
    client: MqttClient | None = None
    while time.monotonic() < deadline:
        try:
            if client is None or client.is_closed:
                client = await nodes.connect("commander")
            device = targets[n % len(targets)]
            n += 1
            if not device.subscribed:
                await asyncio.sleep(0.001)
                continue
            uid = f"cmd-{n}"
            await asyncio.wait_for(
                client.publish(f"churn/cmd/{device.cid}", uid.encode()), ACK_SECONDS
            )
            acked[uid] = device.cid
            await asyncio.sleep(0.005)
        except (ConnectionError, OSError, TimeoutError):
            await asyncio.sleep(0.05)
    if client is not None:
        client.close()


async def _read_back(nodes: Nodes, expected: int) -> set[str]:
    """Every telemetry id in the log, from a ``$replay/earliest`` subscription."""
    got: set[str] = set()
    last = [time.monotonic()]

    def on_message(topic: str, payload: bytes) -> None:
        got.add(payload.decode())
        last[0] = time.monotonic()

    client = await nodes.connect("churn-reader", on_message=on_message)
    await client.subscribe("$replay/earliest/churn/+/telemetry")
    while time.monotonic() - last[0] < 3.0 and len(got) < expected:
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # duplicates (acknowledged twice) may still come
    client.close()
    return got


async def _nemesis(
    kill: Callable[[], str], every: float, deadline: float, rng: random.Random, done: list[str]
) -> None:
    """``kill()`` every ``every`` seconds or so, until :data:`SETTLE_SECONDS` before the end."""
    while True:
        await asyncio.sleep(every * (0.5 + rng.random()))
        if time.monotonic() > deadline - SETTLE_SECONDS:
            return
        done.append(await asyncio.to_thread(kill))


async def churn(
    host: str,
    port: int,
    *,
    seconds: float = 30.0,
    devices: int = 60,
    seed: int = 1,
    kill: Callable[[], str] | None = None,
    kill_every: float = 5.0,
    shared: int = 0,
    wills: bool = False,
    retained: bool = False,
    cluster: list[tuple[str, int]] | None = None,
) -> ChurnReport:
    """Run the workload (module docstring) against the broker at ``host:port``; with
    ``kill``, also call it every ``kill_every`` seconds or so (it kills a part of the broker
    and says which); with ``shared`` members, every acknowledged publish must also reach the
    shared subscription's group (some member, at least once); with ``wills``, every
    connection that ended without DISCONNECT must have its will published. ``cluster``: the
    nodes' addresses (``host``, ``port`` is one of them); each connection goes to one at
    random."""
    report = ChurnReport(seconds, devices, seed)
    addrs = cluster or [(host, port)]
    fleet = [
        _Device(i, Nodes(addrs, seed * 7 + i), seed, report, wills, retained)
        for i in range(devices)
    ]
    members = [_Member(k, Nodes(addrs, seed * 11 + k), seed) for k in range(shared)]
    anywhere = Nodes(addrs, seed)
    for m in members:
        await m.connect()  # subscribed before the first publish
    watcher = _WillWatcher(anywhere) if wills else None
    if watcher is not None:
        await watcher.connect()
    commands: dict[str, str] = {}
    deadline = time.monotonic() + seconds
    tasks = [_commander(anywhere, fleet, deadline, commands), *(d.run(deadline) for d in fleet)]
    tasks += [m.run(deadline) for m in members]
    if watcher is not None:
        tasks.append(watcher.run(deadline))
    if kill is not None:
        rng = random.Random(seed)
        tasks.append(_nemesis(kill, kill_every, deadline, rng, report.kills))
    await asyncio.gather(*tasks)
    await asyncio.gather(*(d.collect() for d in fleet if d.persistent))
    acked = set().union(*(d.acked for d in fleet))
    report.acked = len(acked)
    report.lost = sorted(acked - await _read_back(anywhere, len(acked)))
    received = {d.cid: d.commands for d in fleet}
    report.commands_acked = len(commands)
    report.commands_lost = sorted(u for u, cid in commands.items() if u not in received[cid])
    if members:
        await asyncio.gather(*(m.collect() for m in members))
        report.shared_lost = sorted(acked - set().union(*(m.got for m in members)))
    if watcher is not None:
        await watcher.collect()
        owed = set().union(*(d.wills_owed for d in fleet))
        not_owed = set().union(*(d.wills_not_owed for d in fleet))
        report.wills_expected = len(owed)
        report.wills_lost = sorted(owed - watcher.seen)
        report.wills_after_disconnect = len(not_owed & watcher.seen)
        report.wills_twice = sum(n > 1 for n in watcher.got.values())
    if retained:
        stored = await _retained(anywhere)
        last = {d.cid: d.state_acked for d in fleet if d.state_acked}
        report.retained_expected = len(last)
        report.retained_lost = sorted(
            f"{cid}: got {stored.get(cid)}, acked {n}"
            for cid, n in last.items()
            if stored.get(cid, 0) < n
        )
    return report


async def _retained(nodes: Nodes) -> dict[str, int]:
    """The retained counter of each device, as a new subscriber to them all is given."""
    got: dict[str, int] = {}

    def on_message(topic: str, payload: bytes) -> None:
        got[topic.rsplit("/", 1)[1]] = int(payload)

    client = await nodes.connect("churn-states", on_message=on_message)
    await client.subscribe(STATES.format("+"))
    seen = -1
    while len(got) != seen:
        seen = len(got)
        await asyncio.sleep(1.0)
    client.close()
    return got


def worker_killer(supervisor: int, seed: int) -> Callable[[], str]:
    """A function that SIGKILLs one of ``supervisor``'s workers, chosen at random, and
    names it (its supervisor starts it again)."""
    rng = random.Random(seed)

    def kill() -> str:
        pid = rng.choice(_workers(supervisor))
        os.kill(pid, signal.SIGKILL)
        return f"worker pid {pid}"

    return kill


def worker_pauser(supervisor: int, seed: int) -> Callable[[], str]:
    """A function that stops one of ``supervisor``'s workers (SIGSTOP), chosen at random,
    for 0.5-3 s, then lets it go on (SIGCONT): its peers and clients wait for it meanwhile."""
    rng = random.Random(seed)

    def pause() -> str:
        pid = rng.choice(_workers(supervisor))
        seconds = 0.5 + 2.5 * rng.random()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"worker pid {pid} paused {seconds:.1f} s"

    return pause


def _workers(supervisor: int) -> list[int]:
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text()
    return [int(c) for c in children.split()]


def _metric(http_port: int, name: str) -> float | None:
    url = f"http://127.0.0.1:{http_port}/metrics"
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


class _Broker:
    """A broker of this checkout on the shipped config, in its own process group (so a kill
    reaches the supervisor and every worker); restartable on its port and data."""

    def __init__(self, work: Path, workers: int) -> None:
        self.work = work
        self.port, self.http_port = free_port(), free_port()
        self.argv = [
            sys.executable,
            "-m",
            "broker.cli",
            "serve",
            "-c",
            str(ROOT / "config" / "broker.toml"),
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            "--data-dir",
            str(work / "data"),
            "--workers",
            str(workers),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.work / "broker.log", "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the broker did not start: see {self.work / 'broker.log'}")
            time.sleep(0.1)
        time.sleep(0.5)  # every worker listening, not just the one that answered

    def restart(self) -> str:
        """kill -9 of the whole broker, then start it again once every process is gone
        (they hold the data directory)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        self.start()
        return "the broker, restarted"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.churn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--devices", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1, help="seeds seed, seed+1, ...")
    ap.add_argument("--workers", type=int, default=2, help="the broker's worker processes")
    ap.add_argument(
        "--kill-every",
        type=float,
        default=0.0,
        help="a fault every S seconds or so (0: none): --kill decides which",
    )
    ap.add_argument(
        "--kill",
        choices=("worker", "broker", "pause", "node"),
        default=None,
        help="worker (the default): SIGKILL one worker, chosen at random (its supervisor "
        "starts it again); broker: SIGKILL the whole broker and start it again (clients "
        "reconnect); pause: SIGSTOP one worker (with --cluster: one node) for 0.5-3 s, then "
        "SIGCONT; node (with --cluster, its default): SIGKILL one node, start it again "
        "0.5-3 s later",
    )
    ap.add_argument(
        "--cluster",
        type=int,
        default=0,
        help="run a cluster of this many nodes, each in its own network namespace (root; "
        "tests/netlab.py), every partition a Raft group of them, fsync always; each "
        "connection goes to a node picked at random (0: one broker)",
    )
    ap.add_argument(
        "--shared",
        type=int,
        default=0,
        help="members of a shared subscription to every device's telemetry, coming and going "
        "(0: none); every acknowledged publish must reach one of them",
    )
    ap.add_argument(
        "--wills",
        action="store_true",
        help="each connection carries a will; every connection that ended without DISCONNECT "
        "must have it published",
    )
    ap.add_argument(
        "--retained",
        action="store_true",
        help="each device also publishes a retained counter; a new subscriber must be given "
        "the last acknowledged one (or a later one) of each",
    )
    ap.add_argument("--json", type=Path, help="append each run's JSON line to this file")
    ap.add_argument("--keep", action="store_true", help="keep each run's files (logs, data)")
    args = ap.parse_args(argv)
    if args.devices < 1 or args.seconds <= 0 or args.shared < 0:
        ap.error("--devices 1 or more, --seconds above 0, --shared 0 or more")
    if args.kill is None:
        args.kill = "node" if args.cluster else "worker"
    if args.cluster and args.kill not in ("node", "pause"):
        ap.error(f"--kill {args.kill}: with --cluster, node or pause")
    if not args.cluster and args.kill == "node":
        ap.error("--kill node: with --cluster only")
    if args.kill_every and not args.cluster and args.kill != "broker" and args.workers < 2:
        ap.error(f"--kill {args.kill}: one worker is the broker itself (--workers 2+)")
    if args.cluster:
        return _cluster_runs(args)
    failed = 0
    for seed in range(args.seed, args.seed + args.runs):
        work = Path(tempfile.mkdtemp(prefix="churn-"))
        broker = _Broker(work, args.workers)
        broker.start()
        assert broker.proc is not None
        kill: Callable[[], str] | None = None
        if args.kill_every:
            faults = {"worker": worker_killer, "pause": worker_pauser}
            fault = faults.get(args.kill)
            kill = fault(broker.proc.pid, seed) if fault is not None else broker.restart
        try:
            report = _run(args, seed, kill, [("127.0.0.1", broker.port)])
            handed = _metric(broker.http_port, "mqlog_connections_handed_off_total")
        finally:
            broker.stop()
        line = {**report.summary(), "workers": args.workers, "handed_off": handed}
        failed += not _print(report, line, work, args.json, args.keep)
    return 1 if failed else 0


def _run(
    args: argparse.Namespace,
    seed: int,
    kill: Callable[[], str] | None,
    addrs: list[tuple[str, int]],
) -> ChurnReport:
    """One run of the workload with the command line's options against ``addrs``."""
    return asyncio.run(
        churn(
            *addrs[0],
            seconds=args.seconds,
            devices=args.devices,
            seed=seed,
            kill=kill,
            kill_every=args.kill_every,
            shared=args.shared,
            wills=args.wills,
            retained=args.retained,
            cluster=addrs if len(addrs) > 1 else None,
        )
    )


def _print(
    report: ChurnReport,
    line: dict[str, object],
    work: Path,
    json_path: Path | None,
    keep: bool = False,
) -> bool:
    """Print a run's JSON line and its failures; keep its files if it failed. Whether ok."""
    print(json.dumps(line), flush=True)
    for key in FAILURES:
        if getattr(report, key):
            print(f"  {key}: {getattr(report, key)[:10]}")
    if json_path:
        with open(json_path, "a") as f:
            f.write(json.dumps(line) + "\n")
    if report.ok and not keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"  kept: {work}")
    return report.ok


def node_faults(cluster: Any, kind: str, seed: int) -> Callable[[], str]:
    """A function that kills (``node``: SIGKILL, started again 0.5-3 s later) or stops
    (``pause``: SIGSTOP for 0.5-3 s, then SIGCONT) one node of ``cluster``
    (tests/cluster_lab.py's MqlogCluster), chosen at random, and names it."""
    rng = random.Random(seed)

    def fault() -> str:
        member = rng.choice(cluster.members)
        seconds = 0.5 + 2.5 * rng.random()
        if kind == "pause":
            cluster.pause(member)
            try:
                time.sleep(seconds)
            finally:
                cluster.resume(member)
            return f"node {member.node_id} paused {seconds:.1f} s"
        cluster.kill(member)
        time.sleep(seconds)
        cluster.start(member)
        return f"node {member.node_id} killed, started {seconds:.1f} s later"

    return fault


def _cluster_runs(args: argparse.Namespace) -> int:
    """``--cluster N``: each run on a new cluster of N nodes in the network lab."""
    from tests.cluster_lab import MQTT_PORT, MqlogCluster
    from tests.netlab import Lab

    failed = 0
    for seed in range(args.seed, args.seed + args.runs):
        work = Path(tempfile.mkdtemp(prefix="churn-cluster-"))
        with Lab(args.cluster) as lab:
            cluster = MqlogCluster(lab, work, workers=args.workers, extra=STREAMS)
            try:
                cluster.start()
                cluster.wait_all_alive()
                kill = node_faults(cluster, args.kill, seed) if args.kill_every else None
                report = _run(args, seed, kill, [(m.addr, MQTT_PORT) for m in cluster.members])
            finally:
                cluster.stop()
        line = {**report.summary(), "nodes": args.cluster, "workers": args.workers}
        failed += not _print(report, line, work, args.json, args.keep)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
