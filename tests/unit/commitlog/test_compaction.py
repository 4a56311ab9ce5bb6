"""Compaction of keyed logs: latest record per topic, tombstones, offsets kept, crash safety."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from broker.commitlog import CommitLogError, LogConfig, Record, SegmentedLog
from broker.commitlog.batch import (
    CONTROL_COMPACTED,
    CONTROL_FLAG,
    decode_control,
    encode_control,
    read_header,
)
from broker.commitlog.log import CLEAN_SHUTDOWN_FILE
from broker.commitlog.reader import LogReader
from broker.commitlog.verify import verify_data_dir

COMPACTED = LogConfig(segment_bytes=1 << 20, compacted=True, retention_ms=None)
#: A log whose batches are Raft entries: compaction leaves a placeholder where it empties one.
KEEPING = dataclasses.replace(COMPACTED, keep_empty_batches=True)


def put(log: SegmentedLog, *items: tuple[str, bytes]) -> None:
    log.append([Record(0, 1000, key, value) for key, value in items])


def contents(log: SegmentedLog) -> list[tuple[int, str, bytes]]:
    return [(r.offset, r.topic, r.payload) for r in log.read(log.log_start_offset, 10_000)]


def all_batches(log: SegmentedLog) -> list[bytes]:
    return log.read_batches(log.log_start_offset, log.end_offset, 1 << 30, 1 << 40)


def boundaries(log: SegmentedLog) -> list[tuple[int, int, int]]:
    """(base offset, next offset, leader epoch) of every batch: Raft's entries."""
    headers = map(read_header, all_batches(log))
    return [(h.base_offset, h.next_offset, h.leader_epoch) for h in headers]


def kinds(log: SegmentedLog) -> dict[int, int | None]:
    """Base offset -> control type of every batch (None: a batch of records)."""
    return {
        read_header(b).base_offset: decode_control(b)[0] if b[13] & CONTROL_FLAG else None
        for b in all_batches(log)
    }


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


def test_emptied_segments_keep_their_batches_as_placeholders(tmp_path: Path) -> None:
    log = SegmentedLog.open(tmp_path, KEEPING)
    put(log, ("a", b"1"))
    log.roll()
    put(log, ("a", b"2"))
    log.roll()
    put(log, ("a", b"3"))
    log.roll()
    put(log, ("a", b"4"))
    before = boundaries(log)
    assert log.segments == [0, 1, 2, 3]
    assert log.compact() == 3
    assert log.segments == [0, 1, 2, 3] and boundaries(log) == before
    assert [kinds(log)[o] for o in (0, 1, 2)] == [CONTROL_COMPACTED] * 3
    assert log.log_start_offset == 0 and contents(log) == [(3, "a", b"4")]
    assert log.read(0)[0].offset == 3 and log.read_columns(0).bases == [3]
    assert log.compact() == 0
    log.roll()
    assert log.compact() == 0  # placeholders hold nothing to remove
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


# -- batch boundaries (Raft's entries) survive compaction --------------------------------------


def keyed(log: SegmentedLog, epoch: int, *items: tuple[str, bytes]) -> list[Record]:
    """Append one batch of ``items`` at ``epoch`` (timestamps 1000 + 10 * offset); return it."""
    base = log.end_offset
    batch = [Record(base + i, 1000 + 10 * (base + i), k, v) for i, (k, v) in enumerate(items)]
    assert log.append(batch, leader_epoch=epoch) == base
    return batch


def survivors(records: list[Record], active_base: int) -> list[Record]:
    """The reference: the latest record per key, tombstones of closed segments dropped."""
    latest = {r.topic: r.offset for r in records}
    return [
        r for r in records if r.offset >= active_base or (r.payload and latest[r.topic] == r.offset)
    ]


def gapped_log(path: Path, config: LogConfig = KEEPING) -> tuple[SegmentedLog, list[Record]]:
    """Batches whose compaction leaves a gap at the end, at the start, inside, none at all
    (placeholders, the last batch of a segment among them), a control batch, epochs 1-4."""
    log = SegmentedLog.open(path, config)
    written = keyed(log, 1, ("x", b"x0"), ("y", b"y0"), ("z", b"z0"))  # 0-2: keeps x0 only
    written += keyed(log, 1, ("y", b"y1"), ("w", b"w0"))  # 3-4: keeps w0 only
    written += keyed(log, 2, ("z", b"z1"))  # 5: emptied
    log.append_raw(encode_control(log.end_offset, 2, 1, b"", 0))  # 6: a Raft no-op
    written += keyed(log, 2, ("v", b"v0"), ("u", b"u0"))  # 7-8: v0 goes (tombstone at 12)
    written += keyed(log, 3, ("y", b"y2"))  # 9: emptied, the segment's last batch
    log.roll()
    written += keyed(log, 3, ("z", b"z2"), ("y", b"y3"), ("v", b""))  # 10-12: keeps z2
    written += keyed(log, 4, *[(f"p{i}", b"p") for i in range(10)])  # 13-22: p1 p3 p9 go
    log.roll()
    written += keyed(log, 4, ("y", b"y4"), ("p1", b"q"), ("p3", b"q"), ("p9", b"q"))  # active
    return log, written


def check_reads(log: SegmentedLog, expected: list[Record]) -> None:
    """From every offset, every reader returns the reference's records from there on."""
    reader = LogReader(log.directory, log.config, log.end_offset)
    try:
        for offset in range(log.log_start_offset, log.end_offset + 1):
            want = [r for r in expected if r.offset >= offset][:3]
            assert log.read(offset, max_records=3) == want, offset
            assert reader.read(offset, max_records=3) == want, offset
            columns = log.read_columns(offset, max_records=3)
            assert columns.count == len(want), offset
            if want:
                assert columns.next_offset >= want[-1].offset + 1
                assert log.offset_for_time(want[0].timestamp) == want[0].offset
    finally:
        reader.close()


def test_compaction_keeps_every_batch_and_reads_skip_the_gaps(tmp_path: Path) -> None:
    log, written = gapped_log(tmp_path / "$retained" / "0")
    before, end = boundaries(log), log.end_offset
    assert log.compact() == len(written) - len(survivors(written, 23))
    assert boundaries(log) == before and log.end_offset == end == 27
    controls = {o: t for o, t in kinds(log).items() if t is not None}
    assert controls == {5: CONTROL_COMPACTED, 6: 1, 9: CONTROL_COMPACTED}
    expected = survivors(written, 23)
    assert [r.offset for r in expected] == [0, 4, 8, 10, 13, 15, 17, 18, 19, 20, 21, 23, 24, 25, 26]
    check_reads(log, expected)
    assert log.offset_for_time(1000 + 10 * 9) == 10  # only the placeholder at 9 is that old
    log.close()
    assert not any(check.damaged for _d, checks in verify_data_dir(tmp_path) for check in checks)
    # Reopened after a clean close, then recovered from scratch: the log ends where it did.
    for clean in (True, False):
        if not clean:
            (log.directory / CLEAN_SHUTDOWN_FILE).unlink()
            for index in [*log.directory.glob("*.index"), *log.directory.glob("*.timeindex")]:
                index.unlink()
        log = SegmentedLog.open(log.directory, KEEPING)
        assert boundaries(log) == before and log.end_offset == end
        check_reads(log, expected)
        log.close()


def test_a_compacted_batch_is_compacted_again_in_place(tmp_path: Path) -> None:
    log, written = gapped_log(tmp_path)
    before = boundaries(log)
    log.compact()
    written += keyed(log, 5, ("x", b"x1"), ("w", b"w1"), ("z", b"z3"))  # 27-29
    log.roll()
    assert log.compact() == 3  # x0, w0 and z2
    assert boundaries(log)[: len(before)] == before
    controls = {o: t for o, t in kinds(log).items() if t == CONTROL_COMPACTED}
    assert sorted(controls) == [0, 3, 5, 9, 10]  # x0, w0, z2: their batches' last survivors
    check_reads(log, survivors(written, 30))
    log.close()


def test_only_records_below_the_high_water_mark_count(tmp_path: Path) -> None:
    # A replicated log pins its high-water mark to what the replicas committed; what lies past
    # it may still be truncated, so it neither goes nor removes what it supersedes (else a
    # truncated tombstone would leave its key without the committed value before it).
    log = SegmentedLog.open(tmp_path, KEEPING)
    put(log, ("a", b"1"))  # 0
    log.roll()
    put(log, ("a", b"2"))  # 1
    log.roll()
    put(log, ("a", b""))  # 2: a tombstone, not committed yet
    log.roll()
    put(log, ("b", b"1"))  # 3
    log.set_high_watermark(2)
    assert log.compact() == 1  # a@0 only: a@1 is the latest committed value
    assert log.compact() == 0
    log.truncate(2, floor=2)  # the uncommitted tombstone is cut: a@1 is still there
    assert contents(log) == [(1, "a", b"2")]
    put(log, ("a", b""))  # 2 again, in the active segment
    log.roll()
    put(log, ("c", b"1"))  # 3
    log.set_high_watermark(4)
    assert log.compact() == 2  # a@1 and the committed tombstone in a closed segment
    assert contents(log) == [(3, "c", b"1")]
    log.close()


def test_a_local_log_drops_emptied_batches_and_keeps_the_others_where_they_were(
    tmp_path: Path,
) -> None:
    log, written = gapped_log(tmp_path / "s" / "0", COMPACTED)
    before = {base: (end, epoch) for base, end, epoch in boundaries(log)}
    log.compact()
    after = {base: (end, epoch) for base, end, epoch in boundaries(log)}
    assert sorted(before.keys() - after.keys()) == [5, 9]  # the emptied ones
    assert all(after[base] == before[base] for base in after)
    check_reads(log, survivors(written, 23))
    log.close()
    assert not any(check.damaged for _d, checks in verify_data_dir(tmp_path) for check in checks)


def test_a_log_ending_in_a_compaction_gap_reopens_at_the_same_end(tmp_path: Path) -> None:
    # The log's last batches lose their last records: with the (empty) active segment lost in
    # a crash, recovery takes the end offset from the last batch's last offset delta.
    log = SegmentedLog.open(tmp_path, KEEPING)
    put(log, ("a", b"1"))  # 0
    put(log, ("b", b"1"), ("c", b"1"), ("b", b""))  # 1-3: a tombstone last
    log.roll()
    assert log.segments == [0, 4] and log.compact() == 2
    assert kinds(log) == {0: None, 1: None}  # b@1 and the tombstone gone, c@2 kept
    put(log, ("e", b"1"), ("c", b""))  # 4-5: a tombstone last again
    log.roll()
    assert log.compact() == 2  # c@2 and the tombstone at 5
    assert kinds(log) == {0: None, 1: CONTROL_COMPACTED, 4: None}
    assert [r.offset for r in log.read(4)] == [4]  # the batch at 4 still ends at 5
    log.close()
    for name in (f"{6:020d}.log", f"{6:020d}.index", f"{6:020d}.timeindex", CLEAN_SHUTDOWN_FILE):
        (tmp_path / name).unlink(missing_ok=True)
    log = SegmentedLog.open(tmp_path, KEEPING)
    assert log.segments == [0, 4] and log.end_offset == 6
    assert log.append([Record(0, 1, "d", b"1")]) == 6
    assert contents(log) == [(0, "a", b"1"), (4, "e", b"1"), (6, "d", b"1")]
    log.close()
