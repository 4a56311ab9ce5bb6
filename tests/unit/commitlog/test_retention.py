"""Retention by segment age and by total size: whole closed segments, oldest first."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.commitlog import LogConfig, OffsetOutOfRange, Record, SegmentedLog

DAY = 24 * 3600 * 1000


class FakeClock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> float:
        return self.now_ms / 1000


def open_log(path: Path, clock: FakeClock, **kw: object) -> SegmentedLog:
    config = LogConfig(**{"segment_bytes": 1 << 20, **kw})  # type: ignore[arg-type]
    return SegmentedLog.open(path, config, clock=clock)


def append_segment(log: SegmentedLog, ts: int, n: int = 5) -> None:
    log.append([Record(0, ts, f"k/{i}", b"x" * 100) for i in range(n)])
    log.roll()


def test_age_retention_deletes_expired_prefix_only(tmp_path: Path) -> None:
    clock = FakeClock(100 * DAY)
    log = open_log(tmp_path, clock, retention_ms=7 * DAY)
    append_segment(log, 80 * DAY)  # expired
    append_segment(log, 95 * DAY)  # kept (5 days old)
    append_segment(log, 81 * DAY)  # expired but after a kept one: kept (no holes)
    log.append([Record(0, 1, "old-but-active", b"x")])
    assert log.segments == [0, 5, 10, 15]
    assert log.enforce_retention() == 1
    assert log.segments == [5, 10, 15] and log.log_start_offset == 5
    assert not (tmp_path / f"{0:020d}.log").exists()
    assert not (tmp_path / f"{0:020d}.index").exists()
    with pytest.raises(OffsetOutOfRange):
        log.read(0)
    assert log.read(5)[0].offset == 5
    # newest record exactly retention_ms old is kept; one ms later it goes
    assert log.enforce_retention(95 * DAY + 7 * DAY) == 0
    assert log.enforce_retention(95 * DAY + 7 * DAY + 1) == 2
    assert log.segments == [15]  # the active segment is never deleted
    log.close()


def test_none_keeps_forever(tmp_path: Path) -> None:
    clock = FakeClock(1000 * DAY)
    log = open_log(tmp_path, clock, retention_ms=None)
    append_segment(log, 1)
    assert log.enforce_retention() == 0
    log.close()


def test_size_retention_keeps_total_under_limit(tmp_path: Path) -> None:
    clock = FakeClock(DAY)
    log = open_log(tmp_path, clock, retention_ms=None, retention_bytes=2000)
    for _ in range(6):
        append_segment(log, DAY)
    segment_size = log.size // 6
    assert log.enforce_retention() == 6 - 2000 // segment_size
    assert log.size <= 2000
    assert log.segments[-1] == 30 and log.end_offset == 30
    log.close()


def test_offsets_continue_after_everything_is_deleted(tmp_path: Path) -> None:
    clock = FakeClock(100 * DAY)
    log = open_log(tmp_path, clock, retention_ms=DAY)
    append_segment(log, 1)
    append_segment(log, 2)
    assert log.enforce_retention() == 2
    assert (log.log_start_offset, log.end_offset) == (10, 10)
    assert log.read(10) == []
    log.close()
    log = open_log(tmp_path, clock, retention_ms=DAY)
    assert (log.log_start_offset, log.end_offset) == (10, 10)
    assert log.append([Record(0, 5, "t", b"p")]) == 10
    log.close()
