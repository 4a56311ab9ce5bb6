"""SegmentedLog: append/read, limits, time lookup, roll, reopen/recovery, fsync policies,
out-of-range reads and failed-append rollback. A fake clock drives every time decision."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest

from broker.commitlog import (
    CommitLogError,
    InvalidRecord,
    LogClosed,
    LogConfig,
    LogIOError,
    OffsetOutOfRange,
    Record,
    SegmentedLog,
)
from broker.commitlog.batch import RECORD_FIXED_SIZE
from broker.commitlog.log import CLEAN_SHUTDOWN_FILE
from broker.commitlog.small_batch import encode


class FakeClock:
    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> float:
        return self.now_ms / 1000

    def advance(self, ms: int) -> None:
        self.now_ms += ms


def recs(n: int, ts: int = 1000, size: int = 50, topic: str = "dev/{i}") -> list[Record]:
    return [
        Record(
            0,
            ts + i,
            topic.format(i=i),
            bytes([i % 256]) * size,
            i % 3,
            i % 2 == 0,
            f"c{i}",
            b"\x26\x00",
        )
        for i in range(n)
    ]


def open_log(path: Path, clock: FakeClock | None = None, **kw: object) -> SegmentedLog:
    config = LogConfig(**{"segment_bytes": 4096, "index_interval_bytes": 512, **kw})  # type: ignore[arg-type]
    return SegmentedLog.open(path, config, clock=clock or FakeClock())


def offsets(records: list[Record]) -> list[int]:
    return [r.offset for r in records]


def test_append_returns_first_offset_and_reads_back(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    assert (log.log_start_offset, log.end_offset) == (0, 0)
    assert log.read(0) == []
    assert log.append(recs(3)) == 0
    assert log.append(recs(2, ts=5000)) == 3
    assert log.append([]) == 5
    got = log.read(0)
    assert offsets(got) == [0, 1, 2, 3, 4]
    assert got[0] == recs(3)[0]._replace(offset=0)
    assert got[4].timestamp == 5001 and got[4].client_id == "c1"
    log.close()


def test_reads_across_segments_from_any_offset(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    for _ in range(40):
        log.append(recs(5))
    assert len(log.segments) > 3
    assert log.segments[0] == 0 and log.segments == sorted(log.segments)
    for start in range(0, 201, 3):
        assert offsets(log.read(start, 10_000)) == list(range(start, 200))
    # a sequential consumer in small steps sees every record once
    seen, offset = [], 0
    while offset < log.end_offset:
        chunk = log.read(offset, max_records=7)
        seen += offsets(chunk)
        offset = chunk[-1].offset + 1
    assert seen == list(range(200))
    log.close()


def test_read_limits(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes=1 << 20)
    log.append(recs(10, size=100))
    assert offsets(log.read(2, max_records=3)) == [2, 3, 4]
    one = RECORD_FIXED_SIZE + 2 + 100  # record header, properties, payload
    assert offsets(log.read(0, max_bytes=one * 3)) == [0, 1, 2]
    assert offsets(log.read(0, max_bytes=1)) == [0]  # always at least one record
    log.append(recs(1, size=10_000))
    assert offsets(log.read(10, max_bytes=10)) == [10]
    log.close()


def test_out_of_range(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    log.append(recs(4))
    with pytest.raises(OffsetOutOfRange) as info:
        log.read(5)
    assert (info.value.offset, info.value.log_start_offset, info.value.end_offset) == (5, 0, 4)
    assert "[0, 4]" in str(info.value)
    with pytest.raises(OffsetOutOfRange):
        log.read(-1)
    log.close()


def test_offset_for_time(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    for b in range(30):
        log.append(recs(4, ts=10_000 + b * 100))  # timestamps 10000+100b .. +3
    assert log.offset_for_time(0) == 0
    assert log.offset_for_time(10_002) == 2
    assert log.offset_for_time(10_004) == 4
    assert log.offset_for_time(12_050) == 84
    assert log.offset_for_time(99_999) == log.end_offset == 120
    log.close()


def test_roll_by_size_keeps_segments_under_segment_bytes(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes=2000)
    for _ in range(30):
        log.append(recs(3))
    sizes = [os.path.getsize(tmp_path / f"{b:020d}.log") for b in log.segments]
    assert all(0 < s <= 2000 for s in sizes)
    log.append(recs(1, size=5000))  # bigger than a segment: gets one of its own
    assert os.path.getsize(tmp_path / f"{log.segments[-1]:020d}.log") > 2000
    log.close()


def test_roll_by_time_with_fake_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    log = open_log(tmp_path, clock, segment_bytes=1 << 20, segment_ms=60_000)
    log.append(recs(1))
    clock.advance(60_000)
    log.append(recs(1))
    assert log.segments == [0]
    clock.advance(1)
    log.append(recs(1))
    assert log.segments == [0, 2]
    log.close()


def test_reopened_segment_counts_segment_ms_from_the_open(tmp_path: Path) -> None:
    # Record timestamps (here far in the past) never decide a roll, or a restart alone would
    # roll: a reopened segment's age restarts at the open, on the wall clock.
    clock = FakeClock()
    log = open_log(tmp_path, clock, segment_bytes=1 << 20, segment_ms=60_000)
    log.append(recs(1, ts=0))
    log.close()
    clock.advance(50_000)
    log = open_log(tmp_path, clock, segment_bytes=1 << 20, segment_ms=60_000)
    clock.advance(60_000)
    log.append(recs(1, ts=0))
    assert log.segments == [0]
    clock.advance(1)
    log.append(recs(1, ts=0))
    assert log.segments == [0, 2]
    log.close()


def test_explicit_roll(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    log.roll()  # empty active segment: nothing to roll
    assert log.segments == [0]
    log.append(recs(2))
    log.roll()
    assert log.segments == [0, 2]
    assert (tmp_path / f"{0:020d}.index").exists()
    assert log.append(recs(1)) == 2
    log.close()


def test_reopen_after_clean_close(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    for _ in range(20):
        log.append(recs(5))
    segments = log.segments
    log.close()
    assert (tmp_path / CLEAN_SHUTDOWN_FILE).exists()
    log = open_log(tmp_path)
    assert not (tmp_path / CLEAN_SHUTDOWN_FILE).exists()
    assert log.segments == segments and log.end_offset == 100
    assert offsets(log.read(37, 1000)) == list(range(37, 100))
    assert log.append(recs(1)) == 100
    log.close()


def test_unclean_reopen_truncates_torn_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = open_log(tmp_path, segment_bytes=1 << 20)
    log.append(recs(5))
    log.append(recs(5))
    active = tmp_path / f"{0:020d}.log"
    good = os.path.getsize(active)
    with open(active, "ab") as f:  # a torn third batch
        f.write(b"\x0a" + b"\x00" * 30)
    del log  # no close: unclean shutdown
    with caplog.at_level(logging.WARNING, logger="broker.commitlog"):
        log = open_log(tmp_path, segment_bytes=1 << 20)
    assert log.end_offset == 10 and os.path.getsize(active) == good
    assert "truncating 31 bytes" in caplog.text
    assert log.append(recs(1)) == 10
    log.close()


def test_unclean_reopen_rebuilds_active_index(tmp_path: Path) -> None:
    log = open_log(tmp_path, segment_bytes=1 << 20, index_interval_bytes=100)
    for _ in range(10):
        log.append(recs(3))
    (tmp_path / f"{0:020d}.index").write_bytes(b"\xff" * 8)  # garbage, never trusted
    log2 = open_log(tmp_path, segment_bytes=1 << 20, index_interval_bytes=100)
    assert offsets(log2.read(13, 5)) == [13, 14, 15, 16, 17]
    log2.close()


def _flip_last_batch_of_second_segment(tmp_path: Path, *, clean: bool) -> list[int]:
    log = open_log(tmp_path, segment_bytes=1000)
    for _ in range(12):
        log.append(recs(3))
    segments = log.segments
    assert len(segments) >= 3
    log.close()
    if not clean:
        (tmp_path / ".clean_shutdown").unlink()
    second = tmp_path / f"{segments[1]:020d}.log"
    data = bytearray(second.read_bytes())
    data[-3] ^= 0xFF  # bit flip in the last batch of a closed segment
    second.write_bytes(data)
    return segments


def test_corrupt_closed_segment_after_a_crash_drops_later_segments(tmp_path: Path) -> None:
    # Without a clean shutdown the bad tail may be torn (fsync=interval defers a roll's
    # sync): the log keeps the prefix before it.
    segments = _flip_last_batch_of_second_segment(tmp_path, clean=False)
    log = open_log(tmp_path, segment_bytes=1000)
    assert log.segments == segments[:2]
    assert log.end_offset < segments[2]
    assert offsets(log.read(0, 1000)) == list(range(log.end_offset))
    log.close()


def test_corrupt_closed_segment_after_a_clean_stop_keeps_later_segments(tmp_path: Path) -> None:
    # After a clean shutdown nothing is torn: the bad batch is damage, passed over by reads
    # (on_corruption = "skip"); the later segments, intact, are kept (issue 25).
    segments = _flip_last_batch_of_second_segment(tmp_path, clean=True)
    log = open_log(tmp_path, segment_bytes=1000)
    assert log.segments == segments
    read = offsets(log.read(0, 1000))
    assert read == [o for o in range(log.end_offset) if not segments[2] - 3 <= o < segments[2]]
    log.close()


@pytest.mark.parametrize("policy", ["always", "interval", "never"])
def test_fsync_policies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    calls: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    clock = FakeClock()
    log = open_log(tmp_path, clock, fsync=policy, fsync_interval_ms=1000)
    calls.clear()
    log.append(recs(2))
    log.append(recs(2))
    assert len(calls) == (2 if policy == "always" else 0)
    calls.clear()
    due = log.flush_if_due()
    assert not due and not calls  # interval not elapsed yet (or not the interval policy)
    clock.advance(1000)
    due = log.flush_if_due()
    assert due == (policy == "interval")
    assert len(calls) == (1 if policy == "interval" else 0)
    assert log.flush_if_due(clock.now_ms + 5000) is False  # nothing unsynced
    calls.clear()
    log.append(recs(1))
    log.flush()
    assert len(calls) == 1  # by the append (always) or by the flush (the others)
    log.close()


def test_failed_append_rolls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = open_log(tmp_path, segment_bytes=1 << 20)
    log.append(recs(3))
    path = tmp_path / f"{0:020d}.log"
    size = os.path.getsize(path)
    real_write = os.write
    failures = {"left": 1}

    def partial_then_enospc(fd: int, data: bytes) -> int:
        if failures["left"] and len(data) > 100:
            failures["left"] -= 1
            real_write(fd, memoryview(data)[:100])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", partial_then_enospc)
    with pytest.raises(LogIOError, match="No space left") as info:
        log.append(recs(4))
    assert str(path) in str(info.value) and info.value.disk_full
    assert os.path.getsize(path) == size and log.end_offset == 3
    assert log.append(recs(2)) == 3  # the next append succeeds
    assert offsets(log.read(0)) == [0, 1, 2, 3, 4]
    log.close()
    log = open_log(tmp_path, segment_bytes=1 << 20)
    assert log.end_offset == 5
    log.close()


def _parts() -> list[list[Record] | bytes]:
    """Runs of records and batches encoded elsewhere (base offset 0), as a group commit with
    another worker's forwards gathers them."""
    forwarded = [bytes(encode(0, recs(n, size=30 + n))) for n in (2, 1, 7)]
    return [recs(3), forwarded[0], forwarded[1], recs(1), forwarded[2], recs(5)]


def test_append_parts_writes_them_in_one_write_indexed_as_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parts of a group commit leave in one ``write`` (a fleet's commit joins this
    worker's records and a peer's batch), and the log is the one appending them one by one
    would have made: the same bytes, offset index, reads, and after a crash the same
    rebuilt index."""
    one_by_one = open_log(tmp_path / "single", segment_bytes=1 << 20, index_interval_bytes=100)
    for part in _parts():
        one_by_one.append_parts([part])
    real_write = os.write
    writes: list[int] = []

    def counted(fd: int, data: bytes) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", counted)
    log = open_log(tmp_path / "joined", segment_bytes=1 << 20, index_interval_bytes=100)
    first, written = log.append_parts(_parts())
    monkeypatch.setattr(os, "write", real_write)
    assert first == 0 and len(writes) == 1 and len(written) == 6
    assert writes[0] == sum(map(len, written))
    name = f"{0:020d}"
    log_bytes = (tmp_path / "joined" / (name + ".log")).read_bytes()
    assert log_bytes == (tmp_path / "single" / (name + ".log")).read_bytes()
    assert log.end_offset == one_by_one.end_offset == 19
    for offset in range(19):
        assert log.read(offset, 2) == one_by_one.read(offset, 2)
    entries = log._segments[-1].offset_index.entries()
    assert entries == one_by_one._segments[-1].offset_index.entries()
    assert len(entries) > 2  # the batches inside the write were indexed too
    log.close()
    (tmp_path / "joined" / (name + ".index")).write_bytes(b"")
    (tmp_path / "joined" / CLEAN_SHUTDOWN_FILE).unlink()
    reopened = open_log(tmp_path / "joined", segment_bytes=1 << 20, index_interval_bytes=100)
    assert reopened._segments[-1].offset_index.entries() == entries
    assert [r.offset for r in reopened.read(0, 100)] == list(range(19))
    reopened.close()
    one_by_one.close()


def test_a_failed_append_parts_stores_none_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One write, rolled back whole: no part of a failed group commit stays in the log (its
    publishers all get an error; none was acknowledged)."""
    log = open_log(tmp_path, segment_bytes=1 << 20)
    log.append(recs(2))
    real_write = os.write
    first_part = len(encode(2, _parts()[0]))  # type: ignore[arg-type]
    full_at = os.path.getsize(tmp_path / f"{0:020d}.log") + first_part + 10

    def enospc_past_full_at(fd: int, data: bytes) -> int:
        if os.fstat(fd).st_size + len(data) > full_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", enospc_past_full_at)
    with pytest.raises(LogIOError):
        log.append_parts(_parts())
    monkeypatch.undo()
    assert log.end_offset == 2
    assert log.append_parts(_parts())[0] == 2
    assert offsets(log.read(0, 100)) == list(range(21))
    log.close()


def test_failed_fsync_rolls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = open_log(tmp_path, fsync="always")
    log.append(recs(1))

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(LogIOError, match="Input/output error"):
        log.append(recs(2))
    monkeypatch.undo()
    assert log.end_offset == 1 and offsets(log.read(0)) == [0]
    log.close()


def test_roll_failure_leaves_log_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = open_log(tmp_path, segment_bytes=600)
    log.append(recs(3))
    real_open = os.open

    def deny_create(path: object, flags: int, *args: int) -> int:
        if flags & os.O_CREAT and str(path).endswith(".log"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", deny_create)
    with pytest.raises(LogIOError, match="Permission denied"):
        log.append(recs(3))  # needs a new segment
    monkeypatch.undo()
    assert log.segments == [0] and log.end_offset == 3
    assert log.append(recs(3)) == 3
    log.close()


def test_permission_denied_at_open_names_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def deny(path: object) -> list[str]:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "listdir", deny)
    with pytest.raises(LogIOError, match="Permission denied") as info:
        open_log(tmp_path / "p")
    assert info.value.path == tmp_path / "p"


def test_invalid_record_leaves_log_unchanged(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    with pytest.raises(InvalidRecord):
        log.append([Record(0, 1, "t" * 70_000, b"")])
    assert log.end_offset == 0
    log.close()


def test_closed_log_refuses_operations(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    log.close()
    log.close()
    with pytest.raises(LogClosed):
        log.append(recs(1))
    with pytest.raises(LogClosed):
        log.read(0)
    assert isinstance(LogClosed("x"), CommitLogError)


def test_leftovers_of_interrupted_writes_are_removed(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    log.append(recs(2))
    log.close()
    for name in (f"{0:020d}.log.cleaned", f"{0:020d}.index.tmp", f"{999:020d}.index"):
        (tmp_path / name).write_bytes(b"junk")
    log = open_log(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{0:020d}{suffix}" for suffix in (".index", ".log", ".timeindex")
    ]
    assert log.end_offset == 2
    log.close()


def test_retention_thread_races_reader_and_appender(tmp_path: Path) -> None:
    clock = FakeClock()
    log = open_log(tmp_path, clock, segment_bytes=800, retention_bytes=3000, retention_ms=None)
    stop = threading.Event()
    errors: list[BaseException] = []

    def cleaner() -> None:
        try:
            while not stop.is_set():
                log.enforce_retention()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=cleaner)
    thread.start()
    try:
        for _ in range(300):
            log.append(recs(2))
            try:
                got = log.read(max(log.log_start_offset, log.end_offset - 10))
            except OffsetOutOfRange:
                continue  # retention moved the start between the two calls
            assert offsets(got) == list(range(got[0].offset, log.end_offset))
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert log.log_start_offset > 0 and log.end_offset == 600
    log.close()


def test_newer_batch_format_raises_unsupported_format(tmp_path: Path) -> None:
    import struct
    import zlib

    from broker.commitlog import UnsupportedFormat
    from broker.commitlog.batch import BATCH_HEADER_SIZE, CRC_OFFSET, MAGIC, encode_batch

    log = open_log(tmp_path)
    log.append(recs(1))
    log.close()
    future = encode_batch(1, recs(1))
    future[12] = MAGIC + 1
    view = memoryview(future)
    struct.pack_into(
        "<I",
        future,
        CRC_OFFSET,
        zlib.crc32(view[BATCH_HEADER_SIZE:], zlib.crc32(view[:CRC_OFFSET])),
    )
    view.release()
    active = tmp_path / f"{0:020d}.log"
    with open(active, "ab") as f:
        f.write(future)
    (tmp_path / CLEAN_SHUTDOWN_FILE).unlink()
    with pytest.raises(UnsupportedFormat, match=str(active)):
        open_log(tmp_path)
    assert active.stat().st_size > 0  # never truncated away


def _syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the file name of every fdatasync / fsync, in order (the directory's as '/')."""
    calls: list[str] = []
    real_fdatasync, real_fsync = os.fdatasync, os.fsync

    def name(fd: int) -> str:
        path = os.readlink(f"/proc/self/fd/{fd}")
        return "/" if os.path.isdir(path) else os.path.basename(path)

    def fdatasync(fd: int) -> None:
        calls.append(name(fd))
        real_fdatasync(fd)

    def fsync(fd: int) -> None:
        calls.append(name(fd))
        real_fsync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "fsync", fsync)
    return calls


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_interval_roll_syncs_at_the_next_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fsync=interval: a roll blocks on no fsync; the next flush syncs the segments' data
    # oldest first, then the rolled segment's indexes, then the directory (the new segment's
    # entry), so that after a crash the log is a prefix of what was appended.
    calls = _syncs(monkeypatch)
    clock = FakeClock()
    log = open_log(tmp_path, clock, fsync="interval", fsync_interval_ms=1000)
    calls.clear()
    log.append(recs(3))
    log.roll()
    log.append(recs(3))
    assert calls == []
    clock.advance(1000)
    assert log.flush_if_due()
    first, second = (f"{base:020d}" for base in log.segments)
    assert calls == [f"{first}.log", f"{second}.log", f"{first}.timeindex", f"{first}.index", "/"]
    calls.clear()
    log.roll()  # the active segment is clean, the roll still needs the next flush
    clock.advance(1000)
    assert log.flush_if_due()
    assert calls == [f"{second}.timeindex", f"{second}.index", "/"]
    clock.advance(1000)
    assert not log.flush_if_due()
    log.close()


@pytest.mark.parametrize("policy", ["always", "interval"])
@pytest.mark.parametrize("compacted", [False, True])
def test_roll_syncs_before_the_append_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str, compacted: bool
) -> None:
    # fsync=always (every append durable when it returns) and compacted logs (whose offset
    # gaps make a lost segment tail undetectable at open) keep the synchronous roll.
    calls = _syncs(monkeypatch)
    log = open_log(tmp_path, fsync=policy, compacted=compacted)
    log.append(recs(3))
    calls.clear()
    log.roll()
    assert ("/" in calls) == (policy == "always" or compacted)
    log.close()


def test_retention_below_an_offset_keeps_every_segment_that_ends_past_it(tmp_path: Path) -> None:
    """A replicated log's retention stops at what its Raft group holds committed and durable:
    whole segments ending at or before ``below`` only, however far the byte cap asks."""
    log = SegmentedLog.open(tmp_path, LogConfig(segment_bytes=1024, retention_bytes=1))
    for _ in range(10):
        log.append(recs(5))
    ends = [s.next_offset for s in log._segments[:-1]]
    assert len(ends) >= 4
    below = ends[2] + 1  # inside the fourth segment
    assert log.enforce_retention(below=below) == 3
    assert log.log_start_offset == ends[2]
    assert log.enforce_retention(below=below) == 0  # the fourth ends past it
    closed = len(log._segments) - 1
    assert log.enforce_retention() == closed  # unbounded: every closed one
    log.close()
