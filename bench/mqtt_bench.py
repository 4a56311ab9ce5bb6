"""mqlog against Mosquitto 2, side by side in one run (issue 6).

Both brokers are started by this script on spare ports, and every scenario runs on each
broker in turn (interleaved: mqlog, Mosquitto, then the next scenario; with ``--runs N`` the
order alternates), with the same load generator (:mod:`bench.loadgen`: raw uvloop sockets,
pre-encoded packets, deliveries framed with numpy and checked per publisher).

* mqlog: ``mqlog serve -c config/broker.toml`` (the shipped defaults: fsync = "interval",
  every message appended to the log, max_inflight = 1000) with its own ports and a temporary
  data directory.
* Mosquitto (``/usr/sbin/mosquitto``): ``listener <port> 127.0.0.1``, ``allow_anonymous
  true``, ``persistence false``, ``max_queued_messages 0`` (unlimited: its default of 1000
  drops QoS 1 fan-in), ``max_inflight_messages`` = the max_inflight of the mqlog config
  run (the same delivery window), ``set_tcp_nodelay true`` (mqlog sets TCP_NODELAY too).

Scenarios (MQTT 3.1.1, 64-byte payloads, topics ``<prefix>/<nnnnn>/telemetry``):

=============  ==========================================================================
fanin0/1       50 publishers, one subscriber on ``devices/+/telemetry``; QoS 0 as fast as
               the sockets take it, QoS 1 with 100 in flight per publisher
fanout0/1      1 publisher, 50 subscribers of its topic (figure: deliveries/s)
fleet          5,000 devices, each one QoS 1 PUBLISH per second (one packet per write), one
               QoS 1 subscriber on the wildcard: broker CPU %, RSS, p50/p99 latency
fleet-         the fleet while a competing load shares the machine: one process pinned to
contended      one core (``CONTEND_CPU``) spinning for the whole measurement, for every
               broker in turn (issue 23: a test suite on the machine stretched the tail)
fleet-cmd      the fleet with each device subscribed (QoS 1) to its own command topic, as
               devices that take commands are (no command is sent): optional, not in the
               default set (``--scenario fleet-cmd``)
storm          5,000 CONNECTs (2 processes, 200 in progress each): connects/s, broker RSS
               growth per idle connection
latency        one publisher paced at 5,000 msg/s QoS 1, one QoS 1 subscriber: p50/p99
replay         N stored messages (1,000,000; --quick 100,000) to one subscriber: mqlog from
               ``$replay/earliest/...``, Mosquitto from a persistent session's offline
               queue (both QoS 1); plus mqlog at QoS 0 (no Mosquitto equivalent)
=============  ==========================================================================

* NATS (optional: ``--brokers mqlog,mosquitto,nats``): NATS 2.9 (Debian ``nats-server``),
  MQTT on JetStream with its file store (the peer that persists, as mqlog does), one node
  configured by :mod:`bench.nats` (as the chaos runs' three are); replay from its
  persistent session's stored messages, as for Mosquitto.
* amqtt (optional: ``--brokers mqlog,mosquitto,amqtt``): the Python broker from the venv,
  3.1.1 only, anonymous-auth plugin only; a tenth of the counted scenarios' messages (its
  rates would make the full counts take many minutes); replay is not measured (its offline
  queue stopped after 4-5% of the stored messages).
* mqlog1 (optional: ``--brokers mqlog,mosquitto,mqlog1``): mqlog with ``--workers 1``
  beside the shipped one worker per core, in the same run.
* floor (optional: ``--brokers mqlog,mosquitto,floor``): :mod:`bench.floor_server`, not a
  broker but the least a Python + uvloop server does per message (frame, one log write per
  iteration, PUBACK, deliver to the one subscriber), in the scenarios it can serve.

Prints one table (figure per broker, mqlog/Mosquitto ratio, throughput per broker
CPU-second, broker and generator CPU seconds, losses), appends JSON lines to
``bench/results/mqtt_bench.jsonl`` and draws ``bench/results/mqtt_bench.png``.

Run: ``.venv/bin/python -m bench.mqtt_bench [--quick] [--scenario fanin1,fanout0] [--runs 3]``
or ``mqlog bench ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import loadgen
from bench.nats import nats_config, nats_server
from bench.ports import free_port
from broker.config import load_config

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
MOSQUITTO = "/usr/sbin/mosquitto"
CLK_TCK = os.sysconf("SC_CLK_TCK")
ALL = [
    "storm",
    "fanin0",
    "fanin1",
    "fanout0",
    "fanout1",
    "fleet",
    "fleet-contended",
    "latency",
    "replay",
]
#: Scenarios run only when named (``--scenario``).
OPTIONAL = ["fleet-cmd"]
KNOWN = ALL + OPTIONAL
MP = mp.get_context("fork")


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} not listening after {timeout}s")


class Broker:
    """A broker process we started; CPU and RSS come from /proc."""

    name = ""
    #: Fraction of the message counts of the counted scenarios (fan-in, fan-out, replay) this
    #: broker is given; their figures are rates, so they stay comparable.
    scale = 1.0
    #: The scenarios this broker is measured in (``run_scenario`` skips the others).
    scenarios = frozenset(KNOWN)

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0

    def start(self) -> None:
        raise NotImplementedError

    def cpu(self) -> float:
        """User + system CPU seconds of the broker process so far."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def pids(self) -> list[int]:
        return [self.pid]

    def runq_wait(self) -> float:
        """Seconds the broker's threads spent runnable but waiting for a core so far (the
        scheduler's ``run_delay``, /proc/PID/task/TID/schedstat): what a competing load
        costs its latency."""
        ns = 0
        for pid in self.pids():
            for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    ns += int(stat.read_text().split()[1])
        return ns / 1e9

    def rss_kb(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def pss_kb(self) -> int:
        """Proportional set size of the broker's processes: a page shared by several (a
        forked worker shares its parent's imports until it writes them) is counted once
        over them, not once in each as RSS summed over the processes counts it."""
        total = 0
        for pid in self.pids():
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
        return total

    def settle(self) -> None:
        """Return once the broker is idle: the next scenario (on any broker) must not share
        the machine with this one's backlog. Here at once: a broker that delivers what it
        accepted within the scenario has none (amqtt overrides it)."""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT if isinstance(self, Mqlog) else signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Mqlog(Broker):
    name = "mqlog"

    def __init__(
        self,
        tmp: Path,
        profile: Path | None = None,
        src: Path = REPO,
        name: str = "mqlog",
        workers: int | None = None,
    ) -> None:
        super().__init__(tmp)
        self.profile = profile
        self.src = src
        self.name = name
        self.workers = workers

    def start(self) -> None:
        data = self.tmp / f"{self.name}-data"
        cmd = [
            sys.executable,
            "-m",
            "broker.cli",
            "--log-level",
            "WARNING",
            "serve",
            "-c",
            str(self.src / "config" / "broker.toml"),
            "--port",
            str(self.port),
            "--http-port",
            str(free_port()),
            "--data-dir",
            str(data),
        ]
        if self.workers is not None:
            cmd += ["--workers", str(self.workers)]
        if self.profile is not None:
            spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
            # --subprocesses: with several workers the supervisor itself does little.
            cmd = [
                spy,
                "record",
                "-r",
                "250",
                "--native",
                "--subprocesses",
                "-f",
                "raw",
                "-o",
                str(self.profile),
                "--",
                *cmd,
            ]
        env = {**os.environ, "PYTHONPATH": str(self.src)}
        self.proc = subprocess.Popen(cmd, cwd=self.src, env=env)
        wait_port(self.port, self.proc)
        self.pid = self.proc.pid
        if self.profile is not None:  # the broker is py-spy's child
            self.pid = self.pids()[1]
        time.sleep(0.5)  # several workers: all of them listening, not just the first

    def pids(self) -> list[int]:
        """The broker's process and its children (its workers, with workers > 1)."""
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        return [self.pid, *map(int, children)]

    def cpu_by_process(self) -> list[float]:
        out = []
        for pid in self.pids():
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / CLK_TCK)
        return out

    def cpu(self) -> float:
        """User + system CPU seconds of the broker's processes so far."""
        return sum(self.cpu_by_process())

    def rss_kb(self) -> int:
        total = 0
        for pid in self.pids():
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        return total


class Mosquitto(Broker):
    name = "mosquitto"
    CONFIG = (
        "listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        "max_queued_messages 0\nmax_inflight_messages {window}\nset_tcp_nodelay true\n"
        "log_dest none\n"
    )

    def start(self) -> None:
        conf = self.tmp / "mosquitto.conf"
        # The delivery window mqlog runs with (replay QoS 1 is bound by it).
        window = load_config(REPO / "config" / "broker.toml").router.max_inflight
        conf.write_text(self.CONFIG.format(port=self.port, window=window))
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], cwd=self.tmp)
        wait_port(self.port, self.proc)
        self.pid = self.proc.pid


class Amqtt(Broker):
    """amqtt (the Python broker, 3.1.1 only), from the venv: optional (``--brokers``).

    Started with its anonymous-auth plugin only (no $SYS, no packet logging) and errors only
    in its log, as Mosquitto runs with ``log_dest none``. ``allow_anonymous: false`` because
    amqtt keeps no offline messages for a session it calls anonymous (the replay scenario's
    persistent session): the generator's connections give a user name (``loadgen.USER``),
    which it then accepts without a password. It runs a tenth of the counted scenarios'
    messages (``scale``): at its rates the full counts take many minutes.
    """

    name = "amqtt"
    scale = 0.1
    # Its offline queue delivered 4-5% of the stored messages to the reconnected session,
    # then nothing more (10,000 stored, --quick, two runs): replay is not measured.
    scenarios = frozenset(KNOWN) - {"replay"}
    CONFIG = (
        "listeners:\n  default:\n    type: tcp\n    bind: 127.0.0.1:{port}\n"
        "    max_connections: 0\nplugins:\n"
        "  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: false\n"
    )
    LAUNCH = (
        "import asyncio, logging, sys, yaml\n"
        "from amqtt.broker import Broker\n"
        "logging.basicConfig(level=logging.ERROR)\n"
        "async def main():\n"
        "    broker = Broker(yaml.safe_load(open(sys.argv[1])))\n"
        "    await broker.start()\n"
        "    await asyncio.Event().wait()\n"
        "asyncio.run(main())\n"
    )

    def settle(self, timeout: float = 180) -> None:
        """amqtt acknowledges before it delivers: when the fleet's generator stops it is tens
        of seconds behind and goes on delivering. Wait until it uses under 10% of a core."""
        deadline = time.monotonic() + timeout
        before = self.cpu()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.cpu()
            if now - before < 0.05:
                return
            before = now

    def start(self) -> None:
        conf = self.tmp / "amqtt.yaml"
        conf.write_text(self.CONFIG.format(port=self.port))
        self.proc = subprocess.Popen([sys.executable, "-c", self.LAUNCH, str(conf)], cwd=self.tmp)
        wait_port(self.port, self.proc, timeout=60)
        self.pid = self.proc.pid


class Nats(Broker):
    """NATS 2.9 (Debian ``nats-server``, optional: ``--brokers ...,nats``): MQTT on
    JetStream with its file store, the peer that persists as mqlog does; one node, its config
    written by :mod:`bench.nats` (as the replicated chaos targets' is). ``max_ack_pending``
    is the delivery window mqlog runs with (``max_inflight``), as Mosquitto's
    ``max_inflight_messages`` is. Replay is its persistent session's stored messages, as for
    Mosquitto."""

    name = "nats"

    def start(self) -> None:
        binary = nats_server()
        if binary is None:
            raise RuntimeError("nats-server is not installed (apt-get install nats-server)")
        window = load_config(REPO / "config" / "broker.toml").router.max_inflight
        conf = self.tmp / "nats.conf"
        conf.write_text(
            nats_config(
                name="bench",
                listen=f"127.0.0.1:{free_port()}",
                store_dir=self.tmp / "nats-data",
                mqtt_listen=f"127.0.0.1:{self.port}",
                mqtt=f"max_ack_pending: {window}",
            )
        )
        # its log (a line per start, stop and stream it creates) to a file, as Mosquitto
        # runs with log_dest none
        self.proc = subprocess.Popen(
            [binary, "-c", str(conf), "--log", str(self.tmp / "nats.log")], cwd=self.tmp
        )
        wait_port(self.port, self.proc)
        self.pid = self.proc.pid


class Floor(Broker):
    """:mod:`bench.floor_server` (optional, ``--brokers ...,floor``): not a broker, the least
    a Python + uvloop server does per message; measured only where one subscriber gets
    everything (``scenarios``)."""

    name = "floor"
    scenarios = frozenset({"storm", "fanin0", "fanin1", "fleet", "fleet-contended", "latency"})

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.floor_server",
                str(self.port),
                str(self.tmp / "floor.log"),
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        wait_port(self.port, self.proc)
        self.pid = self.proc.pid


#: Brokers shown after mqlog and Mosquitto when run (figure, mqlog/broker ratio, losses).
EXTRA_BROKERS = ("nats", "amqtt", "floor", "mqlog1", "mqlog-base")


@dataclass
class Ctl:
    """Shared between the orchestrator and the generator processes of one measurement."""

    ready_q: Any
    result_q: Any
    go: Any
    stop: Any
    release: Any
    expected: Any
    go_ns: Any

    @classmethod
    def new(cls) -> Ctl:
        return cls(
            MP.Queue(),
            MP.Queue(),
            MP.Event(),
            MP.Event(),
            MP.Event(),
            MP.Value("q", 0),
            MP.Value("q", 0),
        )


def _get(q: Any, timeout: float, what: str) -> Any:
    try:
        item = q.get(timeout=timeout)
    except Exception:
        raise RuntimeError(f"timed out waiting for {what}") from None
    if isinstance(item, tuple) and item[0] == "error":
        raise RuntimeError(item[1])
    if isinstance(item, dict) and "error" in item:
        raise RuntimeError(f"{item['role']}: {item['error']}")
    return item


def run_load(
    broker: Broker,
    subs: list[dict[str, Any]],
    pubs: list[dict[str, Any]],
    storms: list[dict[str, Any]] = (),  # type: ignore[assignment]
    *,
    expected: int = 0,
    window: tuple[float, float] | None = None,
    setup_timeout: float = 120,
) -> dict[str, Any]:
    """Start the generator processes, wait until every connection is up, set ``go``,
    collect results. ``window`` = (warm-up, duration): broker CPU is measured only there."""
    ctl = Ctl.new()
    ctl.expected.value = expected
    procs = []
    for spec in [*subs, *pubs, *storms]:
        spec = {**spec, "port": broker.port}
        p = MP.Process(target=loadgen.worker, args=(spec, ctl), daemon=True)
        p.start()
        procs.append(p)
    try:
        for spec in [*subs, *pubs, *storms]:
            _get(ctl.ready_q, setup_timeout, f"{spec['id']} to connect")
        rss0 = broker.rss_kb()
        cpu0 = broker.cpu()
        t0 = time.monotonic()
        ctl.go_ns.value = time.monotonic_ns()
        ctl.go.set()
        if window is not None:
            time.sleep(window[0])
            cpu0, t0, wait0 = broker.cpu(), time.monotonic(), broker.runq_wait()
            time.sleep(window[1])
            cpu_win = broker.cpu() - cpu0
            wall_win = time.monotonic() - t0
            wait_win = broker.runq_wait() - wait0
        results = [_get(ctl.result_q, 600, "the generators") for _ in [*pubs, *storms]]
        pub_res = [r for r in results if r["role"] == "pub"]
        storm_res = [r for r in results if r["role"] == "storm"]
        if pub_res and not expected:
            ctl.expected.value = sum(r["sent"] for r in pub_res)
        rss_storm = 0
        if storm_res:
            time.sleep(1.0)  # let the broker settle (allocations of the last CONNACKs)
            rss_storm = broker.rss_kb()
        ctl.stop.set()
        sub_res = [_get(ctl.result_q, 600, "the subscribers") for _ in subs]
        cpu = broker.cpu() - cpu0
        wall = time.monotonic() - t0
        rss = broker.rss_kb()
        pss = broker.pss_kb()
        ctl.release.set()
    finally:
        ctl.release.set()
        ctl.stop.set()
        ctl.go.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    out: dict[str, Any] = {
        "broker_cpu": cpu,
        "wall": wall,
        "rss_kb": rss,
        "pss_kb": pss,
        "rss0_kb": rss0,
        "gen_cpu": sum(r["cpu"] for r in [*results, *sub_res]),
        "sent": sum(r["sent"] for r in pub_res),
        "acked": sum(r["acked"] for r in pub_res),
        "received": sum(r["received"] for r in sub_res),
        "gaps": sum(r["gaps"] for r in sub_res),
        "dup_reorder": sum(r["dup_reorder"] for r in sub_res),
        "errors": sum(r["errors"] for r in [*results, *sub_res]),
        "expected_per_sub": ctl.expected.value,
        "closed_early": sum(r["closed"] for r in sub_res),
        "per_sub_min": min((r["per_sub_min"] for r in sub_res), default=0),
    }
    if sub_res:
        out["elapsed"] = (max(r["last_ns"] for r in sub_res) - ctl.go_ns.value) / 1e9
        lat = np.concatenate([r["lat"] for r in sub_res])
        if len(lat):
            out["p50_ms"] = float(np.percentile(lat, 50)) / 1e6
            out["p99_ms"] = float(np.percentile(lat, 99)) / 1e6
            out["lat_samples"] = len(lat)
    if window is not None:
        out["broker_cpu"] = cpu_win
        out["wall"] = wall_win
        out["cpu_pct"] = 100 * cpu_win / wall_win
        out["runq_ms_per_s"] = 1000 * wait_win / wall_win
    if storm_res:
        n = sum(r["connected"] for r in storm_res)
        out["connected"] = n
        out["connect_s"] = (max(r["t1"] for r in storm_res) - min(r["t0"] for r in storm_res)) / 1e9
        out["rss_storm_kb"] = rss_storm
        out["bytes_per_conn"] = (rss_storm - rss0) * 1024 / n
    return out


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` items in ``parts`` contiguous (first, count) ranges."""
    base, extra = divmod(n, parts)
    out, first = [], 0
    for i in range(parts):
        c = base + (i < extra)
        out.append((first, c))
        first += c
    return out


def losses(m: dict[str, Any], subs: int = 1) -> int:
    """Deliveries missing: every subscriber should have received every message sent."""
    missing: int = m["expected_per_sub"] * subs - m["received"]
    return max(0, missing)


# ============================================================== scenarios


@dataclass
class Figure:
    """One scenario's headline figure for one broker."""

    value: float
    unit: str
    higher_is_better: bool
    per_cpu: float | None
    m: dict[str, Any]
    lost: int


def fanin(broker: Broker, qos: int, quick: bool, tag: str) -> Figure:
    n_pubs = 50
    n = int((2000 if quick else 6000) * broker.scale)
    subs = [
        {
            "role": "sub",
            "id": f"{tag}-s",
            "count": 1,
            "filter": "devices/+/telemetry",
            "qos": qos,
            "sub_qos": qos,
            "n_pubs": n_pubs,
        }
    ]
    pubs = [
        {
            "role": "pub",
            "id": f"{tag}-p{i}",
            "first": first,
            "count": count,
            "qos": qos,
            "prefix": "devices",
            "n": n,
            "mode": "window" if qos else "blast",
            "window": 100,
        }
        for i, (first, count) in enumerate(split(n_pubs, 2))
    ]
    m = run_load(broker, subs, pubs)
    rate = m["received"] / m["elapsed"]
    return Figure(rate, "msg/s", True, m["received"] / m["broker_cpu"], m, losses(m))


def fanout(broker: Broker, qos: int, quick: bool, tag: str) -> Figure:
    n_subs = 50
    n = int((10_000 if quick else 30_000) * broker.scale)
    topic = "fanouts/00000/telemetry"
    subs = [
        {
            "role": "sub",
            "id": f"{tag}-s{i}",
            "count": count,
            "filter": topic,
            "qos": qos,
            "sub_qos": qos,
            "n_pubs": 1,
        }
        for i, (_, count) in enumerate(split(n_subs, 2))
    ]
    pubs = [
        {
            "role": "pub",
            "id": f"{tag}-p",
            "first": 0,
            "count": 1,
            "qos": qos,
            "prefix": "fanouts",
            "n": n,
            "mode": "window" if qos else "blast",
            "window": 100,
        }
    ]
    m = run_load(broker, subs, pubs)
    rate = m["received"] / m["elapsed"]
    return Figure(rate, "deliveries/s", True, m["received"] / m["broker_cpu"], m, losses(m, n_subs))


#: The core the contended fleet's competing load is pinned to.
CONTEND_CPU = 0


def _spin(cpu: int) -> None:
    """A competing CPU load: pinned to ``cpu``, it spins until it is killed."""
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


@contextlib.contextmanager
def contention(cpu: int = CONTEND_CPU) -> Any:
    """A busy process pinned to ``cpu`` while the block runs; yields a callable giving the
    share of that core it got so far (%), to show the load was there."""
    spinner = MP.Process(target=_spin, args=(cpu,), daemon=True)
    spinner.start()
    assert spinner.pid is not None
    stat = Path(f"/proc/{spinner.pid}/stat")
    t0 = time.monotonic()

    def share() -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / CLK_TCK
        return 100 * cpu_s / (time.monotonic() - t0)

    try:
        yield share
    finally:
        spinner.kill()
        spinner.join()


def fleet_contended(broker: Broker, quick: bool, tag: str) -> Figure:
    """The fleet with a spinning process pinned to one core throughout."""
    with contention() as share:
        fig = fleet(broker, quick, tag)
        fig.m["spin_pct"] = share()
    return fig


def fleet_cmd(broker: Broker, quick: bool, tag: str) -> Figure:
    """The fleet, each device subscribed to its command topic."""
    return fleet(broker, quick, tag, commands=True)


def fleet(broker: Broker, quick: bool, tag: str, commands: bool = False) -> Figure:
    devices = 5000
    warmup, duration = (2.0, 5.0) if quick else (3.0, 10.0)
    subs = [
        {
            "role": "sub",
            "id": f"{tag}-s",
            "count": 1,
            "filter": "devices/+/telemetry",
            "qos": 1,
            "sub_qos": 1,
            "n_pubs": devices,
            "latency": True,
            "warmup": warmup,
        }
    ]
    pubs = [
        {
            "role": "pub",
            "id": f"{tag}-p{i}",
            "first": first,
            "count": count,
            "qos": 1,
            "prefix": "devices",
            "mode": "paced",
            "rate": count,
            "duration": warmup + duration + 0.5,
            "commands": commands,
        }
        for i, (first, count) in enumerate(split(devices, 2))
    ]
    m = run_load(broker, subs, pubs, window=(warmup, duration), setup_timeout=300)
    return Figure(m["cpu_pct"], "% CPU", False, None, m, losses(m))


def storm(broker: Broker, quick: bool, tag: str) -> Figure:
    conns = 5000
    storms = [
        {"role": "storm", "id": f"{tag}-c{i}", "count": count, "concurrency": 200}
        for i, (_, count) in enumerate(split(conns, 2))
    ]
    m = run_load(broker, [], [], storms)
    rate = m["connected"] / m["connect_s"]
    time.sleep(1.0)  # the broker closes 5,000 sessions before the next scenario
    return Figure(
        rate, "connects/s", True, m["connected"] / m["broker_cpu"], m, conns - m["connected"]
    )


def latency(broker: Broker, quick: bool, tag: str) -> Figure:
    warmup, duration = (1.0, 4.0) if quick else (2.0, 10.0)
    subs = [
        {
            "role": "sub",
            "id": f"{tag}-s",
            "count": 1,
            "filter": "latency/00000/telemetry",
            "qos": 1,
            "sub_qos": 1,
            "n_pubs": 1,
            "latency": True,
            "warmup": warmup,
        }
    ]
    pubs = [
        {
            "role": "pub",
            "id": f"{tag}-p",
            "first": 0,
            "count": 1,
            "qos": 1,
            "prefix": "latency",
            "mode": "paced",
            "rate": 5000,
            "duration": warmup + duration,
        }
    ]
    m = run_load(broker, subs, pubs, window=(warmup, duration))
    return Figure(m["p50_ms"], "ms p50", False, None, m, losses(m))


def _persistent_subscribe(port: int, client_id: str, topic_filter: str) -> None:
    """Create a persistent session subscribed at QoS 1, then leave (Mosquitto queues)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            loadgen.connect_packet(client_id, clean=False, username=loadgen.USER)
            + loadgen.subscribe_packet(topic_filter, 1)
        )
        got = b""
        while len(got) < 9:
            chunk = s.recv(64)
            if not chunk:
                raise RuntimeError("closed before SUBACK")
            got += chunk
        s.sendall(loadgen.DISCONNECT)


def replay(broker: Broker, quick: bool, tag: str, run: int) -> list[Figure]:
    total = int((100_000 if quick else 1_000_000) * broker.scale)
    n_pubs = 50
    prefix = f"replay{run % 10}"
    wild = f"{prefix}/+/telemetry"
    sub_id = f"{tag}-replayer"
    if not isinstance(broker, Mqlog):
        _persistent_subscribe(broker.port, f"{sub_id}-0", wild)  # the id the sub role uses
    pubs = [
        {
            "role": "pub",
            "id": f"{tag}-load{i}",
            "first": first,
            "count": count,
            "qos": 1,
            "prefix": prefix,
            "n": total // n_pubs,
            "mode": "window",
            "window": 100,
        }
        for i, (first, count) in enumerate(split(n_pubs, 2))
    ]
    load = run_load(broker, [], pubs)
    figs = []
    for qos in (1, 0) if isinstance(broker, Mqlog) else (1,):
        spec: dict[str, Any]
        if isinstance(broker, Mqlog):
            spec = {"filter": f"$replay/earliest/{wild}", "sub_qos": qos, "clean": True}
        else:
            spec = {"filter": None, "sub_qos": 1, "clean": False}
        subs = [
            {
                "role": "sub",
                "id": sub_id if not isinstance(broker, Mqlog) else f"{sub_id}{qos}",
                "count": 1,
                "qos": qos,
                "n_pubs": n_pubs,
                "connect_on_go": True,
                **spec,
            }
        ]
        m = run_load(broker, subs, [], expected=load["acked"])
        m["loaded"] = load["acked"]
        rate = m["received"] / m["elapsed"]
        figs.append(Figure(rate, "msg/s", True, m["received"] / m["broker_cpu"], m, losses(m)))
    return figs


# ============================================================== report

ROWS: dict[str, tuple[str, str]] = {
    "fanin0": ("fan-in QoS 0 (50 pub -> 1 sub)", "msg/s"),
    "fanin1": ("fan-in QoS 1 (50 pub -> 1 sub)", "msg/s"),
    "fanout0": ("fan-out QoS 0 (1 pub -> 50 sub)", "deliveries/s"),
    "fanout1": ("fan-out QoS 1 (1 pub -> 50 sub)", "deliveries/s"),
    "fleet": ("fleet 5,000 dev x 1 msg/s QoS 1: broker CPU", "% CPU"),
    "fleet_p50": ("fleet: p50 latency", "ms"),
    "fleet_p99": ("fleet: p99 latency", "ms"),
    "fleet_rss": ("fleet: broker RSS (summed over its processes)", "MiB"),
    "fleet_pss": ("fleet: broker PSS (shared pages once)", "MiB"),
    "fleet-contended": ("fleet, one core busy (spinner): broker CPU", "% CPU"),
    "fleet-contended_p50": ("fleet, one core busy: p50 latency", "ms"),
    "fleet-contended_p99": ("fleet, one core busy: p99 latency", "ms"),
    "fleet-cmd": ("fleet, devices subscribed to commands: broker CPU", "% CPU"),
    "fleet-cmd_p50": ("fleet, devices subscribed: p50 latency", "ms"),
    "fleet-cmd_p99": ("fleet, devices subscribed: p99 latency", "ms"),
    "storm": ("connection storm 5,000 CONNECTs", "connects/s"),
    "storm_mem": ("storm: broker memory per idle connection", "bytes"),
    "latency": ("latency 5,000 msg/s QoS 1: p50", "ms"),
    "latency_p99": ("latency 5,000 msg/s QoS 1: p99", "ms"),
    "replay1": ("replay QoS 1 (mqlog $replay; mosq offline queue)", "msg/s"),
    "replay0": ("replay QoS 0 (mqlog only)", "msg/s"),
}


def expand(scenario: str, broker: str, figs: list[Figure], run: int) -> dict[str, dict[str, Any]]:
    """A scenario's figures as table rows: row key -> {value, per_cpu, cpu, gen, lost}."""
    f = figs[0]
    m = f.m
    base = {
        "broker": broker,
        "cpu": m["broker_cpu"],
        "gen_cpu": m["gen_cpu"],
        "lost": f.lost,
        "dup_reorder": m["dup_reorder"],
        "errors": m["errors"],
    }
    rows = {
        scenario if scenario != "replay" else "replay1": {
            **base,
            "value": f.value,
            "per_cpu": f.per_cpu,
        }
    }
    if scenario in ("fleet", "fleet-contended", "fleet-cmd"):
        for q in ("p50", "p99"):
            rows[f"{scenario}_{q}"] = {
                **base,
                "value": m.get(f"{q}_ms", float("nan")),
                "per_cpu": None,
            }
    if scenario == "fleet":
        rows["fleet_rss"] = {**base, "value": m["rss_kb"] / 1024, "per_cpu": None}
        rows["fleet_pss"] = {**base, "value": m["pss_kb"] / 1024, "per_cpu": None}
    if scenario == "storm":
        # Only a fresh broker's growth is its memory per connection: in later runs it reuses
        # what the first one grew (a few bytes or none per connection; None is left out of
        # the median).
        rows["storm_mem"] = {
            **base,
            "value": m["bytes_per_conn"] if run == 0 else None,
            "per_cpu": None,
        }
    if scenario == "latency":
        rows["latency_p99"] = {**base, "value": m.get("p99_ms", float("nan")), "per_cpu": None}
    if scenario == "replay" and len(figs) > 1:
        g = figs[1]
        rows["replay0"] = {
            **base,
            "cpu": g.m["broker_cpu"],
            "gen_cpu": g.m["gen_cpu"],
            "lost": g.lost,
            "value": g.value,
            "per_cpu": g.per_cpu,
        }
    return rows


def fmt(v: float | None) -> str:
    if v is None or v != v:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def fmt_ratio(r: float | None) -> str:
    """``r`` as ``1.23x``; below 0.01 as ``1/456x`` (amqtt's latencies are seconds)."""
    if r is None:
        return "-"
    return f"{r:.2f}x" if r >= 0.01 else f"1/{1 / r:,.0f}x"


def table(rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    extras = [name for name in EXTRA_BROKERS if any(name in per for per in rows.values())]
    head = [
        "scenario",
        "unit",
        "mqlog",
        "mosquitto",
        "ratio",
        "mqlog/CPU-s",
        "mosq/CPU-s",
        "CPU s mqlog (gen)",
        "CPU s mosq (gen)",
        "lost mqlog/mosq",
    ]
    for name in extras:
        head += [name, f"mqlog/{name}", f"{name}/CPU-s", f"CPU s {name} (gen)", f"lost {name}"]
    lines = []
    for key, (label, unit) in ROWS.items():
        if key not in rows:
            continue
        a = rows[key].get("mqlog")
        b = rows[key].get("mosquitto")
        ratio = (
            a["value"] / b["value"] if a and b and a["value"] is not None and b["value"] else None
        )
        extra = []
        for name in extras:
            c = rows[key].get(name)
            vs = (
                a["value"] / c["value"]
                if a and c and a["value"] is not None and c["value"]
                else None
            )
            extra += [
                fmt(c["value"]) if c else "-",
                fmt_ratio(vs),
                fmt(c["per_cpu"]) if c else "-",
                f"{c['cpu']:.2f} ({c['gen_cpu']:.2f})" if c else "-",
                str(c["lost"] + c["dup_reorder"]) if c else "-",
            ]
        lines.append(
            [
                label,
                unit,
                fmt(a["value"]) if a else "-",
                fmt(b["value"]) if b else "-",
                f"{ratio:.2f}x" if ratio is not None else "-",
                fmt(a["per_cpu"]) if a else "-",
                fmt(b["per_cpu"]) if b else "-",
                f"{a['cpu']:.2f} ({a['gen_cpu']:.2f})" if a else "-",
                f"{b['cpu']:.2f} ({b['gen_cpu']:.2f})" if b else "-",
                f"{a['lost'] + a['dup_reorder'] if a else '-'}/"
                f"{b['lost'] + b['dup_reorder'] if b else '-'}",
                *extra,
            ]
        )
    widths = [max(len(str(r[i])) for r in [head, *lines]) for i in range(len(head))]
    out = []
    for r in [head, *lines]:
        out.append(
            "  ".join(
                str(c).ljust(w) if i < 2 else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def chart(ratios: dict[str, float], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(ratios)
    values = [ratios[k] for k in labels]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.5))
    colors = ["#2a7" if v >= 1 else "#c63" for v in values]
    ax.barh(labels, values, color=colors)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xscale("log")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}x", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("mqlog / Mosquitto (higher is better for mqlog; log scale)")
    ax.set_title(f"mqlog vs Mosquitto 2 - {subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: For "lower is better" figures the chart shows Mosquitto/mqlog so that >1 favours mqlog.
LOWER_BETTER = {
    "fleet",
    "fleet_p50",
    "fleet_p99",
    "fleet_rss",
    "fleet_pss",
    "fleet-contended",
    "fleet-contended_p50",
    "fleet-contended_p99",
    "fleet-cmd",
    "fleet-cmd_p50",
    "fleet-cmd_p99",
    "storm_mem",
    "latency",
    "latency_p99",
}


def run_scenario(name: str, broker: Broker, quick: bool, run: int) -> list[Figure]:
    """The scenario's figures; none when ``broker`` cannot run it."""
    tag = f"{name}-r{run}-{broker.name}"
    if name not in broker.scenarios:
        return []
    if name in ("fanin0", "fanin1"):
        return [fanin(broker, int(name[-1]), quick, tag)]
    if name in ("fanout0", "fanout1"):
        return [fanout(broker, int(name[-1]), quick, tag)]
    fn: dict[str, Callable[[Broker, bool, str], Figure]] = {
        "fleet": fleet,
        "fleet-contended": fleet_contended,
        "fleet-cmd": fleet_cmd,
        "storm": storm,
        "latency": latency,
    }
    if name in fn:
        return [fn[name](broker, quick, tag)]
    if name == "replay":
        return replay(broker, quick, tag, run)
    raise ValueError(name)


def tail_note(m: dict[str, Any]) -> str:
    """The latency percentiles (and the competing load's share of its core) of a run that
    measured them, for its progress line."""
    note = ""
    if "p99_ms" in m:
        note += f" p50 {m['p50_ms']:.2f} ms p99 {m['p99_ms']:.2f} ms"
    if "runq_ms_per_s" in m:
        note += f" runq {m['runq_ms_per_s']:.0f} ms/s"
    if "spin_pct" in m:
        note += f" spinner {m['spin_pct']:.0f}% of cpu {CONTEND_CPU}"
    return note


def load_avg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mqlog bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller counts and durations")
    ap.add_argument(
        "--scenario", default=",".join(ALL), help=f"comma-separated subset of {','.join(KNOWN)}"
    )
    ap.add_argument("--runs", type=int, default=1, help="repeat; the table shows medians")
    ap.add_argument(
        "--brokers",
        default="mqlog,mosquitto",
        help="comma-separated: mqlog, mosquitto, nats (optional: NATS 2.9, MQTT on JetStream), "
        "amqtt (optional, 3.1.1 only), "
        "floor (optional: bench/floor_server.py, not a broker), "
        "mqlog1 (optional: mqlog with one worker process)",
    )
    ap.add_argument(
        "--profile",
        help="run mqlog (or mqlog1 without mqlog) under py-spy, raw samples to this file",
    )
    ap.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="folder of the JSON lines and the chart (default bench/results)",
    )
    ap.add_argument("--chart", help="PNG path (default RESULTS/mqtt_bench.png)")
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="also run the mqlog of another checkout (as mqlog-base), for A/B",
    )
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenario.split(",") if s]
    for s in scenarios:
        if s not in KNOWN:
            ap.error(f"unknown scenario {s!r}; choose from {','.join(KNOWN)}")
    loadgen.raise_nofile()
    results: Path = args.results
    results.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="mqtt-bench-"))
    brokers: list[Broker] = []
    names = args.brokers.split(",")
    profile = Path(args.profile).resolve() if args.profile else None
    if "mqlog" in names:
        brokers.append(Mqlog(tmp, profile))
    if "mosquitto" in names:
        brokers.append(Mosquitto(tmp))
    if "nats" in names:
        brokers.append(Nats(tmp))
    if "amqtt" in names:
        brokers.append(Amqtt(tmp))
    if "floor" in names:
        brokers.append(Floor(tmp))
    if "mqlog1" in names:
        # --profile goes to mqlog1 when mqlog itself is not run
        spied = profile if "mqlog" not in names else None
        brokers.append(Mqlog(tmp, spied, name="mqlog1", workers=1))
    if args.baseline:
        brokers.append(Mqlog(tmp, src=Path(args.baseline).resolve(), name="mqlog-base"))
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(
        f"# {started}  load {load_avg()}  cpus {os.cpu_count()}  quick={args.quick} "
        f"runs={args.runs}",
        flush=True,
    )
    collected: dict[str, dict[str, list[dict[str, Any]]]] = {}
    jsonl = results / "mqtt_bench.jsonl"
    try:
        for b in brokers:
            b.start()
        for run in range(args.runs):
            for name in scenarios:
                order = brokers if run % 2 == 0 else brokers[::-1]
                for b in order:
                    t = time.monotonic()
                    figs = run_scenario(name, b, args.quick, run)
                    b.settle()
                    if not figs:
                        print(f"  run {run} {name:8s} {b.name:9s} not measured", flush=True)
                        continue
                    rows = expand(name, b.name, figs, run)
                    for key, row in rows.items():
                        collected.setdefault(key, {}).setdefault(b.name, []).append(row)
                    head = figs[0]
                    print(
                        f"  run {run} {name:8s} {b.name:9s} {fmt(head.value):>10s} "
                        f"{head.unit:13s} lost {head.lost} dup/reorder "
                        f"{head.m['dup_reorder']} cpu {head.m['broker_cpu']:.2f}s gen "
                        f"{head.m['gen_cpu']:.2f}s ({time.monotonic() - t:.1f}s, load "
                        f"{load_avg()}){tail_note(head.m)}",
                        flush=True,
                    )
                    with jsonl.open("ab") as f:
                        f.write(
                            orjson.dumps(
                                {
                                    "ts": started,
                                    "run": run,
                                    "scenario": name,
                                    "broker": b.name,
                                    "quick": args.quick,
                                    "load": load_avg(),
                                    "figures": [
                                        {
                                            "value": g.value,
                                            "unit": g.unit,
                                            "lost": g.lost,
                                            **{k: v for k, v in g.m.items()},
                                        }
                                        for g in figs
                                    ],
                                },
                                default=lambda o: None,
                            )
                            + b"\n"
                        )
    finally:
        for b in brokers:
            b.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    medians: dict[str, dict[str, dict[str, Any]]] = {}
    for key, per in collected.items():
        medians[key] = {}
        for bname, rows_ in per.items():
            med = dict(rows_[0])
            for field in ("value", "per_cpu", "cpu", "gen_cpu"):
                vals = [r[field] for r in rows_ if r[field] is not None]
                med[field] = statistics.median(vals) if vals else None
            med["lost"] = sum(r["lost"] for r in rows_)
            med["dup_reorder"] = sum(r["dup_reorder"] for r in rows_)
            medians[key][bname] = med
    print()
    print(
        f"mqlog vs Mosquitto 2 ({'median of ' + str(args.runs) if args.runs > 1 else '1 run'}"
        f", load at end {load_avg()}; lost = missing + duplicated/reordered deliveries)"
    )
    print(table(medians))
    ratios: dict[str, float] = {}
    per_run_ratios: dict[str, list[float]] = {}
    for key, per in collected.items():
        if "mqlog" in per and "mosquitto" in per:
            rs = [
                a["value"] / b["value"]
                for a, b in zip(per["mqlog"], per["mosquitto"], strict=True)
                if a["value"] is not None and b["value"]
            ]
            if key in LOWER_BETTER:
                rs = [1 / r for r in rs if r]
            if rs:
                per_run_ratios[key] = rs
                ratios[ROWS[key][0]] = statistics.median(rs)
    summary = {
        "ts": started,
        "summary": True,
        "quick": args.quick,
        "runs": args.runs,
        "load": load_avg(),
        "ratios_favouring_mqlog": {k: statistics.median(v) for k, v in per_run_ratios.items()},
        "per_run": per_run_ratios,
        "medians": {
            k: {
                b: {f: r[f] for f in ("value", "per_cpu", "cpu", "gen_cpu", "lost")}
                for b, r in v.items()
            }
            for k, v in medians.items()
        },
    }
    line = orjson.dumps(summary)
    print(line.decode())
    with jsonl.open("ab") as f:
        f.write(line + b"\n")
    if ratios:
        path = Path(args.chart) if args.chart else results / "mqtt_bench.png"
        chart(
            ratios,
            path,
            f"{'quick, ' if args.quick else ''}median of {args.runs}, "
            f"{os.cpu_count()} cores, load {load_avg()}",
        )
        print(f"chart: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
