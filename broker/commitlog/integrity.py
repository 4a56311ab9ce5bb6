"""Batch verification on the read paths, damaged ranges and their reports.

Every batch a read hands to a decoder was first checked here: its CRC-32 (zlib's, over the
batch but its own four bytes, :mod:`broker.commitlog.batch`) is computed once, when the read
first takes the batch from the buffer it read (``Segment.read_into``,
``reader._SegmentView.read_into``); a batch whose CRC or structure is wrong raises
:class:`~broker.commitlog.errors.CorruptRecordBatch` inside the package, never a generic
exception. The CRC costs ~128 us per MiB through libdeflate (zlib: ~490) and 0.11 us for a
batch of a few records through the compiled check (``broker.commitlog.crc.batch_crc_ok``; its
pure-Python form, two slices and two ``zlib.crc32`` calls, 0.7-1.1 us), measured on the 2-core
machine of issue 25.

After a first failure in a segment, the segment is scanned once from its start
(:func:`scan_segment`): every batch is validated in full and each damaged range is found,
from the first bad byte to the next batch whose header and CRC verify (a resynchronisation:
candidates are headers with this format's magic and zero reserved bytes, an offset not below
the expected one and a CRC that matches). Reads of that segment then walk it with every batch
verified (:func:`read_verified`), from the scan's own sparse index of intact batches.

What a read does at a damaged range is the stream's ``on_corruption``:

* ``skip`` (default): the range is passed over like a compaction gap, the read goes on with
  the next intact batch; the loss is reported (below);
* ``stop``: the read returns what lies before the range, and a read starting in it raises
  :class:`CorruptRecordBatch` (``first_offset``/``last_offset`` set): the partition's
  consumers are held there until an operator repairs the segment (``mqlog verify --repair``,
  which moves the damaged bytes aside and leaves a gap; or a copy restored from a backup)
  and restarts the broker, or changes the stream to ``skip``.

Each damaged range is reported once per process (:func:`report`): an ERROR line on logger
``broker.commitlog`` naming the stream, partition, segment file, byte position and offset
range, a count per ``(stream, partition)`` (:func:`corrupt_counts`, the
``mqlog_corrupt_batches_total`` metric and the ``$SYS`` topics) and the listeners added with
:func:`add_listener`. Thread-safe: reads run on the event loop, the scrubber and the cleaner
on their own threads.

A replicated log repairs a damaged range from a healthy replica (issue 25 item 4): the
cluster (``broker.cluster.repair``) listens to the reports (:func:`add_listener`), fetches the
range's batches from another replica and rewrites them in place
(:mod:`broker.commitlog.rewrite`), which :func:`forget` the range's report so that new damage
there is reported again.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import NamedTuple, TypeVar

from broker.commitlog.batch import (
    BATCH_HEADER,
    BATCH_HEADER_SIZE,
    CRC_OFFSET,
    MAGIC,
    MIN_BATCH_SIZE,
    Decoder,
    decode_batch,
    read_header,
)
from broker.commitlog.crc import batch_crc_ok
from broker.commitlog.errors import CorruptRecordBatch

logger = logging.getLogger("broker.commitlog")

_Out = TypeVar("_Out", bound=Sized)
_CRC = CRC_OFFSET  # the CRC's position in the header (44)

#: Read size of a verifying scan (bytes).
SCAN_CHUNK = 1 << 20
#: Bytes of intact batches between two entries of a scan's own index.
SCAN_INDEX_INTERVAL = 64 << 10
#: A position where a batch header with this format's magic and zero reserved bytes could
#: start (a zero-width match, so every candidate position is found, overlapping or not).
_CANDIDATE = re.compile(rb"(?=[\s\S]{12}" + bytes([MAGIC]) + rb"[\s\S]\x00\x00)")

#: Tests and the benchmark's verification-off switch (``bench``, never the broker) set this to
#: False to measure what the check costs; every read path consults it.
verify_reads = True


#: Whether the stored CRC of the batch at ``buf[pos:pos + length]`` (``buf`` holds the whole
#: batch) matches its bytes: :func:`broker.commitlog.crc.batch_crc_ok`, compiled when built.
crc_ok = batch_crc_ok


class DamagedRange(NamedTuple):
    """Bytes ``[position, end)`` of segment file ``path`` that hold no intact batch.

    ``first_offset`` is the offset the next record should have had (one past the previous
    intact batch, or the segment's base); ``last_offset`` the base offset of the next intact
    batch minus one, or -1 when no intact batch follows in the file (the range runs to the
    segment's end, so to the next segment's base).
    """

    path: Path
    position: int
    end: int
    first_offset: int
    last_offset: int
    reason: str

    @property
    def stream(self) -> str:
        return self.path.parent.parent.name

    @property
    def partition(self) -> str:
        return self.path.parent.name

    def offsets(self) -> str:
        """``"500..519"``, or ``"500.."`` when the range runs to the segment's end."""
        last = str(self.last_offset) if self.last_offset >= self.first_offset else ""
        return f"{self.first_offset}..{last}"

    def error(self) -> CorruptRecordBatch:
        """The error a read raises at this range under ``on_corruption = "stop"``."""
        exc = CorruptRecordBatch(
            f"{self.reason}; offsets {self.offsets()} held (on_corruption = stop)",
            self.position,
            self.path,
        )
        exc.first_offset = self.first_offset
        exc.last_offset = self.last_offset
        return exc


class SegmentScan(NamedTuple):
    """What a verifying scan of one segment file found: its damaged ranges, and a sparse
    index of intact batches (base offsets and positions, ascending) to start reads from."""

    ranges: list[DamagedRange]
    bases: list[int]
    positions: list[int]
    end: int
    next_offset: int


# ------------------------------------------------------------------ reports
_lock = threading.Lock()
_reported: set[tuple[str, int]] = set()
_counts: dict[tuple[str, str], int] = {}
_listeners: list[Callable[[DamagedRange], None]] = []


def report(damage: DamagedRange) -> bool:
    """Report ``damage`` unless this process already did; returns whether it was new."""
    key = (os.fspath(damage.path), damage.position)
    with _lock:
        if key in _reported:
            return False
        _reported.add(key)
        partition = (damage.stream, damage.partition)
        _counts[partition] = _counts.get(partition, 0) + 1
        listeners = list(_listeners)
    logger.error(
        "corrupt record batch: stream %s partition %s, segment %s, bytes %d..%d, offsets %s: %s",
        damage.stream,
        damage.partition,
        damage.path,
        damage.position,
        damage.end,
        damage.offsets(),
        damage.reason,
    )
    for listener in listeners:
        try:
            listener(damage)
        except Exception:  # a listener's bug must not break the read that found the damage
            logger.exception("corruption listener failed")
    return True


def corrupt_counts() -> dict[tuple[str, str], int]:
    """Damaged ranges reported by this process, per ``(stream, partition)``."""
    with _lock:
        return dict(_counts)


def add_listener(listener: Callable[[DamagedRange], None]) -> None:
    """Call ``listener`` with every newly reported range (on the reporting thread)."""
    with _lock:
        _listeners.append(listener)


def remove_listener(listener: Callable[[DamagedRange], None]) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def forget(path: Path, position: int, end: int) -> None:
    """A repaired range of ``path``: what was reported at positions ``position..end`` is
    forgotten (its counts kept), so that damage found there later is reported again."""
    name = os.fspath(path)
    with _lock:
        for key in [k for k in _reported if k[0] == name and position <= k[1] <= end]:
            _reported.discard(key)


def forget_reports() -> None:
    """Tests: start again as if nothing was reported."""
    with _lock:
        _reported.clear()
        _counts.clear()


# -------------------------------------------------------------------- scans
class _File:
    """Positioned reads of a segment file with a one-chunk cache."""

    __slots__ = ("buf", "buf_pos", "fd", "pace", "size")

    def __init__(self, fd: int, size: int, pace: Callable[[int], None] | None = None) -> None:
        self.fd = fd
        self.size = size
        self.buf = b""
        self.buf_pos = 0
        #: Called with the bytes of every read (the scrubber's rate cap).
        self.pace = pace

    def pread(self, size: int, pos: int) -> bytes:
        data = os.pread(self.fd, size, pos)
        if self.pace is not None:
            self.pace(len(data))
        return data

    def at(self, pos: int, need: int) -> tuple[bytes, int]:
        """The buffer holding ``need`` bytes at ``pos`` (fewer at the file's end) and where."""
        rel = pos - self.buf_pos
        if rel < 0 or len(self.buf) - rel < need:
            want = min(self.size - pos, max(need, SCAN_CHUNK))
            self.buf = self.pread(want, pos) if want > 0 else b""
            self.buf_pos, rel = pos, 0
        return self.buf, rel


def _check(f: _File, pos: int, min_base: int) -> tuple[int, int, int] | str:
    """``(length, base, next_offset)`` of the intact batch at ``pos``, else why it is
    damaged."""
    buf, rel = f.at(pos, BATCH_HEADER_SIZE)
    if len(buf) - rel < BATCH_HEADER_SIZE:
        return f"torn batch header ({len(buf) - rel} bytes)"
    base, length = BATCH_HEADER.unpack_from(buf, rel)[:2]
    if length < MIN_BATCH_SIZE:
        return f"batch length {length} too small"
    if length > f.size - pos:
        return f"batch length {length} runs past the end of the file"
    buf, rel = f.at(pos, length)
    # The CRC says the bytes are those written, so their structure is the encoder's: the
    # header's own fields are checked, the columns are not (a full validate_batch costs
    # ~20 us per batch, measured: 150 s per GiB of 2-record batches; this ~3 us).
    if not crc_ok(buf, rel, length):
        stored = int.from_bytes(buf[rel + _CRC : rel + BATCH_HEADER_SIZE], "little")
        return f"CRC mismatch (stored {stored:#010x})"
    _b, _l, magic, _a, _r, _e, last_delta, count = BATCH_HEADER.unpack_from(buf, rel)[:8]
    if magic != MAGIC:
        return f"unknown magic {magic}"
    if base < min_base:
        return f"base offset {base} below expected {min_base}"
    if count < 1 or last_delta < count - 1:
        return f"record count {count} inconsistent with last offset delta {last_delta}"
    return length, base, base + last_delta + 1


def _resync(f: _File, pos: int, min_base: int) -> tuple[int, int] | None:
    """The first position after ``pos`` where an intact batch starts, and its base offset."""
    q = pos + 1
    end = f.size - MIN_BATCH_SIZE
    while q <= end:
        chunk = f.pread(min(SCAN_CHUNK + 16, f.size - q), q)
        for match in _CANDIDATE.finditer(chunk, 0, max(0, len(chunk) - 15)):
            at = q + match.start()
            if at > end:
                return None
            base, length = BATCH_HEADER.unpack_from(chunk, match.start())[:2]
            if base < min_base or length < MIN_BATCH_SIZE or length > f.size - at:
                continue
            if isinstance(_check(f, at, min_base), tuple):
                return at, base
        q += SCAN_CHUNK
    return None


def walk(
    fd: int,
    path: Path,
    pos: int,
    size: int,
    min_base: int,
    stop_base: int | None = None,
    pace: Callable[[int], None] | None = None,
) -> Iterator[tuple[bytes, int, int, int] | DamagedRange | None]:
    """Every batch of the file from ``pos`` (a batch start whose base is >= ``min_base``) to
    ``size``, each validated in full: ``(buffer, offset in it, file position, next offset)``
    for an intact batch, a :class:`DamagedRange` for damage. ``pace`` is called with the size
    of every read.

    ``stop_base`` is a follower reader's announced mark: every batch whose base offset is
    below it is complete. Yields None and stops where the next batch's offset (one past the
    previous batch) is at or past the mark, whatever the bytes there hold (perhaps a write in
    progress), or at an intact batch whose base is (after a compaction gap). Below the mark a
    batch is judged as the owner judges it: a header whose base offset or length was damaged
    into one past the mark or the file's end is damage, never taken for a write in progress.
    """
    f = _File(fd, size, pace)
    while pos < size:
        if stop_base is not None and min_base >= stop_base:
            yield None
            return
        found = _check(f, pos, min_base)
        if isinstance(found, tuple):
            length, base, next_offset = found
            if stop_base is not None and base >= stop_base:
                yield None
                return
            buf, rel = f.at(pos, length)
            yield buf, rel, pos, next_offset
            min_base = next_offset
            pos += length
            continue
        after = _resync(f, pos, min_base)
        if after is None:
            yield DamagedRange(path, pos, size, min_base, -1, found)
            return
        yield DamagedRange(path, pos, after[0], min_base, after[1] - 1, found)
        pos = after[0]
        min_base = after[1]


def scan_segment(
    fd: int,
    path: Path,
    base_offset: int,
    size: int,
    stop_base: int | None = None,
    pace: Callable[[int], None] | None = None,
) -> SegmentScan:
    """Validate every batch of a segment file; see :class:`SegmentScan`."""
    ranges: list[DamagedRange] = []
    bases = [base_offset]
    positions = [0]
    next_offset = base_offset
    end = 0
    since = 0
    for item in walk(fd, path, 0, size, base_offset, stop_base, pace):
        if item is None:
            break
        if isinstance(item, DamagedRange):
            ranges.append(item)
            end = item.end
            since = SCAN_INDEX_INTERVAL  # index the first batch after the damage
            continue
        buf, rel, at, next_offset = item
        length = BATCH_HEADER.unpack_from(buf, rel)[1]
        if since >= SCAN_INDEX_INTERVAL and at > positions[-1]:
            bases.append(BATCH_HEADER.unpack_from(buf, rel)[0])
            positions.append(at)
            since = 0
        since += length
        end = at + length
    return SegmentScan(ranges, bases, positions, end, next_offset)


def read_verified(
    fd: int,
    path: Path,
    scan: SegmentScan,
    size: int,
    out: _Out,
    offset: int,
    max_records: int,
    max_bytes: int,
    decode: Decoder[_Out],
    stop_on_damage: bool,
    stop_base: int | None = None,
) -> tuple[int, bool]:
    """A read of a damaged segment (``Segment.read_into``'s contract): every batch walked is
    verified, damaged ranges are reported and skipped, or with ``stop_on_damage`` end the read
    (see the module doc). ``scan`` serves only as a sparse index of intact batches (so a scan
    of a file that grew since is still right). Returns the byte budget left and whether a
    limit, a held range or ``stop_base`` ended the read (False: the file ended first)."""
    i = max(0, bisect_right(scan.bases, offset) - 1)
    for item in walk(fd, path, scan.positions[i], size, scan.bases[i], stop_base):
        if item is None:
            return max_bytes, True
        if isinstance(item, DamagedRange):
            report(item)
            if item.last_offset >= 0 and item.last_offset < offset:
                continue  # wholly before what this read asks for
            if stop_on_damage:
                if len(out):
                    return max_bytes, True
                raise item.error()
            continue
        buf, rel, _at, next_offset = item
        if next_offset <= offset:
            continue
        try:
            max_bytes, stop = decode(buf, rel, out, offset, max_records, max_bytes)
        except (ValueError, IndexError, TypeError, OverflowError) as exc:  # struct.error too
            raise CorruptRecordBatch(f"undecodable batch: {exc}", _at, path) from None
        if stop >= 0 or len(out) >= max_records or max_bytes <= 0:
            return max_bytes, True
    return max_bytes, False


def resync(fd: int, path: Path, pos: int, size: int, min_base: int) -> tuple[int, int] | None:
    """Position and base offset of the first intact batch after the bad one at ``pos`` whose
    base is >= ``min_base``, or None when none follows before ``size``."""
    return _resync(_File(fd, size), pos, min_base)


def report_index(path: Path, named: int, position: int, found: int) -> None:
    """An offset index entry names ``named`` at ``position``, where the batch starts at
    ``found``: the index is damaged (its segment is read from the start instead, nothing is
    lost). Logged once per index file and process; ``mqlog verify --repair`` rebuilds it."""
    key = (str(path), -1)
    with _lock:
        if key in _reported:
            return
        _reported.add(key)
    logger.error(
        "%s: damaged offset index: its entry names offset %d at byte %d, where the batch at "
        "offset %d starts; reading the segment from its start (rebuild the index with "
        "`mqlog verify DATA_DIR --repair`)",
        path,
        named,
        position,
        found,
    )


def report_error(exc: CorruptRecordBatch) -> bool:
    """:func:`report` a damaged batch known only by the error a scan raised (compaction):
    the range is that one batch, its offsets unknown."""
    path = exc.path if exc.path is not None else Path("?/?/?")
    return report(DamagedRange(path, exc.position, exc.position, exc.first_offset, -1, exc.reason))


#: Subdirectory of a partition directory where ``mqlog verify --repair`` moves damaged
#: segments (never deleted): ``quarantine/<base>.log`` is the segment as it was found.
QUARANTINE_DIR = "quarantine"


def quarantined(directory: Path, base_offset: int) -> bool:
    """Whether the segment of ``base_offset`` was repaired (its damaged original is kept in
    the quarantine directory), so a gap after it is a known loss, not a torn tail."""
    return (directory / QUARANTINE_DIR / f"{base_offset:020d}.log").exists()


def report_gap(path: Path, size: int, first_offset: int, next_base: int) -> bool:
    """:func:`report` the offsets ``first_offset .. next_base - 1`` missing between the end of
    the segment file ``path`` (``size`` bytes) and the next segment (a file cut short)."""
    reason = f"segment ends at offset {first_offset}, the next one starts at {next_base}"
    return report(DamagedRange(path, size, size, first_offset, next_base - 1, reason))


#: Exceptions a decoder raises on a structurally inconsistent batch (struct.error is a
#: ValueError), turned into :class:`CorruptRecordBatch` on the read paths.
DECODE_ERRORS = (ValueError, IndexError, TypeError, OverflowError)


def first_offset_at(fd: int, path: Path, size: int, base_offset: int, timestamp: int) -> int | None:
    """``Segment.offset_for_time`` of a damaged segment: a verified walk of the whole file,
    damaged ranges reported and passed over."""
    for item in walk(fd, path, 0, size, base_offset):
        if item is None or isinstance(item, DamagedRange):
            if item is not None:
                report(item)
            continue
        buf, rel, _pos, _next = item
        if read_header(buf, rel).max_timestamp >= timestamp:
            for record in decode_batch(buf, rel):
                if record.timestamp >= timestamp:
                    return record.offset
    return None
