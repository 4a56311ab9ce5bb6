"""Segment: append/read, sparse index cadence, reopen, recovery, failed-append rollback."""

from __future__ import annotations

import errno
import logging
import os
from itertools import pairwise
from pathlib import Path

import pytest

from broker.commitlog.batch import decode_into, encode_batch
from broker.commitlog.config import LogConfig
from broker.commitlog.errors import LogIOError
from broker.commitlog.record import Record
from broker.commitlog.segment import Segment, file_name

CONFIG = LogConfig(index_interval_bytes=200)


def batch(base: int, n: int, ts: int = 1000) -> bytearray:
    return encode_batch(base, [Record(0, ts + i, f"t/{i % 3}", b"v" * 40) for i in range(n)])


def filled(tmp_path: Path, batches: int = 20, per_batch: int = 2) -> Segment:
    seg = Segment.create(tmp_path, 100, CONFIG, now_ms=0)
    for b in range(batches):
        seg.append(batch(100 + b * per_batch, per_batch, ts=1000 + 10 * b), fsync=False)
    return seg


def read_all(seg: Segment, offset: int) -> list[int]:
    out: list[Record] = []
    seg.read_into(out, offset, 10_000, 1 << 30, decode_into)
    return [r.offset for r in out]


def test_file_names_are_20_digit_base_offsets(tmp_path: Path) -> None:
    seg = Segment.create(tmp_path, 42, CONFIG, now_ms=0)
    assert seg.log_path.name == "00000000000000000042.log"
    assert file_name(7, ".index") == "00000000000000000007.index"
    seg.close()


def test_append_and_read_from_every_offset(tmp_path: Path) -> None:
    seg = filled(tmp_path)
    assert (seg.base_offset, seg.next_offset) == (100, 140)
    assert seg.max_timestamp == 1000 + 10 * 19 + 1
    for offset in range(100, 141):
        assert read_all(seg, offset) == list(range(offset, 140))
    seg.close()


def test_index_entry_every_interval_bytes(tmp_path: Path) -> None:
    seg = filled(tmp_path)
    entries = seg.offset_index.entries()
    assert entries, "expected sparse entries"
    size = len(batch(0, 2))
    # an entry is added before a batch once more than the interval was written since the last
    per_entry = -(-CONFIG.index_interval_bytes // size)
    assert [p for _o, p in entries] == [i * per_entry * size for i in range(1, len(entries) + 1)]
    assert all(o == 100 + p // size * 2 for o, p in entries)
    assert seg.time_index.entries()[-1][0] <= seg.max_timestamp
    seg.close()


def test_reopen_trusts_consistent_indexes(tmp_path: Path) -> None:
    seg = filled(tmp_path)
    seg.persist_indexes(fsync=False)
    entries = seg.offset_index.entries()
    seg.close()
    again, truncated = Segment.open(tmp_path, 100, CONFIG, now_ms=0, recover=False)
    assert truncated == 0
    assert again.offset_index.entries() == entries
    assert (again.next_offset, again.max_timestamp) == (140, 1191)
    assert read_all(again, 117) == list(range(117, 140))
    again.close()


def test_missing_or_bad_index_is_rebuilt(tmp_path: Path) -> None:
    seg = filled(tmp_path)
    seg.persist_indexes(fsync=False)
    entries = seg.offset_index.entries()
    seg.close()
    seg.index_path.write_bytes(b"\x01\x00\x00\x00\x07\x00\x00\x00")  # points mid-batch
    again, _ = Segment.open(tmp_path, 100, CONFIG, now_ms=0, recover=False)
    assert again.offset_index.entries() == entries
    again.close()
    seg.timeindex_path.unlink()
    again, _ = Segment.open(tmp_path, 100, CONFIG, now_ms=0, recover=False)
    assert again.time_index.entries()
    again.close()


def test_recover_truncates_torn_tail_and_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seg = filled(tmp_path, batches=5)
    size = seg.size
    seg.close()
    with open(tmp_path / file_name(100, ".log"), "ab") as f:
        f.write(bytes(batch(110, 3))[:-5])
    with caplog.at_level(logging.WARNING, logger="broker.commitlog"):
        again, truncated = Segment.open(tmp_path, 100, CONFIG, now_ms=0, recover=True)
    assert truncated > 0 and again.size == size
    assert os.path.getsize(again.log_path) == size
    assert again.next_offset == 110
    assert "truncating" in caplog.text and again.log_path.name in caplog.text
    again.close()


def test_failed_write_rolls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seg = filled(tmp_path, batches=3)
    size, next_offset = seg.size, seg.next_offset
    real_write = os.write

    def half_then_enospc(fd: int, data: bytes) -> int:
        if fd != seg._fd:
            return real_write(fd, data)
        if len(data) > 10:
            return real_write(fd, memoryview(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_enospc)
    with pytest.raises(LogIOError) as info:
        seg.append(batch(next_offset, 4), fsync=False)
    monkeypatch.undo()
    assert info.value.disk_full and str(seg.log_path) in str(info.value)
    assert (seg.size, seg.next_offset) == (size, next_offset)
    assert os.path.getsize(seg.log_path) == size
    seg.append(batch(next_offset, 1), fsync=True)
    assert read_all(seg, 100)[-1] == next_offset
    seg.close()
    again, truncated = Segment.open(tmp_path, 100, CONFIG, now_ms=0, recover=True)
    assert truncated == 0 and again.next_offset == next_offset + 1
    again.close()


def test_offset_for_time_with_out_of_order_timestamps(tmp_path: Path) -> None:
    seg = Segment.create(tmp_path, 0, LogConfig(index_interval_bytes=0), now_ms=0)
    stamps = [10, 30, 20, 50, 40, 40, 70]
    for i, ts in enumerate(stamps):
        seg.append(encode_batch(i, [Record(0, ts, "k", b"v")]), fsync=False)
    for target in range(0, 80, 5):
        expected = next((i for i, ts in enumerate(stamps) if ts >= target), None)
        assert seg.offset_for_time(target) == expected, target
    seg.close()


def test_delete_removes_all_files(tmp_path: Path) -> None:
    seg = filled(tmp_path, batches=2)
    seg.persist_indexes(fsync=False)
    seg.delete()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("policy", ["interval", "never"])
def test_interval_policy_starts_writeback_every_writeback_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    from broker.commitlog import segment as segment_module

    calls: list[tuple[int, int, int]] = []

    def record(fd: int, start: int, length: int, flags: int) -> int:
        assert flags == 2  # SYNC_FILE_RANGE_WRITE: start the writes, do not wait
        calls.append((fd, start, length))
        return 0

    monkeypatch.setattr(segment_module, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(segment_module, "_sync_file_range", record)
    config = LogConfig(fsync=policy)  # type: ignore[arg-type]
    seg = Segment.create(tmp_path, 0, config, now_ms=0)
    size = len(batch(0, 4))
    for i in range(12):
        seg.append(batch(4 * i, 4), fsync=False)
    if policy == "never":
        assert calls == []
    else:
        # Contiguous ranges from 0, each at least WRITEBACK_BYTES, none past the data.
        assert calls and calls[0][1] == 0
        assert all(
            start == prev + length for (_fd, prev, length), (_f, start, _l) in pairwise(calls)
        )
        assert all(length >= 1000 for _fd, _start, length in calls)
        assert calls[-1][1] + calls[-1][2] <= seg.size == 12 * size
        seg.flush()  # everything is synced: the next range starts at the end
        seg.append(batch(48, 4), fsync=False)
        end = seg.size
        while seg.size - end < 1000:
            seg.append(batch(seg.next_offset, 4), fsync=False)
        assert calls[-1][1] == 12 * size
    seg.close()


def test_writeback_hint_is_available_on_linux() -> None:
    from broker.commitlog import segment as segment_module

    if os.uname().sysname == "Linux":
        assert segment_module._sync_file_range is not None
