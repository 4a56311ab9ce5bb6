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
