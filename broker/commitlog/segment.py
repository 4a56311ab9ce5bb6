"""One log segment: ``<base>.log`` plus its sparse ``.index`` and ``.timeindex`` (Kafka's
``LogSegment``).

Files are named by the segment's base offset, zero-padded to 20 digits. The ``.log`` file is a
sequence of record batches (:mod:`broker.commitlog.batch`); ``size`` bytes of it are valid and
immutable once written. Invariants:

* batches are contiguous from position 0 to ``size``; base offsets strictly increase, the first
  is >= ``base_offset``, and ``next_offset`` is the last batch's (one past its last offset
  delta, which may lie past its last record after compaction; ``base_offset`` when empty);
  compaction may leave gaps between offsets, never reorders them;
* ``max_timestamp`` is the largest of its batches' (a placeholder's too; -1 when empty);
* an index entry is added before a batch once more than ``index_interval_bytes`` were appended
  since the previous entry, so rebuilding an index from the ``.log`` yields the same entries;
* only the log's active (last) segment is appended to; one ``append`` (of one batch or several
  consecutive ones) is one ``write()`` on a file descriptor opened with ``O_APPEND``; a failed
  append truncates the file back to its previous size before the error propagates.

With fsync=interval, every ``WRITEBACK_BYTES`` appended start their disk write at once
(Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait), so the interval's
fdatasync finds little left to write instead of the whole interval's data. A hint only: the
durability point is still the fdatasync of :meth:`flush`.

Reads use ``os.pread`` on the same cached descriptor (no shared file position) and keep the last
buffer read, so a sequential consumer costs one syscall per chunk, not per record or batch.

Threads: a segment is guarded by its :class:`~broker.commitlog.log.SegmentedLog`'s lock.
Closed segments are immutable, so the cleaner thread may scan them without the lock while the
owner's loop appends to the active segment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import TypeVar

from broker.commitlog import integrity, recovery
from broker.commitlog.batch import (
    BATCH_HEADER,
    BATCH_HEADER_SIZE,
    MIN_BATCH_SIZE,
    Decoder,
    decode_batch,
    read_header,
    validate_batch,
)
from broker.commitlog.config import LogConfig
from broker.commitlog.disk import SYNC_FILE_RANGE_WRITE as _SYNC_FILE_RANGE_WRITE
from broker.commitlog.disk import fsync_data as _fsync_data
from broker.commitlog.disk import sync_file_range as _sync_file_range
from broker.commitlog.errors import CorruptIndex, CorruptRecordBatch, LogIOError
from broker.commitlog.index import OffsetIndex, TimeIndex
from broker.commitlog.integrity import DECODE_ERRORS, DamagedRange, SegmentScan, crc_ok
from broker.commitlog.record import Record

logger = logging.getLogger("broker.commitlog")

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
TIMEINDEX_SUFFIX = ".timeindex"
#: Suffix of the files a compaction writes before swapping them in.
CLEANED_SUFFIX = ".cleaned"
#: Suffix of index files being written (see :func:`broker.commitlog.index._write_atomically`).
TMP_SUFFIX = ".tmp"

#: Smallest ``pread`` of a read (bytes); larger reads are sized from the request's limits.
READ_CHUNK_MIN = 16 * 1024
#: ``pread`` size of recovery scans and cleaner scans (bytes).
SCAN_CHUNK = 1 << 20

_Out = TypeVar("_Out", bound=Sized)

_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)


def file_name(base_offset: int, suffix: str) -> str:
    """``00000000000000000042.log`` for base offset 42 and suffix ``.log``."""
    return f"{base_offset:020d}{suffix}"


#: fsync=interval: start the disk write of every this many appended bytes right away, so the
#: interval's fdatasync waits for the last ones only (RocksDB's ``bytes_per_sync``).
WRITEBACK_BYTES = 1 << 20


class Segment:
    """A segment of a partition log; see the module docstring for invariants."""

    __slots__ = (
        "_broken",
        "_bytes_since_index",
        "_cache_buf",
        "_cache_pos",
        "_damage_scan",
        "_dirty",
        "_fd",
        "_hint_offset",
        "_hint_pos",
        "_verified_from",
        "_verified_to",
        "_writeback_from",
        "base_offset",
        "config",
        "damaged",
        "directory",
        "index_path",
        "log_path",
        "max_timestamp",
        "next_offset",
        "offset_index",
        "rolling_base_ms",
        "size",
        "time_index",
        "timeindex_path",
    )

    def __init__(
        self,
        directory: Path,
        base_offset: int,
        config: LogConfig,
        fd: int,
        size: int,
        rolling_base_ms: int,
    ) -> None:
        self.directory = directory
        self.base_offset = base_offset
        self.config = config
        self.log_path = directory / file_name(base_offset, LOG_SUFFIX)
        self.index_path = directory / file_name(base_offset, INDEX_SUFFIX)
        self.timeindex_path = directory / file_name(base_offset, TIMEINDEX_SUFFIX)
        self._fd = fd
        self.size = size
        self.next_offset = base_offset
        self.max_timestamp = -1
        #: Wall-clock ms the segment_ms roll deadline counts from: the first append to a new
        #: segment, the open of a reopened one. Never a record timestamp: records may carry
        #: any clock (replayed or imported data, devices), and a restart alone must not roll
        #: (test_log.py: test_reopened_segment_counts_segment_ms_from_the_open). A reopened
        #: segment thus gets a fresh segment_ms.
        self.rolling_base_ms = rolling_base_ms
        self.offset_index = OffsetIndex(self.index_path, base_offset)
        self.time_index = TimeIndex(self.timeindex_path, base_offset)
        self._bytes_since_index = 0
        self._writeback_from = size
        self._dirty = False
        self._broken: OSError | None = None
        self._hint_offset = -1
        self._hint_pos = 0
        self._cache_buf = b""
        self._cache_pos = 0
        #: Batches ``[_verified_from, _verified_to)`` of the cached buffer passed their CRC.
        self._verified_from = self._verified_to = 0
        #: The verifying scan of this segment, made when a read first met damage in it.
        self._damage_scan: SegmentScan | None = None
        #: Damaged ranges recovery found and kept (intact batches follow them); see
        #: :meth:`recover`.
        self.damaged: list[DamagedRange] = []

    # ----------------------------------------------------------------- open / create
    @classmethod
    def create(cls, directory: Path, base_offset: int, config: LogConfig, now_ms: int) -> Segment:
        """Create an empty segment; raises :class:`LogIOError` (e.g. EACCES, ENOSPC, EEXIST)."""
        path = directory / file_name(base_offset, LOG_SUFFIX)
        try:
            fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise LogIOError(path, "create segment", exc) from exc
        return cls(directory, base_offset, config, fd, 0, now_ms)

    @classmethod
    def open(
        cls,
        directory: Path,
        base_offset: int,
        config: LogConfig,
        now_ms: int,
        *,
        recover: bool,
        keep_damaged_tail: bool = False,
    ) -> tuple[Segment, int]:
        """Open an existing segment; return it and the number of bytes recovery truncated.

        With ``recover`` the whole ``.log`` is scanned and both indexes rebuilt. Otherwise the
        indexes are loaded and checked (sanity check plus a scan of the batches after the last
        index entry, CRCs verified); any inconsistency falls back to a full recovery.
        ``keep_damaged_tail`` (after a clean shutdown, when no tail can be torn): see
        :meth:`recover`. Raises :class:`LogIOError` or
        :class:`~broker.commitlog.errors.UnsupportedFormat`.
        """
        path = directory / file_name(base_offset, LOG_SUFFIX)
        try:
            fd = os.open(path, _OPEN_FLAGS)
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise LogIOError(path, "open segment", exc) from exc
        seg = cls(directory, base_offset, config, fd, size, now_ms)
        try:
            if not recover:
                try:
                    seg._load_indexes()
                    return seg, 0
                except (CorruptIndex, CorruptRecordBatch, FileNotFoundError) as exc:
                    logger.info("%s: rebuilding indexes: %s", path, exc)
            truncated = seg.recover(keep_damaged_tail=keep_damaged_tail)
        except OSError as exc:
            seg.close()
            raise LogIOError(path, "recover segment", exc) from exc
        except BaseException:
            seg.close()
            raise
        return seg, truncated

    def _load_indexes(self) -> None:
        """Load both indexes and verify the batches after the last offset-index entry."""
        recovery.load_indexes(self)

    def recover(self, *, keep_damaged_tail: bool = False) -> int:
        """Scan the whole ``.log``, rebuild the indexes, truncate a torn tail, keep damage
        followed by intact batches (:func:`broker.commitlog.recovery.recover`); returns the
        number of bytes truncated."""
        return recovery.recover(self, keep_damaged_tail=keep_damaged_tail)

    # ----------------------------------------------------------------------- append
    def append(self, batches: bytearray | bytes, *, fsync: bool) -> None:
        """Append one encoded batch, or several consecutive ones (each indexed as if
        appended alone), with one ``write()``; fdatasync them when ``fsync``.

        On an OS error the file is truncated back to its previous size and
        :class:`LogIOError` is raised; the segment's state is unchanged.
        """
        if self._broken is not None:
            raise LogIOError(
                self.log_path,
                "append to segment (a failed append could not be "
                "rolled back; reopen the log to recover)",
                self._broken,
            )
        pos = self.size
        length = len(batches)
        fd = self._fd
        try:
            written = os.write(fd, batches)
            if written != length:
                view = memoryview(batches)
                while written < length:
                    written += os.write(fd, view[written:])
            if fsync:
                _fsync_data(fd)
        except OSError as exc:
            self._roll_back(pos, exc)
            raise LogIOError(self.log_path, "append to segment", exc) from exc
        self.size = pos + length
        at = 0
        while at < length:
            (base, size, _m, _a, _r, _e, lod, _c, _ft, max_ts, _crc) = BATCH_HEADER.unpack_from(
                batches, at
            )
            self._index_batch(base, base + lod, max_ts, pos + at, size)
            at += size
        self.next_offset = base + lod + 1
        if not fsync:
            self._dirty = True
            if (
                self.size - self._writeback_from >= WRITEBACK_BYTES
                and self.config.fsync == "interval"
            ):
                self.start_writeback()

    def start_writeback(self) -> None:
        """Start the disk write of the appends since the last hint or flush, without waiting
        for it. A hint, never an error: the durability point stays the fdatasync of
        :meth:`flush`."""
        start = self._writeback_from
        self._writeback_from = self.size
        if _sync_file_range is not None:
            _sync_file_range(self._fd, start, self.size - start, _SYNC_FILE_RANGE_WRITE)

    def _roll_back(self, size: int, cause: OSError) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError as exc:
            logger.error(
                "%s: cannot truncate back to %d bytes after a failed append (%s): "
                "segment refuses appends until the log is reopened",
                self.log_path,
                size,
                exc,
            )
            self._broken = cause

    def _index_batch(self, base: int, last: int, max_ts: int, pos: int, length: int) -> None:
        if max_ts > self.max_timestamp:
            self.max_timestamp = max_ts
        if self._bytes_since_index >= self.config.index_interval_bytes and (
            pos > 0 or not len(self.offset_index)
        ):
            self.offset_index.append(base, pos)
            self.time_index.maybe_append(self.max_timestamp, last)
            self._bytes_since_index = 0
        self._bytes_since_index += length

    # ------------------------------------------------------------------------ reads
    def read_into(
        self, out: _Out, offset: int, max_records: int, max_bytes: int, decode: Decoder[_Out]
    ) -> tuple[int, bool]:
        """Add records with offset >= ``offset`` to ``out`` within the limits, each batch
        by ``decode`` (:func:`~broker.commitlog.batch.decode_into` for records,
        :mod:`~broker.commitlog.columns` for columns).

        Returns the remaining byte budget and whether a limit stopped the read (False: the
        segment was read to its end). The read hot path: one ``pread`` per chunk.

        Each batch is verified (CRC) the first time it is decoded from the buffer read, the
        buffer's verified batches remembered as one interval; a batch that fails, or any
        inconsistency, switches this segment to verifying reads (:meth:`_read_damaged`).
        """
        if offset >= self.next_offset:
            return max_bytes, False
        if self._damage_scan is not None:
            return self._read_damaged(out, offset, max_records, max_bytes, decode)
        end = self.size
        # A sequential consumer asks for the offset right after its previous read: start at
        # the remembered position instead of the index entry (saves the scan to the offset).
        hinted = offset == self._hint_offset
        # The batch an index entry points at must start at the offset the entry names: if not,
        # the index is damaged and the segment is read from its start.
        expect, pos = (-1, self._hint_pos) if hinted else self.offset_index.lookup(offset)
        buf = self._cache_buf
        buf_pos = self._cache_pos
        n = len(buf)
        verified_from, verified_to = self._verified_from, self._verified_to
        if not buf_pos <= pos < buf_pos + n:
            buf, buf_pos, n = b"", pos, 0
            verified_from = verified_to = pos
        p = pos - buf_pos
        avg = self.size // max(1, self.next_offset - self.base_offset) + 1
        unpack_header = BATCH_HEADER.unpack_from
        check = integrity.verify_reads
        resume = offset  # the first offset not read yet, should damage be met
        try:
            while buf_pos + p < end:
                if n - p >= BATCH_HEADER_SIZE:
                    base, length, _m, _a, _r, _e, lod = unpack_header(buf, p)[:7]
                    if expect >= 0:
                        named, expect = expect, -1
                        if base != named and buf_pos + p:
                            integrity.report_index(self.index_path, named, buf_pos + p, base)
                            buf, buf_pos, p, n, verified_from, verified_to = b"", 0, 0, 0, 0, 0
                            continue
                    if length < MIN_BATCH_SIZE:
                        raise CorruptRecordBatch(
                            f"batch length {length} too small", buf_pos + p, self.log_path
                        )
                    if length <= n - p:
                        # Verified before its header is believed, skipped or not: a damaged
                        # base offset or count must not skip records silently.
                        at = buf_pos + p
                        if not verified_from <= at < verified_to and check:
                            if not crc_ok(buf, p, length):
                                raise CorruptRecordBatch("CRC mismatch", at, self.log_path)
                            if at != verified_to:
                                verified_from = at
                            verified_to = at + length
                        if base + lod >= offset:
                            try:
                                max_bytes, stop = decode(
                                    buf, p, out, offset, max_records, max_bytes
                                )
                            except DECODE_ERRORS as exc:
                                raise CorruptRecordBatch(
                                    f"undecodable batch: {exc}", at, self.log_path
                                ) from None
                            resume = base + lod + 1
                            if stop >= 0:
                                self._hint_offset, self._hint_pos = stop, buf_pos + p
                                return max_bytes, True
                            if len(out) >= max_records or max_bytes <= 0:
                                # The batch was read to its end (stop < 0).
                                self._hint_offset = base + lod + 1
                                self._hint_pos = buf_pos + p + length
                                return max_bytes, True
                        p += length
                        continue
                    need = length
                else:
                    need = BATCH_HEADER_SIZE
                at = buf_pos + p
                # Read ahead twice the expected need: the buffer is kept for the next
                # sequential read, so the surplus is not wasted.
                want = 2 * min(max_bytes, (max_records - len(out)) * avg) + BATCH_HEADER_SIZE
                buf = os.pread(self._fd, min(end - at, max(need, want, READ_CHUNK_MIN)), at)
                buf_pos, p, n = at, 0, len(buf)
                verified_from = verified_to = at
                if n < need:
                    raise CorruptRecordBatch(f"short read: {n} of {need} bytes", at, self.log_path)
            return max_bytes, False
        except CorruptRecordBatch:
            if not check:
                raise
            buf, buf_pos = b"", 0
            return self._read_damaged(out, resume, max_records, max_bytes, decode)
        finally:
            self._cache_buf, self._cache_pos = buf, buf_pos
            self._verified_from, self._verified_to = verified_from, verified_to

    def _read_damaged(
        self, out: _Out, offset: int, max_records: int, max_bytes: int, decode: Decoder[_Out]
    ) -> tuple[int, bool]:
        """:meth:`read_into` once damage was met: the segment scanned once, then every batch
        walked verified (:func:`~broker.commitlog.integrity.read_verified`)."""
        if self._damage_scan is None:
            self._damage_scan = integrity.scan_segment(
                self._fd, self.log_path, self.base_offset, self.size
            )
        self._hint_offset = -1
        stop = self.config.on_corruption == "stop"
        scan, fd, path = self._damage_scan, self._fd, self.log_path
        return integrity.read_verified(
            fd, path, scan, self.size, out, offset, max_records, max_bytes, decode, stop
        )

    def iter_batches(
        self, pos: int = 0, end: int | None = None
    ) -> Iterator[tuple[bytes, int, int]]:
        """Yield ``(buffer, offset_in_buffer, file_position)`` for each batch from ``pos``.

        Each batch is validated (CRC and structure) before it is yielded: a bad one raises
        :class:`CorruptRecordBatch` (compaction leaves such a segment as it is). ``end``
        defaults to the current :attr:`size`, so a scan started on the cleaner thread sees a
        fixed prefix.
        """
        stop = self.size if end is None else end
        buf = b""
        buf_pos = pos
        while pos < stop:
            rel = pos - buf_pos
            if len(buf) - rel < BATCH_HEADER_SIZE:
                buf = os.pread(self._fd, min(stop - pos, SCAN_CHUNK), pos)
                buf_pos, rel = pos, 0
                if len(buf) < BATCH_HEADER_SIZE:
                    raise CorruptRecordBatch("short read of a batch header", pos, self.log_path)
            length = BATCH_HEADER.unpack_from(buf, rel)[1]
            if length < MIN_BATCH_SIZE:
                raise CorruptRecordBatch(f"batch length {length} too small", pos, self.log_path)
            if len(buf) - rel < length:
                buf = os.pread(self._fd, max(length, min(stop - pos, SCAN_CHUNK)), pos)
                buf_pos, rel = pos, 0
                if len(buf) < length:
                    raise CorruptRecordBatch("short read of a batch", pos, self.log_path)
            if integrity.verify_reads:
                validate_batch(buf, rel, 0, path=self.log_path, position=pos)
            yield buf, rel, pos
            pos += length

    def iter_records(self, end: int | None = None) -> Iterator[Record]:
        """Every record of the segment in offset order (cleaner, tests, tools)."""
        for buf, rel, _pos in self.iter_batches(0, end):
            yield from decode_batch(buf, rel)

    def offset_for_time(self, timestamp: int) -> int | None:
        """First offset whose record timestamp is >= ``timestamp`` (ms), None if none here."""
        if self.max_timestamp < timestamp:
            return None
        try:
            return self._offset_for_time(timestamp)
        except CorruptRecordBatch:  # damage on the way: a verified walk passes over it
            return integrity.first_offset_at(
                self._fd, self.log_path, self.size, self.base_offset, timestamp
            )

    def _offset_for_time(self, timestamp: int) -> int | None:
        before = self.time_index.lookup_before(timestamp)
        start = self.base_offset if before is None else before + 1
        pos = self.offset_index.lookup(start)[1]
        for buf, rel, _pos in self.iter_batches(pos):
            h = read_header(buf, rel)
            if h.last_offset < start or h.max_timestamp < timestamp:
                continue
            for record in decode_batch(buf, rel):
                if record.offset >= start and record.timestamp >= timestamp:
                    return record.offset
        return None  # only control batches hold it (a compacted batch's placeholder)

    # --------------------------------------------------------------- durability
    def dup_fd(self) -> int:
        """A new ``.log`` descriptor to fdatasync on another thread (the caller closes it)."""
        return os.dup(self._fd)

    @property
    def dirty(self) -> bool:
        """True when appended data has not been fsynced yet."""
        return self._dirty

    def flush(self) -> None:
        """fdatasync the ``.log`` if it has unsynced appends; raises :class:`LogIOError`."""
        if self._dirty:
            try:
                _fsync_data(self._fd)
            except OSError as exc:
                raise LogIOError(self.log_path, "fsync segment", exc) from exc
            self.synced(self.size)

    def synced(self, size: int) -> None:
        """An fdatasync (of :meth:`dup_fd`'s too) made ``size`` bytes durable: clean if all."""
        if size == self.size:
            self._dirty = False
            self._writeback_from = size

    def sync_indexes(self) -> None:
        """fsync the ``.index`` and ``.timeindex`` files as they are now (written earlier by
        ``persist_indexes(fsync=False)``); a missing one is skipped (an index is a hint,
        rebuilt at open). Raises :class:`LogIOError`."""
        for path in (self.timeindex_path, self.index_path):  # persist_indexes' order
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise LogIOError(path, "open index", exc) from exc
            try:
                os.fsync(fd)
            except OSError as exc:
                raise LogIOError(path, "fsync index", exc) from exc
            finally:
                os.close(fd)

    def persist_indexes(self, *, fsync: bool) -> None:
        """Write ``.index`` and ``.timeindex`` (atomically) if they changed.

        The time index first: without ``fsync`` a crash may keep one rename and lose the
        other, and an offset index older than the time index only makes the open scan more
        batches, while the reverse would leave ``max_timestamp`` to the shorter tail scan.
        """
        for index in (self.time_index, self.offset_index):
            try:
                index.write(fsync=fsync)
            except OSError as exc:
                raise LogIOError(index.path, "write index", exc) from exc

    def _drop_read_state(self) -> None:
        self._hint_offset, self._hint_pos = -1, 0
        self._cache_buf, self._cache_pos = b"", 0
        self._verified_from = self._verified_to = 0

    def close(self) -> None:
        """Close the file descriptor (idempotent); does not flush."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._drop_read_state()

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def delete(self) -> None:
        """Close and remove the segment's files, indexes first so a crash never leaves an
        index without its log."""
        self.close()
        for path in (self.index_path, self.timeindex_path, self.log_path):
            path.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"Segment(base_offset={self.base_offset}, next_offset={self.next_offset})"
