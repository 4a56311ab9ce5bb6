"""Broker CPU of the Arrow fetch path per 1M records (``python -m bench.fetch_encode``).

What the HTTP fetch handler does per request, minus aiohttp: the log read plus the Arrow IPC
encode, for the whole log fetched sequentially (``--fetch`` records per request, 4 MiB
``max_bytes`` as the Spark source asks), two ways in the same run:

- ``tuples`` (the reference): ``SegmentedLog.read`` (a Record per record) + ``to_record_batch``;
- ``columns``: ``SegmentedLog.read_columns`` (the stored columns) + ``columns_to_record_batch``.

The log is bench/spark_drain.py's telemetry (JSON payloads, 25 devices per partition, one
partition here) appended in batches of ``--batch`` records (1,000 in the drain bench; the
router's group commit makes them smaller when traffic is light, so try 1 and 10 too). Prints a
table of CPU seconds per 1M records (``time.process_time``, median of ``--runs``) and a JSON
line with the load average (the machine's 2 cores are shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from broker.commitlog import LogConfig, Record, SegmentedLog
from broker.http.arrow import columns_to_record_batch, to_ipc_stream, to_record_batch

MAX_BYTES = 4 << 20


def build(directory: Path, records: int, batch: int) -> SegmentedLog:
    log = SegmentedLog.open(directory, LogConfig(fsync="never"))
    devices = [f"dev-{i:03d}" for i in range(25)]
    base_ms = int(time.time() * 1000) - records
    for start in range(0, records, batch):
        log.append(
            [
                Record(
                    0,
                    base_ms + i,
                    f"devices/{devices[i % 25]}/telemetry",
                    orjson.dumps(
                        {
                            "device": devices[i % 25],
                            "seq": i // 25,
                            "ts": base_ms + i,
                            "temperature": round(21 + (i % 40) / 10, 2),
                            "humidity": 45.0 + i % 10,
                            "battery": 90.0 - (i % 50) / 10,
                        }
                    ),
                    1,
                    False,
                    devices[i % 25],
                )
                for i in range(start, min(start + batch, records))
            ]
        )
    return log


Fetch = Callable[[SegmentedLog, int, int], tuple[bytes, int]]


def drain(log: SegmentedLog, fetch: int, encode: Fetch) -> float:
    """CPU seconds to fetch the whole log as Arrow IPC bodies."""
    offset, end = 0, log.end_offset
    cpu = time.process_time()
    while offset < end:
        _body, offset = encode(log, offset, fetch)
    return time.process_time() - cpu


def tuples(log: SegmentedLog, offset: int, fetch: int) -> tuple[bytes, int]:
    records = log.read(offset, fetch, MAX_BYTES)
    return (to_ipc_stream(to_record_batch("telemetry", 0, records)), records[-1].offset + 1)


def columns(log: SegmentedLog, offset: int, fetch: int) -> tuple[bytes, int]:
    read = log.read_columns(offset, fetch, MAX_BYTES)
    return to_ipc_stream(columns_to_record_batch("telemetry", 0, read)), read.next_offset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1000, help="records per stored batch")
    parser.add_argument("--fetch", type=int, default=10_000, help="records per fetch")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--columns-only",
        action="store_true",
        help="skip the tuples reference (slow on small batches)",
    )
    args = parser.parse_args(argv)
    ways: dict[str, Fetch] = {"columns": columns}
    if not args.columns_only:
        ways = {"tuples": tuples, **ways}
    results: dict[str, list[float]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory(prefix="mqlog-fetch-bench-") as tmp:
        log = build(Path(tmp), args.records, args.batch)
        for encode in ways.values():
            drain(log, args.fetch, encode)  # warm-up: page cache, caches
        for _ in range(args.runs):
            for name, encode in ways.items():
                results[name].append(drain(log, args.fetch, encode) * 1e6 / args.records)
        log.close()
    load = os.getloadavg()
    print(f"{'path':<8} {'CPU s per 1M (median)':>22}  runs")
    for name, runs in results.items():
        print(f"{name:<8} {statistics.median(runs):22.3f}  " + " ".join(f"{r:.3f}" for r in runs))
    summary = {
        "bench": "fetch_encode",
        "records": args.records,
        "batch": args.batch,
        "fetch": args.fetch,
        "runs": args.runs,
    }
    for name, runs in results.items():
        summary[f"{name}_cpu_s_per_1m"] = round(statistics.median(runs), 3)
    if "tuples" in results:
        ratio = statistics.median(results["tuples"]) / statistics.median(results["columns"])
        summary["ratio"] = round(ratio, 2)
        print(f"columns is {ratio:.1f}x less CPU")
    print(
        f"batch {args.batch}, fetch {args.fetch}; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    summary["load"] = [round(x, 2) for x in load]
    print(orjson.dumps(summary).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
