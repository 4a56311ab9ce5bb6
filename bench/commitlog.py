"""Commit log throughput against the disk it writes to (``python -m bench.commitlog``).

Append throughput of :class:`SegmentedLog` for 64-byte and 1 KiB payloads, batches of 1, 100
and 1,000 records, under each fsync policy; sequential read throughput; and, in the same run on
the same file system, ``dd`` writing as many bytes as the reference cell (1 KiB payloads,
batches of 1,000, fsync=interval) with and without ``conv=fdatasync``: the physical reference,
so the headline figure is a ratio.

Each append cell runs until it has written ``--bytes-cap`` bytes or spent ``--time-cap``
seconds, whichever comes first (fsync=always with batches of 1 is disk-latency bound). Timing
includes the final ``flush()`` for ``always`` and ``interval`` (the data is only as durable as
its policy promises once that returns); ``never`` is timed up to the last ``append`` return.
``interval`` cells call ``flush_if_due()`` after each append, as the partition owner's loop does.
The records are built before the timed region (a partition already holds them when it appends),
each with its own payload object; the output names the CRC-32 implementation that ran
(:mod:`broker.commitlog.crc`: libdeflate when the system has it, else zlib).

``--runs N`` repeats the whole matrix and reports, per cell, the median run; the dd ratio is
the median of the per-run ratios (log and dd paired within a run).

Targets: 1 KiB batched appends at fsync=interval >= 70% of dd's bandwidth with fdatasync;
sequential reads >= 1,000,000 records/s. Output: a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import orjson

from broker.commitlog import crc
from broker.commitlog.config import FsyncPolicy, LogConfig
from broker.commitlog.log import SegmentedLog
from broker.commitlog.record import Record

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
PAYLOAD_SIZES = (64, 1024)
BATCH_SIZES = (1, 100, 1000)
POLICIES: tuple[FsyncPolicy, ...] = ("always", "interval", "never")
REFERENCE = (1024, 1000, "interval")
TARGET_DD_RATIO = 0.70
TARGET_READ_RECORDS_S = 1_000_000
MIB = 1 << 20
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AppendResult:
    payload: int
    batch: int
    fsync: str
    records: int
    seconds: float
    payload_bytes: int
    disk_bytes: int  # size of the .log files written (records + framing)
    cpu_seconds: float  # this process's CPU time (excludes waiting for the disk and the CPUs)

    @property
    def records_s(self) -> float:
        return self.records / self.seconds

    @property
    def disk_mb_s(self) -> float:
        return self.disk_bytes / self.seconds / 1e6

    @property
    def payload_mb_s(self) -> float:
        return self.payload_bytes / self.seconds / 1e6

    @property
    def disk_mb_cpu_s(self) -> float:
        return self.disk_bytes / self.cpu_seconds / 1e6


@dataclass(frozen=True, slots=True)
class ReadResult:
    payload: int
    records: int
    seconds: float
    cpu_seconds: float  # this process's CPU time: what the 2 shared cores' load cannot inflate

    @property
    def records_s(self) -> float:
        return self.records / self.seconds

    @property
    def records_cpu_s(self) -> float:
        return self.records / self.cpu_seconds

    @property
    def payload_mb_s(self) -> float:
        return self.records * self.payload / self.seconds / 1e6


@dataclass(frozen=True, slots=True)
class DdResult:
    fdatasync: bool
    bytes: int
    seconds: float

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / 1e6


def make_batch(payload: int, batch: int) -> list[Record]:
    """The records of one append, built before the timed region (a broker's partition already
    holds them as decoded publishes). Each record has its own payload object, as publishes
    do: one shared object would keep the payload bytes in the CPU cache and flatter the copy
    and the CRC."""
    now_ms = int(time.time() * 1000)
    blob = os.urandom(payload * batch)
    return [
        Record(
            offset=0,
            timestamp=now_ms,
            topic=f"devices/dev-{i % 100:04d}/telemetry",
            payload=blob[i * payload : (i + 1) * payload],
            qos=1,
            client_id=f"dev-{i % 100:04d}",
        )
        for i in range(batch)
    ]


def log_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.log"))


def settle() -> None:
    """Untimed: write back every dirty page (so no cell pays for the previous one's data or
    shares the CPUs with the kernel's flusher threads) and collect garbage."""
    os.sync()
    gc.collect()


def run_append(
    directory: Path, payload: int, batch: int, policy: FsyncPolicy, time_cap: float, bytes_cap: int
) -> AppendResult:
    config = LogConfig(fsync=policy, fsync_interval_ms=1000, retention_ms=None)
    records = make_batch(payload, batch)
    appends_cap = max(1, bytes_cap // (payload * batch))
    log = SegmentedLog.open(directory, config)
    appends = 0
    try:
        append = log.append
        flush_if_due = log.flush_if_due
        interval = policy == "interval"
        cpu_start = time.process_time()
        start = time.perf_counter()
        deadline = start + time_cap
        while appends < appends_cap:
            append(records)
            if interval:
                flush_if_due()
            appends += 1
            if (appends % 16 == 0 or batch >= 100) and time.perf_counter() > deadline:
                break
        if policy != "never":
            log.flush()
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
    finally:
        log.close()
    n = appends * batch
    return AppendResult(
        payload, batch, policy, n, seconds, n * payload, log_bytes(directory), cpu_seconds
    )


def run_read(directory: Path, payload: int, time_cap: float) -> ReadResult:
    config = LogConfig(fsync="never", retention_ms=None)
    log = SegmentedLog.open(directory, config)
    try:
        read = log.read
        end = log.end_offset
        offset = log.log_start_offset
        count = 0
        cpu_start = time.process_time()
        start = time.perf_counter()
        deadline = start + time_cap
        while offset < end:
            chunk = read(offset, 1000, 1 << 20)
            count += len(chunk)
            offset = chunk[-1].offset + 1
            if time.perf_counter() > deadline:
                break
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
    finally:
        log.close()
    return ReadResult(payload, count, seconds, cpu_seconds)


_DD_RE = re.compile(r"^(\d+) bytes .* copied, ([0-9.,e-]+) s", re.MULTILINE)


def run_dd(directory: Path, mib: int, fdatasync: bool) -> DdResult:
    target = directory / "dd.out"
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}"]
    if fdatasync:
        cmd.append("conv=fdatasync")
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    target.unlink()
    m = _DD_RE.search(done.stderr)
    if m:  # dd's own figure excludes process start-up
        return DdResult(fdatasync, int(m.group(1)), float(m.group(2).replace(",", ".")))
    return DdResult(fdatasync, mib * MIB, wall)


def table(appends: list[AppendResult], reads: list[ReadResult], dds: list[DdResult]) -> str:
    lines = [
        f"{'payload':>7} {'batch':>5} {'fsync':>8} {'records':>10} {'s':>6} "
        f"{'records/s':>11} {'disk MB/s':>9} {'payload MB/s':>12} {'disk MB/CPU-s':>13}"
    ]
    for a in appends:
        lines.append(
            f"{a.payload:>7} {a.batch:>5} {a.fsync:>8} {a.records:>10} {a.seconds:>6.2f} "
            f"{a.records_s:>11,.0f} {a.disk_mb_s:>9.1f} {a.payload_mb_s:>12.1f} "
            f"{a.disk_mb_cpu_s:>13.1f}"
        )
    lines.append("")
    lines.append(
        f"{'read':>7} {'':>5} {'':>8} {'records':>10} {'s':>6} {'records/s':>11} "
        f"{'records/CPU-s':>14}"
    )
    for r in reads:
        lines.append(
            f"{r.payload:>7} {'':>5} {'':>8} {r.records:>10} {r.seconds:>6.2f} "
            f"{r.records_s:>11,.0f} {r.records_cpu_s:>14,.0f}"
        )
    lines.append("")
    for d in dds:
        mode = "conv=fdatasync" if d.fdatasync else "no sync"
        lines.append(f"dd bs=1M {d.bytes / MIB:>6.0f} MiB {mode:<15} {d.mb_s:>9.1f} MB/s")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Run:
    appends: list[AppendResult]
    reads: list[ReadResult]
    dd_sync: DdResult
    dd_nosync: DdResult

    @property
    def reference(self) -> AppendResult:
        return next(a for a in self.appends if (a.payload, a.batch, a.fsync) == REFERENCE)

    @property
    def dd_ratio(self) -> float:
        """The reference cell's bandwidth over dd's (with fdatasync), measured in this run."""
        return self.reference.disk_mb_s / self.dd_sync.mb_s

    def read_records_s(self, payload: int) -> float:
        return next(r for r in self.reads if r.payload == payload).records_s


def run_once(args: argparse.Namespace) -> Run:
    """The whole matrix once, in a fresh data dir under ``args.dir`` (removed afterwards)."""
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="commitlog-", dir=args.dir))
    appends: list[AppendResult] = []
    reads: list[ReadResult] = []
    dds: list[DdResult] = []
    try:
        keep = {(p, 1000, "never") for p in PAYLOAD_SIZES}  # read back afterwards
        for payload in PAYLOAD_SIZES:
            for batch in BATCH_SIZES:
                for policy in POLICIES:
                    d = work / f"{payload}-{batch}-{policy}"
                    settle()
                    res = run_append(d, payload, batch, policy, args.time_cap, args.bytes_cap * MIB)
                    appends.append(res)
                    print(
                        f"  append {payload:>5} B x {batch:>4} {policy:>8}: "
                        f"{res.records_s:>11,.0f} records/s {res.disk_mb_s:>7.1f} MB/s",
                        file=sys.stderr,
                        flush=True,
                    )
                    if (payload, batch, policy) == REFERENCE:
                        # Right after the reference cell, as many bytes, same file system.
                        mib = max(1, -(-res.disk_bytes // MIB))
                        settle()
                        dd_sync = run_dd(work, mib, True)
                        settle()
                        dds = [dd_sync, run_dd(work, mib, False)]
                    if (payload, batch, policy) not in keep:
                        shutil.rmtree(d)
        for payload in PAYLOAD_SIZES:
            settle()
            reads.append(run_read(work / f"{payload}-1000-never", payload, args.read_cap))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Run(appends, reads, dds[0], dds[1])


def median_run(runs: list[Run]) -> Run:
    """Per cell, the run with the median throughput (the lower middle one for even counts)."""

    def pick(items: list[T], key: Callable[[T], float]) -> T:
        return sorted(items, key=key)[(len(items) - 1) // 2]

    return Run(
        [
            pick([r.appends[i] for r in runs], lambda a: a.records_s)
            for i in range(len(runs[0].appends))
        ],
        [
            pick([r.reads[i] for r in runs], lambda x: x.records_s)
            for i in range(len(runs[0].reads))
        ],
        pick([r.dd_sync for r in runs], lambda d: d.mb_s),
        pick([r.dd_nosync for r in runs], lambda d: d.mb_s),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.commitlog", description=__doc__)
    parser.add_argument("--time-cap", type=float, default=1.5, help="seconds per append cell")
    parser.add_argument("--bytes-cap", type=int, default=256, help="payload MiB per cell")
    parser.add_argument("--read-cap", type=float, default=3.0, help="seconds per read run")
    parser.add_argument("--runs", type=int, default=1, help="repeat; report medians")
    parser.add_argument("--dir", type=Path, default=RESULTS_DIR, help="parent of the data dir")
    args = parser.parse_args(argv)

    runs = [run_once(args) for _ in range(max(1, args.runs))]
    med = median_run(runs)
    # The ratio pairs the log and dd of the same run; its median is over runs.
    ratios = sorted(r.dd_ratio for r in runs)
    ratio = ratios[(len(ratios) - 1) // 2]
    nosync_ratios = sorted(r.reference.disk_mb_s / r.dd_nosync.mb_s for r in runs)
    nosync_ratio = nosync_ratios[(len(nosync_ratios) - 1) // 2]
    read_64 = med.read_records_s(64)

    if len(runs) > 1:
        print(f"medians of {len(runs)} runs")
    print(table(med.appends, med.reads, [med.dd_sync, med.dd_nosync]))
    print()
    print(
        f"1 KiB x 1000 fsync=interval vs dd conv=fdatasync: {ratio:.0%} "
        f"(target >= {TARGET_DD_RATIO:.0%}); vs dd without sync: {nosync_ratio:.0%}; "
        f"batch CRC-32 by {crc.IMPLEMENTATION}"
    )
    print(
        f"sequential read, 64 B records: {read_64:,.0f} records/s "
        f"(target >= {TARGET_READ_RECORDS_S:,}); per CPU-second: "
        f"{next(r for r in med.reads if r.payload == 64).records_cpu_s:,.0f}"
    )
    summary = {
        "bench": "commitlog",
        "runs": len(runs),
        "crc_implementation": crc.IMPLEMENTATION,
        "appends": [
            asdict(a)
            | {"records_s": a.records_s, "disk_mb_s": a.disk_mb_s, "disk_mb_cpu_s": a.disk_mb_cpu_s}
            for a in med.appends
        ],
        "reads": [
            asdict(r) | {"records_s": r.records_s, "records_cpu_s": r.records_cpu_s}
            for r in med.reads
        ],
        "dd": [asdict(d) | {"mb_s": d.mb_s} for d in (med.dd_sync, med.dd_nosync)],
        "interval_1k_x1000_mb_s": med.reference.disk_mb_s,
        "dd_fdatasync_mb_s": med.dd_sync.mb_s,
        "dd_nosync_mb_s": med.dd_nosync.mb_s,
        "ratio_vs_dd_fdatasync": ratio,
        "ratio_vs_dd_fdatasync_per_run": [r.dd_ratio for r in runs],
        "ratio_vs_dd_nosync": nosync_ratio,
        "read_records_s": read_64,
        "read_records_s_per_run": [r.read_records_s(64) for r in runs],
        "read_1k_records_s": med.read_records_s(1024),
        "targets_met": {
            "dd_ratio": ratio >= TARGET_DD_RATIO,
            "read_records_s": read_64 >= TARGET_READ_RECORDS_S,
        },
    }
    print(orjson.dumps(summary).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
