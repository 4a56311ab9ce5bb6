"""What a replicated partition log needs beyond append and read (Kafka's follower-side log
operations), mixed into :class:`~broker.commitlog.log.SegmentedLog`:

* :meth:`ReplicaOps.append_raw`: append a batch encoded by another process (a Raft leader)
  byte for byte, so every replica stores the same bytes and the leader's epoch in them;
* :meth:`ReplicaOps.read_batches`: the stored batches, byte for byte, to send to a replica
  (never a damaged one);
* :meth:`ReplicaOps.rewrite`: a damaged range replaced in place by another replica's copies
  of its batches (:mod:`broker.commitlog.rewrite`);
* :meth:`ReplicaOps.truncate`: drop a suffix from a batch boundary on, never below a floor
  (the replicas' commit point);
* :meth:`ReplicaOps.set_high_watermark`: pin what readers see (``SegmentedLog.read`` and
  ``read_columns`` stop there);
* :meth:`ReplicaOps.reset`: replace the whole log by an empty one starting at a given offset
  (a replica that installed a snapshot: what came before is gone everywhere);
* :meth:`ReplicaOps.epoch_runs`: the (first offset, leader epoch) runs of the log, rebuilt from
  the batch headers (Kafka's leader-epoch cache).

The log stays ignorant of the protocol: it stores the epoch each batch carries and the control
batches the replication layer writes (:mod:`broker.commitlog.batch`), nothing else.

Threads: the owner's loop thread, like ``append``; :meth:`truncate` and :meth:`reset` also take
the cleaner lock (they delete and reopen segments).
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from broker.commitlog import integrity
from broker.commitlog.batch import BATCH_HEADER, BATCH_HEADER_SIZE, read_header, validate_batch
from broker.commitlog.cleaned import swap_in, write_segment
from broker.commitlog.config import LogConfig
from broker.commitlog.disk import fsync_data, fsync_directory
from broker.commitlog.errors import (
    CommitLogError,
    CorruptRecordBatch,
    LogIOError,
    OffsetOutOfRange,
    RewriteRefused,
)
from broker.commitlog.index import OffsetIndex, TimeIndex
from broker.commitlog.integrity import DamagedRange
from broker.commitlog.rewrite import (
    check_batches,
    range_offsets,
    resized_batches,
    rewrite_range,
    verified_batches,
)
from broker.commitlog.segment import CLEANED_SUFFIX, Segment


class ReplicaOps:
    """The replicated-log operations of :class:`~broker.commitlog.log.SegmentedLog` (module
    doc); its state is the log's."""

    if TYPE_CHECKING:
        directory: Path
        config: LogConfig
        _segments: list[Segment]
        _bases: list[int]
        _lock: threading.Lock
        _cleaner_lock: threading.Lock
        _fsync_always: bool
        _rolled: list[Segment]
        _compacted_state: tuple[int, int]
        _visible_end: int | None
        _closed: bool

        def _check_open(self) -> None: ...
        def _now_ms(self) -> int: ...
        def _roll_locked(self, now_ms: int) -> None: ...
        def _write_locked(
            self, batch: bytes | bytearray, next_offset: int, sync: bool = True
        ) -> None: ...

    def append_raw(self, batch: bytes, *, defer_fsync: bool = False) -> int:
        """Append ``batch``, encoded elsewhere, as it is (one ``write()``); return its base
        offset, which must be the log end offset. ``defer_fsync``: not fsynced here even
        under ``fsync = "always"``; it is durable once the caller's next :meth:`flush`
        returns (a Raft group's driver: one fsync per round for every entry the round
        appended, after the round's messages left).

        The batch is checked as recovery checks one (CRC, structure, magic) before anything is
        written. Raises :class:`CorruptRecordBatch` for bad bytes, :class:`CommitLogError` for
        another base offset, :class:`LogIOError` as ``append``; the log is unchanged on error.
        """
        with self._lock:
            self._check_open()
            active = self._segments[-1]
            base = active.next_offset
            h = validate_batch(batch, 0, 0, path=self.directory, position=0)
            if h.batch_length != len(batch):
                raise CorruptRecordBatch(
                    f"{len(batch) - h.batch_length} bytes after the batch", 0, self.directory
                )
            if h.base_offset != base:
                raise CommitLogError(
                    f"{self.directory}: a batch with base offset {h.base_offset} cannot be "
                    f"appended at the log end offset {base}"
                )
            self._write_locked(batch, h.next_offset, sync=not defer_fsync)
            return base

    def read_batches(self, offset: int, end: int, max_batches: int, max_bytes: int) -> list[bytes]:
        """The stored batches, byte for byte, from the one holding ``offset`` through the last
        one starting below ``end``; at most ``max_batches``, and none that would take the total
        past ``max_bytes`` (but at least one). Raises :class:`OffsetOutOfRange` unless
        ``log_start_offset <= offset < end_offset``. Control batches included.

        Every batch is verified. A damaged batch ends the read before it (reported, see
        :func:`~broker.commitlog.rewrite.verified_batches`); when the read would start in a
        damaged range, :class:`CorruptRecordBatch` with the range's offsets is raised."""
        with self._lock:
            self._check_open()
            segments = self._segments
            start, stop = segments[0].base_offset, segments[-1].next_offset
            if not start <= offset < stop:
                raise OffsetOutOfRange(offset, start, stop)
            out: list[bytes] = []
            for segment in segments[bisect_right(self._bases, offset) - 1 :]:
                pos = segment.offset_index.lookup(offset)[1]
                try:
                    if _take(segment.iter_batches(pos), offset, end, max_batches, max_bytes, out):
                        return out
                except CorruptRecordBatch:
                    resume = read_header(out[-1]).next_offset if out else offset
                    try:
                        batches = verified_batches(segment, max(offset, resume))
                        if _take(batches, offset, end, max_batches, max_bytes, out):
                            return out
                    except CorruptRecordBatch:
                        if out:
                            return out
                        raise
            return out

    def damaged_offsets(self, damage: DamagedRange) -> tuple[int, int] | None:
        """The offsets ``(first, last)`` that ``damage``, a range of one of this log's segments,
        covers; None when its segment is gone or it holds no offset
        (:func:`~broker.commitlog.rewrite.range_offsets`)."""
        with self._lock:
            self._check_open()
            found = range_offsets(self._segments, damage)
            return None if found is None else (found[1], found[2])

    def rewrite(self, damage: DamagedRange, batches: Sequence[bytes]) -> int:
        """Replace the damaged range ``damage`` of one of this log's segments by ``batches``,
        another replica's copies of its offsets, in place and durably
        (:func:`~broker.commitlog.rewrite.rewrite_range`); in a compacted log whose copies
        differ in length, a sealed segment is rewritten whole and swapped in, as compaction
        does (:func:`~broker.commitlog.rewrite.resized_batches`). Returns the number of
        batches written (0: the range held them already). Raises :class:`RewriteRefused`
        (nothing written: the batches do not fit the range, or the range is gone) or
        :class:`LogIOError`."""
        with self._cleaner_lock:
            with self._lock:
                self._check_open()
                found = range_offsets(self._segments, damage)
                if found is None:
                    raise RewriteRefused(
                        f"{damage.path}: bytes {damage.position}..{damage.end}: no such damaged "
                        "range in this log now"
                    )
                segment, first, last = found
                if (
                    sum(map(len, batches)) == damage.end - damage.position
                    or not self.config.compacted
                    or segment is self._segments[-1]
                ):
                    return rewrite_range(segment, damage, first, last, batches)
            # Written outside the log's lock (appends go on), under the cleaner's (nothing
            # else rewrites or deletes a sealed segment meanwhile).
            check_batches(damage, first, last, batches, exact_size=False)
            copy = write_segment(
                self.directory,
                segment.base_offset,
                self.config,
                resized_batches(segment, damage, batches),
                CLEANED_SUFFIX,
                fsync=True,
            )
            if copy.next_offset != segment.next_offset:
                copy.delete()
                raise RewriteRefused(
                    f"{damage.path}: the rewritten segment ends at offset {copy.next_offset}, "
                    f"the damaged one at {segment.next_offset}"
                )
            with self._lock:
                self._check_open()
                position = self._segments.index(segment)
                self._segments[position] = swap_in(segment, copy, self.directory, fsync=True)
            integrity.forget(damage.path, damage.position, damage.end)
            return len(batches)

    def set_high_watermark(self, offset: int) -> None:
        """Readers see only offsets below ``offset`` from now on (a replicated log's commit
        point, always a batch boundary). It never moves back; it may lead the end offset (a
        replica that has not caught up), readers then stop at the end."""
        if self._visible_end is not None and offset < self._visible_end:
            raise CommitLogError(
                f"{self.directory}: high-water mark {offset} below {self._visible_end}"
            )
        self._visible_end = offset

    def truncate(self, from_offset: int, floor: int) -> None:
        """Drop every offset from ``from_offset`` on (nothing when it is at or past the end).

        ``from_offset`` must be a batch's base offset, at or above ``floor`` (what the caller
        knows is committed ends there: a Raft log is never cut below its commit index) and
        above the high-water mark's offsets; else :class:`CommitLogError`, the log unchanged.
        Durable when it returns: later segments deleted newest first and the directory
        fsynced, then the segment holding ``from_offset`` cut and fsynced and its indexes
        rewritten; a crash in between leaves a prefix of the log as it was. An OS error
        raises :class:`LogIOError` and leaves the log to be reopened.
        """
        with self._cleaner_lock, self._lock:
            self._check_open()
            segments = self._segments
            bound = max(floor, self._visible_end or 0)
            if from_offset < bound:
                raise CommitLogError(
                    f"{self.directory}: refusing to truncate from offset {from_offset}, below "
                    f"the committed offsets (up to {bound})"
                )
            if from_offset >= segments[-1].next_offset:
                return
            if from_offset < segments[0].base_offset:
                raise OffsetOutOfRange(
                    from_offset, segments[0].base_offset, segments[-1].next_offset
                )
            i = bisect_right(self._bases, from_offset) - 1
            segment = segments[i]
            position = _batch_position(segment, from_offset)
            later = segments[i + 1 :]
            try:
                for victim in reversed(later):
                    victim.delete()
                if later:
                    fsync_directory(self.directory)
            except OSError as exc:
                raise LogIOError(self.directory, "delete truncated segments", exc) from exc
            del segments[i + 1 :]
            del self._bases[i + 1 :]
            self._rolled = [s for s in self._rolled if s in segments[:i]]
            segments[i] = _cut_segment(segment, position, from_offset, self._now_ms())
            self._compacted_state = (-1, -1)

    def reset(self, start_offset: int) -> None:
        """Drop every segment and start over, empty, at ``start_offset``: the log start and end
        offsets are both ``start_offset`` afterwards (an installed snapshot: the records before
        it are the snapshot's business). Refused (:class:`CommitLogError`, the log unchanged)
        below the high-water mark, whose offsets are committed.

        Durable when it returns: the old segments deleted newest first and the directory
        fsynced, then the new empty segment created and the directory fsynced again. A crash in
        between leaves a prefix of the old log, or an empty log at offset 0 (which ``open``
        creates): the caller records the new start first (durably) and resets again at open
        when the log ends before it. An OS error raises :class:`LogIOError` and leaves the log
        to be reopened."""
        with self._cleaner_lock, self._lock:
            self._check_open()
            if start_offset < 0:
                raise CommitLogError(f"{self.directory}: cannot start a log at {start_offset}")
            if self._visible_end is not None and start_offset < self._visible_end:
                raise CommitLogError(
                    f"{self.directory}: refusing to reset the log to offset {start_offset}, "
                    f"below the high-water mark {self._visible_end}"
                )
            old, self._segments, self._bases, self._rolled = self._segments, [], [], []
            try:
                for victim in reversed(old):
                    victim.delete()
                fsync_directory(self.directory)
                new = Segment.create(self.directory, start_offset, self.config, self._now_ms())
                fsync_directory(self.directory)
            except OSError as exc:
                self._closed = True
                raise LogIOError(self.directory, "reset log", exc) from exc
            except LogIOError:
                self._closed = True
                raise
            self._segments.append(new)
            self._bases.append(start_offset)
            self._compacted_state = (-1, -1)
            if self._visible_end is not None:
                self._visible_end = start_offset

    def epoch_runs(self) -> list[tuple[int, int]]:
        """``(first offset, leader epoch)`` of each run of batches of one epoch, ascending:
        the log's term table. Reads batch headers only, and of those few: epochs never
        decrease along a replicated log (Raft s5.3), so a segment (and any stretch of it
        between two offset-index entries) whose first and last batches share an epoch is one
        run; the others are split in two until a stretch is one index interval, scanned."""
        with self._lock:
            self._check_open()
            runs: list[tuple[int, int]] = []
            for segment in self._segments:
                if segment.size:
                    _segment_runs(segment, runs)
            return runs


def _take(
    batches: Iterable[tuple[bytes, int, int]],
    offset: int,
    end: int,
    max_batches: int,
    max_bytes: int,
    out: list[bytes],
) -> bool:
    """Add to ``out`` the batches of ``batches`` holding offsets at or past ``offset`` (see
    ``read_batches``); True when a limit or ``end`` ended the read."""
    total = sum(map(len, out))
    for buf, rel, _pos in batches:
        base, length, _m, _a, _r, _e, last_delta = BATCH_HEADER.unpack_from(buf, rel)[:7]
        if base + last_delta < offset:
            continue
        if base >= end or len(out) >= max_batches or (out and total + length > max_bytes):
            return True
        out.append(bytes(buf[rel : rel + length]))
        total += length
    return False


def _batch_position(segment: Segment, offset: int) -> int:
    """The file position of the batch of ``segment`` whose base offset is ``offset``; the
    segment's size when ``offset`` is past its last batch. Raises if ``offset`` is inside a
    batch. An index entry whose batch does not start at the offset it names (a damaged index)
    is not believed: the segment is walked from its start. The batch at ``offset`` itself may
    be damaged (a Raft truncation cuts a damaged uncommitted entry): it starts where the
    intact batch before it ends; a damaged batch before it raises."""
    named, start = segment.offset_index.lookup(offset)
    if start and _base_at(segment, start) != named:
        start = 0
    # Where the next batch starts and the base offset it must have (what the walk has read).
    at, expect = start, named if start else segment.base_offset
    try:
        for buf, rel, pos in segment.iter_batches(start):
            base, length, _m, _a, _r, _e, last_delta = BATCH_HEADER.unpack_from(buf, rel)[:7]
            if base >= offset:
                return pos
            if offset <= base + last_delta:
                raise CommitLogError(
                    f"{segment.log_path}: offset {offset} is inside the batch at {base}..."
                    f"{base + last_delta}: a log is cut between batches"
                )
            at, expect = pos + length, base + last_delta + 1
    except CorruptRecordBatch as exc:
        if exc.position == at and expect == offset:
            return at
        raise
    return segment.size


def _base_at(segment: Segment, position: int) -> int | None:
    """The base offset of the batch at ``position``; None when it is damaged."""
    try:
        for buf, rel, _pos in segment.iter_batches(position):
            return int(BATCH_HEADER.unpack_from(buf, rel)[0])
    except CorruptRecordBatch:
        return None
    return None


def _cut_segment(segment: Segment, position: int, next_offset: int, now_ms: int) -> Segment:
    """Cut ``segment`` at ``position`` (where the batch at ``next_offset`` started), keep its
    index entries below, and reopen it (the open checks the indexes against the file)."""
    offsets = OffsetIndex(segment.index_path, segment.base_offset)
    for offset, pos in segment.offset_index.entries():
        if pos < position:
            offsets.append(offset, pos)
    times = TimeIndex(segment.timeindex_path, segment.base_offset)
    for timestamp, offset in segment.time_index.entries():
        if offset < next_offset:
            times.maybe_append(timestamp, offset)
    rolling_base_ms = segment.rolling_base_ms
    segment.close()
    try:
        fd = os.open(segment.log_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            os.ftruncate(fd, position)
            fsync_data(fd)
        finally:
            os.close(fd)
        times.write(fsync=True)
        offsets.write(fsync=True)
    except OSError as exc:
        raise LogIOError(segment.log_path, "truncate segment", exc) from exc
    # Nothing is torn at a cut made here: a damaged batch the open meets below it is kept (for
    # its repair), never cut with the intact batches after it. When it is the last one, its
    # damaged header hides its offsets: they run to the cut's.
    cut, _ = Segment.open(
        segment.directory,
        segment.base_offset,
        segment.config,
        now_ms,
        recover=False,
        keep_damaged_tail=True,
    )
    if cut.damaged and cut.damaged[-1].end == position:
        cut.next_offset = next_offset
    cut.rolling_base_ms = rolling_base_ms
    return cut


def _segment_runs(segment: Segment, runs: list[tuple[int, int]]) -> None:
    """Add the epoch runs of ``segment`` (non-empty) to ``runs`` (see ``epoch_runs``)."""
    path = segment.log_path
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise LogIOError(path, "open segment", exc) from exc
    headers: dict[int, tuple[int, int, int]] = {}

    def header(pos: int) -> tuple[int, int, int]:
        """(base offset, length, epoch) of the batch at ``pos``."""
        found = headers.get(pos)
        if found is None:
            raw = os.pread(fd, BATCH_HEADER_SIZE, pos)
            if len(raw) < BATCH_HEADER_SIZE:
                raise CorruptRecordBatch("short read of a batch header", pos, path)
            base, length, _m, _a, _r, epoch = BATCH_HEADER.unpack_from(raw)[:6]
            found = headers[pos] = (base, length, epoch)
        return found

    def walk(pos: int, stop: int) -> None:
        """Add the runs starting at the batches after the one at ``pos`` through the one at
        ``stop`` (a later batch's position)."""
        while pos < stop:
            pos += header(pos)[1]
            base, _length, epoch = header(pos)
            if epoch != runs[-1][1]:
                runs.append((base, epoch))

    def split(i: int, j: int) -> None:
        if header(marks[i])[2] == header(marks[j])[2]:
            return  # one epoch from the one batch to the other: epochs never decrease
        if j == i + 1:
            walk(marks[i], marks[j])
            return
        middle = (i + j) // 2
        split(i, middle)
        split(middle, j)

    try:
        marks = [0] + [pos for _offset, pos in segment.offset_index.entries() if pos > 0]
        # The last batch: the last index entry is at most an index interval before it.
        last_batch = marks[-1]
        while last_batch + header(last_batch)[1] < segment.size:
            last_batch += header(last_batch)[1]
        if last_batch != marks[-1]:
            marks.append(last_batch)
        base, _length, epoch = header(0)
        if not runs or runs[-1][1] != epoch:
            runs.append((base, epoch))
        split(0, len(marks) - 1)
    except OSError as exc:
        raise LogIOError(path, "scan batch headers", exc) from exc
    finally:
        os.close(fd)
