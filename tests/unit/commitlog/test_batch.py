"""Record-batch encoding: round trips (examples and hypothesis against a per-record reference),
the column layout byte for byte, CRC coverage, limits, format version."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.commitlog.batch import (
    BATCH_HEADER_SIZE,
    CRC_OFFSET,
    MAGIC,
    RECORD_FIXED_SIZE,
    decode_batch,
    decode_into,
    encode_batch,
    read_header,
    validate_batch,
)
from broker.commitlog.errors import CorruptRecordBatch, InvalidRecord, UnsupportedFormat
from broker.commitlog.record import Record
from broker.commitlog.small_batch import SMALL_BATCH, encode_small


def rec(i: int, **kw: object) -> Record:
    fields: dict[str, object] = {
        "offset": 0,
        "timestamp": 1_700_000_000_000 + i,
        "topic": f"t/{i}",
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
    with pytest.raises(InvalidRecord):
        encode_small(0, [bad])
    with pytest.raises(InvalidRecord):
        encode_small(0, [rec(1), bad])


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
    size = RECORD_FIXED_SIZE + 10
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
    record = RECORD_FIXED_SIZE + len(rec(0).payload)
    assert many - one == 99 * record
    decoded = decode_batch(encode_batch(0, [rec(i % 3, client_id=f"c{i % 2}") for i in range(9)]))
    assert [(r.topic, r.client_id) for r in decoded] == [
        (f"t/{i % 3}", f"c{i % 2}") for i in range(9)
    ]


def test_column_layout_is_stable() -> None:
    # Built by hand from the module docstring, independently of the encoder.
    records = [
        Record(0, 1_000, "a/b", b"xyz", 1, True, "c1", b"\x01"),
        Record(0, 999, "ü", b"", 2, False, "a/b", b""),
    ]
    strings = ["a/b", "ü", "c1"]  # each once: the topics, then the other client ids
    encoded = [t.encode() for t in strings]
    body = b"".join(
        [
            struct.pack("<I3H", 3, *map(len, encoded)),
            *encoded,
            struct.pack("<2q", 1_000, 999),
            struct.pack("<2I", 0, 1),  # offset deltas
            struct.pack("<2I", 0, 1),  # topic indexes
            struct.pack("<2I", 2, 0),  # client id indexes
            struct.pack("<2I", 1, 0),  # properties lengths
            struct.pack("<2I", 3, 0),  # payload lengths
            bytes([1, 2]),
            bytes([1, 0]),  # qos, flags
            b"\x01",
            b"xyz",
        ]
    )
    length = BATCH_HEADER_SIZE + len(body)
    head = struct.pack("<qIBBHiIIqq", 7, length, MAGIC, 0, 0, 3, 1, 2, 1_000, 1_000)
    crc = zlib.crc32(body, zlib.crc32(head))
    assert bytes(encode_batch(7, records, leader_epoch=3)) == head + struct.pack("<I", crc) + body


# --- property tests against a per-record reference ------------------------------------------

_text = st.text(max_size=12)
_records = st.lists(
    st.builds(
        Record,
        offset=st.just(0),
        timestamp=st.integers(-(2**63), 2**63 - 1),
        topic=st.one_of(st.sampled_from(["", "t/1", "dev/ü/✓"]), _text),
        payload=st.binary(max_size=40),
        qos=st.integers(0, 255),
        retain=st.booleans(),
        client_id=st.one_of(st.sampled_from(["", "c"]), _text),
        properties=st.one_of(st.just(b""), st.binary(max_size=10)),
    ),
    min_size=1,
    max_size=40,
)


def _maybe_equal_sizes(records: list[Record], equal: bool) -> list[Record]:
    """With ``equal``, every payload gets the first one's size (decode_into's fast path)."""
    if not equal:
        return records
    size = len(records[0].payload)
    return [r._replace(payload=(r.payload * (size + 1))[:size] or bytes(size)) for r in records]


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    records=_records,
    base=st.integers(0, 2**62),
    epoch=st.integers(0, 2**31 - 1),
    equal=st.booleans(),
)
def test_round_trip_property(records: list[Record], base: int, epoch: int, equal: bool) -> None:
    records = _maybe_equal_sizes(records, equal)
    buf = encode_batch(base, records, leader_epoch=epoch)
    h = validate_batch(bytes(buf), 0, base)
    assert (h.base_offset, h.batch_length, h.record_count) == (base, len(buf), len(records))
    assert (h.last_offset, h.leader_epoch) == (base + len(records) - 1, epoch)
    assert h.first_timestamp == records[0].timestamp
    assert h.max_timestamp == max(r.timestamp for r in records)
    decoded = decode_batch(buf)
    assert decoded == [r._replace(offset=base + i) for i, r in enumerate(records)]
    assert all(type(r.payload) is bytes and type(r.properties) is bytes for r in decoded)
    assert all(type(r.retain) is bool for r in decoded)


@settings(max_examples=200, deadline=None)
@given(
    records=_records,
    gaps=st.lists(st.integers(1, 1000), min_size=40, max_size=40),
    base=st.integers(0, 2**40),
)
def test_keep_offsets_round_trip_property(
    records: list[Record], gaps: list[int], base: int
) -> None:
    offsets = [base]
    for gap in gaps[: len(records) - 1]:
        offsets.append(offsets[-1] + gap)
    records = [r._replace(offset=o) for r, o in zip(records, offsets, strict=False)]
    buf = encode_batch(base, records, keep_offsets=True)
    assert validate_batch(buf, 0, base).last_offset == offsets[-1]
    assert decode_batch(buf) == records


def _reference_decode_into(
    records: list[Record], out: list[Record], min_offset: int, max_records: int, max_bytes: int
) -> tuple[int, int]:
    """decode_into's documented semantics, one record at a time."""
    for r in records:
        if r.offset < min_offset:
            continue
        size = RECORD_FIXED_SIZE + len(r.properties) + len(r.payload)
        if len(out) >= max_records or (size > max_bytes and out):
            return max_bytes, r.offset
        out.append(r)
        max_bytes -= size
    return max_bytes, -1


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(
    records=_records,
    gapped=st.booleans(),
    equal=st.booleans(),
    have=st.integers(0, 3),
    data=st.data(),
)
def test_decode_into_matches_reference(
    records: list[Record], gapped: bool, equal: bool, have: int, data: st.DataObject
) -> None:
    records = _maybe_equal_sizes(records, equal)
    base = 100
    if gapped:
        records = [r._replace(offset=base + 3 * i) for i, r in enumerate(records)]
        buf = bytes(encode_batch(base, records, keep_offsets=True))
    else:
        buf = bytes(encode_batch(base, records))
        records = [r._replace(offset=base + i) for i, r in enumerate(records)]
    last = records[-1].offset
    min_offset = data.draw(st.integers(base - 2, last), label="min_offset")
    max_records = data.draw(st.integers(0, len(records) + have + 1), label="max_records")
    max_bytes = data.draw(st.integers(-1, 2 * len(buf)), label="max_bytes")
    prefix = [Record(-1, 0, "p", b"")] * have
    # The buffer holds other data around the batch, as a read's chunk does.
    padded = b"\xee" * 5 + buf + b"\xee" * 3
    out, expected = list(prefix), list(prefix)
    got = decode_into(padded, 5, out, min_offset, max_records, max_bytes)
    assert got == _reference_decode_into(records, expected, min_offset, max_records, max_bytes)
    assert out == expected


@pytest.mark.parametrize("gapped", [False, True])
def test_decode_into_equal_size_payloads_matches_reference(gapped: bool) -> None:
    # Batches of equal-size payloads are cut by one struct call: every window of one.
    records = [
        rec(i, payload=bytes([i]) * 7, offset=100 + (5 * i if gapped else i)) for i in range(60)
    ]
    buf = bytes(encode_batch(100, records, keep_offsets=True))
    for min_offset in (0, 101, 120, 150):
        for max_records in (1, 17, 40, 100):
            for max_bytes in (1, 500, 1 << 20):
                out: list[Record] = []
                expected: list[Record] = []
                got = decode_into(buf, 0, out, min_offset, max_records, max_bytes)
                assert got == _reference_decode_into(
                    records, expected, min_offset, max_records, max_bytes
                )
                assert out == expected


@pytest.mark.parametrize("head", [1, 9, 20])
def test_decode_into_equal_sizes_after_a_different_head(head: int) -> None:
    # A read from inside a batch whose records from there on have equal payloads, but not
    # the ones before (b"q1/a#9" then b"q1/a#10"...): the cut starts after the head's own
    # sizes. It started at first * size and read past the batch (or other records' bytes).
    records = [rec(i, payload=b"p" * (6 if i < head else 7), offset=i) for i in range(head + 40)]
    buf = bytes(encode_batch(0, records, keep_offsets=True))
    for min_offset in range(len(records)):
        out: list[Record] = []
        expected: list[Record] = []
        got = decode_into(buf, 0, out, min_offset, 1000, 1 << 20)
        assert got == _reference_decode_into(records, expected, min_offset, 1000, 1 << 20)
        assert out == expected


# --- the small-batch encoder writes the general encoder's bytes ------------------------------

_fleet_like = st.builds(
    Record,
    offset=st.integers(-1, 5),
    timestamp=st.sampled_from([1_700_000_000_000, 1_700_000_000_001, -5, 2**63 - 1]),
    topic=st.sampled_from(["devices/d1/telemetry", "devices/d2/telemetry", "c", "", "ü/✓"]),
    payload=st.binary(max_size=70),
    qos=st.integers(0, 255),
    retain=st.one_of(st.booleans(), st.integers(0, 255)),
    client_id=st.sampled_from(["d1", "d2", "c", "", "devices/d1/telemetry", "ü"]),
    properties=st.one_of(st.just(b""), st.binary(max_size=10)),
)


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(
    records=st.one_of(
        st.lists(_fleet_like, min_size=1, max_size=SMALL_BATCH),
        st.lists(_records.map(lambda rs: rs[0]), min_size=1, max_size=SMALL_BATCH),
    ),
    base=st.integers(0, 2**62),
    epoch=st.integers(0, 2**31 - 1),
)
def test_small_batches_are_byte_identical(records: list[Record], base: int, epoch: int) -> None:
    """The append path's small-batch encoder writes exactly the general encoder's batch
    (same format, so every reader, the recovery scan and the cleaner see the same bytes):
    random batches of 1 .. SMALL_BATCH records, repeated and shared strings (a topic that
    is also a client id), retain given as a bool or an int, properties or none."""
    assert encode_small(base, records, leader_epoch=epoch) == bytes(
        encode_batch(base, records, leader_epoch=epoch)
    )
