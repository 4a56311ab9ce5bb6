"""Opening a segment: its indexes checked, or the whole ``.log`` recovered.

A segment is opened one of two ways (:meth:`Segment.open`): after a clean shutdown its indexes
are loaded and checked and only the batches after the last offset-index entry are scanned
(:func:`load_indexes`); otherwise, or when that check fails, the whole ``.log`` is scanned, the
indexes rebuilt and a torn tail truncated (:func:`recover`). Every batch scanned is validated
in full (CRC, structure, offset continuity).

Sealed segments are not fully scanned at a clean start: measured on the 2-core machine of
issue 25, validating every batch costs 12 s per GiB of 1,000-record batches and 150 s per GiB
of a fleet's 2-record batches (a CRC-only walk: 0.5-1.4 and 35-50 s), minutes before a broker
with a few GiB of history could serve. Reads verify every batch they use and the scrubber
(:mod:`broker.commitlog.scrub`) re-reads the rest in the background.

Functions of a :class:`Segment` under construction (its own module for size; they set its
fields as its methods would). Same thread rules as the segment.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

from broker.commitlog import integrity
from broker.commitlog.batch import (
    BATCH_HEADER,
    BATCH_HEADER_SIZE,
    MIN_BATCH_SIZE,
    read_header,
    validate_batch,
)
from broker.commitlog.config import LogConfig
from broker.commitlog.disk import fsync_data as _fsync_data
from broker.commitlog.errors import CorruptIndex, CorruptRecordBatch
from broker.commitlog.index import OffsetIndex, TimeIndex
from broker.commitlog.integrity import SCAN_CHUNK, DamagedRange, SegmentScan

logger = logging.getLogger("broker.commitlog")


class Segment(Protocol):
    """What recovery reads and sets of a :class:`broker.commitlog.segment.Segment` (named
    here so this module does not import that one, which calls it)."""

    config: LogConfig
    base_offset: int
    size: int
    next_offset: int
    max_timestamp: int
    log_path: Path
    index_path: Path
    timeindex_path: Path
    offset_index: OffsetIndex
    time_index: TimeIndex
    damaged: list[DamagedRange]
    _fd: int
    _bytes_since_index: int
    _damage_scan: SegmentScan | None

    def _index_batch(self, base: int, last: int, max_ts: int, pos: int, length: int) -> None: ...

    def _drop_read_state(self) -> None: ...


def scan(seg: Segment, pos: int, min_base: int, *, build: bool) -> tuple[int, str | None]:
    """Validate the batches of ``seg`` from ``pos`` to its ``size``, updating its offsets
    and timestamps (and, with ``build``, its indexes).

    Returns the end of the last valid batch and, if scanning stopped early, why.
    """
    end = seg.size
    buf = b""
    buf_pos = pos
    while pos < end:
        avail = end - pos
        if avail < BATCH_HEADER_SIZE:
            return pos, f"torn batch header ({avail} bytes)"
        rel = pos - buf_pos
        if len(buf) - rel < BATCH_HEADER_SIZE:
            buf = os.pread(seg._fd, min(avail, SCAN_CHUNK), pos)
            buf_pos, rel = pos, 0
        length = BATCH_HEADER.unpack_from(buf, rel)[1]
        if length < MIN_BATCH_SIZE:
            return pos, f"batch length {length} too small"
        if length > avail:
            return pos, f"torn batch: length {length}, {avail} bytes left in file"
        if len(buf) - rel < length:
            buf = os.pread(seg._fd, max(length, min(avail, SCAN_CHUNK)), pos)
            buf_pos, rel = pos, 0
        try:
            h = validate_batch(buf, rel, min_base, path=seg.log_path, position=pos)
        except CorruptRecordBatch as exc:
            return pos, exc.reason
        if build:
            seg._index_batch(h.base_offset, h.last_offset, h.max_timestamp, pos, length)
        elif h.max_timestamp > seg.max_timestamp:
            seg.max_timestamp = h.max_timestamp
        seg.next_offset = min_base = h.next_offset
        pos += length
    return pos, None


def load_indexes(seg: Segment) -> None:
    """Load both indexes of ``seg`` and verify the batches after the last offset-index entry
    (CRCs included); raises :class:`CorruptIndex` or :class:`CorruptRecordBatch` when the
    segment needs :func:`recover`."""
    offset_index = OffsetIndex.load(seg.index_path, seg.base_offset, seg.size)
    last_offset, pos = offset_index.last_entry()
    if len(offset_index):
        head = os.pread(seg._fd, BATCH_HEADER_SIZE, pos)
        if len(head) < BATCH_HEADER_SIZE or read_header(head).base_offset != last_offset:
            raise CorruptIndex(
                seg.index_path,
                f"entry ({last_offset}, {pos}) points at no batch with that base offset",
            )
    seg.offset_index = offset_index
    seg.next_offset = seg.base_offset
    end, reason = scan(seg, pos, last_offset, build=False)
    if reason is not None:
        raise CorruptRecordBatch(reason, end, seg.log_path)
    seg._bytes_since_index = seg.size - pos
    tail_max = seg.max_timestamp
    seg.time_index = TimeIndex.load(seg.timeindex_path, seg.base_offset, seg.next_offset)
    if len(offset_index) and not len(seg.time_index):
        # Each first offset-index entry comes with a time-index entry: this file lost its
        # data in a crash (written without fsync, see SegmentedLog's roll).
        raise CorruptIndex(seg.timeindex_path, "empty while the offset index is not")
    seg.max_timestamp = max(tail_max, seg.time_index.last_timestamp())


def recover(seg: Segment, *, keep_damaged_tail: bool = False) -> int:
    """Scan the whole ``.log`` of ``seg``, rebuild its indexes, truncate a torn tail.

    A bad batch followed by an intact one is damage, not a torn write (a crash tears only
    the end): it is kept, reported (:func:`~broker.commitlog.integrity.report`) and listed
    in ``seg.damaged``, and reads pass over it per the stream's ``on_corruption``, so the
    acknowledged batches after it are not cut. A bad tail (no intact batch after it) is
    truncated, unless ``keep_damaged_tail``: after a clean shutdown nothing can be torn,
    so a bad tail is damage too, kept rather than cut (with the later segments).
    Returns the number of bytes truncated (0 when nothing was cut) and logs what was cut
    on logger ``broker.commitlog``.
    """
    seg.offset_index = OffsetIndex(seg.index_path, seg.base_offset)
    seg.time_index = TimeIndex(seg.timeindex_path, seg.base_offset)
    seg.next_offset = seg.base_offset
    seg.max_timestamp = -1
    seg._bytes_since_index = 0
    seg._drop_read_state()
    seg._damage_scan = None
    seg.damaged = []
    end, reason = scan(seg, 0, seg.base_offset, build=True)
    while reason is not None:
        after = integrity.resync(seg._fd, seg.log_path, end, seg.size, seg.next_offset)
        if after is None and not keep_damaged_tail:
            break
        stop, base = after if after is not None else (seg.size, -1)
        damage = DamagedRange(
            seg.log_path, end, stop, seg.next_offset, base - 1 if base >= 0 else -1, reason
        )
        seg.damaged.append(damage)
        integrity.report(damage)
        if after is None:
            return 0
        # Index the first batch after the damage, so reads past it start there.
        seg._bytes_since_index = seg.config.index_interval_bytes
        end, reason = scan(seg, stop, base, build=True)
    truncated = seg.size - end
    if truncated:
        logger.warning(
            "%s: truncating %d bytes at position %d (%s); log end offset is now %d",
            seg.log_path,
            truncated,
            end,
            reason,
            seg.next_offset,
        )
        os.ftruncate(seg._fd, end)
        _fsync_data(seg._fd)
        seg.size = end
    return truncated
