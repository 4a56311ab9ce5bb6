"""The batch checksum equals zlib's CRC-32 for every buffer type, range and running value,
whichever implementation computes it (so the on-disk format does not depend on libdeflate)."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.commitlog import crc
from broker.commitlog.batch import BATCH_HEADER_SIZE, CRC_OFFSET, encode_batch, validate_batch
from broker.commitlog.record import Record

BUFFER_TYPES = (bytes, bytearray, lambda b: memoryview(b), lambda b: memoryview(bytearray(b)))


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=3 * crc.NATIVE_MIN_BYTES),
    cuts=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    value=st.integers(0, 0xFFFFFFFF),
    kind=st.sampled_from(range(len(BUFFER_TYPES))),
)
def test_crc32_of_a_range_is_zlibs(
    data: bytes, cuts: tuple[float, float], value: int, kind: int
) -> None:
    start, end = sorted(int(c * len(data)) for c in cuts)
    buf = BUFFER_TYPES[kind](data)
    assert crc.crc32(buf, start, end, value) == zlib.crc32(data[start:end], value)


@pytest.mark.parametrize("size", [crc.NATIVE_MIN_BYTES - 1, crc.NATIVE_MIN_BYTES, 1 << 20])
def test_crc32_around_the_native_threshold(size: int) -> None:
    data = bytes(range(251)) * (size // 251 + 1)
    for make in BUFFER_TYPES:
        assert crc.crc32(make(data), 3, size, 42) == zlib.crc32(data[3:size], 42)


def test_implementation_is_named() -> None:
    assert crc.IMPLEMENTATION in ("libdeflate", "zlib")


def test_large_batch_crc_is_zlibs_over_header_and_body() -> None:
    """A batch big enough for the native path still carries zlib's CRC-32 (readers without
    libdeflate must accept it)."""
    records = [
        Record(0, 1_700_000_000_000, f"t/{i % 7}", bytes(1024) + bytes([i % 256]))
        for i in range(64)
    ]
    buf = encode_batch(0, records)
    assert len(buf) > 4 * crc.NATIVE_MIN_BYTES
    view = memoryview(buf)
    expected = zlib.crc32(view[BATCH_HEADER_SIZE:], zlib.crc32(view[:CRC_OFFSET]))
    assert int.from_bytes(buf[CRC_OFFSET : CRC_OFFSET + 4], "little") == expected
    validate_batch(bytes(buf), 0, 0)
    validate_batch(memoryview(bytes(buf)), 0, 0)


def test_range_past_the_end_is_clamped_like_a_slice() -> None:
    data = bytes(range(256)) * 64
    for make in BUFFER_TYPES:
        assert crc.crc32(make(data), 100, len(data) + 999) == zlib.crc32(data[100:])


# -- a batch's own checksum, compiled and pure Python ---------------------------------------


def test_the_compiled_batch_check_serves_by_default() -> None:
    if crc.BATCH_IMPLEMENTATION != "compiled":
        pytest.fail("broker.commitlog._crc is not built (pip install -e . builds it)")
    assert crc.batch_crc_ok.__module__ == "broker.commitlog._crc"


@settings(max_examples=300, deadline=None)
@given(
    body=st.binary(min_size=BATCH_HEADER_SIZE, max_size=2 * crc.NATIVE_MIN_BYTES),
    before=st.binary(max_size=64),
    after=st.binary(max_size=64),
    flip=st.one_of(st.none(), st.floats(0, 1)),
    kind=st.sampled_from(range(len(BUFFER_TYPES))),
)
def test_batch_crc_is_the_same_compiled_and_in_python(
    body: bytes, before: bytes, after: bytes, flip: float | None, kind: int
) -> None:
    """Over the batch but its four CRC bytes, at any position of any buffer type; a batch
    whose stored CRC is right passes, any one changed byte but those four fails."""
    expected = zlib.crc32(body[BATCH_HEADER_SIZE:], zlib.crc32(body[:CRC_OFFSET]))
    batch = bytearray(body)
    batch[CRC_OFFSET:BATCH_HEADER_SIZE] = expected.to_bytes(4, "little")
    at = None if flip is None else int(flip * (len(batch) - 1))
    if at is not None and CRC_OFFSET <= at < BATCH_HEADER_SIZE:
        at = None  # the CRC's own bytes: a changed one is a mismatch too, tested below
    if at is not None:
        batch[at] ^= 0x01
    buf = BUFFER_TYPES[kind](before + bytes(batch) + after)
    pos, length = len(before), len(batch)
    for compute, check in ((crc.batch_crc, crc.batch_crc_ok), (crc._batch_crc, crc._batch_crc_ok)):
        assert compute(buf, pos, length) == zlib.crc32(
            bytes(batch[BATCH_HEADER_SIZE:]), zlib.crc32(bytes(batch[:CRC_OFFSET]))
        )
        assert check(buf, pos, length) is (at is None)
    batch[CRC_OFFSET] ^= 0x01
    changed = BUFFER_TYPES[kind](before + bytes(batch) + after)
    assert not crc.batch_crc_ok(changed, pos, length) and not crc._batch_crc_ok(
        changed, pos, length
    )


@pytest.mark.parametrize(("pos", "length"), [(-1, 60), (0, 47), (10, 60), (0, 61)])
def test_a_range_outside_the_buffer_is_refused_not_read(pos: int, length: int) -> None:
    buf = bytes(60)
    for compute, check in ((crc.batch_crc, crc.batch_crc_ok), (crc._batch_crc, crc._batch_crc_ok)):
        with pytest.raises(ValueError, match="no batch"):
            compute(buf, pos, length)
        with pytest.raises(ValueError, match="no batch"):
            check(buf, pos, length)
