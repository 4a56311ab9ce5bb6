"""Broker -> Parquet drain throughput in Spark local[2] (``python -m bench.spark_drain``).

Builds a ``telemetry`` stream of ``--records`` (default 1,000,000) fleet-style JSON telemetry
records (100 devices, each topic in its crc32 partition of 4, as the broker would place it)
by appending to the commit log directly, ``--batch-records`` (default 1,000) per stored batch,
starts a real ``mqlog serve`` on it, and drains it
with the exactly-once drain (``spark_sink.drain.start_drain``: Structured Streaming,
Trigger.AvailableNow, Parquet partitioned by date, fresh checkpoint each run) twice per run:

- ``arrow``: the ``mqlog`` source, whose workers hand Spark the fetched Arrow batches as is;
- ``tuples`` (the reference): the same source, the same HTTP fetches and planning, but
  ``read()`` yields one Python tuple per record, as a plain Python data source does.

Each drain is timed from query start to its end and checked (the output holds every record);
the target is judged on that time. The session is started once, outside the timed region (its
seconds are printed: 10 to 20 s of JVM start-up that a long-running drain pays once, and that a
``mqlog spark-drain --once`` run pays every time, so the summary also gives the rate with one
session start added to the median drain), but each drain's query start-up is inside it (Spark
starting the source's Python process and planning); ``batch rows/s`` shows the rate inside the
micro-batches alone (rows / the sum of ``triggerExecution``).

Stored batches: the fleet simulator (``examples/iot/fleet.py``, 100 devices at up to ~3,000
publishes/s in all here) leaves batches of 1-3 records (median 1: the router's group commit
appends what arrived in one loop turn), which cost the broker far more per record to read than
the default 1,000 (``bench/fetch_encode.py``); ``--batch-records 2`` drains a fleet-shaped log.
``--warmup`` (default 1) untimed rounds come first (JVM JIT, Python workers); ``--runs``
(default 3) then repeats both; the table shows each run, the summary the medians and the
ratio arrow / tuples. Target: >= 200,000 rows/s for ``arrow``. Output: a table, then one JSON
line with the load average of the run (the machine's 2 cores are shared).
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
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from bench.ports import free_port
from broker.commitlog import Record, Streams, StreamSpec
from spark_sink.source import (
    MqlogBatchReader,
    MqlogDataSource,
    MqlogStreamReader,
    OffsetRangePartition,
    read_range,
)

ROOT = Path(__file__).resolve().parents[1]
PARTITIONS = 4
DEVICES = 100
TARGET_ROWS_S = 200_000


# ------------------------------------------------------------------ the reference source
def read_tuples(partition: InputPartition) -> Iterator[tuple[Any, ...]]:
    """The same fetches as the ``mqlog`` source, handed to Spark one tuple per record."""
    if not isinstance(partition, OffsetRangePartition):
        return
    for batch in read_range(partition):
        columns = [c.to_pylist() for c in batch.columns]
        columns[-1] = [dict(m) for m in columns[-1]]  # map<string,string> -> dict
        yield from zip(*columns, strict=True)


class TupleBatchReader(MqlogBatchReader):
    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:  # type: ignore[override]
        return read_tuples(partition)


class TupleStreamReader(MqlogStreamReader):
    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:  # type: ignore[override]
        return read_tuples(partition)


class TupleDataSource(MqlogDataSource):
    """``mqlog_tuples``: the ``mqlog`` source returning Python tuples (the reference)."""

    @classmethod
    def name(cls) -> str:
        return "mqlog_tuples"

    def reader(self, schema: StructType) -> DataSourceReader:
        return TupleBatchReader(self.parsed)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return TupleStreamReader(self.parsed)


# ------------------------------------------------------------------ the data and the broker
def build_log(data_dir: Path, records: int, batch_records: int) -> float:
    """Append ``records`` telemetry records, ``batch_records`` per stored batch; returns the
    seconds it took."""
    start = time.perf_counter()
    devices = [f"dev-{i:03d}" for i in range(DEVICES)]
    by_partition: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    for d in devices:
        by_partition[zlib.crc32(f"devices/{d}/telemetry".encode()) % PARTITIONS].append(d)
    base_ms = int(time.time() * 1000) - records  # one record per millisecond until now
    seq = dict.fromkeys(devices, 0)
    with Streams(data_dir, [StreamSpec("telemetry", ("devices/#",), PARTITIONS)]) as streams:
        written = 0
        while written < records:
            for p, names in by_partition.items():
                n = min(batch_records, records - written)
                if not names or n == 0:
                    continue
                batch = []
                for i in range(n):
                    device = names[i % len(names)]
                    ts = base_ms + written + i
                    payload = orjson.dumps(
                        {
                            "device": device,
                            "seq": seq[device],
                            "ts": ts,
                            "temperature": round(21 + (i % 40) / 10, 2),
                            "humidity": 45.0 + i % 10,
                            "battery": 90.0 - (i % 50) / 10,
                        }
                    )
                    seq[device] += 1
                    batch.append(
                        Record(0, ts, f"devices/{device}/telemetry", payload, 1, False, device)
                    )
                streams.log("telemetry", p).append(batch)
                written += n
    return time.perf_counter() - start


def start_broker(tmp: Path, data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    http_port = free_port()
    config = tmp / "broker.toml"
    config.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {free_port()}\n'
        f'[commitlog]\ndata_dir = "{data_dir}"\n'
        f'[[streams]]\nname = "telemetry"\ntopic_filter = ["devices/#"]\n'
        f'partitions = {PARTITIONS}\nretention = "forever"\n'
        f'[http]\nhost = "127.0.0.1"\nport = {http_port}\n'
    )
    log_path = tmp / "broker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "broker.cli", "serve", "-c", str(config)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while "listening on mqtt://" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"broker did not start:\n{log_path.read_text()}")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{http_port}"


# ------------------------------------------------------------------ the measurement
def drain_once(spark: Any, broker: str, work: Path, fmt: str, records: int) -> tuple[float, float]:
    """Seconds of one drain from query start to its end, and of its micro-batches alone."""
    from spark_sink.drain import start_drain

    out, checkpoint = work / f"out-{fmt}", work / f"cp-{fmt}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(checkpoint, ignore_errors=True)
    start = time.perf_counter()
    query = start_drain(
        spark,
        broker,
        str(out),
        str(checkpoint),
        streams=["telemetry"],
        once=True,
        source_format=fmt,
    )
    query.awaitTermination()
    elapsed = time.perf_counter() - start
    if query.exception() is not None:
        raise SystemExit(f"{fmt} drain failed: {query.exception()}")
    got = spark.read.parquet(str(out)).count()
    if got != records:
        raise SystemExit(f"{fmt} drain wrote {got} rows, expected {records}")
    batches_ms = sum(p.durationMs["triggerExecution"] for p in query.recentProgress)
    return elapsed, batches_ms / 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument(
        "--batch-records",
        type=int,
        default=1000,
        help="records per stored log batch (default 1000)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds first (JIT, Python workers; default 1)",
    )
    args = parser.parse_args(argv)

    # Workers import this module (the reference source) and our packages.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from spark_sink.drain import spark_session

    tmp = Path(tempfile.mkdtemp(prefix="mqlog-spark-bench-"))
    broker = None
    try:
        build_s = build_log(tmp / "data", args.records, args.batch_records)
        print(f"built {args.records} records in {build_s:.1f}s", flush=True)
        broker, url = start_broker(tmp, tmp / "data")
        session_start = time.perf_counter()
        spark = spark_session(
            master=args.master, app="mqlog-bench", extra={"spark.driver.memory": "2g"}
        )
        session_s = time.perf_counter() - session_start
        print(f"session started in {session_s:.1f}s (outside the timed drains)", flush=True)
        spark.dataSource.register(TupleDataSource)
        results: dict[str, list[float]] = {"mqlog": [], "mqlog_tuples": []}
        in_batches: dict[str, list[float]] = {"mqlog": [], "mqlog_tuples": []}
        for _ in range(args.warmup):
            for fmt in results:
                drain_once(spark, url, tmp, fmt, args.records)
        print(
            f"{'run':>3}  {'source':<13} {'seconds':>8} {'rows/s':>10} {'batch rows/s':>13}",
            flush=True,
        )
        for run in range(args.runs):
            for fmt in results:
                elapsed, batches = drain_once(spark, url, tmp, fmt, args.records)
                results[fmt].append(args.records / elapsed)
                in_batches[fmt].append(args.records / batches)
                print(
                    f"{run + 1:>3}  {fmt:<13} {elapsed:8.2f} {args.records / elapsed:10,.0f} "
                    f"{args.records / batches:13,.0f}",
                    flush=True,
                )
        spark.stop()
    finally:
        if broker is not None:
            broker.terminate()
            broker.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    arrow = statistics.median(results["mqlog"])
    tuples = statistics.median(results["mqlog_tuples"])
    load = os.getloadavg()
    with_session = args.records / (session_s + args.records / arrow)
    print()
    print(
        f"median of {args.runs}: arrow {arrow:,.0f} rows/s, tuples (reference) "
        f"{tuples:,.0f} rows/s, ratio {arrow / tuples:.2f}x; target >= {TARGET_ROWS_S:,} "
        f"rows/s: {'met' if arrow >= TARGET_ROWS_S else 'NOT met'}; micro-batches alone: "
        f"arrow {statistics.median(in_batches['mqlog']):,.0f}, tuples "
        f"{statistics.median(in_batches['mqlog_tuples']):,.0f} rows/s; with one session "
        f"start-up added: arrow {with_session:,.0f} rows/s; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(
        orjson.dumps(
            {
                "bench": "spark_drain",
                "records": args.records,
                "master": args.master,
                "batch_records": args.batch_records,
                "session_s": round(session_s, 2),
                "arrow_rows_s_with_session": round(with_session),
                "runs": args.runs,
                "warmup": args.warmup,
                "arrow_rows_s": round(arrow),
                "tuples_rows_s": round(tuples),
                "arrow_batch_rows_s": round(statistics.median(in_batches["mqlog"])),
                "tuples_batch_rows_s": round(statistics.median(in_batches["mqlog_tuples"])),
                "load": [round(x, 2) for x in load],
                "ratio": round(arrow / tuples, 2),
                "target_rows_s": TARGET_ROWS_S,
                "target_met": arrow >= TARGET_ROWS_S,
                "arrow_runs": [round(r) for r in results["mqlog"]],
                "tuples_runs": [round(r) for r in results["mqlog_tuples"]],
            }
        ).decode()
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
