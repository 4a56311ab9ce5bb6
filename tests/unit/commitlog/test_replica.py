"""The replicated-log operations (broker/commitlog/replica.py) and control batches: raw appends
byte for byte, suffix truncation at batch boundaries never below the floor, the high-water mark
bounding reads, the epoch runs against a full header scan, control batches skipped by every
reader and kept by compaction."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from broker.commitlog import (
    CommitLogError,
    CorruptRecordBatch,
    LogConfig,
    OffsetOutOfRange,
    Record,
    SegmentedLog,
)
from broker.commitlog.batch import (
    BATCH_HEADER,
    CONTROL_FLAG,
    decode_control,
    encode_batch,
    encode_control,
    read_header,
)
from broker.commitlog.reader import LogReader
from tests.unit.commitlog.test_log import FakeClock, recs


def open_log(path: Path, **kw: object) -> SegmentedLog:
    config = LogConfig(**{"segment_bytes": 2048, "index_interval_bytes": 256, **kw})  # type: ignore[arg-type]
    return SegmentedLog.open(path, config, clock=FakeClock())


def noop(log: SegmentedLog, epoch: int) -> bytes:
    return encode_control(log.end_offset, epoch, 1, b"", 1000)


def all_batches(log: SegmentedLog) -> list[bytes]:
    return log.read_batches(log.log_start_offset, log.end_offset, 1 << 30, 1 << 40)


def write_epochs(log: SegmentedLog, rng: random.Random, batches: int) -> list[bytes]:
    """Raw batches of 1-4 records with non-decreasing epochs, one in six a control batch."""
    epoch = 0
    written = []
    for _ in range(batches):
        if rng.random() < 0.15:
            epoch += rng.randint(1, 3)
        if rng.random() < 1 / 6:
            batch = noop(log, epoch)
        else:
            batch = bytes(encode_batch(log.end_offset, recs(rng.randint(1, 4)), leader_epoch=epoch))
        log.append_raw(batch)
        written.append(batch)
    return written


def header_scan(batches: list[bytes]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for batch in batches:
        h = read_header(batch)
        if not runs or runs[-1][1] != h.leader_epoch:
            runs.append((h.base_offset, h.leader_epoch))
    return runs


# -- control batches -------------------------------------------------------------------------


def test_a_control_batch_takes_an_offset_and_no_reader_sees_it(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        log.append(recs(2))
        log.append_raw(encode_control(2, 3, 2, b"config body", 1000))
        log.append(recs(1))
        assert log.end_offset == 4
        assert [r.offset for r in log.read(0)] == [0, 1, 3]
        assert [r.offset for r in log.read(2)] == [3]
        columns = log.read_columns(0)
        assert columns.count == 3 and columns.bases == [0, 3]
        control = log.read_batches(2, 3, 1, 0)[0]
        assert read_header(control).attributes & CONTROL_FLAG
        assert decode_control(control) == (2, b"config body")
        reader = LogReader(tmp_path, log.config, log.end_offset)
        assert [r.offset for r in reader.read(0)] == [0, 1, 3]
        assert reader.read_columns(0).count == 3
        reader.close()
    with open_log(tmp_path) as log:  # recovery accepts it as any valid batch
        assert log.end_offset == 4 and [r.offset for r in log.read(0)] == [0, 1, 3]


def test_a_log_of_control_batches_only_reads_empty(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        for epoch in (1, 2, 3):
            log.append_raw(noop(log, epoch))
        assert log.read(0) == [] and log.read_columns(0).count == 0
        # A column reader (the fetch API) still learns where to go on from.
        assert log.read_columns(0).next_offset == 3
        log.append(recs(2))
        log.append_raw(noop(log, 4))
        read = log.read_columns(1)
        assert (read.count, read.bases, read.next_offset) == (2, [3], 6)


@pytest.mark.parametrize("keep_empty_batches", [False, True])
def test_compaction_keeps_control_batches(tmp_path: Path, keep_empty_batches: bool) -> None:
    keep = keep_empty_batches
    with open_log(tmp_path, compacted=True, segment_bytes=600, keep_empty_batches=keep) as log:
        for i in range(12):
            log.append([Record(0, 1000 + i, "same/topic", b"v%d" % i, 0, False, "c", b"")])
            if i % 4 == 0:
                log.append_raw(noop(log, i))
        controls = [
            read_header(b).base_offset for b in all_batches(log) if read_header(b)[3] & CONTROL_FLAG
        ]
        ends = [read_header(b).next_offset for b in all_batches(log)]
        assert len(log.segments) > 2 and log.compact() > 0
        after = all_batches(log)
        if keep:  # the emptied batches are placeholders
            assert [read_header(b).next_offset for b in after] == ends
        kept = [
            read_header(b).base_offset
            for b in after
            if read_header(b)[3] & CONTROL_FLAG and decode_control(b)[0] == 1
        ]
        assert kept == controls
        payloads = [r.payload for r in log.read(0)]  # the active segment is not compacted
        assert payloads[-1] == b"v11" and b"v0" not in payloads


# -- append_raw ------------------------------------------------------------------------------


def test_append_raw_stores_the_leaders_bytes_and_epoch(tmp_path: Path) -> None:
    batch = bytes(encode_batch(0, recs(3), leader_epoch=7))
    with open_log(tmp_path) as log:
        assert log.append_raw(batch) == 0
        assert log.end_offset == 3
        assert log.read_batches(0, 3, 10, 1 << 20) == [batch]
        assert log.read_batches(2, 3, 10, 1 << 20) == [batch]  # the batch holding offset 2
    with open_log(tmp_path) as log:
        assert log.read_batches(0, 3, 10, 1 << 20) == [batch]
        assert [r.offset for r in log.read(0)] == [0, 1, 2]


def test_append_raw_refuses_bad_bytes_and_a_wrong_base_offset(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        log.append(recs(2))
        good = bytes(encode_batch(2, recs(1), leader_epoch=1))
        flipped = bytearray(good)
        flipped[-1] ^= 0xFF
        with pytest.raises(CorruptRecordBatch, match="CRC"):
            log.append_raw(bytes(flipped))
        with pytest.raises(CorruptRecordBatch, match="after the batch"):
            log.append_raw(good + b"x")
        with pytest.raises(
            CommitLogError, match="base offset 5 cannot be appended at the log end offset 2"
        ):
            log.append_raw(bytes(encode_batch(5, recs(1))))
        assert log.end_offset == 2
        assert log.append_raw(good) == 2


def test_read_batches_limits(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        written = write_epochs(log, random.Random(1), 40)
        assert all_batches(log) == written
        assert log.read_batches(0, log.end_offset, 3, 1 << 20) == written[:3]
        # A byte cap below the first batch still returns it; then stops before the next.
        assert log.read_batches(0, log.end_offset, 10, 1) == written[:1]
        two = len(written[0]) + len(written[1])
        assert log.read_batches(0, log.end_offset, 10, two) == written[:2]
        # ``end`` excludes the batches starting at or after it.
        second = read_header(written[1]).base_offset
        assert log.read_batches(0, second, 10, 1 << 20) == written[:1]


# -- truncate --------------------------------------------------------------------------------


def test_truncate_at_every_batch_boundary_matches_the_prefix(tmp_path: Path) -> None:
    rng = random.Random(2)
    with open_log(tmp_path / "ref") as ref:
        written = write_epochs(ref, rng, 60)
        assert len(ref.segments) > 3
    bases = [read_header(b).base_offset for b in written]
    for cut in [*rng.sample(range(len(written)), 12), 0, len(written) - 1]:
        path = tmp_path / f"cut{cut}"
        with open_log(path) as log:
            for batch in written:
                log.append_raw(batch)
            log.truncate(bases[cut], floor=0)
            assert log.end_offset == bases[cut]
            if cut:
                assert all_batches(log) == written[:cut]
            assert log.segments[-1] <= bases[cut]
            log.append_raw(written[cut])  # appends go on from the cut
            assert log.end_offset == read_header(written[cut]).next_offset
        with open_log(path) as log:  # and the cut is what reopens
            assert all_batches(log) == written[: cut + 1]
            assert log.epoch_runs() == header_scan(written[: cut + 1])


def test_truncate_refuses_inside_a_batch_and_below_the_floor(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        log.append(recs(3))
        log.append(recs(3))
        with pytest.raises(CommitLogError, match="inside the batch at 3"):
            log.truncate(4, floor=0)
        with pytest.raises(CommitLogError, match="below the committed offsets"):
            log.truncate(3, floor=4)
        log.set_high_watermark(6)
        with pytest.raises(CommitLogError, match="below the committed offsets"):
            log.truncate(3, floor=0)
        assert log.end_offset == 6
        log.truncate(6, floor=6)  # at the end: nothing to drop
        assert log.end_offset == 6


def test_truncate_cuts_at_a_damaged_batch_and_keeps_one_below_the_cut(tmp_path: Path) -> None:
    """A Raft truncation may start at a damaged uncommitted batch (a leader that could not read
    it stepped down, and the next leader's log overwrites it): the cut is where the intact
    batch before it ends. A cut above a damaged batch keeps it (for its repair) and the batches
    between, or, when finding the cut would mean walking through it, raises and changes
    nothing; it never drops more than it was asked to."""
    rng = random.Random(3)
    with open_log(tmp_path / "ref") as ref:
        written = write_epochs(ref, rng, 40)
    bases = [read_header(b).base_offset for b in written]
    last = len(written) - 1
    for at in (0, 1, 5, last):  # a segment's first batch, ones inside, the last
        for cut in sorted({at, min(at + 1, last), last}):
            path = tmp_path / f"d{at}-{cut}"
            with open_log(path) as log:
                for batch in written:
                    log.append_raw(batch)
                segment = max(s for s in log.segments if s <= bases[at])
                file = path / f"{segment:020d}.log"
                data = bytearray(file.read_bytes())
                data[data.find(written[at]) + BATCH_HEADER.size + 2] ^= 0x40
                with file.open("r+b") as f:  # in place, as a disk would
                    f.write(data)
                try:
                    log.truncate(bases[cut], floor=0)
                except CorruptRecordBatch:
                    assert cut > at and log.end_offset == read_header(written[-1]).next_offset
                    continue
                assert log.end_offset == bases[cut]
                if at:
                    assert log.read_batches(bases[0], bases[at], 1 << 30, 1 << 40) == written[:at]
                if cut > at + 1:  # the intact batches between the damage and the cut
                    after = log.read_batches(bases[at + 1], bases[cut], 1 << 30, 1 << 40)
                    assert after == written[at + 1 : cut]
                log.append_raw(written[cut])  # appends go on from the cut
                assert log.end_offset == read_header(written[cut]).next_offset
            if cut == at:  # the damaged batch is gone: what reopens is the same
                with open_log(path) as log:
                    assert all_batches(log) == written[: cut + 1]


# -- reset -----------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [4, 40])
def test_reset_starts_an_empty_log_at_an_offset_and_it_reopens_so(
    tmp_path: Path, start: int
) -> None:
    rng = random.Random(3)
    with open_log(tmp_path) as log:
        write_epochs(log, rng, 30)  # several segments, ending past 40
        assert len(log.segments) > 2 and log.end_offset > 40
        log.set_high_watermark(2)
        log.reset(start)  # below the old end (a divergent follower) or above it
        assert (log.log_start_offset, log.end_offset, log.segments) == (start, start, [start])
        assert log.high_watermark == start and log.read(start) == []
        with pytest.raises(OffsetOutOfRange):
            log.read(start - 1)
        batch = bytes(encode_batch(start, recs(2), leader_epoch=7))
        assert log.append_raw(batch) == start
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == [f"{start:020d}.index", f"{start:020d}.log", f"{start:020d}.timeindex"]
    with open_log(tmp_path) as log:  # what reopens is the reset log
        assert (log.log_start_offset, log.end_offset) == (start, start + 2)
        assert all_batches(log) == [batch] and log.epoch_runs() == [(start, 7)]


def test_reset_refuses_below_the_high_water_mark(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        log.append(recs(3))
        log.set_high_watermark(3)
        with pytest.raises(CommitLogError, match="below the high-water mark 3"):
            log.reset(2)
        assert (log.log_start_offset, log.end_offset) == (0, 3)
        log.reset(3)
        assert (log.log_start_offset, log.end_offset) == (3, 3)


# -- high-water mark -------------------------------------------------------------------------


def test_reads_stop_at_the_high_water_mark(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        for _ in range(5):
            log.append(recs(3))
        assert log.high_watermark == log.end_offset == 15  # one node: follows the end
        log.set_high_watermark(6)
        assert log.high_watermark == 6
        assert [r.offset for r in log.read(0)] == list(range(6))
        assert log.read_columns(0).count == 6
        assert [r.offset for r in log.read(4)] == [4, 5]
        assert log.read(6) == [] and log.read(15) == []
        log.set_high_watermark(12)
        assert [r.offset for r in log.read(4)] == list(range(4, 12))
        with pytest.raises(CommitLogError, match="below"):
            log.set_high_watermark(9)
        log.set_high_watermark(40)  # a lagging replica: readers stop at the end
        assert log.high_watermark == 15 and len(log.read(0)) == 15


# -- epoch runs ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_epoch_runs_equal_a_scan_of_every_header(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    with open_log(tmp_path, index_interval_bytes=rng.choice((0, 100, 256, 4096))) as log:
        written = write_epochs(log, rng, rng.randint(1, 150))
        assert log.epoch_runs() == header_scan(written)
    with open_log(tmp_path) as log:
        assert log.epoch_runs() == header_scan(written)


def test_a_single_node_log_is_one_run_of_epoch_zero(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        assert log.epoch_runs() == []
        for _ in range(30):
            log.append(recs(5))
        assert len(log.segments) > 2
        assert log.epoch_runs() == [(0, 0)]
        assert BATCH_HEADER.unpack_from(log.read_batches(0, 5, 1, 0)[0])[5] == 0


def test_a_deferred_append_waits_for_flush(tmp_path: Path) -> None:
    """``append_raw(defer_fsync=True)`` leaves the segment unsynced even under fsync
    "always" (the replicated log flushes once per round); ``flush`` syncs it."""
    log = open_log(tmp_path / "always", fsync="always")
    log.append_raw(noop(log, 1))
    assert not log._segments[-1].dirty
    log.append_raw(noop(log, 1), defer_fsync=True)
    assert log._segments[-1].dirty
    log.flush()
    assert not log._segments[-1].dirty
    log.close()
