"""QoS 1 fan-in through a cluster in the network lab: throughput and PUBACK latency.

Each target runs in the lab of tests/netlab.py (one namespace per node, clients on the host
across the bridge, so every byte crosses a veth as it would cross a wire):

- ``mqlog``: one mqlog node (``--mqlog-fsync``, default "always": a PUBACK follows the fsync);
- ``mqlog-cluster``: three mqlog nodes, ``replication_factor = 3``, ``fsync = "always"`` (a
  PUBACK follows the quorum commit: a majority has fsynced the entry), one worker each
  (:class:`MqlogClusterBenchTarget`, configs from tests/cluster_lab.py), publishers spread
  over the three nodes (those on a follower are forwarded to the partition's leader);
  ``--cluster-workers N`` runs N workers per node, and ``mqlog-cluster-wN`` is the same
  cluster with N workers per node, so that ``--targets mqlog-cluster,mqlog-cluster-w2``
  compares one and two workers per node in one run;
- ``nats``: NATS 2.9, three nodes, MQTT on JetStream with ``stream_replicas: 3`` (the file
  store; bench/targets.py's NatsTarget), publishers spread over the three nodes.

``--rounds N`` runs every target N times, interleaved (round 1: each target in turn, then
round 2, ...), so that a slow spell of this shared machine hits them alike; the table gives
each target's median msg/s, the medians of its runs' PUBACK p50 and p99, every run's msg/s and
the load average at each run's start.

Where the time goes, per run (in its JSON line): the CPU seconds of each node's processes over
the measured window and the CPU per acknowledged message (``cpu_s``, ``cpu_us_per_msg``), the
PUBACK p50 of the publishers connected to each node (``puback_p50_ms_by_node``: the cost of
forwarding to the leader), the Raft frames, heartbeats and commit notices the cluster's nodes
sent per second (``raft_per_s``, broker.cluster.commits); with ``--syscalls``, each node's
fdatasync, write, writev calls per second (``perf stat``); with ``--profile DIR``, py-spy's
stacks of every node.

bench/targets.py's ``MqlogClusterTarget`` (the chaos runs' adapter) is the same deployment
with a ``chaos`` stream; this bench keeps :class:`MqlogClusterBenchTarget`, whose processes
are the base ``Target``'s (``procs``), which the CPU, perf and py-spy counters read.

Workload: ``--publishers`` connections (in ``--procs`` processes, uvloop), each keeping
``--window`` QoS 1 publishes of 64 bytes in flight on its own topic ``bench/<k>/fanin``, and
one subscriber on ``bench/+/fanin`` at QoS 1 acknowledging every delivery. After ``--warmup``
seconds, ``--duration`` seconds are measured: acknowledged publishes per second, and the
PUBACK latency (send to PUBACK) p50/p99 of the publishes sent in that window. The subscriber's
count must reach every acknowledged publish (checked after the run).

Usage (root): ``python -m bench.cluster_bench [--targets mqlog,mqlog-cluster,nats]
[--rounds 3] [--duration 10]``; prints a table and one JSON line per run and per median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.loadgen import DISCONNECT, connect_packet, raise_nofile, varint
from bench.mqttclient import MqttClient
from bench.targets import MqlogTarget, NatsTarget, Target
from broker.cluster.placement import node_ids, replicas
from tests.cluster_lab import MqlogCluster
from tests.netlab import Lab, Node

PAYLOAD = b"\x5a" * 64


class MqlogClusterBenchTarget(Target):
    """Three mqlog nodes with ``[cluster]`` (RF=3, ``fsync = "always"``, ``workers`` each),
    configured by tests/cluster_lab.py's :class:`MqlogCluster` (one secret, every other node a
    seed). This bench's own adapter until bench/targets.py has the chaos harness's."""

    name = "mqlog-cluster"
    size = 3

    def __init__(self, lab: Lab, workdir: Path, workers: int = 1, partitions: int = 0) -> None:
        super().__init__(lab, workdir)
        extra = (
            f'[[streams]]\nname = "bench"\ntopic_filter = ["bench/#"]\npartitions = {partitions}\n'
            if partitions
            else ""
        )
        self.cluster = MqlogCluster(lab, workdir, workers=workers, extra=extra)

    def argv(self, node: Node) -> list[str]:
        member = self.cluster.members[node.index]
        return [str(self.cluster.mqlog), "serve", "-c", str(member.config_path)]

    def env(self) -> dict[str, str]:
        return self.cluster.env()

    def status(self, node: Node) -> dict[str, Any]:
        """``GET /api/v1/cluster`` of ``node``."""
        return self.cluster.status(self.cluster.members[node.index])

    def settle(self, timeout: float = 30.0) -> None:
        """Until every node names, for every partition, the replica placement prefers
        (``broker.cluster.placement``) as its leader: the balancer hands leadership there a few
        seconds after the start (``BALANCE_TICKS``), and a transfer during the measured
        window would end its in-flight publishes with an unknown outcome (connections
        closed)."""
        names = node_ids(m.node_id for m in self.cluster.members)
        deadline = time.monotonic() + timeout
        while True:
            try:
                views = [self.status(node)["partitions"] for node in self.lab.nodes]
            except OSError:
                views = []
            if views and all(
                p["leader"] == names[replicas(p["group"], names, len(names))[0]]
                for view in views
                for p in view
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"leaders not on their preferred replicas after {timeout}s")
            time.sleep(0.2)

    def leaders(self) -> dict[str, str | None]:
        """Each partition's leader ("stream/partition" -> node id) as the first node that
        answers sees it."""
        for node in self.lab.nodes:
            try:
                doc = self.status(node)
            except OSError:
                continue
            return {f"{p['stream']}/{p['partition']}": p["leader"] for p in doc["partitions"]}
        return {}


class _Pub(asyncio.Protocol):
    """One publisher connection in window mode; PUBACK latencies in ns while measuring."""

    def __init__(self, cid: str, topic: str, window: int, clock: dict[str, float]) -> None:
        self.cid = cid
        t = topic.encode()
        self.head = struct.pack(">H", len(t)) + t
        self.window = window
        self.clock = clock
        self.sent_at: dict[int, int] = {}
        self.pid = 0
        self.sent = 0
        self.buf = bytearray()
        self.lat: list[int] = []
        self.acked_in = 0
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(connect_packet(self.cid, True, username="bench"))  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"{self.cid}: {exc}"))

    def start(self) -> None:
        for _ in range(self.window):
            self._send()

    def _send(self) -> None:
        if time.monotonic() >= self.clock["end"] or self.transport is None:
            return
        self.pid = self.pid % 65535 + 1
        body = self.head + struct.pack(">H", self.pid) + PAYLOAD
        self.sent_at[self.pid] = time.monotonic_ns()
        self.sent += 1
        self.transport.write(b"\x32" + varint(len(body)) + body)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        n = len(buf)
        while pos + 2 <= n:
            rl = buf[pos + 1]
            if rl & 0x80 or pos + 2 + rl > n:
                break  # PUBACK and CONNACK are 4 bytes: a long packet is not expected
            kind = buf[pos] >> 4
            if kind == 4:
                pid = (buf[pos + 2] << 8) | buf[pos + 3]
                t = self.sent_at.pop(pid, None)
                if t is not None:
                    now = time.monotonic_ns()
                    if t >= self.clock["t0_ns"] and now <= self.clock["end_ns"]:
                        self.lat.append(now - t)
                        self.acked_in += 1
                self._send()
            elif kind == 2 and not self.ready.done():
                if buf[pos + 3] == 0:
                    self.ready.set_result(None)
                else:
                    self.ready.set_exception(ConnectionError(f"CONNACK {buf[pos + 3]}"))
            pos += 2 + rl
        del buf[:pos]


async def _pubs(spec: dict[str, Any], go: Any, out: Any) -> None:
    loop = asyncio.get_running_loop()
    clock = {"end": float("inf"), "t0_ns": 1 << 62, "end_ns": 0}
    conns: list[_Pub] = []
    for k in spec["indexes"]:
        host, port = spec["addrs"][k % len(spec["addrs"])]
        cid = f"bench-p{k}"

        def make(cid: str = cid, k: int = k) -> _Pub:
            return _Pub(cid, f"bench/{k}/fanin", spec["window"], clock)

        _, proto = await loop.create_connection(make, host, port)
        await asyncio.wait_for(proto.ready, 30)
        conns.append(proto)
    out.put(("ready", len(conns)))
    while not go.is_set():
        await asyncio.sleep(0.005)
    now = time.monotonic()
    clock["end"] = now + spec["warmup"] + spec["duration"]
    clock["t0_ns"] = int((now + spec["warmup"]) * 1e9)
    clock["end_ns"] = int(clock["end"] * 1e9)
    for c in conns:
        c.start()
    await asyncio.sleep(spec["warmup"] + spec["duration"] + 1.0)
    lat = np.array([x for c in conns for x in c.lat], dtype=np.int64)
    sent = sum(c.sent for c in conns)
    for c in conns:
        if c.transport is not None:
            c.transport.write(DISCONNECT)
            c.transport.close()
    nodes = len(spec["addrs"])
    by_node = {
        n: np.array(
            [
                x
                for k, c in zip(spec["indexes"], conns, strict=True)
                if k % nodes == n
                for x in c.lat
            ]
        )
        for n in range(nodes)
    }
    p50s = {n: (float(np.percentile(v, 50)) / 1e6, len(v)) for n, v in by_node.items() if len(v)}
    out.put(("pub", int(sum(c.acked_in for c in conns)), lat.tobytes(), sent, p50s))


async def _sub(spec: dict[str, Any], go: Any, stop: Any, out: Any) -> None:
    count = [0]
    host, port = spec["addrs"][0]
    c = await MqttClient.connect(
        host,
        port,
        "bench-sub",
        timeout=30,
        on_message=lambda t, p: count.__setitem__(0, count[0] + 1),
    )
    if await c.subscribe("bench/+/fanin", timeout=30) == 0x80:
        raise RuntimeError("subscription refused")
    out.put(("ready", 1))
    while not stop.is_set():
        await asyncio.sleep(0.05)
    last, quiet = count[0], time.monotonic()
    while time.monotonic() - quiet < 2.0:  # until two seconds without a delivery
        await asyncio.sleep(0.1)
        if count[0] != last:
            last, quiet = count[0], time.monotonic()
    c.close()
    out.put(("sub", count[0]))


def _proc_main(role: str, spec: dict[str, Any], go: Any, stop: Any, out: Any) -> None:
    import uvloop

    raise_nofile()
    try:
        if role == "pub":
            uvloop.run(_pubs(spec, go, out))
        else:
            uvloop.run(_sub(spec, go, stop, out))
    except BaseException as e:
        out.put(("error", f"{role}: {type(e).__name__}: {e}"))
        raise


async def _warm(target: Target, timeout: float = 60.0) -> None:
    """Until a QoS 1 publish through each node is acknowledged (JetStream creates its MQTT
    streams on the first connection)."""
    deadline = time.monotonic() + timeout
    for node in target.lab.nodes:
        while True:
            try:
                c = await MqttClient.connect(*target.addr(node), "bench-warm", timeout=5)
                await asyncio.wait_for(c.publish("bench/warm", b"x"), 5)
                c.close()
                break
            except (OSError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)


def measure(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    """One target, already started: fan-in for the configured time."""
    asyncio.run(_warm(target))
    if isinstance(target, MqlogClusterBenchTarget):
        target.settle()
    addrs = [target.addr(n) for n in target.lab.nodes]
    ctx = mp.get_context("fork")
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    spec = {
        "addrs": addrs,
        "window": args.window,
        "warmup": args.warmup,
        "duration": args.duration,
    }
    procs = [ctx.Process(target=_proc_main, args=("sub", spec, go, stop, out))]
    for i in range(args.procs):
        s = {**spec, "indexes": list(range(i, args.publishers, args.procs))}
        procs.append(ctx.Process(target=_proc_main, args=("pub", s, go, stop, out)))
    procs[0].start()
    _expect(out, "ready", 1)
    for p in procs[1:]:
        p.start()
    _expect(out, "ready", args.procs)
    go.set()
    time.sleep(args.warmup)
    hosts0 = _host_counters(target)
    cpu0 = {name: _cpu_seconds(proc.pid) for name, proc in target.procs.items()}
    spies = _profile(target, args) if args.profile else []
    counters = _count_syscalls(target, args.duration - 1) if args.syscalls else {}
    time.sleep(args.duration)
    cpu = {
        name: round(_cpu_seconds(proc.pid) - cpu0[name], 2) for name, proc in target.procs.items()
    }
    hosts = _host_counters(target)
    pubs = _expect(out, "pub", args.procs, timeout=args.duration + 60)
    for spy in spies:
        spy.wait(30)
    stop.set()
    sub = _expect(out, "sub", 1, timeout=120)[0]
    for p in procs:
        p.join(10)
    acked = sum(r[1] for r in pubs)
    lat = np.concatenate([np.frombuffer(r[2], dtype=np.int64) for r in pubs]) / 1e6
    sent = sum(r[3] for r in pubs)
    # PUBACK p50 of the publishers connected to each node (the median of the processes'
    # p50s weighted by their counts: close enough for a per-node view)
    p50_by_node = {}
    for n, name in enumerate(target.procs):
        parts = [r[4][n] for r in pubs if n in r[4]]
        if parts:
            total = sum(k for _, k in parts)
            p50_by_node[name] = round(sum(v * k for v, k in parts) / total, 2)
    return {
        "target": target.name,
        "nodes": len(target.lab.nodes),
        "msg_s": round(acked / args.duration),
        "acked_measured": acked,
        "puback_p50_ms": round(float(np.percentile(lat, 50)), 2) if len(lat) else None,
        "puback_p99_ms": round(float(np.percentile(lat, 99)), 2) if len(lat) else None,
        "sent": sent,
        "received": sub[1],
        "puback_p50_ms_by_node": p50_by_node,
        "cpu_s": cpu,
        "syscalls_s": {
            name: _read_counts(perf, args.duration - 1) for name, perf in counters.items()
        },
        "cpu_us_per_msg": round(sum(cpu.values()) * 1e6 / acked, 1) if acked else None,
        "raft_per_s": {k: round((hosts[k] - hosts0.get(k, 0)) / args.duration) for k in hosts},
        "publishers": args.publishers,
        "window": args.window,
    }


def _host_counters(target: Target) -> dict[str, int]:
    """A cluster's Raft frames, heartbeats and commit notices sent so far, every node's
    added up (``host`` in ``GET /api/v1/cluster``; none before a tree had it)."""
    if not isinstance(target, MqlogClusterBenchTarget):
        return {}
    totals: dict[str, int] = {}
    for node in target.lab.nodes:
        host = target.status(node).get("host", {})
        for k in ("frames_sent", "beats_sent", "notices_sent"):
            totals[k] = totals.get(k, 0) + host.get(k, 0)
    return totals


def _cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (a node's
    broker and its workers), from ``/proc/<pid>/stat``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # fields from the state on: state, ppid, pgrp, ...
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


#: System calls ``--syscalls`` counts per node (perf's tracepoints).
SYSCALLS = ("fdatasync", "fsync", "epoll_wait", "write", "writev", "sendmsg")


def _count_syscalls(target: Target, seconds: float) -> dict[str, subprocess.Popen[str]]:
    """``perf stat`` of :data:`SYSCALLS` over each node's process group for ``seconds``."""
    events = ",".join(f"syscalls:sys_enter_{name}" for name in SYSCALLS)
    counters = {}
    for name, proc in target.procs.items():
        pids = subprocess.run(
            ["ps", "-o", "pid=", "-g", str(proc.pid)], capture_output=True, text=True, check=True
        ).stdout.split()
        counters[name] = subprocess.Popen(
            ["perf", "stat", "-x", ",", "-e", events, "-p", ",".join(pids), "sleep", str(seconds)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    return counters


def _read_counts(perf: subprocess.Popen[str], seconds: float) -> dict[str, float]:
    """Per second, each system call ``perf stat -x ,`` counted."""
    _, err = perf.communicate(timeout=30)
    counts = {}
    for line in err.splitlines():
        parts = line.split(",")
        if len(parts) > 2 and parts[2].startswith("syscalls:sys_enter_") and parts[0].isdigit():
            counts[parts[2].removeprefix("syscalls:sys_enter_")] = round(int(parts[0]) / seconds)
    return counts


def _profile(target: Target, args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    """Started after the warmup: py-spy (``--nonblocking``, the venv's ``py-spy``) records
    every node's processes, workers included, for the measured window: collapsed stacks in
    ``<profile>/<target>-<node>-r<round>.txt``. Threads py-spy deems idle are left out; a
    blocking system call such as an fsync counts, and so may time in uvloop's C code, which
    shows as ``Runner.run``."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        raise SystemExit(f"--profile: {spy} not found (pip install py-spy)")
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                str(spy),
                "record",
                "--nonblocking",
                "--subprocesses",
                "--format",
                "raw",
                "--duration",
                str(max(1, int(args.duration) - 1)),
                "--pid",
                str(proc.pid),
                "-o",
                str(out / f"{target.name}-{name}-r{args.round}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, proc in target.procs.items()
    ]


def _expect(out: Any, kind: str, n: int, timeout: float = 60.0) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        msg = out.get(timeout=max(0.1, deadline - time.monotonic()))
        if msg[0] == "error":
            raise RuntimeError(msg[1])
        if msg[0] == kind:
            got.append(msg)
    return got


def run_target(name: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"cluster-bench-{name}-"))
    # "mqlog-cluster-w2": the cluster with 2 workers per node (else --cluster-workers).
    kind, _, suffix = name.partition("-w") if name.startswith("mqlog-cluster") else (name, "", "")
    workers = int(suffix) if suffix else args.cluster_workers
    size = {"mqlog": 1, "mqlog-cluster": 3, "nats": 3}[kind]
    load = os.getloadavg()
    try:
        with Lab(size) as lab:
            target: Target
            if name == "mqlog":
                target = MqlogTarget(lab, work, workers=args.mqlog_workers, fsync=args.mqlog_fsync)
            elif kind == "mqlog-cluster":
                target = MqlogClusterBenchTarget(lab, work, workers, args.cluster_partitions)
            else:
                target = NatsTarget(lab, work)
            target.start_all()
            row = measure(target, args)
            row["target"] = name  # mqlog-cluster-wN apart from mqlog-cluster
            if isinstance(target, MqlogClusterBenchTarget):
                row["leaders"] = target.leaders()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    row["load_1m"] = round(load[0], 2)
    row["config"] = {
        "mqlog": f"fsync={args.mqlog_fsync} workers={args.mqlog_workers}",
        "mqlog-cluster": f"RF=3 fsync=always workers={workers}"
        + (f" partitions={args.cluster_partitions}" if args.cluster_partitions else ""),
        "nats": "JetStream file store, stream_replicas=3",
    }[kind]
    return row


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median msg/s (the lower middle one of an even count), with every
    run's msg/s and load beside it."""
    ordered = sorted(rows, key=lambda r: r["msg_s"])
    mid = ordered[(len(ordered) - 1) // 2]
    return {
        **mid,
        "runs": len(rows),
        "msg_s_runs": [r["msg_s"] for r in rows],
        "p50_ms_median": statistics.median(r["puback_p50_ms"] or 0.0 for r in rows),
        "p99_ms_median": statistics.median(r["puback_p99_ms"] or 0.0 for r in rows),
        "load_1m_runs": [r["load_1m"] for r in rows],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="mqlog,mqlog-cluster,nats")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each target, interleaved")
    ap.add_argument("--publishers", type=int, default=50)
    ap.add_argument("--procs", type=int, default=2, help="publisher processes")
    ap.add_argument("--window", type=int, default=8, help="QoS 1 in flight per publisher")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--mqlog-fsync", default="always", choices=("always", "interval", "never"))
    ap.add_argument("--mqlog-workers", type=int, default=1)
    ap.add_argument(
        "--cluster-workers",
        type=int,
        default=1,
        help="workers per node of mqlog-cluster (mqlog-cluster-wN: N, in the same run)",
    )
    ap.add_argument(
        "--cluster-partitions",
        type=int,
        default=0,
        help="a stream 'bench' of this many partitions for the publishers' topics "
        "(0: the default stream's one partition)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the brokers' data and logs")
    ap.add_argument(
        "--profile", default="", help="directory: py-spy profiles of every node's measured window"
    )
    ap.add_argument(
        "--syscalls", action="store_true", help="count fsyncs, writes, loop wakeups per node (perf)"
    )
    args = ap.parse_args(argv)
    names = [name for name in args.targets.split(",") if name]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for i in range(args.rounds):
        args.round = i + 1
        for name in names:
            row = run_target(name, args)
            row["round"] = i + 1
            runs[name].append(row)
            print(json.dumps({"bench": "cluster", **row}), flush=True)
    rows = [median_row(runs[name]) for name in names]
    print(
        f"{'target':<14} {'nodes':>5} {'msg/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'runs msg/s':>24} {'load 1m':>16}  config"
    )
    for r in rows:
        print(
            f"{r['target']:<14} {r['nodes']:>5} {r['msg_s']:>9} {r['p50_ms_median']!s:>8} "
            f"{r['p99_ms_median']!s:>8} {r['msg_s_runs']!s:>24} "
            f"{r['load_1m_runs']!s:>16}  {r['config']}"
        )
    for r in rows:
        print(json.dumps({"bench": "cluster-median", **r}))
    bad = [r for name in names for r in runs[name] if r["received"] < r["acked_measured"]]
    for r in bad:
        print(
            f"{r['target']} round {r['round']}: the subscriber got {r['received']} of the "
            f"{r['acked_measured']} acknowledged publishes"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
