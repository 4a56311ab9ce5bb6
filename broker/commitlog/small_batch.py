"""The small-batch encoder: :func:`encode_small` writes the bytes of
:func:`~broker.commitlog.batch.encode_batch` for 1 .. :data:`SMALL_BATCH` records, in fewer steps;
and what a batch encoded by another worker needs (a forward, broker.workers.partitions):
:func:`rebased` to the offset it is appended at, :func:`decode_records` back into records.

A fleet appends one to three records per partition and event-loop iteration, where the
general encoder's per-call setup was most of the append. The two encoders are held to the
same bytes by ``tests/unit/commitlog/test_batch.py``; the format itself is described in
:mod:`broker.commitlog.batch`. Compiled (:mod:`broker.commitlog._smallbatch`, when built), the
encoder (of a batch of any size: :func:`encode`), the rebase and the decoder are one C call
each; the pure-Python forms here are the reference, and serve where it is not built
(``tests/unit/commitlog/test_smallbatch.py`` holds them to the same bytes and records).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from functools import lru_cache
from itertools import count
from types import ModuleType

from broker.commitlog.batch import (
    BATCH_HEADER,
    BATCH_HEADER_SIZE,
    CRC_OFFSET,
    MAGIC,
    decode_batch,
    encode_batch,
)
from broker.commitlog.crc import batch_crc
from broker.commitlog.record import Record

_smallbatch: ModuleType | None
try:
    from broker.commitlog import _smallbatch
except ImportError:  # not built: the pure-Python forms serve
    _smallbatch = None
#: ``"compiled"`` or ``"python"``: what encodes small batches, rebases and decodes them.
IMPLEMENTATION = "python" if _smallbatch is None else "compiled"

_CRC = struct.Struct("<I")
_I64 = struct.Struct("<q")
_EMPTY = b""

#: Batches of up to this many records take :func:`encode_small` (a fleet's appends: each
#: device's one message, a few per event-loop iteration).
SMALL_BATCH = 8
_HEAD = struct.Struct("<qIBBHiIIqq")  # BATCH_HEADER without its CRC (the last 4 bytes)
#: The offset-delta column of a small batch without gaps: 0 .. n-1.
_SMALL_DELTAS = tuple(tuple(range(n)) for n in range(SMALL_BATCH + 1))


@lru_cache(maxsize=64)
def _table_head(m: int) -> struct.Struct:
    """A string table's count and ``m`` lengths."""
    return struct.Struct(f"<I{m}H")


@lru_cache(maxsize=SMALL_BATCH)
def _small_columns(n: int) -> struct.Struct:
    """The fixed columns of ``n`` records, qos and flags as one unsigned byte each (the bytes
    ``bytes(qoss)`` and ``bytes(retains)`` give in :func:`encode_batch`)."""
    return struct.Struct(f"<{n}q{5 * n}I{2 * n}B")


def encode(
    base_offset: int, records: Sequence[Record], *, leader_epoch: int = 0
) -> bytes | bytearray:
    """``records`` as one batch from ``base_offset`` (consecutive offsets): compiled when
    built, whatever their number; else the small-batch encoder up to SMALL_BATCH records,
    the general one above (a bytearray, not copied)."""
    if _smallbatch is not None:
        batch: bytes | None = _smallbatch.encode_records(base_offset, records, leader_epoch)
        if batch is not None:
            return batch
    if len(records) <= SMALL_BATCH:
        return encode_small(base_offset, records, leader_epoch=leader_epoch)
    return encode_batch(base_offset, records, leader_epoch=leader_epoch)


def encode_small(base_offset: int, records: Sequence[Record], *, leader_epoch: int = 0) -> bytes:
    """:func:`encode_small_python`, compiled when built (module doc)."""
    if _smallbatch is not None:
        batch: bytes | None = _smallbatch.encode_small(base_offset, records, leader_epoch)
        if batch is not None:
            return batch
    return encode_small_python(base_offset, records, leader_epoch=leader_epoch)


def rebased(batch: bytes, base_offset: int) -> bytes:
    """``batch`` (one whole batch) with its base offset ``base_offset`` and its CRC computed
    again for it: a batch another worker encoded, appended at this log's end."""
    if _smallbatch is not None:
        out: bytes = _smallbatch.rebased(batch, base_offset)
        return out
    buf = bytearray(batch)
    if len(buf) < BATCH_HEADER_SIZE or BATCH_HEADER.unpack_from(buf)[1] != len(buf):
        raise ValueError("not one whole batch")
    _I64.pack_into(buf, 0, base_offset)
    _CRC.pack_into(buf, CRC_OFFSET, batch_crc(buf, 0, len(buf)))
    return bytes(buf)


def decode_records(batch: bytes | bytearray, pos: int = 0) -> list[Record]:
    """The records of the (checked) batch at ``batch[pos:]``: :func:`decode_batch`'s, in one
    C call when compiled (from bytes)."""
    if _smallbatch is not None and type(batch) is bytes:
        records: list[Record] | None = _smallbatch.decode_records(batch, pos)
        if records is not None:
            return records
    return decode_batch(batch, pos)


def encode_small_python(
    base_offset: int, records: Sequence[Record], *, leader_epoch: int = 0
) -> bytes:
    """:func:`encode_batch` (consecutive offsets) of 1 .. SMALL_BATCH records: the same
    bytes in fewer steps (a dict for the string table, one struct call for every fixed
    column, the CRC of the header and the body as two pieces instead of patched in place).
    A fleet appends one to three records per partition and iteration, where the general
    encoder's per-call setup was most of the append (see ``tests/unit/commitlog/
    test_batch.py`` for the timing and the byte-for-byte comparison).

    What it cannot encode (a field that does not fit, a record of the wrong shape) goes to
    :func:`encode_batch`, which raises the error the format calls for.
    """
    try:
        if len(records) == 1:
            return _encode_one(base_offset, records[0], leader_epoch)
        (_offsets, stamps, topics, payloads, qoss, retains, client_ids, props) = zip(
            *records, strict=True
        )
        n = len(stamps)
        names = [*dict.fromkeys(topics + client_ids)]  # first appearance: topics, then ids
        strings = [*map(str.encode, names)]
        # A scan of a few strings is cheaper than building a dict; of more, it is not.
        find = names.index if len(names) <= 4 else dict(zip(names, count())).__getitem__
        parts = [
            _table_head(len(strings)).pack(len(strings), *map(len, strings)),
            *strings,
            _small_columns(n).pack(
                *stamps,
                *_SMALL_DELTAS[n],
                *map(find, topics),
                *map(find, client_ids),
                *map(len, props),
                *map(len, payloads),
                *qoss,
                *retains,
            ),
            *props,
            *payloads,
        ]
        body = b"".join(parts)
        first_ts = stamps[0]
        head = _HEAD.pack(
            base_offset,
            BATCH_HEADER_SIZE + len(body),
            MAGIC,
            0,
            0,
            leader_epoch,
            n - 1,
            n,
            first_ts,
            max(stamps) if n > 1 else first_ts,
        )
    except (struct.error, AttributeError, TypeError, ValueError, OverflowError):
        return bytes(encode_batch(base_offset, records, leader_epoch=leader_epoch))
    return b"".join((head, _CRC.pack(zlib.crc32(body, zlib.crc32(head))), body))


_ONE_STRING = struct.Struct("<IH")
_TWO_STRINGS = struct.Struct("<IHH")
_ONE_RECORD = struct.Struct("<q5I2B")


def _encode_one(base_offset: int, record: Record, leader_epoch: int) -> bytes:
    """:func:`encode_small` of one record (a fleet device's message), without transposing."""
    (_offset, stamp, topic, payload, qos, retain, client_id, props) = record
    name = topic.encode()
    if client_id == topic:
        table, who, index = _ONE_STRING.pack(1, len(name)), _EMPTY, 0
    else:
        who = client_id.encode()
        table, index = _TWO_STRINGS.pack(2, len(name), len(who)), 1
    body = b"".join(
        (
            table,
            name,
            who,
            _ONE_RECORD.pack(stamp, 0, 0, index, len(props), len(payload), qos, retain),
            props,
            payload,
        )
    )
    head = _HEAD.pack(
        base_offset, BATCH_HEADER_SIZE + len(body), MAGIC, 0, 0, leader_epoch, 0, 1, stamp, stamp
    )
    return b"".join((head, _CRC.pack(zlib.crc32(body, zlib.crc32(head))), body))
