"""Compaction of keyed logs: latest record per topic, tombstones, offsets kept, crash safety."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.commitlog import CommitLogError, LogConfig, Record, SegmentedLog

COMPACTED = LogConfig(segment_bytes=1 << 20, compacted=True, retention_ms=None)


def put(log: SegmentedLog, *items: tuple[str, bytes]) -> None:
    log.append([Record(0, 1000, key, value) for key, value in items])


def contents(log: SegmentedLog) -> list[tuple[int, str, bytes]]:
    return [(r.offset, r.topic, r.payload) for r in log.read(log.log_start_offset, 10_000)]


def test_keeps_latest_per_key_and_drops_tombstones(tmp_path: Path) -> None:
    log = SegmentedLog.open(tmp_path, COMPACTED)
    put(log, ("a", b"a0"), ("b", b"b0"), ("c", b"c0"))  # 0 1 2
    log.roll()
    put(log, ("a", b"a1"), ("b", b""), ("d", b"d0"))  # 3 4 5 (b deleted)
    log.roll()
    put(log, ("c", b"c1"))  # 6 (active)
    assert log.compact() == 4  # a0, b0, the b tombstone, and c0 (superseded by the active c1)
    assert contents(log) == [(3, "a", b"a1"), (5, "d", b"d0"), (6, "c", b"c1")]
    assert log.log_start_offset == 0 and log.end_offset == 7
    assert log.read(1)[0].offset == 3  # reads skip the gaps
    assert log.compact() == 0  # nothing new since the last pass
    log.close()
    log = SegmentedLog.open(tmp_path, COMPACTED)
    assert contents(log) == [(3, "a", b"a1"), (5, "d", b"d0"), (6, "c", b"c1")]
    assert log.offset_for_time(1000) == 3
    assert log.append([Record(0, 1, "e", b"e0")]) == 7
    log.close()


def test_emptied_segments_are_dropped_but_the_first_is_kept(tmp_path: Path) -> None:
    log = SegmentedLog.open(tmp_path, COMPACTED)
    put(log, ("a", b"1"))
    log.roll()
    put(log, ("a", b"2"))
    log.roll()
    put(log, ("a", b"3"))
    log.roll()
    put(log, ("a", b"4"))
    assert log.segments == [0, 1, 2, 3]
    assert log.compact() == 3
    assert log.segments == [0, 3]
    assert log.log_start_offset == 0 and contents(log) == [(3, "a", b"4")]
    assert os.path.getsize(tmp_path / f"{0:020d}.log") == 0
    log.close()


def test_tombstone_in_active_segment_is_kept_until_compacted(tmp_path: Path) -> None:
    log = SegmentedLog.open(tmp_path, COMPACTED)
    put(log, ("a", b"1"), ("b", b"1"))
    log.roll()
    put(log, ("a", b""))
    assert log.compact() == 1
    assert contents(log) == [(1, "b", b"1"), (2, "a", b"")]
    log.roll()
    put(log, ("z", b"z"))
    assert log.compact() == 1
    assert contents(log) == [(1, "b", b"1"), (3, "z", b"z")]
    log.close()


def test_compact_refuses_uncompacted_logs(tmp_path: Path) -> None:
    log = SegmentedLog.open(tmp_path, LogConfig())
    with pytest.raises(CommitLogError, match="not compacted"):
        log.compact()
    log.close()


def test_interrupted_swap_is_recovered(tmp_path: Path) -> None:
    """A crash after the old indexes were removed and before the new ones were renamed in."""
    log = SegmentedLog.open(tmp_path, COMPACTED)
    put(log, *[(f"k{i % 4}", bytes([i])) for i in range(40)])
    log.roll()
    put(log, ("k0", b"new"))
    log.compact()
    log.close()
    (tmp_path / f"{0:020d}.index").unlink()
    (tmp_path / f"{0:020d}.timeindex.cleaned").write_bytes(b"partial")
    log = SegmentedLog.open(tmp_path, COMPACTED)
    assert [(o, k) for o, k, _v in contents(log)] == [
        (37, "k1"),
        (38, "k2"),
        (39, "k3"),
        (40, "k0"),
    ]
    assert not list(tmp_path.glob("*.cleaned"))
    log.close()
    assert (tmp_path / f"{0:020d}.index").exists()  # rebuilt and written back


def test_roll_alone_makes_the_log_dirty_again(tmp_path: Path) -> None:
    log = SegmentedLog.open(tmp_path, COMPACTED)
    put(log, ("a", b""))
    log.roll()
    put(log, ("a", b""))
    assert log.compact() == 1  # the first tombstone, superseded by the active one
    log.roll()  # the second tombstone is now in a closed segment
    assert log.compact() == 1
    assert contents(log) == []
    log.close()
