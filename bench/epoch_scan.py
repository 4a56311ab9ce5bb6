"""How long a Raft group's term table takes to rebuild at recovery, for a partition of N GiB.

Writes a partition log of ``--gib`` GiB of ``--batch-bytes`` batches (default segments of
64 MiB, the default index interval),
whose leader epoch moves ``--terms`` times at random batches, closes it, then times, each on a
freshly opened log:

* ``epoch_runs``: :meth:`SegmentedLog.epoch_runs`, the scan recovery runs without a checkpoint
  (a few batch headers per segment, split in two where the epoch changes);
* ``every header``: the naive rebuild for reference, one ``pread`` of each batch header;
* ``open`` / ``open + checkpoint``: :meth:`GroupStorage.open` without and with a valid
  ``leader-epoch-checkpoint`` (the log's own open included in both).

The page cache is warm (the log was just written); a cold cache adds the reads of the headers
(epoch_runs: a few per segment) or of everything (every header). Prints a table and a JSON line.
Run: ``python -m bench.epoch_scan [--gib 1] [--batch-bytes 1024] [--terms 5] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from broker.cluster.hardstate import EPOCH_CHECKPOINT_FILE
from broker.cluster.storage import GroupStorage
from broker.commitlog import LogConfig, Record, SegmentedLog
from broker.commitlog.batch import BATCH_HEADER, BATCH_HEADER_SIZE, encode_batch

CONFIG = LogConfig(fsync="never")


def write(directory: Path, total: int, batch_bytes: int, terms: int, seed: int) -> int:
    """Write the log, one record per batch; return its batch count."""
    record = Record(0, 1_700_000_000_000, "devices/d1/telemetry", b"", 1, False, "d1", b"")
    size = len(encode_batch(0, [record]))
    record = record._replace(payload=bytes(max(0, batch_bytes - size)))
    count = total // len(encode_batch(0, [record]))
    rng = random.Random(seed)
    changes = set(rng.sample(range(1, count), terms))
    epoch = 1
    with SegmentedLog.open(directory, CONFIG) as log:
        for i in range(count):
            if i in changes:
                epoch += rng.randint(1, 3)
            log.append([record], leader_epoch=epoch)
    return count


def every_header(log: SegmentedLog) -> list[tuple[int, int]]:
    """The naive rebuild: a pread of each batch header of each segment."""
    runs: list[tuple[int, int]] = []
    for base in log.segments:
        path = log.directory / f"{base:020d}.log"
        fd = os.open(path, os.O_RDONLY)
        try:
            size, pos = os.fstat(fd).st_size, 0
            while pos < size:
                h = BATCH_HEADER.unpack(os.pread(fd, BATCH_HEADER_SIZE, pos))
                if not runs or runs[-1][1] != h[5]:
                    runs.append((h[0], h[5]))
                pos += h[1]
        finally:
            os.close(fd)
    return runs


def timed(what: object) -> tuple[float, object]:
    started = time.perf_counter()
    result = what()  # type: ignore[operator]
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.epoch_scan", description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--batch-bytes", type=int, default=1024)
    parser.add_argument("--terms", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="epoch-scan-", dir=args.dir))
    try:
        directory = root / "p0"
        started = time.perf_counter()
        batches = write(directory, int(args.gib * (1 << 30)), args.batch_bytes, args.terms, 1)
        written_s = time.perf_counter() - started
        with SegmentedLog.open(directory, CONFIG) as log:
            scan_s, runs = timed(log.epoch_runs)
            naive_s, naive = timed(lambda: every_header(log))
            segments, size = len(log.segments), log.size
        assert runs == naive, (runs, naive)
        (directory / EPOCH_CHECKPOINT_FILE).unlink(missing_ok=True)
        open_s, storage = timed(lambda: GroupStorage.open(directory, CONFIG))
        storage.close()  # type: ignore[attr-defined]
        checkpoint_s, storage = timed(lambda: GroupStorage.open(directory, CONFIG))
        storage.close()  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(root)
    row = {
        "gib": size / (1 << 30),
        "segments": segments,
        "batches": batches,
        "runs": len(runs),  # type: ignore[arg-type]
        "write_s": written_s,
        "epoch_runs_ms": scan_s * 1e3,
        "every_header_ms": naive_s * 1e3,
        "open_scan_ms": open_s * 1e3,
        "open_checkpoint_ms": checkpoint_s * 1e3,
    }
    print(
        f"{'GiB':>5} {'segments':>8} {'batches':>9} {'runs':>4} {'epoch_runs':>11} "
        f"{'every header':>13} {'open (scan)':>12} {'open (ckpt)':>12}"
    )
    print(
        f"{row['gib']:>5.2f} {segments:>8} {batches:>9} {row['runs']:>4} "
        f"{row['epoch_runs_ms']:>9.1f}ms {row['every_header_ms']:>11.1f}ms "
        f"{row['open_scan_ms']:>10.1f}ms {row['open_checkpoint_ms']:>10.1f}ms"
    )
    print(json.dumps({"bench": "epoch_scan", **row}))


if __name__ == "__main__":
    main()
