"""Offline verification and repair of a data directory (``mqlog verify DATA_DIR``).

:func:`verify_data_dir` checks every segment of every partition, read-only (safe against a
running broker's files: it opens them ``O_RDONLY`` and writes nothing):

* the ``.log``: every batch validated in full (:func:`~broker.commitlog.integrity.scan_segment`),
  each damaged range with its byte and offset range;
* the ``.index``: entries increasing, each pointing at an intact batch with that base offset;
* the ``.timeindex``: entries increasing, each naming the last offset of an intact batch and
  the largest timestamp up to it.

:func:`repair` (``--repair``, with the broker stopped) fixes what was found, deleting nothing:
a segment with damaged ranges is moved aside to ``<partition>/quarantine/<base>.log`` and
replaced by a copy holding its intact batches only (offsets kept: the damaged offsets become a
gap, reported as a loss, which readers pass over and :meth:`SegmentedLog.open` accepts because
the quarantined original is there); its indexes, and any index found wrong, are rebuilt.

Threads: plain functions, any thread; nothing here is used by the broker's loop.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from broker.commitlog.batch import BATCH_HEADER
from broker.commitlog.config import LogConfig
from broker.commitlog.errors import CorruptIndex, LogIOError
from broker.commitlog.index import OFFSET_ENTRY, TIME_ENTRY
from broker.commitlog.integrity import QUARANTINE_DIR, DamagedRange, walk
from broker.commitlog.segment import INDEX_SUFFIX, LOG_SUFFIX, TIMEINDEX_SUFFIX, Segment


class Finding(NamedTuple):
    """One problem: in which file, what, and for damage to the ``.log`` the range lost."""

    stream: str
    partition: str
    path: Path
    problem: str
    damage: DamagedRange | None


class SegmentCheck(NamedTuple):
    """What :func:`verify_segment` found in one segment."""

    log_path: Path
    base_offset: int
    size: int
    batches: int
    ranges: list[DamagedRange]
    index_problem: str | None
    timeindex_problem: str | None

    @property
    def damaged(self) -> bool:
        return bool(self.ranges or self.index_problem or self.timeindex_problem)


def segment_bases(directory: Path) -> list[int]:
    """Base offsets of the segments in a partition directory, ascending."""
    names = os.listdir(directory)
    return sorted(
        int(name[: -len(LOG_SUFFIX)])
        for name in names
        if name.endswith(LOG_SUFFIX) and len(name) == 20 + len(LOG_SUFFIX) and name[:20].isdigit()
    )


def partitions(data_dir: Path) -> list[Path]:
    """Every ``<stream>/<partition>`` directory under ``data_dir``, sorted."""
    found = []
    for stream in sorted(p for p in data_dir.iterdir() if p.is_dir()):
        for partition in sorted(p for p in stream.iterdir() if p.is_dir()):
            if partition.name.isdigit():
                found.append(partition)
    return found


def verify_segment(log_path: Path, base_offset: int, *, active: bool = False) -> SegmentCheck:
    """Check one segment's ``.log``, ``.index`` and ``.timeindex`` (read-only).

    ``active``: the partition's last segment, which a running broker appends to: an
    incomplete batch at its very end is a write in progress (or a crash's torn tail, which
    recovery truncates), not damage."""
    try:
        fd = os.open(log_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise LogIOError(log_path, "open segment", exc) from exc
    try:
        size = os.fstat(fd).st_size
        ranges: list[DamagedRange] = []
        starts: dict[int, int] = {}  # position -> base offset of each intact batch
        last_offsets: dict[int, int] = {}  # last offset -> max timestamp up to it
        max_ts = -1
        for item in walk(fd, log_path, 0, size, base_offset):
            if item is None:
                break
            if isinstance(item, DamagedRange):
                ranges.append(item)
                continue
            buf, rel, at, next_offset = item
            header = BATCH_HEADER.unpack_from(buf, rel)
            starts[at] = header[0]
            max_ts = max(max_ts, header[9])
            last_offsets[next_offset - 1] = max_ts
    finally:
        os.close(fd)
    if active and ranges and _in_progress(ranges[-1]):
        ranges.pop()
    directory = log_path.parent
    # Entries for a damaged batch are not the indexes' fault: the .log's damage is reported.
    for damage in ranges:
        starts.setdefault(damage.position, -1)
    index_problem = _check_index(directory / f"{base_offset:020d}{INDEX_SUFFIX}", starts, size)
    timeindex_problem = _check_timeindex(
        directory / f"{base_offset:020d}{TIMEINDEX_SUFFIX}", last_offsets, ranges
    )
    return SegmentCheck(
        log_path, base_offset, size, len(starts), ranges, index_problem, timeindex_problem
    )


def _in_progress(damage: DamagedRange) -> bool:
    """An incomplete batch at the file's end: nothing intact after it, and the file ends
    inside its header or before its length."""
    return damage.last_offset < 0 and (
        damage.reason.startswith("torn batch header") or "runs past the end" in damage.reason
    )


def _check_index(path: Path, starts: dict[int, int], size: int) -> str | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None  # a hint only: rebuilt at open
    if len(data) % OFFSET_ENTRY.size:
        return f"size {len(data)} is not a multiple of {OFFSET_ENTRY.size}"
    base = int(path.name[:20])
    previous = (-1, -1)
    for i, (relative, position) in enumerate(OFFSET_ENTRY.iter_unpack(data)):
        if relative <= previous[0] or position <= previous[1] or position >= max(size, 1):
            return f"entry {i} ({base + relative}, {position}) out of order or past the log"
        if starts.get(position, -2) not in (base + relative, -1):
            return f"entry {i} ({base + relative}, {position}) points at no batch with that offset"
        previous = (relative, position)
    return None


def _check_timeindex(
    path: Path, last_offsets: dict[int, int], ranges: list[DamagedRange]
) -> str | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) % TIME_ENTRY.size:
        return f"size {len(data)} is not a multiple of {TIME_ENTRY.size}"
    base = int(path.name[:20])
    previous = (-1, -1)
    for i, (timestamp, relative) in enumerate(TIME_ENTRY.iter_unpack(data)):
        offset = base + relative
        if (timestamp, relative) < previous:
            return f"entry {i} ({timestamp}, {offset}) goes backwards"
        lost = any(
            r.first_offset <= offset and (r.last_offset < 0 or offset <= r.last_offset)
            for r in ranges
        )
        if not lost and last_offsets.get(offset) != timestamp:
            return f"entry {i} ({timestamp}, {offset}) names no batch end with that timestamp"
        previous = (timestamp, relative)
    return None


def verify_data_dir(data_dir: Path) -> list[tuple[Path, list[SegmentCheck]]]:
    """:func:`verify_segment` for every segment of every partition under ``data_dir``."""
    return [
        (
            directory,
            [
                verify_segment(directory / f"{b:020d}{LOG_SUFFIX}", b, active=b == bases[-1])
                for b in bases
            ],
        )
        for directory in partitions(data_dir)
        for bases in [segment_bases(directory)]
    ]


def findings(check: SegmentCheck) -> list[Finding]:
    """The problems of one segment as table rows."""
    stream, partition = check.log_path.parent.parent.name, check.log_path.parent.name
    rows = [
        Finding(stream, partition, check.log_path, damage.reason, damage) for damage in check.ranges
    ]
    for suffix, problem in (
        (INDEX_SUFFIX, check.index_problem),
        (TIMEINDEX_SUFFIX, check.timeindex_problem),
    ):
        if problem is not None:
            path = check.log_path.with_name(check.log_path.name[:20] + suffix)
            rows.append(Finding(stream, partition, path, problem, None))
    return rows


def repair(check: SegmentCheck, config: LogConfig | None = None) -> list[str]:
    """Fix one damaged segment (the broker stopped); returns what was done, one line each.

    Damaged ``.log``: the original is moved to ``quarantine/`` (never deleted) and replaced by
    its intact batches; both indexes are rebuilt (a wrong index alone: rebuilt).
    """
    config = config or LogConfig()
    done: list[str] = []
    directory = check.log_path.parent
    base = check.base_offset
    if check.ranges:
        quarantine = directory / QUARANTINE_DIR
        quarantine.mkdir(exist_ok=True)
        kept = quarantine / check.log_path.name
        if kept.exists():
            kept = quarantine / f"{check.log_path.name}.{os.getpid()}"
        os.rename(check.log_path, kept)
        _copy_intact(kept, check.log_path, base)
        lost = ", ".join(r.offsets() for r in check.ranges)
        done.append(f"moved {check.log_path.name} to {kept}; kept its intact batches (lost {lost})")
    for suffix in (INDEX_SUFFIX, TIMEINDEX_SUFFIX):
        (directory / f"{base:020d}{suffix}").unlink(missing_ok=True)
    segment, _truncated = Segment.open(directory, base, config, 0, recover=True)
    try:
        segment.persist_indexes(fsync=True)
    finally:
        segment.close()
    done.append(f"rebuilt {base:020d}{INDEX_SUFFIX} and {base:020d}{TIMEINDEX_SUFFIX}")
    return done


def _copy_intact(source: Path, target: Path, base_offset: int) -> None:
    """Write ``target`` with the intact batches of ``source``, in order, and fsync it."""
    fd = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        size = os.fstat(fd).st_size
        for item in walk(fd, source, 0, size, base_offset):
            if item is None or isinstance(item, DamagedRange):
                continue
            buf, rel, _at, _next = item
            length = BATCH_HEADER.unpack_from(buf, rel)[1]
            os.write(out, buf[rel : rel + length])
        os.fsync(out)
    finally:
        os.close(fd)
        os.close(out)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


__all__ = [
    "CorruptIndex",
    "Finding",
    "SegmentCheck",
    "findings",
    "partitions",
    "repair",
    "segment_bases",
    "verify_data_dir",
    "verify_segment",
]
