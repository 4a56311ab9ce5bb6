"""The partition log: an ordered list of segments (Kafka's ``Log`` / laminarmq's
``SegmentedLog``).

Directory ``DATA/<stream>/<partition>/`` holds ``<20-digit base offset>.log|.index|.timeindex``.
Invariants:

* offsets are logical record numbers from 0, assigned on append, never reused: segment base
  offsets strictly increase and each segment starts at or after the previous one's
  ``next_offset`` (compaction leaves gaps, which reads skip: inside batches, and unless
  ``keep_empty_batches`` where it removed a batch or a segment);
* the last segment is the *active* one, the only one appended to; it is never deleted by
  retention. ``end_offset`` (log end offset) is its ``next_offset``; ``log_start_offset`` is
  the first segment's base offset;
* a new segment is rolled before an append that would take the active segment past
  ``segment_bytes``, or once ``segment_ms`` passed on the wall clock since its first append
  (since the open, for a segment reopened with data): record timestamps play no part, so a
  restart alone never rolls;
* fsync policy ``always``: append returns after fdatasync; ``interval``: the owner calls
  :meth:`flush_if_due` (or fdatasyncs :meth:`interval_sync`'s descriptor on another
  thread), and close fsyncs; ``never``: only an explicit :meth:`flush`;
* after a crash the log holds a prefix of what was appended. A roll under ``always`` (and for
  compacted logs) fsyncs the rolled segment, its indexes and the directory before the append
  goes on. Under ``interval`` a roll blocks on nothing: it starts the rolled segment's
  writeback, writes its indexes without fsync and creates the new segment; the next flush
  (:meth:`flush_if_due`, :meth:`flush`, :meth:`close`, the policy's durability point) syncs
  the segments' data oldest first, then those indexes and the directory. A crash before that
  flush may cost the rolled segment its tail (or its index files: hints, rebuilt at open) while
  a later segment kept data; so a closed segment of a log that is not compacted must end
  exactly where the next one starts, and :meth:`open` deletes the segments after a gap
  (compaction leaves gaps between offsets, so a compacted log cannot tell and keeps the
  synchronous roll);
* readers see offsets below :attr:`high_watermark` only: on one node it is the log end offset;
  a replicated log (:mod:`broker.commitlog.replica`) pins it to what its replicas committed;
* recovery at :meth:`open`: without the clean-shutdown marker the active segment is scanned
  and its indexes rebuilt; any segment with a missing or inconsistent index is rebuilt too;
  a torn or corrupt tail is truncated at the last intact batch and later segments are
  deleted, everything reported on logger ``broker.commitlog``.

Threads: append, read, offset_for_time, flush, roll and close are called from the owner's
event loop thread; enforce_retention and compact may run concurrently on the cleaner thread.
``_lock`` guards the segment list and the active segment; ``_cleaner_lock`` serialises the
cleaner's operations with each other and with close. The cleaner reads closed segments without
``_lock`` (they are immutable) and takes it only to swap or drop segments.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence, Sized
from pathlib import Path
from typing import TypeVar

from broker.commitlog.batch import BATCH_HEADER, Decoder, decode_into
from broker.commitlog.cleaned import swap_in, write_segment
from broker.commitlog.columns import ColumnRead, decode_columns_into
from broker.commitlog.config import MAX_SEGMENT_OFFSETS, LogConfig
from broker.commitlog.directory import drop_after_truncation, tidy_directory
from broker.commitlog.disk import fsync_directory
from broker.commitlog.errors import (
    CommitLogError,
    CorruptRecordBatch,
    LogClosed,
    LogIOError,
    OffsetOutOfRange,
)
from broker.commitlog.integrity import quarantined, report_error, report_gap
from broker.commitlog.interval_sync import IntervalSync
from broker.commitlog.policy import (
    build_offset_map,
    cleaned_batches,
    count_removable,
    retention_victims,
)
from broker.commitlog.record import Record
from broker.commitlog.replica import ReplicaOps
from broker.commitlog.segment import (
    CLEANED_SUFFIX,
    Segment,
)
from broker.commitlog.small_batch import encode, rebased

logger = logging.getLogger("broker.commitlog")

#: Present in a partition directory only between a clean close and the next open.
CLEAN_SHUTDOWN_FILE = ".clean_shutdown"
_Out = TypeVar("_Out", bound=Sized)


def _bounded(decode: Decoder[_Out], end: int) -> Decoder[_Out]:
    """``decode`` stopping at the first batch at or past ``end`` (a batch boundary: the
    high-water mark of a replicated log is always one), as if a limit were hit there."""
    unpack = BATCH_HEADER.unpack_from

    def bounded(
        buf: bytes, pos: int, out: _Out, min_offset: int, max_records: int, max_bytes: int
    ) -> tuple[int, int]:
        base = unpack(buf, pos)[0]
        if base >= end:
            return max_bytes, base
        return decode(buf, pos, out, min_offset, max_records, max_bytes)

    return bounded


class SegmentedLog(ReplicaOps, IntervalSync):
    """One partition's log; see the module docstring. Create with :meth:`open`. The
    operations a replicated log adds (raw appends, suffix truncation, the high-water mark,
    the epoch scan) are :class:`~broker.commitlog.replica.ReplicaOps`'; the ``interval``
    policy's syncs (:meth:`flush_if_due`, :meth:`interval_sync`) are
    :class:`~broker.commitlog.interval_sync.IntervalSync`'s."""

    def __init__(
        self,
        directory: Path,
        config: LogConfig,
        clock: Callable[[], float],
        segments: list[Segment],
    ) -> None:
        self.directory = directory
        self.config = config
        self._clock = clock
        self._segments = segments
        self._bases = [segment.base_offset for segment in segments]
        self._lock = threading.Lock()
        self._cleaner_lock = threading.Lock()
        self._closed = False
        self._fsync_always = config.fsync == "always"
        self._sync_on_roll = config.fsync != "never"
        #: Rolls that only sync at the next flush (see the module doc).
        self._defer_roll_sync = config.fsync == "interval" and not config.compacted
        #: Segments rolled since the last flush, whose indexes and directory entry (the new
        #: segment's) that flush must sync.
        self._rolled: list[Segment] = []
        self._last_flush_ms = self._now_ms()
        self._compacted_state = (-1, -1)
        #: The high-water mark a replicated log pinned (``ReplicaOps.set_high_watermark``);
        #: None: it follows the end offset.
        self._visible_end: int | None = None

    # ------------------------------------------------------------------------- open
    @classmethod
    def open(
        cls, directory: Path, config: LogConfig, *, clock: Callable[[], float] = time.time
    ) -> SegmentedLog:
        """Open (creating if needed) and recover the log in ``directory``.

        Raises :class:`LogIOError` (permission denied, disk full...), :class:`UnsupportedFormat`
        (a batch of a newer format) or :class:`CommitLogError` (overlapping segments).
        """
        directory = Path(directory)
        now_ms = int(clock() * 1000)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            names = os.listdir(directory)
        except OSError as exc:
            raise LogIOError(directory, "open log directory", exc) from exc
        marker = directory / CLEAN_SHUTDOWN_FILE
        clean = CLEAN_SHUTDOWN_FILE in names
        bases = tidy_directory(directory, names)
        segments: list[Segment] = []
        try:
            for i, base in enumerate(bases):
                is_active = i == len(bases) - 1
                segment, truncated = Segment.open(
                    directory,
                    base,
                    config,
                    now_ms,
                    recover=is_active and not clean,
                    keep_damaged_tail=clean,
                )
                if segments and base < segments[-1].next_offset:
                    segment.close()
                    raise CommitLogError(
                        f"{segment.log_path}: base offset {base} overlaps the previous segment "
                        f"ending at offset {segments[-1].next_offset - 1}"
                    )
                if segments and base > segments[-1].next_offset and not config.compacted:
                    previous = segments[-1]
                    repaired = quarantined(directory, previous.base_offset)
                    if clean or previous.damaged or repaired:
                        # Nothing is torn after a clean shutdown: the missing offsets are
                        # damage (a file cut short), reported (a repaired loss was already,
                        # a damaged tail is one range); the later segments are kept.
                        tail = previous.damaged and previous.damaged[-1].last_offset < 0
                        if not repaired and not tail:
                            report_gap(previous.log_path, previous.size, previous.next_offset, base)
                        segments.append(segment)
                        continue
                    # The previous segment lost its tail in a crash before the interval's
                    # flush (see the module doc): what follows does not continue it.
                    segment.close()
                    drop_after_truncation(directory, segments[-1], bases[i:])
                    break
                segments.append(segment)
                if truncated and not is_active:
                    drop_after_truncation(directory, segment, bases[i + 1 :])
                    break
            if not segments:
                segments.append(Segment.create(directory, 0, config, now_ms))
            if clean:
                marker.unlink()
                fsync_directory(directory)
        except OSError as exc:
            for segment in segments:
                segment.close()
            raise LogIOError(directory, "open log", exc) from exc
        except BaseException:
            for segment in segments:
                segment.close()
            raise
        return cls(directory, config, clock, segments)

    # ------------------------------------------------------------------- properties
    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    @property
    def end_offset(self) -> int:
        """Log end offset: the offset the next appended record gets."""
        return self._segments[-1].next_offset

    @property
    def high_watermark(self) -> int:
        """The offset after the last record readers may see (Kafka's high-water mark): the
        end offset unless :meth:`set_high_watermark` pinned it (a replicated log)."""
        visible = self._visible_end
        end = self._segments[-1].next_offset
        return end if visible is None or visible > end else visible

    @property
    def log_start_offset(self) -> int:
        """Earliest offset still retained (the first segment's base offset)."""
        return self._segments[0].base_offset

    @property
    def segments(self) -> list[int]:
        """Base offsets of the segments, oldest first (the last is the active segment)."""
        with self._lock:
            return list(self._bases)

    @property
    def size(self) -> int:
        """Total bytes of the ``.log`` files."""
        with self._lock:
            return sum(segment.size for segment in self._segments)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise LogClosed(f"{self.directory}: log is closed")

    # ----------------------------------------------------------------------- append
    def append(self, records: Sequence[Record], *, leader_epoch: int = 0) -> int:
        """Append ``records`` as one batch (one ``write()``); return the first offset.

        Record offsets passed in are ignored. An empty sequence appends nothing and returns
        :attr:`end_offset`. Raises :class:`LogIOError` after rolling the file back, or
        :class:`~broker.commitlog.errors.InvalidRecord`; the log is unchanged on error.
        """
        with self._lock:
            self._check_open()
            active = self._segments[-1]
            base = active.next_offset
            if not records:
                return base
            self._write_locked(
                encode(base, records, leader_epoch=leader_epoch), base + len(records)
            )
            return base

    def append_parts(
        self, parts: Sequence[Sequence[Record] | bytes]
    ) -> tuple[int, list[bytes | bytearray]]:
        """Append ``parts`` in order, each a batch: a run of records (encoded here, as
        ``append``), or the bytes of a checked batch of consecutive records encoded elsewhere
        (another worker's forward, broker.workers.partitions), given its place here (base
        offset and CRC rewritten, nothing decoded). Returns the first offset and the batches
        written. One write for them all (a group commit of a fleet's iteration holds this
        worker's records and a peer's batch: two writes cost a system call per commit
        more), so on an error none of them stays."""
        with self._lock:
            self._check_open()
            first = base = self._segments[-1].next_offset
            written: list[bytes | bytearray] = []
            for part in parts:
                batch: bytes | bytearray
                if isinstance(part, bytes):
                    batch, count = rebased(part, base), BATCH_HEADER.unpack_from(part)[7]
                else:
                    batch, count = encode(base, part), len(part)
                written.append(batch)
                base += count
            if written:
                self._write_locked(written[0] if len(written) == 1 else b"".join(written), base)
            return first, written

    def _write_locked(self, batch: bytes | bytearray, next_offset: int, sync: bool = True) -> None:
        """Write one encoded batch (or consecutive ones) that ends before ``next_offset`` to
        the active segment, rolling first if it would make the segment too big, too old or
        span too many offsets (``append`` and ``append_raw``); fsynced under
        ``fsync = "always"`` unless ``sync`` is False (then the next :meth:`flush` does)."""
        active = self._segments[-1]
        now_ms = self._now_ms()
        if active.size and (
            active.size + len(batch) > self.config.segment_bytes
            or now_ms - active.rolling_base_ms > self.config.segment_ms
            or next_offset - active.base_offset > MAX_SEGMENT_OFFSETS
        ):
            self._roll_locked(now_ms)
            active = self._segments[-1]
        first = not active.size
        active.append(batch, fsync=self._fsync_always and sync)
        if first:
            active.rolling_base_ms = now_ms

    def roll(self) -> None:
        """Close the active segment and start a new one at :attr:`end_offset`.

        A no-op when the active segment is empty (it already starts at the end offset).
        """
        with self._lock:
            self._check_open()
            if self._segments[-1].size:
                self._roll_locked(self._now_ms())

    def _roll_locked(self, now_ms: int) -> None:
        old = self._segments[-1]
        if self._defer_roll_sync:
            # Blocks on nothing; the next flush syncs (module doc). Measured with the
            # 1 KiB x 1000 benchmark cell: 4 rolls per 264 MB spent 4-36 ms in fsyncs.
            old.persist_indexes(fsync=False)
            old.start_writeback()
            new = Segment.create(self.directory, old.next_offset, self.config, now_ms)
            self._rolled.append(old)
            self._segments.append(new)
            self._bases.append(new.base_offset)
            logger.debug("%s: rolled new segment %s", self.directory, new.log_path.name)
            return
        sync = self._sync_on_roll
        old.persist_indexes(fsync=sync)
        if sync:
            old.flush()
        new = Segment.create(self.directory, old.next_offset, self.config, now_ms)
        if sync:
            try:
                fsync_directory(self.directory)
            except OSError as exc:
                new.delete()
                raise LogIOError(self.directory, "fsync log directory", exc) from exc
        self._segments.append(new)
        self._bases.append(new.base_offset)
        logger.debug("%s: rolled new segment %s", self.directory, new.log_path.name)

    # ------------------------------------------------------------------------ reads
    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list[Record]:
        """Records with offset >= ``offset`` in order, at most ``max_records`` and about
        ``max_bytes`` of encoded records (at least one record when one exists).

        ``[]`` when ``offset == end_offset``; :class:`OffsetOutOfRange` when ``offset`` is
        below :attr:`log_start_offset` or beyond :attr:`end_offset`. Nothing at or past
        :attr:`high_watermark` is returned (``[]`` from there to the end offset).
        """
        return self._read(offset, max_records, max_bytes, [], decode_into)

    def read_columns(
        self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20
    ) -> ColumnRead:
        """The records :meth:`read` returns (same arguments, limits and errors), as the
        stored batches' columns (:mod:`broker.commitlog.columns`): no tuple per record."""
        return self._read(offset, max_records, max_bytes, ColumnRead(), decode_columns_into)

    def _read(
        self, offset: int, max_records: int, max_bytes: int, out: _Out, decode: Decoder[_Out]
    ) -> _Out:
        with self._lock:
            self._check_open()
            segments = self._segments
            end = segments[-1].next_offset
            start = segments[0].base_offset
            if offset < start or offset > end:
                raise OffsetOutOfRange(offset, start, end)
            if offset == end or max_records <= 0:
                return out
            visible = self._visible_end
            if visible is not None and visible < end:
                if offset >= visible:
                    return out
                decode = _bounded(decode, visible)
            i = bisect_right(self._bases, offset) - 1
            last = len(segments) - 1
            while True:
                max_bytes, stopped = segments[i].read_into(
                    out, offset, max_records, max_bytes, decode
                )
                if stopped or i == last:
                    return out
                i += 1

    def offset_for_time(self, timestamp_ms: int) -> int:
        """First offset whose record timestamp is >= ``timestamp_ms``, else :attr:`end_offset`."""
        with self._lock:
            self._check_open()
            for segment in self._segments:
                if segment.max_timestamp >= timestamp_ms:
                    found = segment.offset_for_time(timestamp_ms)
                    if found is not None:
                        return found
            return self._segments[-1].next_offset

    # ------------------------------------------------------------------- durability
    def flush(self) -> None:
        """fsync every segment with unsynced appends now, and what rolls since the last flush
        left unsynced (module doc); raises :class:`LogIOError`."""
        with self._lock:
            self._check_open()
            self._flush_locked()

    def _flush_locked(self, now_ms: int | None = None) -> None:
        for segment in self._segments:  # oldest first: the log stays a prefix
            segment.flush()
        self._sync_rolled()
        self._last_flush_ms = self._now_ms() if now_ms is None else now_ms

    def _sync_rolled(self) -> None:
        """After the segments' data: the indexes of the segments rolled since the last flush,
        then the directory (new segment, renamed indexes). Kept for the next flush if it fails."""
        if not self._rolled:
            return
        for segment in self._rolled:
            if not segment.closed:  # else deleted by retention meanwhile
                segment.sync_indexes()
        try:
            fsync_directory(self.directory)
        except OSError as exc:
            raise LogIOError(self.directory, "fsync log directory", exc) from exc
        self._rolled.clear()

    # -------------------------------------------------------------- cleaner thread
    def enforce_retention(self, now_ms: int | None = None, *, below: int | None = None) -> int:
        """Delete closed segments past ``retention_ms`` / ``retention_bytes`` (see
        :mod:`broker.commitlog.policy`); return how many. Safe from the cleaner thread.
        ``below``: only segments that end at or before this offset (a replicated log: what is
        committed and durable everywhere it counts, so Raft never needs it again)."""
        with self._cleaner_lock:
            now = self._now_ms() if now_ms is None else now_ms
            with self._lock:
                self._check_open()
                count = retention_victims(
                    self._segments, now, self.config.retention_ms, self.config.retention_bytes
                )
                if below is not None:
                    while count and self._segments[count - 1].next_offset > below:
                        count -= 1
                victims = self._segments[:count]
                del self._segments[:count]
                del self._bases[:count]
                self._rolled = [s for s in self._rolled if s not in victims]
            for segment in victims:
                logger.info(
                    "%s: retention deletes segment %s (offsets %d..%d, %d bytes)",
                    self.directory,
                    segment.log_path.name,
                    segment.base_offset,
                    segment.next_offset - 1,
                    segment.size,
                )
                segment.delete()
            return count

    def compact(self) -> int:
        """Compacted logs: rewrite closed segments keeping the latest record per topic;
        tombstones are dropped; only records below :attr:`high_watermark` count (a replicated
        log's committed ones); offsets are kept, and with ``keep_empty_batches`` every batch's
        (:func:`~broker.commitlog.policy.cleaned_batches`), so no segment is dropped or ends
        earlier. Returns the number of records removed. Safe from the cleaner thread."""
        if not self.config.compacted:
            raise CommitLogError(f"{self.directory}: compact() on a log that is not compacted")
        with self._cleaner_lock:
            with self._lock:
                self._check_open()
                segments = list(self._segments)
                active = segments[-1]
                active_end = active.size
                # Only committed records count (policy module doc).
                below = self.high_watermark
                # Nothing new to compact: no record committed and no segment rolled since.
                state = (active.base_offset, min(active.next_offset, below))
                if state == self._compacted_state or len(segments) < 2:
                    return 0
            try:
                latest = build_offset_map(
                    [(s, s.size) for s in segments[:-1]] + [(active, active_end)], below
                )
                removed = 0
                for segment in segments[:-1]:
                    removable = count_removable(segment, latest, below)
                    if removable:
                        self._replace_cleaned(segment, latest, below, first=segment is segments[0])
                        removed += removable
            except CorruptRecordBatch as exc:
                # Never rewrite damage away: the log stays as it is until it is repaired.
                report_error(exc)
                logger.error("%s: compaction skipped until the damage is repaired", self.directory)
                return 0
            self._compacted_state = state
            if removed:
                logger.info("%s: compaction removed %d records", self.directory, removed)
            return removed

    def _replace_cleaned(
        self, segment: Segment, latest: dict[str, int], below: int, *, first: bool
    ) -> None:
        """Write the cleaned copy of ``segment`` and swap it in (crash-safe order: old indexes
        removed, log renamed over, new indexes renamed in; a missing index is rebuilt), or drop
        the segment if nothing is left in it but the log's first (only without
        ``keep_empty_batches``: else every batch stays)."""
        sync = self._sync_on_roll
        cleaned = write_segment(
            self.directory,
            segment.base_offset,
            self.config,
            cleaned_batches(segment, latest, below, self.config.keep_empty_batches),
            CLEANED_SUFFIX,
            fsync=sync,
        )
        if self.config.keep_empty_batches and cleaned.next_offset != segment.next_offset:
            cleaned.delete()  # a bug, never the data's fault: the segment stays as it is
            raise CommitLogError(f"{segment.log_path}: its compacted copy ends elsewhere")
        with self._lock:
            position = self._segments.index(segment)
            if cleaned.size == 0 and not first:
                del self._segments[position]
                del self._bases[position]
                cleaned.delete()
                segment.delete()
                return
            self._segments[position] = swap_in(segment, cleaned, self.directory, fsync=sync)

    # ------------------------------------------------------------------------ close
    def close(self) -> None:
        """Flush (unless fsync=never), persist the active indexes, write the clean-shutdown
        marker and close the files. Idempotent."""
        with self._cleaner_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            sync = self._sync_on_roll
            try:
                for segment in self._segments:
                    segment.persist_indexes(fsync=sync)
                    if sync:
                        segment.flush()
                for segment in self._rolled:
                    if not segment.closed:
                        segment.sync_indexes()
                self._rolled.clear()
                marker = self.directory / CLEAN_SHUTDOWN_FILE
                try:
                    marker.touch()
                    if sync:
                        fsync_directory(self.directory)
                except OSError as exc:
                    raise LogIOError(marker, "write clean-shutdown marker", exc) from exc
            finally:
                for segment in self._segments:
                    segment.close()

    def __enter__(self) -> SegmentedLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SegmentedLog({str(self.directory)!r}, log_start_offset="
            f"{self.log_start_offset}, end_offset={self.end_offset})"
        )
