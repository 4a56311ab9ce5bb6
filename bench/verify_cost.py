"""What verifying every batch on read costs (issue 25): replay and drain, verification on vs off.

``python -m bench.verify_cost [--records N] [--batch-records B] [--runs R] [--no-spark]``

One log of ``--records`` telemetry records (``bench.spark_drain.build_log``: 4 partitions,
``--batch-records`` per stored batch; 1,000 by default, 2 for a fleet-shaped log) is served
by one broker process (``--workers 1``) started twice per run: as shipped (every batch's CRC
checked before it is used, :mod:`broker.commitlog.integrity`) and with the check switched off
(``integrity.verify_reads = False``, set by this benchmark's launcher, never by a broker
config). Each run measures, for each mode:

* ``replay``: ``mosquitto_sub -C N -t '$replay/earliest/devices/#'`` (QoS 0: the path where
  the broker's read cost shows most; output to /dev/null), seconds from start to exit;
* ``fetch``: every partition read to its end through the HTTP fetch API as Arrow
  (:class:`spark_sink.client.BrokerClient`, the Spark source's reader), 10,000 records per
  request: the broker's side of a Spark drain;
* ``spark``: the Spark drain itself (``bench.spark_drain.drain_once``, the ``mqlog`` source
  into Parquet, one local Spark session for all runs), unless ``--no-spark``;
* ``log read``, ``log columns``: in this process, no broker: every partition read to its end
  by :meth:`SegmentedLog.read` (the router's record path) and :meth:`SegmentedLog.read_columns`
  (the replay's runs and the fetch API), the check's CPU cost without the sockets around it.

``replay`` and ``fetch`` run ``--repeat`` times per broker start (their median is the run's
figure): on this shared 2-core machine one pass of either varied by 2x from minute to minute.
Each measure also reports CPU seconds: the broker process's (``/proc/PID/stat``, user +
system; one process with ``--workers 1``) for the broker's measures, this process's for the
in-process ones. Other sessions' load stretches wall time far more than CPU time (at a load
of 7-10 the wall ratios of one run went from 0.68 to 2.19), so the CPU ratios are the ones to
read on a busy machine.

After one untimed warm-up round, the order of the two modes alternates from run to run (the
machine is shared: a drift in its load must not always favour one side), the data files are
read once before the first run so both start from the page cache, and the figure is the median
over runs of each mode's time, reported as the ratio on / off (target: at most 1.10).
Output: a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench.ports import free_port
from bench.spark_drain import PARTITIONS, build_log
from broker.commitlog import integrity

ROOT = Path(__file__).resolve().parent.parent
#: The launcher: the broker's own entry point, with verification switched off first when asked.
LAUNCH = (
    "import sys\n"
    "import broker.commitlog.integrity as integrity\n"
    "integrity.verify_reads = sys.argv.pop(1) == 'on'\n"
    "from broker.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
TARGET_RATIO = 1.10


class Broker:
    """One broker process serving ``data_dir``, verification ``on`` or ``off``."""

    def __init__(self, tmp: Path, data_dir: Path, mode: str) -> None:
        self.port = free_port()
        self.http_port = free_port()
        config = tmp / f"broker-{mode}.toml"
        config.write_text(
            f'[server]\nhost = "127.0.0.1"\nport = {self.port}\nsys_interval = "0s"\n'
            f'[commitlog]\ndata_dir = "{data_dir}"\nscrub_interval = "0s"\n'
            f'[[streams]]\nname = "telemetry"\ntopic_filter = ["devices/#"]\n'
            f'partitions = {PARTITIONS}\nretention = "forever"\n'
            f'[http]\nhost = "127.0.0.1"\nport = {self.http_port}\n'
        )
        self.log_path = tmp / f"broker-{mode}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", LAUNCH, mode, "serve", "-c", str(config), "--workers", "1"],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while "listening on mqtt://" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit(f"broker did not start:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.http_port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def broker_cpu(broker: Broker) -> float:
    """CPU seconds (user + system) the broker process has used so far."""
    fields = Path(f"/proc/{broker.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def on_broker(broker: Broker, measure: Callable[[], float]) -> tuple[float, float]:
    """``measure``'s wall seconds and the broker's CPU seconds meanwhile."""
    before = broker_cpu(broker)
    wall = measure()
    return wall, broker_cpu(broker) - before


def in_process(measure: Callable[[], float]) -> tuple[float, float]:
    """``measure``'s wall seconds and this process's CPU seconds meanwhile."""
    before = time.process_time()
    wall = measure()
    return wall, time.process_time() - before


def replay(broker: Broker, records: int) -> float:
    start = time.perf_counter()
    subprocess.run(
        [
            "mosquitto_sub",
            "-h",
            "127.0.0.1",
            "-p",
            str(broker.port),
            "-t",
            "$replay/earliest/devices/#",
            "-q",
            "0",
            "-C",
            str(records),
            "-W",
            "900",
        ],
        stdout=subprocess.DEVNULL,
        check=True,
        timeout=1000,
    )
    return time.perf_counter() - start


def fetch(broker: Broker, records: int) -> float:
    from spark_sink.client import BrokerClient

    start = time.perf_counter()
    got = 0
    with BrokerClient(broker.url) as client:
        for p in client.partitions("telemetry"):
            offset = p.earliest_offset
            while offset < p.high_water_mark:
                fetched = client.fetch("telemetry", p.partition, offset, 10_000, 16 << 20)
                got += 0 if fetched.batch is None else fetched.batch.num_rows
                offset = fetched.next_offset
    if got != records:
        raise SystemExit(f"fetched {got} records, expected {records}")
    return time.perf_counter() - start


def log_read(data_dir: Path, columns: bool) -> float:
    """Seconds to read every partition of the log to its end, in this process."""
    from broker.commitlog import LogConfig, SegmentedLog

    start = time.perf_counter()
    for p in range(PARTITIONS):
        log = SegmentedLog.open(data_dir / "telemetry" / str(p), LogConfig(retention_ms=None))
        try:
            offset = log.log_start_offset
            while offset < log.end_offset:
                if columns:
                    offset = log.read_columns(offset, 10_000, 16 << 20).next_offset
                else:
                    offset = log.read(offset, 10_000, 16 << 20)[-1].offset + 1
        finally:
            log.close()
    return time.perf_counter() - start


def repeated(measure: Callable[[], tuple[float, float]], times: int) -> tuple[float, float]:
    """The medians of ``times`` (wall, CPU) measures."""
    walls, cpus = zip(*(measure() for _ in range(times)), strict=True)
    return statistics.median(walls), statistics.median(cpus)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--batch-records", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3, help="replay and fetch per broker start")
    parser.add_argument("--no-spark", action="store_true", help="skip the Spark drain")
    parser.add_argument("--dir", help="where to build the log (default: a temporary directory)")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="verify-cost-", dir=args.dir))
    spark: Any = None
    try:
        data_dir = tmp / "data"
        built = build_log(data_dir, args.records, args.batch_records)
        size = sum(p.stat().st_size for p in data_dir.rglob("*.log"))
        for path in data_dir.rglob("*.log"):
            path.read_bytes()  # both modes start from the page cache
        print(
            f"{args.records:,} records in batches of {args.batch_records} "
            f"({size / 2**20:.0f} MiB) built in {built:.1f} s"
        )
        measures: dict[str, Callable[[Broker], tuple[float, float]]] = {
            "replay": lambda b: repeated(
                lambda: on_broker(b, lambda: replay(b, args.records)), args.repeat
            ),
            "fetch": lambda b: repeated(
                lambda: on_broker(b, lambda: fetch(b, args.records)), args.repeat
            ),
        }
        if not args.no_spark:
            from bench.spark_drain import drain_once
            from spark_sink.drain import spark_session

            spark = spark_session("local[2]")
            measures["spark"] = lambda b: on_broker(
                b, lambda: drain_once(spark, b.url, tmp, "mqlog", args.records)[0]
            )
        # One untimed round first: Spark's JVM, its Python workers and the broker's imports
        # warm up (the first drain took five times the next one here).
        broker = Broker(tmp, data_dir, "on")
        try:
            for measure in measures.values():
                measure(broker)
        finally:
            broker.stop()
        times: dict[str, dict[str, list[tuple[float, float]]]] = {
            m: {"on": [], "off": []} for m in measures
        }
        local = {"log read": False, "log columns": True}
        times.update({m: {"on": [], "off": []} for m in local})
        names = [*measures, *local]
        print(f"{'run':>3}  {'mode':<4} " + " ".join(f"{m + ' s (cpu)':>22}" for m in names))
        for run in range(args.runs):
            for mode in ("on", "off") if run % 2 == 0 else ("off", "on"):
                broker = Broker(tmp, data_dir, mode)
                try:
                    row = {m: measure(broker) for m, measure in measures.items()}
                finally:
                    broker.stop()
                integrity.verify_reads = mode == "on"
                for m, columns in local.items():
                    row[m] = repeated(
                        lambda c=columns: in_process(lambda: log_read(data_dir, c)), args.repeat
                    )
                integrity.verify_reads = True
                for m, seconds in row.items():
                    times[m][mode].append(seconds)
                cells = (f"{row[m][0]:12.3f} ({row[m][1]:6.3f})" for m in names)
                print(f"{run:>3}  {mode:<4} " + " ".join(cells))
        result: dict[str, Any] = {
            "bench": "verify_cost",
            "records": args.records,
            "batch_records": args.batch_records,
            "runs": args.runs,
            "load": os.getloadavg()[0],
        }
        print()
        for m in names:
            on = statistics.median(w for w, _ in times[m]["on"])
            off = statistics.median(w for w, _ in times[m]["off"])
            on_cpu = statistics.median(c for _, c in times[m]["on"])
            off_cpu = statistics.median(c for _, c in times[m]["off"])
            ratio, cpu_ratio = on / off, on_cpu / off_cpu
            verdict = "met" if cpu_ratio <= TARGET_RATIO else "NOT met"
            print(
                f"{m:<11} median on {on:7.2f} s ({args.records / on:10,.0f} rec/s), "
                f"off {off:7.2f} s: on/off {ratio:.3f}; CPU on {on_cpu:7.2f} s, off "
                f"{off_cpu:7.2f} s: on/off {cpu_ratio:.3f} (target <= {TARGET_RATIO}: {verdict})"
            )
            result[m] = {
                "on_s": [w for w, _ in times[m]["on"]],
                "off_s": [w for w, _ in times[m]["off"]],
                "ratio": ratio,
                "on_cpu_s": [c for _, c in times[m]["on"]],
                "off_cpu_s": [c for _, c in times[m]["off"]],
                "cpu_ratio": cpu_ratio,
            }
        print(orjson.dumps(result).decode())
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
