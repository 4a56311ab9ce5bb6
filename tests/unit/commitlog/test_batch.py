"""Record-batch encoding: round trips, CRC coverage, limits, format version."""

from __future__ import annotations

import struct

import pytest

from broker.commitlog.batch import (
    BATCH_HEADER_SIZE,
    CRC_OFFSET,
    MAGIC,
    RECORD_HEADER_SIZE,
    decode_batch,
    decode_into,
    encode_batch,
    read_header,
    validate_batch,
)
from broker.commitlog.errors import CorruptRecordBatch, InvalidRecord, UnsupportedFormat
from broker.commitlog.record import Record


def rec(i: int, **kw: object) -> Record:
    fields: dict[str, object] = {
        "offset": 0, "timestamp": 1_700_000_000_000 + i, "topic": f"t/{i}",
        "payload": f"payload-{i}".encode(),
    }
    fields.update(kw)
    return Record(**fields)  # type: ignore[arg-type]


def test_round_trip_assigns_consecutive_offsets() -> None:
    records = [
        rec(0, qos=2, retain=True, client_id="dev-1", properties=b"\x01\x02"),
        rec(1, topic="ünïcødé/✓", payload=b""),
        rec(2, timestamp=5),  # older than the first: negative delta
    ]
    buf = encode_batch(42, records)
    header = validate_batch(buf, 0, 42)
    assert header.base_offset == 42
    assert header.record_count == 3
    assert header.last_offset == 44
    assert header.batch_length == len(buf)
    assert header.magic == MAGIC
    assert header.first_timestamp == records[0].timestamp
    assert header.max_timestamp == max(r.timestamp for r in records)
    decoded = decode_batch(buf)
    assert decoded == [r._replace(offset=42 + i) for i, r in enumerate(records)]
    assert decoded[0].retain is True and decoded[1].retain is False


def test_keep_offsets_allows_gaps_and_rejects_disorder() -> None:
    records = [rec(0, offset=10), rec(1, offset=13), rec(2, offset=20)]
    buf = encode_batch(10, records, keep_offsets=True)
    header = validate_batch(buf, 0, 0)
    assert (header.record_count, header.last_offset_delta) == (3, 10)
    assert [r.offset for r in decode_batch(buf)] == [10, 13, 20]
    with pytest.raises(InvalidRecord):
        encode_batch(10, [rec(0, offset=12), rec(1, offset=12)], keep_offsets=True)


@pytest.mark.parametrize(
    "bad",
    [rec(0, topic="x" * 70_000), rec(0, client_id="c" * 70_000), rec(0, qos=-1)],
)
def test_unencodable_records_raise_invalid_record(bad: Record) -> None:
    with pytest.raises(InvalidRecord):
        encode_batch(0, [bad])


def test_empty_batch_is_refused() -> None:
    with pytest.raises(InvalidRecord):
        encode_batch(0, [])


def test_crc_covers_every_byte_of_header_and_body() -> None:
    buf = encode_batch(7, [rec(0), rec(1, properties=b"pp")])
    for i in range(len(buf)):
        damaged = bytearray(buf)
        damaged[i] ^= 0x40
        with pytest.raises((CorruptRecordBatch, UnsupportedFormat)):
            validate_batch(damaged, 0, 0)


def test_truncated_batches_are_corrupt() -> None:
    buf = encode_batch(0, [rec(0), rec(1)])
    for cut in (0, 10, BATCH_HEADER_SIZE, len(buf) - 1):
        with pytest.raises(CorruptRecordBatch):
            validate_batch(buf[:cut], 0, 0)


def test_offset_continuity_is_checked() -> None:
    buf = encode_batch(5, [rec(0)])
    validate_batch(buf, 0, 5)
    with pytest.raises(CorruptRecordBatch, match="below expected"):
        validate_batch(buf, 0, 6)


def _with_magic(buf: bytearray, magic: int) -> bytearray:
    import zlib

    out = bytearray(buf)
    out[12] = magic
    view = memoryview(out)
    crc = zlib.crc32(view[BATCH_HEADER_SIZE:], zlib.crc32(view[:CRC_OFFSET]))
    struct.pack_into("<I", out, CRC_OFFSET, crc)
    return out


def test_newer_magic_with_valid_crc_is_unsupported_format() -> None:
    future = _with_magic(encode_batch(0, [rec(0)]), MAGIC + 1)
    with pytest.raises(UnsupportedFormat, match=r"segment\.log") as info:
        validate_batch(future, 0, 0, path="segment.log")
    assert info.value.found == MAGIC + 1


def test_decode_into_respects_min_offset_and_limits() -> None:
    buf = bytes(encode_batch(100, [rec(i, payload=b"x" * 10) for i in range(5)]))
    out: list[Record] = []
    left, stop = decode_into(buf, 0, out, 102, 2, 1 << 20)
    assert [r.offset for r in out] == [102, 103] and stop == 104
    out = []
    size = RECORD_HEADER_SIZE + 10
    left, stop = decode_into(buf, 0, out, 0, 100, size * 2)
    assert [r.offset for r in out] == [100, 101] and stop == 102 and left == 0
    out = []
    _left, stop = decode_into(buf, 0, out, 0, 100, 1)  # at least one record
    assert [r.offset for r in out] == [100] and stop == 101


def test_header_layout_is_stable() -> None:
    buf = encode_batch(1, [rec(0)], leader_epoch=9)
    assert BATCH_HEADER_SIZE == 48
    assert struct.unpack_from("<qI", buf, 0) == (1, len(buf))
    assert buf[12] == MAGIC
    assert read_header(buf).leader_epoch == 9


def test_topics_and_client_ids_are_stored_once_per_batch() -> None:
    one = len(encode_batch(0, [rec(0, topic="devices/42/telemetry", client_id="dev-42")]))
    many = len(encode_batch(0, [rec(0, topic="devices/42/telemetry", client_id="dev-42")] * 100))
    record = RECORD_HEADER_SIZE + len(rec(0).payload)
    assert many - one == 99 * record
    decoded = decode_batch(encode_batch(0, [rec(i % 3, client_id=f"c{i % 2}") for i in range(9)]))
    assert [(r.topic, r.client_id) for r in decoded] == [
        (f"t/{i % 3}", f"c{i % 2}") for i in range(9)
    ]
