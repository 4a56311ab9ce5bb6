"""On-disk record-batch format (format version / magic 1).

A segment's ``.log`` file is a sequence of record batches; one :meth:`SegmentedLog.append` call
writes exactly one batch with one ``write()``. All integers are little-endian.

Batch header, 48 bytes (``BATCH_HEADER``, struct ``<qIBBHiIIqqI``)::

    off size field
      0  8   base_offset        offset of the first record (absolute, logical)
      8  4   batch_length       total bytes of the batch, this header included
     12  1   magic              on-disk format version (``MAGIC``)
     13  1   attributes         reserved, 0
     14  2   reserved           0
     16  4   leader_epoch       Raft term of the leader that wrote the batch (0 on one node)
     20  4   last_offset_delta  offset of the last record minus base_offset
     24  4   record_count       number of records (>= 1)
     28  8   first_timestamp    ms since the epoch of the first record (timestamp base)
     36  8   max_timestamp      largest record timestamp in the batch (ms)
     44  4   crc                zlib.crc32 over bytes [0, 44) then [48, batch_length)

The CRC covers every byte of the batch except itself, header included. The body starts with a
string table holding each distinct topic and client id of the batch once (MQTT batches repeat a
few topics and publishers many times, so records stay small and decoding a record decodes no
string)::

      0  4   string_count
      4  ..  string_count times: 2-byte length + UTF-8 bytes

Records follow, each a 30-byte header (``RECORD_HEADER``, struct ``<IqBBIIII``) and two
variable fields::

      0  4   offset_delta       record offset minus base_offset (strictly increasing)
      4  8   timestamp_delta    record timestamp minus first_timestamp (ms, signed)
     12  1   qos
     13  1   flags              bit 0: retain
     14  4   topic_index        index of the topic in the string table
     18  4   client_id_index    index of the client id in the string table
     22  4   properties_length
     26  4   payload_length
     30  ..  properties, payload

Invariants of a valid batch: ``record_count >= 1``; offset deltas strictly increase and the
last equals ``last_offset_delta`` (compaction leaves gaps, so ``last_offset_delta >=
record_count - 1``); string indexes lie inside the table; the table and the records fill
exactly ``batch_length - 48`` bytes; the CRC matches.

Decoding is the read hot path: one ``struct.unpack_from`` per record, two list lookups and one
slice of one buffer; no per-record syscall. Pure functions on buffers, no I/O; safe from any thread.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from broker.commitlog.errors import CorruptRecordBatch, InvalidRecord, UnsupportedFormat
from broker.commitlog.record import Record

#: Current on-disk format version, written in every batch and in ``DATA/FORMAT``.
MAGIC = 1

BATCH_HEADER = struct.Struct("<qIBBHiIIqqI")
BATCH_HEADER_SIZE = BATCH_HEADER.size  # 48
CRC_OFFSET = 44
RECORD_HEADER = struct.Struct("<IqBBIIII")
RECORD_HEADER_SIZE = RECORD_HEADER.size  # 30
_COUNT = struct.Struct("<I")
_STRLEN = struct.Struct("<H")
MAX_STRING_BYTES = 0xFFFF
RETAIN_FLAG = 0x01

_CRC = struct.Struct("<I")
_new_record = tuple.__new__
_RETAIN = (False, True)


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


assert BATCH_HEADER_SIZE == 48 and RECORD_HEADER_SIZE == 30  # layout documented above


def encode_batch(
    base_offset: int,
    records: Sequence[Record],
    *,
    leader_epoch: int = 0,
    keep_offsets: bool = False,
) -> bytearray:
    """Encode ``records`` as one batch starting at ``base_offset``.

    With ``keep_offsets`` (compaction), each record's own ``offset`` is kept and must be
    strictly increasing from ``base_offset``; otherwise records get consecutive offsets and
    the ``offset`` field passed in is ignored. Raises :class:`InvalidRecord` for a field that
    does not fit the format (topic or client id over 65,535 UTF-8 bytes, negative qos...).
    """
    if not records:
        raise InvalidRecord("a record batch needs at least one record")
    first_ts = records[0].timestamp
    max_ts = first_ts
    pack = RECORD_HEADER.pack
    strings: dict[str, int] = {}
    intern = strings.setdefault
    parts: list[bytes] = []
    extend = parts.extend
    delta = 0
    try:
        if keep_offsets:
            last_delta = -1
            for r in records:
                delta = r.offset - base_offset
                if delta <= last_delta:
                    raise InvalidRecord(
                        f"record offsets must increase from {base_offset}: got {r.offset}"
                    )
                last_delta = delta
                ts = r.timestamp
                if ts > max_ts:
                    max_ts = ts
                extend((pack(delta, ts - first_ts, r.qos, r.retain,
                             intern(r.topic, len(strings)), intern(r.client_id, len(strings)),
                             len(r.properties), len(r.payload)),
                        r.properties, r.payload))
        else:
            # The append hot path: tuple unpacking, two dict lookups and one extend per record.
            for _offset, ts, topic, payload, qos, retain, client_id, props in records:
                if ts > max_ts:
                    max_ts = ts
                extend((pack(delta, ts - first_ts, qos, retain, intern(topic, len(strings)),
                             intern(client_id, len(strings)), len(props), len(payload)),
                        props, payload))
                delta += 1
            delta -= 1
        table = [bytes(BATCH_HEADER_SIZE), _COUNT.pack(len(strings))]
        for string in strings:
            encoded = string.encode()
            table.append(_STRLEN.pack(len(encoded)))
            table.append(encoded)
    except struct.error as exc:
        raise InvalidRecord(f"a record does not fit the format: {exc}") from exc
    except (AttributeError, TypeError, ValueError) as exc:
        raise InvalidRecord(f"not a valid record: {exc}") from exc
    table.extend(parts)
    parts = table
    buf = bytearray().join(parts)
    length = len(buf)
    if length > 0xFFFFFFFF:
        raise InvalidRecord(f"record batch of {length} bytes exceeds 4 GiB")
    BATCH_HEADER.pack_into(
        buf, 0, base_offset, length, MAGIC, 0, 0, leader_epoch, delta, len(records),
        first_ts, max_ts, 0,
    )
    view = memoryview(buf)
    crc = zlib.crc32(view[BATCH_HEADER_SIZE:], zlib.crc32(view[:CRC_OFFSET]))
    view.release()
    _CRC.pack_into(buf, CRC_OFFSET, crc)
    return buf


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
    if length < BATCH_HEADER_SIZE + RECORD_HEADER_SIZE:
        raise CorruptRecordBatch(f"batch length {length} too small", where, path)
    if len(buf) - pos < length:
        raise CorruptRecordBatch(
            f"batch length {length} runs past the end of the data", where, path
        )
    view = memoryview(buf)
    try:
        crc = zlib.crc32(view[pos + BATCH_HEADER_SIZE : pos + length],
                         zlib.crc32(view[pos : pos + CRC_OFFSET]))
    finally:
        view.release()
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
    if h.record_count < 1 or h.last_offset_delta < h.record_count - 1:
        raise CorruptRecordBatch(
            f"record count {h.record_count} inconsistent with last offset delta "
            f"{h.last_offset_delta}", where, path,
        )
    end = pos + length
    try:
        _strings, p = _read_table(buf, pos + BATCH_HEADER_SIZE, end)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise CorruptRecordBatch(f"bad string table: {exc}", where, path) from None
    table_size = len(_strings)
    unpack = RECORD_HEADER.unpack_from
    last = -1
    for _ in range(h.record_count):
        if end - p < RECORD_HEADER_SIZE:
            raise CorruptRecordBatch("record header past the batch end", where, path)
        d, _td, _q, _f, ti, ci, pl, yl = unpack(buf, p)
        if d <= last:
            raise CorruptRecordBatch("record offset deltas not increasing", where, path)
        if ti >= table_size or ci >= table_size:
            raise CorruptRecordBatch("string index outside the table", where, path)
        last = d
        p += RECORD_HEADER_SIZE + pl + yl
    if p != end or last != h.last_offset_delta:
        raise CorruptRecordBatch("record sizes do not add up to the batch length", where, path)
    return h


def _read_table(buf: bytes | bytearray | memoryview, p: int, end: int) -> tuple[list[str], int]:
    """Decode the string table at ``p``; return it and the position of the first record."""
    (count,) = _COUNT.unpack_from(buf, p)
    p += 4
    if count > end - p:
        raise ValueError(f"{count} strings cannot fit")
    unpack = _STRLEN.unpack_from
    strings: list[str] = []
    for _ in range(count):
        (n,) = unpack(buf, p)
        p += 2
        q = p + n
        if q > end:
            raise ValueError("string past the batch end")
        strings.append(str(buf[p:q], "utf-8"))
        p = q
    return strings, p


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
    size (its 30-byte header, properties and payload; the batch's shared strings are not
    counted per record) exceeds the remaining ``max_bytes`` budget and ``out`` is not empty (a read
    always returns at least one record). Returns ``(bytes_left, stop_offset)``: the remaining
    byte budget and the offset of the first record not returned because a limit was hit, or -1
    when the batch was consumed to its end. The hot path of :meth:`SegmentedLog.read`: a batch
    that fits the limits entirely is decoded without per-record limit checks.
    """
    (base, length, _magic, _attrs, _res, _epoch, _lod, count, first_ts, _max_ts,
     _crc) = BATCH_HEADER.unpack_from(buf, pos)
    strings, p = _read_table(buf, pos + BATCH_HEADER_SIZE, pos + length)
    unpack = RECORD_HEADER.unpack_from
    add = out.append
    new = _new_record
    rec_cls = Record
    flag = _RETAIN
    body = length - BATCH_HEADER_SIZE
    if min_offset <= base and body <= max_bytes and count <= max_records - len(out):
        for _ in range(count):
            d, td, qos, flags, ti, ci, pl, yl = unpack(buf, p)
            p += RECORD_HEADER_SIZE
            if pl:
                q = p + pl
                props = buf[p:q]
            else:
                q = p
                props = b""
            p = q + yl
            add(new(rec_cls, (base + d, first_ts + td, strings[ti], buf[q:p], qos,
                              flag[flags & 1], strings[ci], props)))
        return max_bytes - body, -1
    n = len(out)
    for _ in range(count):
        d, td, qos, flags, ti, ci, pl, yl = unpack(buf, p)
        offset = base + d
        size = RECORD_HEADER_SIZE + pl + yl
        if offset < min_offset:
            p += size
            continue
        if n >= max_records or (size > max_bytes and n):
            return max_bytes, offset
        p += RECORD_HEADER_SIZE
        q = p + pl
        props = buf[p:q] if pl else b""
        p = q + yl
        add(new(rec_cls, (offset, first_ts + td, strings[ti], buf[q:p], qos, flag[flags & 1],
                          strings[ci], props)))
        n += 1
        max_bytes -= size
    return max_bytes, -1
