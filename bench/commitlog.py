"""Commit log throughput against the disk it writes to (``python -m bench.commitlog``).

Two parts, both on the same file system (``--dir``):

**Matrix** (``--runs N``, medians per cell): append throughput of :class:`SegmentedLog` for
64-byte and 1 KiB payloads, batches of 1, 100 and 1,000 records, under each fsync policy; then
sequential reads of the 1,000-record batches back, by both read paths: :meth:`SegmentedLog.read`
(a ``Record`` tuple per record: the router's message-by-message delivery) and
:meth:`SegmentedLog.read_columns` (the stored columns: the fetch API's path, and the router's
for a lagging subscriber's runs of PUBLISHes, which is how a replay is read). Each append cell
runs until it has written ``--bytes-cap`` bytes or spent ``--time-cap`` seconds, whichever
comes first (fsync=always with batches of 1 is disk-latency bound). Timing includes the final
``flush()`` for ``always`` and ``interval`` (the data is only as durable as its policy promises
once that returns); ``never`` is timed up to the last ``append`` return. ``interval`` cells
call ``flush_if_due()`` after each append, as the partition owner's loop does. The records are
built before the timed region (a partition already holds them when it appends), each with its
own payload object; the output names the CRC-32 implementation that ran
(:mod:`broker.commitlog.crc`: libdeflate when the system has it, else zlib).

**dd pairs** (``--pairs N``): the physical reference for the headline ratio. Each pair runs the
reference cell (1 KiB payloads, batches of 1,000, fsync=interval) and ``dd bs=1M
conv=fdatasync`` writing exactly the same number of bytes (``iflag=count_bytes``) to the same
directory, one right after the other; the ratio is the log's MB/s over dd's in that pair, and
the headline is the median of the per-pair ratios, with their spread (min, max). Why pairs:
this disk (a virtual disk on a shared host) moves between ~440 and ~1,200 MB/s from one minute
to the next, so a dd figure from another moment, or one dd against a median of log runs, says
more about the host than about the log. Pairing measures both within seconds of each other;
repeating pairs and taking the median of the ratios keeps one disturbed pair from deciding the
figure, and the spread shows how much to trust it. Fairness: both sides start from the same
state (previous files removed, ``os.sync()``, untimed), write the same bytes to the same file
system and are timed to durability (the log's final ``flush()``, dd's ``fdatasync``; dd's own
elapsed time, which excludes its process start-up, as the log's excludes ``open``); the order
alternates (log first in odd pairs, dd first in even ones) so a drift in the disk or the load
during a pair does not always favour the same side. The order matters on this machine (the
log's ratio was 0.1-0.2 lower in the pairs where dd ran first, its CPU per MB higher too), so
the pair count should be even, and the output also gives the median of each order. The
reference cell has no time cap, so its
byte count is fixed. Each pair also runs dd without ``fdatasync`` (page-cache bandwidth, the
ceiling for a CPU-bound writer) and records the load average, since the log is CPU-bound on 2
shared cores and dd mostly waits for the disk: the ``log MB/CPU-s`` column is the figure other
processes' load cannot inflate.

Targets: 1 KiB batched appends at fsync=interval >= 70% of dd's bandwidth with fdatasync
(median pair ratio); sequential reads >= 1,000,000 records/s (64-byte records, both paths
reported). Output: tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import math
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
from broker.commitlog.batch import encode_batch
from broker.commitlog.config import FsyncPolicy, LogConfig
from broker.commitlog.log import SegmentedLog
from broker.commitlog.record import Record

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
PAYLOAD_SIZES = (64, 1024)
BATCH_SIZES = (1, 100, 1000)
POLICIES: tuple[FsyncPolicy, ...] = ("always", "interval", "never")
READ_PATHS = ("read", "read_columns")
REFERENCE: tuple[int, int, FsyncPolicy] = (1024, 1000, "interval")
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
    path: str  # "read" (Record tuples) or "read_columns"
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


@dataclass(frozen=True, slots=True)
class Pair:
    """One reference-cell run and the dd runs next to it (see the module doc)."""

    log_first: bool
    log: AppendResult
    dd_sync: DdResult
    dd_nosync: DdResult
    load_before: float  # 1-minute load average
    load_after: float

    @property
    def ratio(self) -> float:
        return self.log.disk_mb_s / self.dd_sync.mb_s

    @property
    def nosync_ratio(self) -> float:
        return self.log.disk_mb_s / self.dd_nosync.mb_s


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


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


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


def run_read(directory: Path, payload: int, path: str, time_cap: float) -> ReadResult:
    """Read the log in ``directory`` from its start, 1,000 records per call, as a sequential
    consumer does; ``path`` names the method (see the module doc)."""
    config = LogConfig(fsync="never", retention_ms=None)
    log = SegmentedLog.open(directory, config)
    try:
        end = log.end_offset
        offset = log.log_start_offset
        count = 0
        cpu_start = time.process_time()
        start = time.perf_counter()
        deadline = start + time_cap
        if path == "read":
            read = log.read
            while offset < end:
                chunk = read(offset, 1000, 1 << 20)
                count += len(chunk)
                offset = chunk[-1].offset + 1
                if time.perf_counter() > deadline:
                    break
        else:
            read_columns = log.read_columns
            while offset < end:
                columns = read_columns(offset, 1000, 1 << 20)
                count += columns.count
                offset = columns.next_offset
                if time.perf_counter() > deadline:
                    break
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
    finally:
        log.close()
    return ReadResult(payload, path, count, seconds, cpu_seconds)


_DD_RE = re.compile(r"^(\d+) bytes .* copied, ([0-9.,e-]+) s", re.MULTILINE)


def run_dd(directory: Path, nbytes: int, fdatasync: bool) -> DdResult:
    """``dd`` writing exactly ``nbytes`` from /dev/zero into ``directory`` in 1 MiB blocks."""
    target = directory / "dd.out"
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={nbytes}", "iflag=count_bytes"]
    if fdatasync:
        cmd.append("conv=fdatasync")
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    target.unlink()
    m = _DD_RE.search(done.stderr)
    if m:  # dd's own figure excludes process start-up
        return DdResult(fdatasync, int(m.group(1)), float(m.group(2).replace(",", ".")))
    return DdResult(fdatasync, nbytes, wall)


def run_matrix(args: argparse.Namespace) -> tuple[list[AppendResult], list[ReadResult]]:
    """Every append cell once, then both read paths over the 1,000-record ``never`` cells, in
    a fresh data dir under ``args.dir`` (removed afterwards)."""
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="commitlog-", dir=args.dir))
    appends: list[AppendResult] = []
    reads: list[ReadResult] = []
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
                    if (payload, batch, policy) not in keep:
                        shutil.rmtree(d)
        for payload in PAYLOAD_SIZES:
            for path in READ_PATHS:
                settle()
                res_read = run_read(work / f"{payload}-1000-never", payload, path, args.read_cap)
                reads.append(res_read)
                print(
                    f"  {path:>12} {payload:>5} B: {res_read.records_s:>11,.0f} records/s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return appends, reads


def run_pair(args: argparse.Namespace, log_first: bool) -> Pair:
    """The reference cell and dd on the same bytes, each from a synced state with the other's
    files removed (see the module doc)."""
    payload, batch, policy = REFERENCE
    appends = max(1, args.bytes_cap * MIB // (payload * batch))
    # Every batch of the cell has the same size whatever its base offset.
    nbytes = appends * len(encode_batch(0, make_batch(payload, batch)))
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="commitlog-pair-", dir=args.dir))
    load_before = os.getloadavg()[0]
    try:
        log_dir = work / "log"
        log = dd_sync = None
        for side in ("log", "dd") if log_first else ("dd", "log"):
            shutil.rmtree(log_dir, ignore_errors=True)
            settle()
            if side == "log":
                log = run_append(
                    log_dir, payload, batch, policy, math.inf, appends * payload * batch
                )
                assert log.disk_bytes == nbytes, (log.disk_bytes, nbytes)
            else:
                dd_sync = run_dd(work, nbytes, True)
        shutil.rmtree(log_dir, ignore_errors=True)
        settle()
        dd_nosync = run_dd(work, nbytes, False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert log is not None and dd_sync is not None
    pair = Pair(log_first, log, dd_sync, dd_nosync, load_before, os.getloadavg()[0])
    print(
        f"  pair ({'log, dd' if log_first else 'dd, log'}): log {log.disk_mb_s:7.1f} MB/s, "
        f"dd {dd_sync.mb_s:7.1f} MB/s, ratio {pair.ratio:.2f}, load {load_before:.2f}",
        file=sys.stderr,
        flush=True,
    )
    return pair


def median_cells(runs: list[list[T]], key: Callable[[T], float]) -> list[T]:
    """Per cell, the run with the median ``key`` (the lower middle one for even counts)."""
    return [sorted(cell, key=key)[(len(cell) - 1) // 2] for cell in zip(*runs, strict=True)]


def table(appends: list[AppendResult], reads: list[ReadResult]) -> str:
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
        f"{'read':>7} {'path':>14} {'records':>10} {'s':>6} {'records/s':>11} {'records/CPU-s':>14}"
    )
    for r in reads:
        lines.append(
            f"{r.payload:>7} {r.path:>14} {r.records:>10} {r.seconds:>6.2f} "
            f"{r.records_s:>11,.0f} {r.records_cpu_s:>14,.0f}"
        )
    return "\n".join(lines)


def pair_table(pairs: list[Pair]) -> str:
    lines = [
        f"{'pair':>4} {'order':>8} {'MiB':>5} {'log MB/s':>9} {'log MB/CPU-s':>12} "
        f"{'dd fdatasync':>12} {'ratio':>6} {'dd no sync':>10} {'load':>11}"
    ]
    for i, p in enumerate(pairs, 1):
        lines.append(
            f"{i:>4} {'log, dd' if p.log_first else 'dd, log':>8} {p.log.disk_bytes / MIB:>5.0f} "
            f"{p.log.disk_mb_s:>9.1f} {p.log.disk_mb_cpu_s:>12.1f} {p.dd_sync.mb_s:>12.1f} "
            f"{p.ratio:>6.2f} {p.dd_nosync.mb_s:>10.1f} {p.load_before:>5.2f}-{p.load_after:<5.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.commitlog",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--time-cap", type=float, default=1.5, help="seconds per append cell")
    parser.add_argument(
        "--bytes-cap",
        type=int,
        default=256,
        help="payload MiB per cell (the dd pairs' reference cell: exactly)",
    )
    parser.add_argument("--read-cap", type=float, default=3.0, help="seconds per read run")
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="matrix repeats, medians per cell (0: no matrix, no reads)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=6,
        help="reference cell / dd pairs for the ratio, even: both orders equally (0: none)",
    )
    parser.add_argument("--dir", type=Path, default=RESULTS_DIR, help="parent of the data dir")
    args = parser.parse_args(argv)

    load_start = os.getloadavg()
    matrix = [run_matrix(args) for _ in range(max(0, args.runs))]
    pairs = [run_pair(args, log_first=i % 2 == 0) for i in range(max(0, args.pairs))]
    load_end = os.getloadavg()
    appends = median_cells([m[0] for m in matrix], lambda a: a.records_s) if matrix else []
    reads = median_cells([m[1] for m in matrix], lambda r: r.records_s) if matrix else []

    summary: dict[str, object] = {
        "bench": "commitlog",
        "runs": len(matrix),
        "crc_implementation": crc.IMPLEMENTATION,
        "loadavg_start": load_start,
        "loadavg_end": load_end,
    }
    print(
        f"batch CRC-32 by {crc.IMPLEMENTATION}; load average {load_start[0]:.2f} "
        f"{load_start[1]:.2f} {load_start[2]:.2f} at start, {load_end[0]:.2f} {load_end[1]:.2f} "
        f"{load_end[2]:.2f} at end"
    )
    if matrix:
        print(f"\nmatrix, medians of {len(matrix)} run(s)")
        print(table(appends, reads))
        summary["appends"] = [
            asdict(a)
            | {"records_s": a.records_s, "disk_mb_s": a.disk_mb_s, "disk_mb_cpu_s": a.disk_mb_cpu_s}
            for a in appends
        ]
        summary["reads"] = [
            asdict(r) | {"records_s": r.records_s, "records_cpu_s": r.records_cpu_s} for r in reads
        ]
        targets: dict[str, bool] = {}
        for r in reads:
            summary[f"{r.path}_{r.payload}_records_s_per_run"] = [
                next(x for x in m[1] if (x.path, x.payload) == (r.path, r.payload)).records_s
                for m in matrix
            ]
            if r.payload == 64:
                targets[f"{r.path}_records_s"] = r.records_s >= TARGET_READ_RECORDS_S
                print(
                    f"sequential {r.path}(), 64 B records: {r.records_s:,.0f} records/s "
                    f"(target >= {TARGET_READ_RECORDS_S:,}); per CPU-second: "
                    f"{r.records_cpu_s:,.0f}"
                )
        summary["targets_met"] = targets
    if pairs:
        ratios = [p.ratio for p in pairs]
        ratio = median(ratios)
        print(f"\n1 KiB x 1000 fsync=interval against dd on the same bytes, {len(pairs)} pairs")
        print(pair_table(pairs))
        by_order = {
            first: median([p.ratio for p in pairs if p.log_first == first])
            for first in (True, False)
            if any(p.log_first == first for p in pairs)
        }
        print(
            f"ratio to dd conv=fdatasync: median {ratio:.2f} (min {min(ratios):.2f}, max "
            f"{max(ratios):.2f}; target >= {TARGET_DD_RATIO:.2f}); by order: "
            + ", ".join(
                f"{'log' if first else 'dd'} first {r:.2f}" for first, r in by_order.items()
            )
            + f"; to dd without sync: median {median([p.nosync_ratio for p in pairs]):.2f}; "
            f"log MB/CPU-s median {median([p.log.disk_mb_cpu_s for p in pairs]):.1f}"
        )
        summary["pairs"] = [
            {
                "log_first": p.log_first,
                "log": asdict(p.log)
                | {"disk_mb_s": p.log.disk_mb_s, "disk_mb_cpu_s": p.log.disk_mb_cpu_s},
                "dd_fdatasync_mb_s": p.dd_sync.mb_s,
                "dd_nosync_mb_s": p.dd_nosync.mb_s,
                "ratio": p.ratio,
                "load_before": p.load_before,
                "load_after": p.load_after,
            }
            for p in pairs
        ]
        summary["ratio_vs_dd_fdatasync"] = ratio
        summary["ratio_vs_dd_fdatasync_min"] = min(ratios)
        summary["ratio_vs_dd_fdatasync_max"] = max(ratios)
        summary["ratio_vs_dd_fdatasync_by_order"] = {
            "log_first" if first else "dd_first": r for first, r in by_order.items()
        }
        summary["ratio_vs_dd_nosync"] = median([p.nosync_ratio for p in pairs])
        met = summary.setdefault("targets_met", {})
        assert isinstance(met, dict)
        met["dd_ratio"] = ratio >= TARGET_DD_RATIO
    print(orjson.dumps(summary).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
