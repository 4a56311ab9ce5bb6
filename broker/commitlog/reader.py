"""A read-only view of a partition log that another process writes (a follower reader).

With several workers, each partition has one owning process that appends to it
(:class:`~broker.commitlog.log.SegmentedLog`); the others read the same files to feed their
subscribers: a subscriber on another core is fed from the log the owner wrote, after the
owner announces the new high-water mark. This view never writes, never recovers and never
trusts more of a file than the owner announced:

* the owner tells the reader its high-water mark (:meth:`LogReader.advance`) only after the
  ``write()`` of the batches below it returned, so every batch whose base offset is below the
  announced :attr:`end_offset` is complete in the page cache; a reader stops where the next
  batch's offset (one past the previous batch's) is at or past it (the bytes there may still
  be in the middle of their write); a batch before that point is judged as the owner judges
  it, so a header damaged into a base offset past the mark is damage, not a write;
* segments appear (roll) and disappear (retention, compaction's swap) under it: the directory
  is listed again when an offset is not in the segments known, and a descriptor that was open
  keeps reading the file it opened (a deleted segment stays readable until closed), unless
  another file took its name (a replicated partition's copy set aside and made anew);
* positions are found through an in-memory sparse index the reader builds as it scans
  (the owner's ``.index`` files are rewritten only on flush and may lag).

Called from one thread (its worker's event loop).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Sized
from pathlib import Path
from typing import TypeVar

from broker.commitlog import integrity
from broker.commitlog.batch import (
    BATCH_HEADER,
    BATCH_HEADER_SIZE,
    MIN_BATCH_SIZE,
    Decoder,
    decode_into,
)
from broker.commitlog.columns import ColumnRead, decode_columns_into
from broker.commitlog.config import LogConfig
from broker.commitlog.errors import CorruptRecordBatch, LogIOError, OffsetOutOfRange
from broker.commitlog.integrity import (
    DECODE_ERRORS,
    DamagedRange,
    SegmentScan,
    crc_ok,
    quarantined,
    read_verified,
    report,
    report_gap,
    scan_segment,
    walk,
)
from broker.commitlog.record import Record
from broker.commitlog.segment import LOG_SUFFIX, READ_CHUNK_MIN

#: Bytes scanned between two entries of the reader's own index.
INDEX_INTERVAL = 64 << 10
#: Bytes per record assumed when sizing a read (a 64-byte telemetry record takes ~110).
AVERAGE_RECORD = 256

_Out = TypeVar("_Out", bound=Sized)


class _SegmentView:
    """One ``.log`` file opened read-only, with the positions of the batches seen so far.

    Every batch decoded is verified first (CRC, :func:`~broker.commitlog.integrity.crc_ok`);
    after damage is met, the file is read by verified walks
    (:func:`~broker.commitlog.integrity.read_verified`) as the owner's segment is.
    """

    __slots__ = ("base", "fd", "gap_checked", "offsets", "path", "positions", "scan")

    def __init__(self, path: Path, base: int) -> None:
        self.path = path
        self.base = base
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.offsets = [base]  # batch base offsets, every INDEX_INTERVAL bytes
        self.positions = [0]
        self.scan: SegmentScan | None = None
        self.gap_checked = False

    def current(self) -> bool:
        """Whether the file open here is still the one at its path: a replicated partition
        whose copy was set aside (its directory renamed, a new one made in its place,
        ``Streams.set_aside``) has new files of the same names, which this one never sees."""
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self.fd)
        return (at_path.st_ino, at_path.st_dev) == (mine.st_ino, mine.st_dev)

    def read_into(
        self,
        out: _Out,
        offset: int,
        end: int,
        max_records: int,
        max_bytes: int,
        decode: Decoder[_Out],
        stop_on_damage: bool = False,
    ) -> tuple[int, bool]:
        """Like :meth:`Segment.read_into`, bounded by the announced ``end`` offset.

        Returns the byte budget left and whether the read is over (a limit, or ``end``,
        was reached); False means the file ended first and the next segment follows.
        """
        if self.scan is not None:
            return self._read_damaged(
                out, offset, end, max_records, max_bytes, decode, stop_on_damage
            )
        resume = offset
        try:
            return self._read_into(out, offset, end, max_records, max_bytes, decode, resume)
        except CorruptRecordBatch as exc:
            if not integrity.verify_reads:
                raise
            resume = max(offset, exc.first_offset)
            return self._read_damaged(
                out, resume, end, max_records, max_bytes, decode, stop_on_damage
            )

    def _read_damaged(
        self,
        out: _Out,
        offset: int,
        end: int,
        max_records: int,
        max_bytes: int,
        decode: Decoder[_Out],
        stop_on_damage: bool,
    ) -> tuple[int, bool]:
        size = os.fstat(self.fd).st_size
        if self.scan is None:
            self.scan = scan_segment(self.fd, self.path, self.base, size, end)
        return read_verified(
            self.fd,
            self.path,
            self.scan,
            size,
            out,
            offset,
            max_records,
            max_bytes,
            decode,
            stop_on_damage,
            end,
        )

    def _read_into(
        self,
        out: _Out,
        offset: int,
        end: int,
        max_records: int,
        max_bytes: int,
        decode: Decoder[_Out],
        resume: int,
    ) -> tuple[int, bool]:
        """The fast read: raises :class:`CorruptRecordBatch` (its ``first_offset`` the
        first offset not read yet) at the first batch that fails."""
        check = integrity.verify_reads
        # An offset below this segment's base (a read that began in an earlier segment)
        # starts at the segment's first batch, not at positions[-1]: that is where the last
        # read left the sparse index, and every record before it would be skipped.
        i = max(0, bisect_right(self.offsets, offset) - 1)
        pos = self.positions[i]
        # The offset the batch at ``pos`` starts at (or after, where compaction left a gap).
        # Below the mark it is a complete batch, whatever its header says: only at the mark
        # may the bytes here be a write in progress.
        expected = self.offsets[i]
        last_indexed = pos
        want = max(READ_CHUNK_MIN, min(2 * max_bytes, max_records * AVERAGE_RECORD))
        while True:
            buf = os.pread(self.fd, want, pos)
            p, n = 0, len(buf)
            while n - p >= BATCH_HEADER_SIZE:
                if expected >= end:
                    return max_bytes, True  # at the mark: maybe still being written
                base, length, _m, _a, _r, _e, last_delta = BATCH_HEADER.unpack_from(buf, p)[:7]
                if length < MIN_BATCH_SIZE:
                    raise _corrupt(f"batch length {length} too small", pos + p, self.path, resume)
                if length > n - p:
                    if p:
                        break  # read again from this batch
                    buf = os.pread(self.fd, length, pos)
                    n = len(buf)
                    if n < length:
                        raise _corrupt(
                            f"short read: {n} of {length} bytes of a "
                            "batch below the high-water mark",
                            pos,
                            self.path,
                            resume,
                        )
                    continue
                # Verified before its header is believed, skipped or not (see Segment): a
                # damaged base offset read as one past the mark must not end the read.
                if check and not crc_ok(buf, p, length):
                    raise _corrupt("CRC mismatch", pos + p, self.path, resume)
                if base >= end:
                    return max_bytes, True  # past the mark, after a compaction gap
                if pos + p - last_indexed >= INDEX_INTERVAL and base > self.offsets[-1]:
                    self.offsets.append(base)
                    self.positions.append(pos + p)
                    last_indexed = pos + p
                expected = base + last_delta + 1
                if expected > offset:
                    try:
                        max_bytes, stop = decode(buf, p, out, offset, max_records, max_bytes)
                    except DECODE_ERRORS as exc:
                        raise _corrupt(
                            f"undecodable batch: {exc}", pos + p, self.path, resume
                        ) from None
                    resume = expected
                    if stop >= 0 or len(out) >= max_records or max_bytes <= 0:
                        return max_bytes, True
                p += length
            if p == 0:
                if expected >= end:
                    return max_bytes, True
                if n:
                    raise _corrupt(f"torn batch header ({n} bytes)", pos, self.path, resume)
                return max_bytes, False  # end of the file: the next segment follows
            pos += p

    def check_gap(self, next_base: int) -> None:
        """A read passes from this segment, sealed, to the next one (base ``next_base``):
        report the offsets missing between them as the owner does when it opens the log
        (:func:`~broker.commitlog.integrity.report_gap`: a file cut short at a batch end),
        unless a damaged tail already covers them or ``mqlog verify --repair`` left the gap.
        Once per segment: the batches from the last known position are walked, verified."""
        if self.gap_checked:
            return
        self.gap_checked = True
        if quarantined(self.path.parent, self.base):
            return
        size = os.fstat(self.fd).st_size
        if self.scan is not None:
            pos, next_offset = self.scan.positions[-1], self.scan.bases[-1]
        else:
            pos, next_offset = self.positions[-1], self.offsets[-1]
        for item in walk(self.fd, self.path, pos, size, next_offset):
            if isinstance(item, DamagedRange):
                report(item)
                if item.last_offset < 0:
                    return  # a damaged tail: the range runs to the next segment's base
                next_offset = item.last_offset + 1
            elif item is not None:
                next_offset = item[3]
        if next_offset < next_base:
            report_gap(self.path, size, next_offset, next_base)

    def close(self) -> None:
        os.close(self.fd)


def _corrupt(reason: str, position: int, path: Path, resume: int) -> CorruptRecordBatch:
    exc = CorruptRecordBatch(reason, position, path)
    exc.first_offset = resume
    return exc


class LogReader:
    """Read-only :class:`SegmentedLog` look-alike for a log owned by another process.

    Offers what a subscriber's reads need: :meth:`read` (and :meth:`read_columns` for the
    fetch API), :attr:`end_offset` (the announced
    high-water mark), :attr:`log_start_offset`, :meth:`offset_for_time`. ``config`` is the
    stream's (callers look at its fsync policy); nothing here writes.
    """

    def __init__(self, directory: Path, config: LogConfig, end_offset: int = 0) -> None:
        self.directory = Path(directory)
        self.config = config
        self._end = end_offset
        self._segments: list[_SegmentView] = []
        self._bases: list[int] = []
        self._refresh()

    @property
    def end_offset(self) -> int:
        """The owner's last announced high-water mark: every offset below it is readable."""
        return self._end

    @property
    def log_start_offset(self) -> int:
        """Earliest offset still on disk (as of the last directory listing)."""
        return self._bases[0] if self._bases else self._end

    def advance(self, end_offset: int, start_offset: int | None = None) -> None:
        """The owner announced its high-water mark (marks only move forward) and, when
        given, its earliest retained offset: segments retention deleted are let go; the
        first segment is found once the mark passes its start (:attr:`log_start_offset`)."""
        if end_offset > self._end:
            self._end = end_offset
        if (start_offset is not None and self._bases and start_offset > self._bases[0]) or (
            not self._bases and self._end > 0
        ):
            self._refresh()

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list[Record]:
        """Records from ``offset`` below :attr:`end_offset`, as :meth:`SegmentedLog.read`.

        Raises :class:`OffsetOutOfRange` below the earliest retained offset or past the mark.
        """
        out: list[Record] = self._read(offset, max_records, max_bytes, [], decode_into)
        # A mark learnt from a peer (committed_through) may fall inside a batch; the owner's
        # announced marks (all read_columns sees) are at batch ends.
        end = self._end
        while out and out[-1].offset >= end:
            out.pop()
        return out

    def read_columns(
        self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20
    ) -> ColumnRead:
        """The records :meth:`read` returns, as columns (:meth:`SegmentedLog.read_columns`)."""
        return self._read(offset, max_records, max_bytes, ColumnRead(), decode_columns_into)

    def _read(
        self, offset: int, max_records: int, max_bytes: int, out: _Out, decode: Decoder[_Out]
    ) -> _Out:
        end = self._end
        if offset > end:
            raise OffsetOutOfRange(offset, self.log_start_offset, end)
        if offset == end or max_records <= 0:
            return out
        if not self._bases or offset < self._bases[0]:
            self._refresh()  # retention may have moved the start; or the first segment is new
            if not self._bases or offset < self._bases[0]:
                raise OffsetOutOfRange(offset, self.log_start_offset, end)
        i = bisect_right(self._bases, offset) - 1
        stop_on_damage = self.config.on_corruption == "stop"
        # Compaction leaves gaps between segments; elsewhere a gap is a file cut short.
        check_gaps = integrity.verify_reads and not self.config.compacted
        try:
            while True:
                max_bytes, done = self._segments[i].read_into(
                    out, offset, end, max_records, max_bytes, decode, stop_on_damage
                )
                if done:
                    break
                if i == len(self._segments) - 1:
                    # The owner rolled: the next segment is new to us (and retention may have
                    # dropped older ones, so find our place again by base offset).
                    base, view = self._bases[i], self._segments[i]
                    self._refresh()
                    i = bisect_right(self._bases, base) - 1
                    if 0 <= i < len(self._segments) and self._segments[i] is not view and not out:
                        continue  # another file took that name (a copy made anew): read it
                    if i == len(self._segments) - 1:
                        break
                if check_gaps:
                    self._segments[i].check_gap(self._bases[i + 1])
                i += 1
        except OSError as exc:
            raise LogIOError(self._segments[i].path, "read segment", exc) from exc
        return out

    def offset_for_time(self, timestamp_ms: int) -> int:
        """First offset whose timestamp is >= ``timestamp_ms``, else :attr:`end_offset`
        (a scan: used when a ``$replay/time:...`` subscription starts)."""
        offset = self.log_start_offset
        while offset < self._end:
            try:
                records = self.read(offset, max_records=4096)
            except CorruptRecordBatch as exc:
                return max(offset, exc.first_offset)  # held there (on_corruption = "stop")
            if not records:
                break
            for record in records:
                if record.timestamp >= timestamp_ms:
                    return record.offset
            offset = records[-1].offset + 1
        return self._end

    def _refresh(self) -> None:
        """List the directory again: open new segments, close deleted ones.

        Only segments that start below the announced mark: one that starts at or past it
        holds nothing committed yet, and a replicated log may delete it (a Raft follower
        cutting an uncommitted suffix) and roll another file of the same name later, which
        a descriptor opened now would never see."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            names = []
        except OSError as exc:
            raise LogIOError(self.directory, "list log directory", exc) from exc
        end = self._end
        bases = sorted(
            base
            for base in (
                int(name[: -len(LOG_SUFFIX)])
                for name in names
                if name.endswith(LOG_SUFFIX) and name[: -len(LOG_SUFFIX)].isdigit()
            )
            if base < end
        )
        known = {view.base: view for view in self._segments}
        views: list[_SegmentView] = []
        for base in bases:
            view = known.pop(base, None)
            if view is not None and not view.current():
                view.close()  # the directory was swapped under it (a replica set aside)
                view = None
            if view is None:
                try:
                    view = _SegmentView(self.directory / f"{base:020d}{LOG_SUFFIX}", base)
                except FileNotFoundError:
                    continue  # deleted between the listing and the open
                except OSError as exc:
                    raise LogIOError(self.directory, "open segment", exc) from exc
            views.append(view)
        for view in known.values():
            view.close()
        self._segments = views
        self._bases = [view.base for view in views]

    def close(self) -> None:
        for view in self._segments:
            view.close()
        self._segments = []
        self._bases = []
