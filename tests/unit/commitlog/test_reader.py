"""LogReader: a read-only view of a log another process appends to, checked against the
writer's own reads."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.commitlog import LogConfig, OffsetOutOfRange, Record, SegmentedLog
from broker.commitlog.reader import LogReader

SMALL = LogConfig(segment_bytes=4096, index_interval_bytes=512, fsync="never", retention_ms=None)


def records(n: int, start: int = 0, size: int = 40) -> list[Record]:
    return [
        Record(
            -1,
            1_000 + start + i,
            f"devices/{(start + i) % 7}/t",
            os.urandom(size),
            (start + i) % 3,
            False,
            "c",
            b"",
        )
        for i in range(n)
    ]


def test_reads_match_the_writer_across_rolls(tmp_path: Path) -> None:
    rng = random.Random(7)
    with SegmentedLog.open(tmp_path, SMALL) as log:
        for i in range(60):
            log.append(records(rng.randint(1, 30), i * 30, rng.choice([10, 100, 700])))
        reader = LogReader(tmp_path, SMALL, log.end_offset)
        assert len(log.segments) > 10
        for _ in range(300):
            offset = rng.randrange(log.end_offset + 1)
            limit = rng.choice([1, 7, 100, 5000])
            max_bytes = rng.choice([100, 4096, 1 << 20])
            got = reader.read(offset, limit, max_bytes)
            assert got == log.read(offset, limit, max_bytes)
        reader.close()


def test_nothing_past_the_announced_mark_is_read(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, SMALL) as log:
        log.append(records(5))
        reader = LogReader(tmp_path, SMALL, log.end_offset)
        log.append(records(5, 5))  # written, not announced yet
        assert [r.offset for r in reader.read(0, 100)] == [0, 1, 2, 3, 4]
        assert reader.read(5) == []
        with pytest.raises(OffsetOutOfRange):
            reader.read(6)
        reader.advance(log.end_offset)
        reader.advance(3)  # marks never go back
        assert [r.offset for r in reader.read(3, 100)] == list(range(3, 10))
        reader.close()


def test_a_batch_being_written_past_the_mark_is_not_touched(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, SMALL) as log:
        log.append(records(3))
        end = log.end_offset
        active = tmp_path / f"{log.segments[-1]:020d}.log"
    # The owner is in the middle of its next write: a header claiming more than is there.
    good = active.read_bytes()
    active.write_bytes(good + good[:30])
    reader = LogReader(tmp_path, SMALL, end)
    assert [r.offset for r in reader.read(0, 100)] == [0, 1, 2]
    reader.close()


def test_new_segments_and_retention_are_followed(tmp_path: Path) -> None:
    config = LogConfig(
        segment_bytes=4096,
        index_interval_bytes=512,
        fsync="never",
        retention_ms=None,
        retention_bytes=20_000,
    )
    with SegmentedLog.open(tmp_path, config) as log:
        log.append(records(20, size=200))
        reader = LogReader(tmp_path, config, log.end_offset)
        assert len(reader.read(0, 1000)) == 20
        for i in range(10):
            log.append(records(20, 20 + 20 * i, size=200))  # rolls several times
        reader.advance(log.end_offset)
        assert reader.read(20, 1000, 1 << 30) == log.read(20, 1000, 1 << 30)
        # Retention deletes the oldest segments; once the owner says so, reading there
        # reports the range (the files it still had open are let go).
        assert log.enforce_retention() > 0
        reader.advance(log.end_offset, log.log_start_offset)
        assert reader.log_start_offset == log.log_start_offset > 0
        with pytest.raises(OffsetOutOfRange):
            reader.read(0)
        start = log.log_start_offset
        assert reader.read(start, 1000, 1 << 30) == log.read(start, 1000, 1 << 30)
        reader.close()


def test_offset_for_time(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, SMALL) as log:
        log.append(records(100))
        reader = LogReader(tmp_path, SMALL, log.end_offset)
        for ts in (0, 1_000, 1_050, 1_099, 5_000):
            assert reader.offset_for_time(ts) == log.offset_for_time(ts)
        reader.close()


def test_an_empty_or_missing_directory_reads_nothing(tmp_path: Path) -> None:
    reader = LogReader(tmp_path / "nothing-yet", SMALL)
    assert reader.end_offset == reader.log_start_offset == 0
    assert reader.read(0) == []


@settings(max_examples=40, deadline=None)
@given(
    batches=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    reads=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 200)), max_size=20),
)
def test_sequential_and_random_reads_agree_with_the_writer(
    tmp_path_factory: pytest.TempPathFactory, batches: list[int], reads: list[tuple[int, int]]
) -> None:
    path = tmp_path_factory.mktemp("log")
    with SegmentedLog.open(path, SMALL) as log:
        reader = LogReader(path, SMALL)
        at = 0
        for n in batches:
            log.append(records(n, at))
            at += n
            reader.advance(log.end_offset)
            assert reader.read(at - n, 1000, 1 << 30) == log.read(at - n, 1000, 1 << 30)
        for offset, limit in reads:
            offset = min(offset, log.end_offset)
            assert reader.read(offset, limit) == log.read(offset, limit)
        reader.close()


def test_a_second_pass_across_segments_skips_nothing(tmp_path: Path) -> None:
    """A read that begins in one segment and goes on into the next starts at that segment's
    first batch, even after an earlier pass extended the next segment's sparse index (it
    used to start where that index ended: a second replay lost the rest of the segment)."""
    config = LogConfig(segment_bytes=1 << 20, fsync="never", retention_ms=None)
    with SegmentedLog.open(tmp_path, config) as log:
        for i in range(60):
            log.append(records(500, i * 500, 64))
        reader = LogReader(tmp_path, config, log.end_offset)
        assert len(log.segments) > 2
        for _ in range(2):
            offset = 0
            while offset < log.end_offset:
                got = reader.read(offset, 4096)
                assert got == log.read(offset, 4096)
                cols = reader.read_columns(offset, 4096)
                assert (len(cols), cols.next_offset) == (len(got), got[-1].offset + 1)
                offset = got[-1].offset + 1
        reader.close()


def test_a_segment_past_the_mark_that_a_truncation_replaced_is_read_anew(tmp_path: Path) -> None:
    """A replicated log (a Raft follower) may cut what is past its high-water mark and
    write other batches there: a segment after the cut is deleted, and the new batches may
    roll a segment of the same name (same sizes: the same records proposed again). A reader
    never holds a segment that starts at or past the announced mark, so it reads the new
    file once the mark covers it, not the deleted one."""
    with SegmentedLog.open(tmp_path, SMALL) as log:
        while len(log.segments) < 2:
            log.append(records(5, log.end_offset, 200))
        mark = log.end_offset - 5  # the last batch, which rolled, and what follows: not committed
        while len(log.segments) < 3:
            log.append(records(5, log.end_offset, 200))
        rolled = log.segments[-1]
        log.set_high_watermark(mark)
        reader = LogReader(tmp_path, SMALL, mark)
        assert reader.read(mark - 1) == log.read(mark - 1)
        log.truncate(mark, floor=mark)  # another leader's log wins
        new: list[Record] = []
        while len(log.segments) < 3:
            batch = records(5, 1_000 + len(new), 200)
            log.append(batch)
            new += batch
        assert log.segments[-1] == rolled  # the same name, another file
        log.set_high_watermark(log.end_offset)
        reader.advance(log.end_offset)
        got: list[Record] = []
        while len(got) < len(new):
            got += reader.read(mark + len(got))
        assert [r.payload for r in got] == [r.payload for r in new]
        reader.close()


def test_a_reader_made_before_the_first_record_knows_where_the_log_starts(tmp_path: Path) -> None:
    """A reader made when the mark was 0 holds no segment (none starts below it); once the
    mark moves, the log starts where the owner's does, not at the mark (a ``$replay`` from
    the earliest offset starts there)."""
    with SegmentedLog.open(tmp_path, SMALL) as log:
        reader = LogReader(tmp_path, SMALL, 0)
        assert reader.log_start_offset == 0
        log.append(records(5))
        reader.advance(log.end_offset, log.log_start_offset)
        assert reader.log_start_offset == 0
        assert reader.read(0) == log.read(0)
        reader.close()


def test_a_log_set_aside_and_made_anew_is_read_from_its_new_files(tmp_path: Path) -> None:
    """A replica removed from its Raft group sets its copy aside (the directory renamed,
    ``Streams.set_aside``) and, added again, writes a new log of the same segment names in
    its place. Another worker's reader that held the old files reads the new ones past the
    old copy's end, not the old file's end forever."""
    directory = tmp_path / "p"
    with SegmentedLog.open(directory, SMALL) as log:
        log.append(records(5))
        old_end = log.end_offset
        reader = LogReader(directory, SMALL, old_end)
        assert [r.offset for r in reader.read(0)] == [0, 1, 2, 3, 4]
    directory.rename(tmp_path / "p.removed-1")
    new = records(12)
    with SegmentedLog.open(directory, SMALL) as log:
        log.append(new)  # the group's log again, longer now (the same first segment's name)
        reader.advance(log.end_offset)
        got = reader.read(old_end)
    assert [r.payload for r in got] == [r.payload for r in new[old_end:]]
    reader.close()
