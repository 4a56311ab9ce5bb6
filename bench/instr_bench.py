"""Instructions per message of the replay and fan-out paths, counted by callgrind.

A wall-clock A/B on a shared machine moves by 20-40% between runs (another process takes the
core, a worker is placed elsewhere); an instruction count does not, as long as the program
does the same reads and writes. So here one process holds the broker (one worker, its HTTP
app off) and the clients on one event loop: the order of reads and writes, and with it the
size of every batch, does not depend on scheduling. Callgrind counts that process's
instructions from the scenario's first write to its last delivery; the clients are counted
too, the same code for every checkout compared.

Scenarios (N messages, 64-byte payloads, 50 topics ``replay0/<nnnnn>/telemetry``):

==========  ==============================================================================
replay1     N stored messages to one ``$replay/earliest/replay0/+/telemetry`` subscriber at
            QoS 1; it acknowledges each read at once (windows of max_inflight deliveries)
replay0     the same at QoS 0
replay1s    replay1 with the PUBACKs written 50 at a time, one write per loop iteration:
            small reads of acknowledgements, as from a client on another core
fanout1     one publisher (QoS 1, 100 in flight) to 50 QoS 1 subscribers of its topic,
            N / 50 messages (N deliveries)
fleet       1,000 devices, each publishing QoS 1 to its own ``devices/<nnnnn>/telemetry``,
            one PUBLISH per write (one packet per read: the device path), 20 devices' writes
            per loop iteration; one QoS 1 subscriber on ``devices/+/telemetry``; N messages
            after one each (not counted) has set every device's plain topic
fleet2      fleet on two workers (the shipped default on two cores): two worker servers of
            one broker (each a ``Server`` with its worker spec, a mesh between them) in the
            one process, each on its own port; each device connects to the worker owning its
            topic's partition, where the hand-off (broker.workers.handoff, off here: it
            moves a descriptor between processes) puts it, the subscriber to worker 0; so
            half of the deliveries are announced by the other worker
fanin0      50 publishers, each QoS 0 to its own ``devices/<nnnnn>/telemetry`` in writes of
            256 PUBLISHes (as bench.mqtt_bench's blast: many packets per read), one write
            per publisher per round, the next round once the round is delivered; one QoS 0
            subscriber on ``devices/+/telemetry``; N messages after one round (not counted)
fanin1      50 publishers, each QoS 1 (100 in flight) to its own ``devices/<nnnnn>/telemetry``;
            one QoS 1 subscriber on ``devices/+/telemetry``
==========  ==============================================================================

The stored messages are written once, by a broker of this checkout, and copied for each
measurement. Figures: instructions per delivered message; with ``--baseline DIR`` the same
scenarios run against that checkout's ``broker`` package in the same run; with
``--python-path`` this checkout also runs with ``MQLOG_DEVICE_PATH=python`` (the pure-Python
device path instead of the compiled one, broker.net.devicepath).

Run: ``.venv/bin/python -m bench.instr_bench [--baseline DIR] [--messages 200000]
[--scenario replay1,fanout1] [--runs 2] [--python-path] [--per-iteration 20]`` (valgrind on
the PATH; about a minute per scenario and run for 200,000 messages).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = ("replay1", "replay0", "replay1s", "fanout1", "fleet", "fleet2", "fanin0", "fanin1")
#: Scenarios that start from an empty data directory.
FRESH = ("fanout1", "fleet", "fleet2", "fanin0", "fanin1")
FANOUT_SUBSCRIBERS = 50
#: fleet: devices, and how many of them write per loop iteration.
FLEET_DEVICES = 1000
FLEET_PER_ITERATION = 20
#: How ``--per-iteration`` reaches the measured process.
PER_ITERATION_ENV = "INSTR_BENCH_PER_ITERATION"
FLEET_TOPIC = "devices/{:05d}/telemetry"  # 23 bytes, as the Subscriber expects
PUBLISHERS = 50
#: fanin0: PUBLISHes per write (bench.loadgen's blast batch).
FANIN_BATCH = 256
#: replay1s: PUBACKs per write.
ACK_CHUNK = 50
TOPIC = "replay0/{:05d}/telemetry"
PAYLOAD_TAIL = b"\xa5" * 56


def _str(b: bytes) -> bytes:
    return struct.pack(">H", len(b)) + b


def connect_packet(client_id: str) -> bytes:
    body = _str(b"MQTT") + bytes([4, 0x02]) + struct.pack(">H", 0) + _str(client_id.encode())
    return bytes([0x10, len(body)]) + body


def subscribe_packet(topic_filter: str, qos: int) -> bytes:
    body = struct.pack(">H", 1) + _str(topic_filter.encode()) + bytes([qos])
    return bytes([0x82, len(body)]) + body


def publish_packet(topic: bytes, packet_id: int, seq: int) -> bytes:
    """A QoS 1 PUBLISH of ``seq`` 's payload; QoS 0 where ``packet_id`` is 0."""
    payload = struct.pack("<Q", seq) + PAYLOAD_TAIL
    pid = struct.pack(">H", packet_id) if packet_id else b""
    first = 0x32 if packet_id else 0x30
    return bytes([first, 2 + len(topic) + len(pid) + 64]) + _str(topic) + pid + payload


class Subscriber(asyncio.Protocol):
    """Counts the deliveries (all of one shape: 23-byte topic, 64-byte payload, so a read
    of them is one numpy array) and
    acknowledges QoS 1 ones, all of a read in one write, or ``chunk`` per loop iteration."""

    def __init__(self, qos: int, expected: int, done: asyncio.Future[None], chunk: int = 0) -> None:
        self.qos, self.expected, self.done, self.chunk = qos, expected, done, chunk
        self.size = 2 + 2 + 23 + (2 if qos else 0) + 64
        self.head = bytes([0x32 if qos else 0x30, self.size - 2])
        self.buf = b""
        self.got = 0
        self.transport: Any = None
        #: (count, future): set once ``got`` reaches count (:meth:`until`).
        self.waiting: tuple[int, asyncio.Future[None]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def until(self, count: int) -> asyncio.Future[None]:
        """Done once ``count`` deliveries are in."""
        future = asyncio.get_running_loop().create_future()
        if self.got >= count:
            future.set_result(None)
        else:
            self.waiting = (count, future)
        return future

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, n, size, acks = 0, len(buf), self.size, []
        while n - pos >= 2:
            if buf.startswith(self.head, pos):
                # A run of deliveries, checked and acknowledged in numpy (the client's cost
                # per message stays small beside the broker's).
                k = (n - pos) // size
                if not k:
                    break
                rows = np.frombuffer(buf, np.uint8, k * size, pos).reshape(k, size)
                ok = (rows[:, 0] == self.head[0]) & (rows[:, 1] == self.head[1])
                if not ok.all():
                    k = int(ok.argmin())
                if self.qos:
                    out = np.empty((k, 4), np.uint8)
                    out[:, 0], out[:, 1] = 0x40, 2
                    out[:, 2:] = rows[:k, 27:29]
                    acks.append(out.tobytes())
                self.got += k
                pos += k * size
                continue
            if buf[pos + 1] & 0x80 or n - pos < 2 + buf[pos + 1]:
                raise ValueError(f"unexpected packet {buf[pos : pos + 8]!r}")
            pos += 2 + buf[pos + 1]  # CONNACK, SUBACK
        self.buf = buf[pos:]
        if acks:
            self._ack(b"".join(acks))
        if self.got >= self.expected and not self.done.done():
            self.done.set_result(None)
        if self.waiting is not None and self.got >= self.waiting[0]:
            self.waiting[1].set_result(None)
            self.waiting = None

    def _ack(self, acks: bytes) -> None:
        if self.transport.is_closing():
            return
        if not self.chunk or len(acks) <= 4 * self.chunk:
            self.transport.write(acks)
            return
        self.transport.write(acks[: 4 * self.chunk])
        asyncio.get_running_loop().call_soon(self._ack, acks[4 * self.chunk :])


class Publisher(asyncio.Protocol):
    """QoS 1 PUBLISHes to ``topics`` in turn, ``window`` unacknowledged at most."""

    def __init__(self, topics: list[bytes], count: int, window: int) -> None:
        self.topics, self.count, self.window = topics, count, window
        self.sent = 0
        self.acked = 0
        self.buf = b""
        self.transport: Any = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def send(self, k: int) -> None:
        k = min(k, self.count - self.sent)
        topics, first = self.topics, self.sent
        self.transport.write(
            b"".join(
                publish_packet(
                    topics[(first + i) % len(topics)], (first + i) % 65535 + 1, first + i
                )
                for i in range(k)
            )
        )
        self.sent += k

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        pos, n, acks = 0, len(buf), 0
        while n - pos >= 2 and n - pos >= 2 + buf[pos + 1]:
            acks += buf[pos] == 0x40
            pos += 2 + buf[pos + 1]
        self.buf = buf[pos:]
        self.acked += acks
        if self.acked >= self.count and not self.done.done():
            self.done.set_result(None)
        self.send(acks)


class Device(asyncio.Protocol):
    """A fleet device: each :meth:`send` writes one QoS 1 PUBLISH (one packet per write),
    made before the measurement (:meth:`prepare`: the client's work stays small beside the
    broker's); counts PUBACKs."""

    def __init__(self, topic: bytes) -> None:
        self.topic = topic
        self.packets: list[bytes] = []
        self.sent = 0
        self.acked = 0
        self.buf = b""
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def prepare(self, count: int) -> None:
        first = self.sent
        self.packets = [
            publish_packet(self.topic, seq % 65535 + 1, seq) for seq in range(first, first + count)
        ]

    def send(self) -> None:
        self.transport.write(self.packets[self.sent])
        self.sent += 1

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        pos, n = 0, len(buf)
        while n - pos >= 2 and n - pos >= 2 + buf[pos + 1]:
            self.acked += buf[pos] == 0x40
            pos += 2 + buf[pos + 1]
        self.buf = buf[pos:]


async def _fleet_round(devices: list[Device]) -> None:
    """One PUBLISH from every device, FLEET_PER_ITERATION writes per loop iteration (or
    ``--per-iteration``)."""
    step = int(os.environ.get(PER_ITERATION_ENV, FLEET_PER_ITERATION))
    for i in range(0, len(devices), step):
        for device in devices[i : i + step]:
            device.send()
        await asyncio.sleep(0)


def _fleet_worker(i: int, workers: int) -> int:
    """The worker device ``i`` is connected to: the one owning its topic's partition (of
    the shipped config's four), where the hand-off puts a device (broker.workers.handoff;
    off here: both workers are in this one process)."""
    partition = zlib.crc32(FLEET_TOPIC.format(i).encode()) % 4
    return (zlib.crc32(b"telemetry") + partition) % workers  # broker.workers.mesh.owner_of


async def _fleet(ports: list[int], count: int) -> int:
    loop = asyncio.get_running_loop()
    rounds = max(1, count // FLEET_DEVICES)
    done = loop.create_future()
    sub = await _connect(
        ports[0],
        lambda: Subscriber(1, FLEET_DEVICES * (rounds + 1), done),
        connect_packet("fleet-sub") + subscribe_packet("devices/+/telemetry", 1),
    )
    devices: list[Device] = []
    for i in range(FLEET_DEVICES):
        devices.append(
            await _connect(
                ports[_fleet_worker(i, len(ports))],
                partial(Device, FLEET_TOPIC.format(i).encode()),
                connect_packet(f"dev{i}"),
            )
        )
    await asyncio.sleep(0.5)
    for device in devices:
        device.prepare(rounds + 1)
    await _fleet_round(devices)  # the first: the full path, which sets the plain topics
    while sub.got < FLEET_DEVICES:
        await asyncio.sleep(0.05)
    _control("--instr=on")
    _control("--zero")
    for _ in range(rounds):
        await _fleet_round(devices)
    await done
    for device in devices:
        while device.acked <= rounds:
            await asyncio.sleep(0)
    _control("--dump")
    _control("--instr=off")
    return int(sub.got) - FLEET_DEVICES


async def _fanin(port: int, qos: int, count: int) -> int:
    """fanin0 / fanin1 (module docstring)."""
    loop = asyncio.get_running_loop()
    topics = [FLEET_TOPIC.format(i).encode() for i in range(PUBLISHERS)]
    per_round = PUBLISHERS * FANIN_BATCH
    rounds = max(1, count // per_round)
    expected = per_round * (rounds + 1) if not qos else count // PUBLISHERS * PUBLISHERS
    done = loop.create_future()
    sub = await _connect(
        port,
        lambda: Subscriber(qos, expected, done),
        connect_packet(f"fanin{qos}-sub") + subscribe_packet("devices/+/telemetry", qos),
    )
    if qos:
        pubs = [
            await _connect(
                port, partial(Publisher, [topic], count // PUBLISHERS, 100), connect_packet(f"p{i}")
            )
            for i, topic in enumerate(topics)
        ]
        await asyncio.sleep(0.5)  # every CONNACK and SUBACK is in
        _control("--instr=on")
        _control("--zero")
        for pub in pubs:
            pub.send(pub.window)
        await done
        _control("--dump")
        _control("--instr=off")
        return int(sub.got)
    blasters = [
        await _connect(port, partial(Device, topic), connect_packet(f"p{i}"))
        for i, topic in enumerate(topics)
    ]
    # Every round's writes made before the measurement (the client's work stays small).
    chunks = [
        [
            b"".join(
                publish_packet(topic, 0, seq)
                for seq in range(r * FANIN_BATCH, (r + 1) * FANIN_BATCH)
            )
            for r in range(rounds + 1)
        ]
        for topic in topics
    ]
    await asyncio.sleep(0.5)
    for r in range(rounds + 1):
        if r == 1:  # the first round (not counted) set every publisher's plain topic
            _control("--instr=on")
            _control("--zero")
        for blaster, writes in zip(blasters, chunks, strict=True):
            blaster.transport.write(writes[r])
        await sub.until((r + 1) * per_round)
    _control("--dump")
    _control("--instr=off")
    return int(sub.got) - per_round


# ============================================================== the measured process


def _control(command: str) -> None:
    """Switch callgrind's instrumentation of this process (no-op outside valgrind)."""
    if os.environ.get("INSTR_BENCH_VALGRIND"):
        subprocess.run(
            ["callgrind_control", *command.split(), str(os.getpid())],
            check=True,
            stdout=subprocess.DEVNULL,
        )


async def _connect(port: int, factory: Callable[[], asyncio.Protocol], first: bytes) -> Any:
    transport, protocol = await asyncio.get_running_loop().create_connection(
        factory, "127.0.0.1", port
    )
    transport.write(first)
    return protocol


async def _scenario(name: str, data: Path, count: int, port: int) -> int:
    """Run ``name`` against a broker of the ``broker`` package on sys.path; returns the
    messages delivered (``load``: stored)."""
    from broker.config import load_config
    from broker.server import Server

    cfg = load_config(
        Path(sys.modules["broker"].__file__ or "").parent.parent / "config" / "broker.toml"
    )
    cfg = dataclasses.replace(
        cfg,
        server=dataclasses.replace(cfg.server, port=port, sys_interval=0),
        http=dataclasses.replace(cfg.http, enabled=False),
        commitlog=dataclasses.replace(cfg.commitlog, data_dir=data),
        router=dataclasses.replace(cfg.router, workers=1),
    )
    if name == "fleet2":
        return await _two_workers(cfg, count)
    server = Server(cfg)
    await server.start()
    loop = asyncio.get_running_loop()
    try:
        if name == "load":
            topics = [TOPIC.format(i).encode() for i in range(PUBLISHERS)]
            pubs = []
            for i in range(PUBLISHERS):
                pub = await _connect(
                    port,
                    partial(Publisher, [topics[i]], count // PUBLISHERS, 100),
                    connect_packet(f"load{i}"),
                )
                pubs.append(pub)
            await asyncio.sleep(0.2)
            for pub in pubs:
                pub.send(pub.window)
            await asyncio.gather(*(p.done for p in pubs))
            return sum(p.acked for p in pubs)
        if name == "fleet":
            return await _fleet([port], count)
        if name in ("fanin0", "fanin1"):
            return await _fanin(port, int(name[5]), count)
        if name == "fanout1":
            topic = "fanouts/00000/telemetry"
            subs = []
            for i in range(FANOUT_SUBSCRIBERS):
                done = loop.create_future()
                subs.append(
                    await _connect(
                        port,
                        partial(Subscriber, 1, count // FANOUT_SUBSCRIBERS, done),
                        connect_packet(f"sub{i}") + subscribe_packet(topic, 1),
                    )
                )
            pub = await _connect(
                port,
                lambda: Publisher([topic.encode()], count // FANOUT_SUBSCRIBERS, 100),
                connect_packet("pub"),
            )
            await asyncio.sleep(0.5)  # every CONNACK and SUBACK is in
            _control("--instr=on")
            _control("--zero")
            pub.send(pub.window)
            await asyncio.gather(*(s.done for s in subs))
            _control("--dump")
            _control("--instr=off")
            return sum(s.got for s in subs)
        qos = int(name[6])
        done = loop.create_future()
        chunk = ACK_CHUNK if name.endswith("s") else 0
        _control("--instr=on")
        _control("--zero")
        sub = await _connect(
            port,
            lambda: Subscriber(qos, count, done, chunk),
            connect_packet(f"replayer{qos}")
            + subscribe_packet("$replay/earliest/replay0/+/telemetry", qos),
        )
        await done
        _control("--dump")
        _control("--instr=off")
        return int(sub.got)
    finally:
        await server.stop()


async def _two_workers(cfg: Any, count: int) -> int:
    """fleet2: the two workers of one broker on this loop (module docstring)."""
    from broker.server import Server
    from broker.workers.runtime import WorkerSpec

    servers = []
    ports = [cfg.server.port, _free_port()]
    for index, port in enumerate(ports):
        _, ready = os.pipe()  # the supervisor's end, never read
        worker_cfg = dataclasses.replace(
            cfg,
            server=dataclasses.replace(cfg.server, port=port),
            router=dataclasses.replace(cfg.router, workers=2, handoff=False),
        )
        servers.append(Server(worker_cfg, worker=WorkerSpec(index, 2, ready)))
    await asyncio.gather(*(s.start() for s in servers))  # each waits for the other's mesh
    try:
        return await _fleet(ports, count)
    finally:
        await asyncio.gather(*(s.stop() for s in servers))


def child(name: str, data: Path, count: int, port: int) -> None:
    import uvloop

    got = uvloop.run(_scenario(name, data, count, port))
    print(f"delivered {got}", flush=True)


# ============================================================== the orchestrator


def measure(
    src: Path, name: str, stored: Path, count: int, work: Path, env_extra: dict[str, str]
) -> tuple[int, int]:
    """(instructions, messages delivered) of one run of ``name`` with ``src``'s broker."""
    run = Path(tempfile.mkdtemp(dir=work))
    data = run / "data"
    shutil.copytree(stored, data)
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={run}/callgrind.%p",
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        name,
        str(data),
        str(count),
        str(_free_port()),
    ]
    env = {**os.environ, "PYTHONPATH": str(src), "INSTR_BENCH_VALGRIND": "1", **env_extra}
    out = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True)
    got = re.search(r"delivered (\d+)", out.stdout)
    dumps = [p for p in run.iterdir() if re.fullmatch(r"callgrind\.\d+\.\d+", p.name)]
    if out.returncode or got is None or len(dumps) != 1:
        raise RuntimeError(f"{src}: {name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    total = re.search(r"^(?:summary|totals): (\d+)", dumps[0].read_text(), re.M)
    assert total is not None, dumps[0]
    shutil.rmtree(run)
    return int(total.group(1)), int(got.group(1))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="a checkout to compare with (its broker/)")
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--scenario", default=",".join(SCENARIOS))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument(
        "--python-path",
        action="store_true",
        help="also run this checkout with the pure-Python device path (MQLOG_DEVICE_PATH)",
    )
    ap.add_argument(
        "--per-iteration",
        type=int,
        default=FLEET_PER_ITERATION,
        help="fleet, fleet2: devices' writes per loop iteration (bench.mqtt_bench's fleet of "
        "5,000 devices at 1 msg/s each gives a worker one to three PUBLISHes per iteration)",
    )
    args = ap.parse_args()
    if args.per_iteration < 1:
        ap.error("--per-iteration: at least 1")
    os.environ[PER_ITERATION_ENV] = str(args.per_iteration)
    names = args.scenario.split(",")
    for name in names:
        if name not in SCENARIOS:
            ap.error(f"--scenario: unknown {name!r} (known: {', '.join(SCENARIOS)})")
    checkouts: dict[str, tuple[Path, dict[str, str]]] = {"this": (REPO, {})}
    if args.python_path:
        checkouts["python"] = (REPO, {"MQLOG_DEVICE_PATH": "python"})
    if args.baseline is not None:
        if not (args.baseline / "broker").is_dir():
            ap.error(f"--baseline: {args.baseline} has no broker/ package")
        checkouts["baseline"] = (args.baseline.resolve(), {})
    with tempfile.TemporaryDirectory(prefix="instr-bench-") as tmp:
        work = Path(tmp)
        stored = work / "stored"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        load = [sys.executable, str(Path(__file__).resolve()), "--child", "load"]
        if set(names) - set(FRESH):
            subprocess.run(
                [*load, str(stored), str(args.messages), str(_free_port())], env=env, check=True
            )
        empty = work / "empty"
        empty.mkdir()
        per: dict[tuple[str, str], list[float]] = {}
        for run in range(args.runs):
            for name in names:
                for label, (src, env_extra) in checkouts.items():
                    t0 = time.monotonic()
                    data = empty if name in FRESH else stored
                    instr, got = measure(src, name, data, args.messages, work, env_extra)
                    per.setdefault((name, label), []).append(instr / got)
                    print(
                        f"run {run} {name:9s} {label:9s} {instr / got:9,.0f} instructions/msg "
                        f"({got:,} delivered, {time.monotonic() - t0:.0f} s)",
                        flush=True,
                    )
    print(f"\n{'scenario':9s} " + " ".join(f"{label:>12s}" for label in checkouts) + "   ratio")
    for name in names:
        meds = [statistics.median(per[(name, label)]) for label in checkouts]
        ratio = f"   {meds[0] / meds[1]:.3f}" if len(meds) > 1 else ""
        print(f"{name:9s} " + " ".join(f"{m:12,.0f}" for m in meds) + ratio)


if __name__ == "__main__":
    main()
