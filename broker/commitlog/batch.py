"""On-disk record-batch format (format version / magic 1).

A segment's ``.log`` file is a sequence of record batches; one :meth:`SegmentedLog.append` call
writes exactly one batch with one ``write()``. All integers are little-endian.

Batch header, 48 bytes (``BATCH_HEADER``, struct ``<qIBBHiIIqqI``)::

    off size field
      0  8   base_offset        offset of the first record (absolute, logical)
      8  4   batch_length       total bytes of the batch, this header included
     12  1   magic              on-disk format version (``MAGIC``)
     13  1   attributes         bit 0: control batch (``CONTROL_FLAG``); other bits reserved, 0
     14  2   reserved           0
     16  4   leader_epoch       Raft term of the leader that wrote the batch (0 on one node);
                                set once by that leader, never rewritten (replication writes
                                the leader's bytes, compaction keeps it)
     20  4   last_offset_delta  offset of the last record minus base_offset
     24  4   record_count       number of records, ``n`` (>= 1)
     28  8   first_timestamp    timestamp of the first record (ms since the epoch)
     36  8   max_timestamp      largest record timestamp in the batch (ms)
     44  4   crc                CRC-32 (zlib's) over bytes [0, 44) then [48, batch_length)

The CRC covers every byte of the batch except itself, header included. The body starts with a
string table holding each distinct topic and client id of the batch once (MQTT batches repeat a
few topics and publishers many times, so records stay small and decoding a record decodes no
string). With ``m`` strings::

    size    field
    4       string_count        ``m``
    2 * m   string_lengths      UTF-8 bytes of each string (at most 65,535)
    ..      strings             the UTF-8 bytes of the ``m`` strings, concatenated

The records follow column by column (``columns(n)``, struct ``<{n}q{5n}I{n}s{n}s``): each
fixed-size field of all ``n`` records, then the variable parts. ``RECORD_FIXED_SIZE`` (30)
bytes of columns per record::

    size    column
    8 * n   timestamp          record timestamps (ms since the epoch, signed)
    4 * n   offset_delta       record offset minus base_offset (strictly increasing)
    4 * n   topic_index        index of the record's topic in the string table
    4 * n   client_id_index    index of the record's client id in the string table
    4 * n   properties_length  bytes of the record's properties
    4 * n   payload_length     bytes of the record's payload
    1 * n   qos
    1 * n   flags              bit 0: retain; other bits reserved (0), ignored when read
    ..      properties         every record's properties, concatenated in record order
    ..      payloads           every record's payload, concatenated in record order

Invariants of a valid batch: ``record_count >= 1``; offset deltas strictly increase, the last
at most ``last_offset_delta``; string indexes lie inside the table; the table, the columns, the
properties and the payloads fill exactly ``batch_length - 48`` bytes; the CRC matches. A batch
covers offsets ``base_offset .. base_offset + last_offset_delta``, a record at each when
appended; compaction (:mod:`broker.commitlog.policy`) leaves gaps, the last record's included,
and keeps a batch's base offset, last offset delta (as Kafka keeps ``lastOffsetDelta``), epoch
and attributes, so batches (Raft's entries, :mod:`broker.cluster.storage`) never move.

A control batch (attributes bit 0) holds no client record but a marker: one record at delta 0,
empty topic and client id, qos 0, no flags, no properties, a payload of a 2-byte little-endian
control type and the control body (:func:`encode_control`, :func:`decode_control`): 1 (no-op)
and 2 (configuration), :mod:`broker.cluster.storage`'s Raft entries, one offset each; 3
(``CONTROL_COMPACTED``, no body) what compaction leaves of a batch it emptied in a log that
``keep_empty_batches``, with its offsets, epoch and ``max_timestamp`` (the segment's age holds).
Readers of records skip them (:func:`decode_into`, the column reads, so ``read``,
``read_columns``, the fetch API, replay, live delivery); compaction keeps them as they are. Older
readers refuse a gap at a batch's end: ``DATA/FORMAT`` 2 keeps them off (``streams.py``).

Why columns: the whole batch is encoded and decoded by C loops (``zip``, ``map``, one
``struct`` call for every fixed field of every record, ``bytes.join``) instead of a Python loop
per record; appending and reading cost well under a microsecond of interpreter time per record.
Equal-size payloads (fixed-format telemetry) are cut with one cached struct instead of slices.

Pure functions on buffers, no I/O; safe from any thread.
"""

from __future__ import annotations

import struct
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence, Sized
from functools import lru_cache
from itertools import accumulate, count, repeat
from operator import add, getitem, itemgetter, lt, sub
from pathlib import Path
from typing import NamedTuple, TypeVar, cast

from broker.commitlog import crc
from broker.commitlog.crc import batch_crc
from broker.commitlog.errors import CorruptRecordBatch, InvalidRecord, UnsupportedFormat
from broker.commitlog.record import Record

#: Current on-disk format version, written in every batch and in ``DATA/FORMAT``.
MAGIC = 1

BATCH_HEADER = struct.Struct("<qIBBHiIIqqI")
BATCH_HEADER_SIZE = BATCH_HEADER.size  # 48
CRC_OFFSET = 44
#: Bytes of the fixed-size columns per record (timestamp, five 4-byte fields, qos, flags).
RECORD_FIXED_SIZE = 8 + 5 * 4 + 1 + 1  # 30
_COUNT = struct.Struct("<I")
#: Smallest possible batch: header, string count, one (empty) string, one record's columns.
MIN_BATCH_SIZE = BATCH_HEADER_SIZE + _COUNT.size + 2 + RECORD_FIXED_SIZE
MAX_STRING_BYTES = 0xFFFF
RETAIN_FLAG = 0x01
#: Attributes bit 0: a control batch, which readers of records skip (module doc).
CONTROL_FLAG = 0x01
#: Control type of what compaction leaves of a batch it emptied (module doc).
CONTROL_COMPACTED = 3
_CONTROL_TYPE = struct.Struct("<H")

_CRC = struct.Struct("<I")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")
_new = tuple.__new__
#: ``operator.getitem`` typed for slicing bytes (mapped over slices: a C call per item).
_slice = cast("Callable[[bytes, slice], bytes]", getitem)
#: Decoded retain flag of each possible flags byte (bit 0).
_RETAIN = (False, True) * 128
_EMPTY = b""

_Out = TypeVar("_Out", bound=Sized)
#: Adds one batch's records to a read's output (:func:`decode_into` for ``list[Record]``,
#: :func:`broker.commitlog.columns.decode_columns_into` for columns): ``(buffer, batch
#: position, output, min_offset, max_records, max_bytes) -> (bytes_left, stop_offset)``,
#: ``len(output)`` counting the records added so far.
Decoder = Callable[[bytes, int, _Out, int, int, int], tuple[int, int]]


class BatchHeader(NamedTuple):
    """The decoded 48-byte batch header."""

    base_offset: int
    batch_length: int
    magic: int
    attributes: int
    reserved: int
    leader_epoch: int
    last_offset_delta: int
    record_count: int
    first_timestamp: int
    max_timestamp: int
    crc: int

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.last_offset_delta + 1


assert BATCH_HEADER_SIZE == 48 and RECORD_FIXED_SIZE == 30  # layout documented above
assert (BATCH_HEADER_SIZE, CRC_OFFSET) == (crc.HEADER_SIZE, crc.CRC_AT)  # batch_crc's layout


@lru_cache(maxsize=128)
def columns(n: int) -> struct.Struct:
    """The struct of the fixed-size columns of a batch of ``n`` records (see module doc)."""
    return struct.Struct(f"<{n}q{5 * n}I{n}s{n}s")


@lru_cache(maxsize=128)
def _array(code: str, n: int) -> struct.Struct:
    """``n`` little-endian integers of struct type ``code``: one column of a batch."""
    return struct.Struct(f"<{n}{code}")


#: Batches whose equal-size payloads are cut by one cached struct: from a size where that
#: beats slicing, to a size that bounds the cache's memory.
_EQUAL_SLICES_MIN = 16
_EQUAL_SLICES_MAX = 4096


@lru_cache(maxsize=16)
def _equal_slices(size: int, n: int) -> struct.Struct:
    """``n`` consecutive byte strings of ``size`` bytes each."""
    return struct.Struct(f"{size}s" * n)


@lru_cache(maxsize=32)
def _consecutive_deltas(n: int) -> bytes:
    """The offset-delta column of a batch without gaps: 0 .. n-1."""
    return _array("I", n).pack(*range(n))


def _column(code: str, single: struct.Struct, values: tuple[int, ...]) -> bytes:
    """Pack one integer column; a column of one repeated value (a batch's timestamps, equal
    payload sizes, no properties) is one value packed and repeated."""
    n = len(values)
    if values.count(values[0]) == n:
        return single.pack(values[0]) * n
    return _array(code, n).pack(*values)


def encode_batch(
    base_offset: int,
    records: Sequence[Record],
    *,
    leader_epoch: int = 0,
    keep_offsets: bool = False,
    last_offset_delta: int | None = None,
    attributes: int = 0,
) -> bytearray:
    """Encode ``records`` as one batch starting at ``base_offset`` (the append hot path:
    every step is one C-level pass over the batch, see module doc).

    With ``keep_offsets`` (compaction), each record's own ``offset`` is kept and must be
    strictly increasing from ``base_offset``; otherwise records get consecutive offsets and
    the ``offset`` field passed in is ignored. ``last_offset_delta`` (compaction keeps the
    original's) may end the batch past its last record; ``attributes`` is the header's byte.
    Raises :class:`InvalidRecord` for a field that does not fit the format (topic or client id
    over 65,535 UTF-8 bytes, negative qos...) or a ``last_offset_delta`` before the last record.
    """
    n = len(records)
    if not n:
        raise InvalidRecord("a record batch needs at least one record")
    try:
        # One transposition in C: a tuple per field, each holding that field of every record.
        (offsets, stamps, topics, payloads, qoss, retains, client_ids, props) = zip(
            *records, strict=True
        )
        if keep_offsets:
            deltas = tuple(map(sub, offsets, repeat(base_offset)))
            if deltas[0] < 0 or not all(map(lt, deltas, deltas[1:])):
                raise InvalidRecord(
                    f"record offsets must increase from {base_offset}: got {list(offsets)}"
                )
            last_delta = deltas[-1]
            delta_column = _array("I", n).pack(*deltas)
        else:
            last_delta = n - 1
            delta_column = _consecutive_deltas(n)
        if last_offset_delta is not None:
            if last_offset_delta < last_delta:
                raise InvalidRecord(f"last offset delta {last_offset_delta} < {last_delta}")
            last_delta = last_offset_delta
        # The string table and both index columns in one pass per column: a missing string
        # gets the next index as it is first seen (topics first, then client ids), so the
        # table is in first-appearance order.
        index: defaultdict[str, int] = defaultdict(count().__next__)
        lookup = index.__getitem__
        topic_indexes = list(map(lookup, topics))
        client_id_indexes = list(map(lookup, client_ids))
        strings = list(map(str.encode, index))
        uint = _array("I", n).pack
        same_stamps = stamps.count(stamps[0]) == n
        no_props = props.count(b"") == n
        parts = [
            bytes(BATCH_HEADER_SIZE),
            _COUNT.pack(len(strings)),
            _array("H", len(strings)).pack(*map(len, strings)),
            *strings,
            _I64.pack(stamps[0]) * n if same_stamps else _array("q", n).pack(*stamps),
            delta_column,
            uint(*topic_indexes),
            uint(*client_id_indexes),
            # Properties are usually all empty (MQTT 3.1.1 and most 5.0 publishes).
            bytes(4 * n) if no_props else _column("I", _U32, tuple(map(len, props))),
            _column("I", _U32, tuple(map(len, payloads))),
            bytes(qoss),
            bytes(retains),
        ]
        if not no_props:
            parts += props
        parts += payloads
        buf = bytearray().join(parts)
        first_ts = stamps[0]
        max_ts = first_ts if same_stamps else max(stamps)
    except struct.error as exc:
        raise InvalidRecord(f"a record does not fit the format: {exc}") from exc
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:
        raise InvalidRecord(f"not a valid record: {exc}") from exc
    length = len(buf)
    if length > 0xFFFFFFFF:
        raise InvalidRecord(f"record batch of {length} bytes exceeds 4 GiB")
    BATCH_HEADER.pack_into(
        buf,
        0,
        base_offset,
        length,
        MAGIC,
        attributes,
        0,
        leader_epoch,
        last_delta,
        n,
        first_ts,
        max_ts,
        0,
    )
    _CRC.pack_into(buf, CRC_OFFSET, batch_crc(buf, 0, length))
    return buf


def encode_control(
    base_offset: int,
    leader_epoch: int,
    control_type: int,
    body: bytes,
    timestamp_ms: int,
    last_offset_delta: int = 0,
) -> bytes:
    """A control batch (module doc) at ``base_offset``, skipped by readers: one offset, or
    ``last_offset_delta + 1`` (a ``CONTROL_COMPACTED`` batch)."""
    if not 0 <= control_type <= 0xFFFF:
        raise InvalidRecord(f"control type {control_type} does not fit 2 bytes")
    payload = _CONTROL_TYPE.pack(control_type) + body
    buf = encode_batch(
        base_offset,
        [Record(0, timestamp_ms, "", payload, 0, False, "", b"")],
        leader_epoch=leader_epoch,
        last_offset_delta=last_offset_delta,
        attributes=CONTROL_FLAG,
    )
    return bytes(buf)


def decode_control(buf: bytes | bytearray | memoryview, pos: int = 0) -> tuple[int, bytes]:
    """``(control type, body)`` of the (validated) control batch at ``pos``."""
    h = read_header(buf, pos)
    if not h.attributes & CONTROL_FLAG:
        raise ValueError(f"the batch at offset {h.base_offset} is not a control batch")
    n = h.record_count
    _strings, p = _read_table(buf, pos + BATCH_HEADER_SIZE, pos + h.batch_length)
    start = p + n * RECORD_FIXED_SIZE  # no properties: the payload follows the columns
    payload = bytes(buf[start : pos + h.batch_length])
    return _CONTROL_TYPE.unpack_from(payload)[0], payload[_CONTROL_TYPE.size :]


def read_header(buf: bytes | bytearray | memoryview, pos: int = 0) -> BatchHeader:
    """Decode the batch header at ``pos`` (no validation beyond its size)."""
    return BatchHeader._make(BATCH_HEADER.unpack_from(buf, pos))


def validate_batch(
    buf: bytes | bytearray | memoryview,
    pos: int,
    min_base_offset: int,
    *,
    path: Path | str | None = None,
    position: int | None = None,
) -> BatchHeader:
    """Check the batch at ``buf[pos:]`` fully and return its header.

    ``buf`` must hold at least the whole batch (the caller reads ``batch_length`` bytes);
    ``min_base_offset`` is the smallest acceptable base offset (offset continuity with the
    previous batch). ``position`` is the file position used in error messages. Raises
    :class:`CorruptRecordBatch` (recovery truncates there) or :class:`UnsupportedFormat` for a
    batch with a valid CRC and a newer magic.
    """
    where = pos if position is None else position
    if len(buf) - pos < BATCH_HEADER_SIZE:
        raise CorruptRecordBatch("truncated batch header", where, path)
    h = read_header(buf, pos)
    length = h.batch_length
    if length < MIN_BATCH_SIZE:
        raise CorruptRecordBatch(f"batch length {length} too small", where, path)
    if len(buf) - pos < length:
        raise CorruptRecordBatch(
            f"batch length {length} runs past the end of the data", where, path
        )
    crc = batch_crc(buf, pos, length)
    if crc != h.crc:
        raise CorruptRecordBatch(
            f"CRC mismatch (stored {h.crc:#010x}, computed {crc:#010x})", where, path
        )
    if h.magic != MAGIC:
        if h.magic > MAGIC:
            raise UnsupportedFormat(f"{path} (batch at byte {where})", h.magic, MAGIC)
        raise CorruptRecordBatch(f"unknown magic {h.magic}", where, path)
    if h.base_offset < min_base_offset:
        raise CorruptRecordBatch(
            f"base offset {h.base_offset} below expected {min_base_offset}", where, path
        )
    n = h.record_count
    if n < 1 or h.last_offset_delta < n - 1:
        raise CorruptRecordBatch(
            f"record count {n} inconsistent with last offset delta {h.last_offset_delta}",
            where,
            path,
        )
    end = pos + length
    try:
        strings, p = _read_table(buf, pos + BATCH_HEADER_SIZE, end)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise CorruptRecordBatch(f"bad string table: {exc}", where, path) from None
    if end - p < n * RECORD_FIXED_SIZE:
        raise CorruptRecordBatch("record columns past the batch end", where, path)
    cols = columns(n).unpack_from(buf, p)
    deltas = cols[n : 2 * n]
    if not all(map(lt, deltas, deltas[1:])):
        raise CorruptRecordBatch("record offset deltas not increasing", where, path)
    if max(cols[2 * n : 4 * n]) >= len(strings):
        raise CorruptRecordBatch("string index outside the table", where, path)
    if deltas[-1] > h.last_offset_delta:  # below it: compaction's gap at the batch's end
        raise CorruptRecordBatch("record offset delta past the last offset delta", where, path)
    if p + n * RECORD_FIXED_SIZE + sum(cols[4 * n : 6 * n]) != end:
        raise CorruptRecordBatch("record sizes do not add up to the batch length", where, path)
    return h


def _read_table(buf: bytes | bytearray | memoryview, p: int, end: int) -> tuple[list[str], int]:
    """Decode the string table at ``p``; return it and the position of the first column.

    Raises ValueError (UnicodeDecodeError included) or struct.error for a table that does not
    fit before ``end`` or holds invalid UTF-8.
    """
    (m,) = _COUNT.unpack_from(buf, p)
    p += 4
    if 2 * m > end - p:
        raise ValueError(f"{m} strings cannot fit")
    start = p + 2 * m
    # Offsets inside the strings blob (character offsets too when it is ASCII).
    bounds = list(accumulate(_array("H", m).unpack_from(buf, p), initial=0))
    q = start + bounds[-1]
    if q > end:
        raise ValueError("strings past the batch end")
    blob = bytes(buf[start:q])
    slices = map(slice, bounds, bounds[1:])
    if blob.isascii():
        # ASCII (nearly every MQTT topic): one decode, then a slice per string.
        return list(map(getitem, repeat(str(blob, "ascii")), slices)), q
    utf8 = cast("Callable[[bytes, str], str]", str)
    cut = cast("Callable[[bytes, slice], bytes]", getitem)
    return list(map(utf8, map(cut, repeat(blob), slices), repeat("utf-8"))), q


def decode_batch(buf: bytes | bytearray | memoryview, pos: int = 0) -> list[Record]:
    """Decode every record of the (already validated or trusted) batch at ``pos``."""
    out: list[Record] = []
    decode_into(bytes(buf), pos, out, -1, 1 << 62, 1 << 62)
    return out


def decode_into(
    buf: bytes,
    pos: int,
    out: list[Record],
    min_offset: int,
    max_records: int,
    max_bytes: int,
) -> tuple[int, int]:
    """Append to ``out`` the records of the batch at ``pos`` whose offset is ``>= min_offset``.

    Stops before a record when ``out`` holds ``max_records`` records, or when the record's
    size (its 30 bytes of columns, properties and payload; the batch's shared strings are not
    counted per record) exceeds the remaining ``max_bytes`` budget and ``out`` is not empty (a
    read always returns at least one record). Returns ``(bytes_left, stop_offset)``: the
    remaining byte budget and the offset of the first record not returned because a limit was
    hit, or -1 when the batch was consumed to its end. The read hot path of
    :meth:`SegmentedLog.read`: no Python loop per record. ``buf`` must be ``bytes`` (records
    hold slices of it). A control batch adds nothing (module doc).
    """
    (base, length, _magic, attrs, _res, _epoch, last_delta, n, _first_ts, _max_ts, _crc) = (
        BATCH_HEADER.unpack_from(buf, pos)
    )
    if attrs & CONTROL_FLAG:
        return max_bytes, -1
    strings, p = _read_table(buf, pos + BATCH_HEADER_SIZE, pos + length)
    consecutive = last_delta == n - 1  # strictly increasing deltas: exactly 0 .. n-1
    size = pos + length - p  # of all records: columns, properties and payloads
    data = p + n * RECORD_FIXED_SIZE  # the properties, then the payloads
    stamps: Sequence[int] | repeat[int]
    offsets: Iterable[int]
    if min_offset <= base and size <= max_bytes and n <= max_records - len(out):
        # The whole batch (every batch of a sequential read but the last, usually): unpack
        # only the columns that vary; byte counts over the raw column show a constant one.
        first, stop, bytes_left, stop_offset = 0, n, max_bytes - size, -1
        if buf.count(buf[p : p + 8], p, p + 8 * n) == n:  # n non-overlapping copies tile it
            stamps = repeat(_I64.unpack_from(buf, p)[0])
        else:
            stamps = _array("q", n).unpack_from(buf, p)
        if consecutive:
            offsets = range(base, base + n)
        else:
            offsets = map(add, _array("I", n).unpack_from(buf, p + 8 * n), repeat(base))
        indexes = _array("I", 2 * n).unpack_from(buf, p + 12 * n)
        topic_indexes, client_id_indexes = indexes[:n], indexes[n:]
        prop_lengths: Sequence[int] = (
            ()
            if buf.count(0, p + 20 * n, p + 24 * n) == 4 * n
            else _array("I", n).unpack_from(buf, p + 20 * n)
        )
        payloads_at = data + sum(prop_lengths)
        (payload_size,) = _U32.unpack_from(buf, p + 24 * n)
        equal_sizes = buf.count(buf[p + 24 * n : p + 24 * n + 4], p + 24 * n, p + 28 * n) == n
        sizes: Sequence[int] = () if equal_sizes else _array("I", n).unpack_from(buf, p + 24 * n)
        qos = buf[p + 28 * n : p + 29 * n]
        flags = buf[p + 29 * n : data]
    else:
        cols = columns(n).unpack_from(buf, p)
        first, stop, bytes_left, stop_offset = _limit(
            cols, n, base, consecutive, len(out), min_offset, max_records, max_bytes
        )
        if first == stop:
            return bytes_left, stop_offset
        ints = cast("tuple[int, ...]", cols[: 6 * n])
        stamps = ints[first:stop]
        if consecutive:
            offsets = range(base + first, base + stop)
        else:
            offsets = map(add, ints[n + first : n + stop], repeat(base))
        topic_indexes = ints[2 * n + first : 2 * n + stop]
        client_id_indexes = ints[3 * n + first : 3 * n + stop]
        prop_lengths = ints[4 * n : 5 * n]
        payloads_at = data + sum(prop_lengths)
        sizes = ints[5 * n : 6 * n]
        payload_size = sizes[first]
        equal_sizes = sizes[first:stop].count(payload_size) == stop - first
        qos = cast("bytes", cols[6 * n])[first:stop]
        flags = cast("bytes", cols[6 * n + 1])[first:stop]
    props: Iterable[bytes]
    if payloads_at == data:
        props = repeat(_EMPTY)
    else:
        bounds = list(accumulate(prop_lengths[:stop], initial=data))
        props = map(_slice, repeat(buf), map(slice, bounds[first:stop], bounds[first + 1 :]))
    payloads: Iterable[bytes]
    count = stop - first
    if equal_sizes and _EQUAL_SLICES_MIN <= count <= _EQUAL_SLICES_MAX:
        # Equal sizes (fixed-format telemetry): one struct call cuts them all. Equal from
        # ``first`` on says nothing of the records before it: skip their own sizes.
        payloads = _equal_slices(payload_size, count).unpack_from(
            buf, payloads_at + sum(sizes[:first])
        )
    else:
        bounds = list(accumulate(sizes[:stop] or repeat(payload_size, stop), initial=payloads_at))
        payloads = map(_slice, repeat(buf), map(slice, bounds[first:stop], bounds[first + 1 :]))
    retains: Iterable[bool] = (
        repeat(False) if flags.count(0) == count else map(_RETAIN.__getitem__, flags)
    )
    out.extend(
        map(
            _new,
            repeat(Record),
            zip(
                offsets,
                stamps,
                _strings(strings, topic_indexes),
                payloads,
                qos,
                retains,
                _strings(strings, client_id_indexes),
                props,
                strict=False,  # repeat() columns are endless; the others hold stop - first items
            ),
        )
    )
    return bytes_left, stop_offset


def _strings(strings: list[str], indexes: Sequence[int]) -> Sequence[str]:
    """The strings at ``indexes`` of a batch's table: one ``itemgetter`` call (twice as fast
    as a lookup per record, measured), which returns a bare item for a single index."""
    if len(indexes) == 1:
        return (strings[indexes[0]],)
    picked: Sequence[str] = itemgetter(*indexes)(strings)
    return picked


def _limit(
    cols: tuple[int | bytes, ...],
    n: int,
    base: int,
    consecutive: bool,
    have: int,
    min_offset: int,
    max_records: int,
    max_bytes: int,
) -> tuple[int, int, int, int]:
    """The records ``[first, stop)`` of a batch that a read with these limits returns, the byte
    budget left and the stop offset (see :func:`decode_into`), for a batch that does not fit
    whole: it starts before ``min_offset`` or exceeds a limit."""
    if min_offset <= base:
        first = 0
    elif consecutive:
        first = min(min_offset - base, n)
    else:
        first = bisect_left(cols, min_offset - base, n, 2 * n) - n
    room = max(0, max_records - have)
    # Running total of the record sizes from ``first``: columns, properties and payload.
    sizes = list(
        accumulate(
            map(
                add,
                map(add, cols[4 * n + first : 5 * n], cols[5 * n + first : 6 * n]),
                repeat(RECORD_FIXED_SIZE),
            )
        )
    )
    take = min(bisect_right(sizes, max_bytes), room)
    if not take and not have and room > 0 and sizes:
        take = 1  # a read always returns at least one record
    stop = first + take
    bytes_left = max_bytes - sizes[take - 1] if take else max_bytes
    if stop == n:
        return first, stop, bytes_left, -1
    stop_delta = stop if consecutive else cols[n + stop]
    return first, stop, bytes_left, base + stop_delta  # type: ignore[operator]
