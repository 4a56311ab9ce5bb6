"""OffsetIndex / TimeIndex: lookups against a simple reference, persistence, sanity checks."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.commitlog.errors import CorruptIndex
from broker.commitlog.index import OffsetIndex, TimeIndex

BASE = 1000


def floor_reference(entries: list[tuple[int, int]], target: int) -> tuple[int, int]:
    best = (BASE, 0)
    for offset, position in entries:
        if offset <= target:
            best = (offset, position)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=0, max_size=30), st.integers(BASE - 5, BASE + 800))
def test_offset_lookup_is_a_floor_lookup(steps: list[int], target: int) -> None:
    index = OffsetIndex(Path("unused.index"), BASE)
    entries = []
    offset, position = BASE, 0
    for step in steps:
        offset += step
        position += step * 7
        index.append(offset, position)
        entries.append((offset, position))
    assert index.lookup(target) == floor_reference(entries, target)


def test_offset_index_refuses_non_increasing_entries() -> None:
    index = OffsetIndex(Path("unused.index"), BASE)
    index.append(BASE + 5, 100)
    with pytest.raises(ValueError):
        index.append(BASE + 5, 200)
    with pytest.raises(ValueError):
        index.append(BASE + 6, 100)


def test_offset_index_persists_and_loads(tmp_path: Path) -> None:
    path = tmp_path / "x.index"
    index = OffsetIndex(path, BASE)
    for i in range(1, 20):
        index.append(BASE + i * 3, i * 100)
    index.write(fsync=False)
    assert path.stat().st_size == 19 * 8
    loaded = OffsetIndex.load(path, BASE, log_size=10_000)
    assert loaded.entries() == index.entries()
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    ("data", "log_size", "reason"),
    [
        (b"\x00" * 7, 100, "multiple"),
        (((5).to_bytes(4, "little") + (10).to_bytes(4, "little")) * 2, 100, "increase"),
        ((5).to_bytes(4, "little") + (500).to_bytes(4, "little"), 100, "beyond"),
    ],
)
def test_offset_index_sanity_check(tmp_path: Path, data: bytes, log_size: int, reason: str) -> None:
    path = tmp_path / "bad.index"
    path.write_bytes(data)
    with pytest.raises(CorruptIndex, match=reason):
        OffsetIndex.load(path, BASE, log_size)


def time_reference(entries: list[tuple[int, int]], target: int) -> int | None:
    found = None
    for timestamp, offset in entries:
        if timestamp < target:
            found = offset
    return found


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-5, 50), st.integers(1, 4)), max_size=30), st.integers(0, 1200)
)
def test_time_lookup_before(steps: list[tuple[int, int]], target: int) -> None:
    index = TimeIndex(Path("unused.timeindex"), BASE)
    accepted = []
    timestamp, offset = 0, BASE
    for dt, doff in steps:
        timestamp += dt
        offset += doff
        before = len(index)
        index.maybe_append(timestamp, offset)
        if len(index) > before:
            accepted.append((timestamp, offset))
    # only strictly increasing timestamps are kept
    assert all(a[0] < b[0] for a, b in pairwise(accepted))
    assert index.entries() == accepted
    assert index.lookup_before(target) == time_reference(accepted, target)


def test_time_index_persists_and_checks(tmp_path: Path) -> None:
    path = tmp_path / "x.timeindex"
    index = TimeIndex(path, BASE)
    index.maybe_append(100, BASE + 3)
    index.maybe_append(200, BASE + 9)
    index.write(fsync=True)
    loaded = TimeIndex.load(path, BASE, next_offset=BASE + 10)
    assert loaded.entries() == [(100, BASE + 3), (200, BASE + 9)]
    assert loaded.last_timestamp() == 200
    with pytest.raises(CorruptIndex, match="beyond"):
        TimeIndex.load(path, BASE, next_offset=BASE + 5)
    path.write_bytes(b"\x00" * 13)
    with pytest.raises(CorruptIndex, match="multiple"):
        TimeIndex.load(path, BASE, next_offset=BASE + 10)
