"""The router's view of a partition (broker.router.partition): offsets assigned as records
are gathered, one append per group commit, acknowledgements with the offsets (or None on a
storage error), the tail of committed records kept in memory and trimmed, reads from the
tail or the log, the read-ahead and column caches, and a partition another worker owns
(:class:`PartitionBase` over a :class:`LogReader`).

The last test drives random appends, commits and reads against a list of records.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

import broker.router.partition as partition_module
from broker.commitlog import LogConfig, LogIOError, OffsetOutOfRange, Record, SegmentedLog
from broker.commitlog.config import StreamSpec
from broker.commitlog.reader import LogReader
from broker.router.partition import (
    READ_AHEAD_REST,
    READ_BATCH,
    Columns,
    Partition,
    PartitionBase,
)

KEY = ("s", 0)
T0 = 1_700_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = T0 / 1000

    def __call__(self) -> float:
        return self.now


class CountingLog(SegmentedLog):
    """A SegmentedLog that counts appends and reads, and fails the next append on demand."""

    appends = 0
    reads = 0
    fail_next = False

    def append(self, records: Sequence[Record], *, leader_epoch: int = 0) -> int:
        if self.fail_next:
            self.fail_next = False
            raise LogIOError(self.directory, "append", OSError(28, "No space left on device"))
        self.appends += 1
        return super().append(records, leader_epoch=leader_epoch)

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list[Record]:
        self.reads += 1
        return super().read(offset, max_records, max_bytes)

    def read_columns(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> Any:
        self.reads += 1
        return super().read_columns(offset, max_records, max_bytes)


def open_log(directory: Path, segment_bytes: int = 64 << 20) -> CountingLog:
    log = CountingLog.open(
        directory, LogConfig(fsync="never", segment_bytes=segment_bytes), clock=Clock()
    )
    assert isinstance(log, CountingLog)
    return log


@pytest.fixture
def log(tmp_path: Path) -> Iterator[CountingLog]:
    plog = open_log(tmp_path / "p")
    yield plog
    plog.close()


def rec(i: int, size: int = 8, **fields: Any) -> Record:
    """A record to gather (its offset is for the partition to assign)."""
    payload = (b"%d:" % i).ljust(size, b".")
    return Record(-1, T0 + i, f"t/{i % 3}", payload, i % 3, i % 5 == 0, f"c{i % 2}", **fields)


def renumbered(records: Sequence[Record], first: int) -> list[Record]:
    return [r._replace(offset=first + i) for i, r in enumerate(records)]


def column_rows(cols: Columns) -> list[tuple[Any, ...]]:
    """The records ``cols`` holds (``start .. stop``), as comparable rows."""
    cols.built()
    pubs = cols.publishers()
    return [
        (
            cols.offsets[i],
            cols.topics[i],
            cols.payloads[i],
            cols.qos[i],
            bool(cols.retains[i]),
            pubs[i],
            bool(cols.properties[i]),
        )
        for i in range(cols.start, cols.stop)
    ]


def record_rows(records: Sequence[Record]) -> list[tuple[Any, ...]]:
    return [
        (r.offset, r.topic, r.payload, r.qos, bool(r.retain), r.client_id, bool(r.properties))
        for r in records
    ]


# ====================================================================== gather and commit


def test_offsets_are_assigned_as_records_are_gathered(log: CountingLog) -> None:
    log.append([rec(0), rec(1)])
    part = Partition(KEY, log)
    assert part.end_offset == part.end == part.next_offset() == 2
    acked: list[int | None] = []
    for i in range(2, 5):
        part.add(rec(i)._replace(offset=99), acked.append)  # a wrong offset is replaced
    assert [r.offset for r in part.pending] == [2, 3, 4]
    assert part.next_offset() == 5
    assert part.end_offset == 2  # nothing committed yet
    assert acked == []
    assert part.commit() == (2, 5)
    assert acked == [2, 3, 4]
    assert part.pending == [] and part.acks == []
    assert part.end_offset == part.end == log.end_offset == 5
    assert log.read(2) == renumbered([rec(2), rec(3), rec(4)], 2)


def test_one_append_per_commit(log: CountingLog) -> None:
    part = Partition(KEY, log)
    for i in range(50):
        part.add(rec(i), None)
    part.commit()
    assert log.appends == 1
    assert part.commit() == (50, 50)  # nothing gathered: nothing appended, nothing changes
    assert log.end_offset == 50


def test_add_run_gathers_one_record_per_payload(log: CountingLog) -> None:
    part = Partition(KEY, log)
    part.add(rec(0), None)
    acked: list[int | None] = []
    part.add_run(T0, "a/b", "pub", [b"x", b"y", b"z"], [1, 0, 2], [acked.append, None, None])
    assert part.pending[1:] == [
        Record(1, T0, "a/b", b"x", 1, False, "pub", b""),
        Record(2, T0, "a/b", b"y", 0, False, "pub", b""),
        Record(3, T0, "a/b", b"z", 2, False, "pub", b""),
    ]
    part.commit()
    assert acked == [1]
    assert [r.payload for r in log.read(1)] == [b"x", b"y", b"z"]


def test_add_rows_acks_the_first_offset_once(log: CountingLog) -> None:
    """A batch forwarded by another worker: rows without offsets, one ack for all."""
    part = Partition(KEY, log)
    part.add(rec(0), None)
    acked: list[int | None] = []
    rows = [(T0, "a", b"1", 1, False, "c", b""), (T0, "a", b"2", 1, False, "c", b"")]
    part.add_rows(rows, acked.append)
    assert [r.offset for r in part.pending] == [0, 1, 2]
    part.commit()
    assert acked == [1]
    assert [r.payload for r in log.read(1)] == [b"1", b"2"]


def test_a_failed_append_answers_none_and_frees_its_offsets(log: CountingLog) -> None:
    part = Partition(KEY, log)
    part.add(rec(0), None)
    part.commit()
    acked: list[int | None] = []
    part.add(rec(1), acked.append)
    part.add(rec(2), acked.append)
    log.fail_next = True
    with pytest.raises(LogIOError):
        part.commit()
    assert acked == [None, None]
    assert part.pending == [] and part.acks == []
    assert part.end == part.end_offset == 1
    assert [r.offset for r in part.tail] == [0]  # the failed records never reached the tail
    part.add(rec(3), acked.append)  # gets the offset the failed batch had
    assert part.commit() == (1, 2)
    assert acked == [None, None, 1]
    assert part.read(0) == renumbered([rec(0), rec(3)], 0)


def test_a_log_moved_under_the_partition_is_renumbered(log: CountingLog) -> None:
    """The partition is the log's only writer; should something else append, the records
    gathered are stored and acknowledged with the offsets the log gave them."""
    part = Partition(KEY, log)
    part.add(rec(0), None)
    log.append([rec(100)])
    acked: list[int | None] = []
    part.add(rec(1), acked.append)
    assert part.commit() == (1, 3)
    assert acked == [2]
    assert part.read(1) == renumbered([rec(0), rec(1)], 1)


# ================================================================================= the tail


def test_committed_records_are_read_from_the_tail(log: CountingLog) -> None:
    part = Partition(KEY, log)
    gathered = [rec(i) for i in range(5)]
    for r in gathered:
        part.add(r, None)
    pending = list(part.pending)
    part.commit()
    assert part.tail_base == 0 and part.tail == pending
    assert part.tail_bytes == sum(len(r.payload) for r in pending)
    reads = log.reads
    got = part.read(2, max_records=2)
    assert got == renumbered(gathered, 0)[2:4]
    assert got[0] is pending[2]  # the records gathered, not rebuilt
    assert part.read(5) == []  # caught up
    assert column_rows(part.read_columns(1)) == record_rows(pending[1:])
    assert log.reads == reads  # none of it touched the log


def test_a_tail_that_does_not_continue_is_replaced(log: CountingLog) -> None:
    log.append([rec(i) for i in range(3)])
    part = Partition(KEY, log)
    assert (part.tail, part.tail_base) == ([], 3)
    part.add(rec(3), None)
    part.commit()
    assert part.tail_base == 3 and len(part.tail) == 1
    part.keep_tail(10, renumbered([rec(10), rec(11)], 10))  # a gap: the new records only
    assert part.tail_base == 10 and [r.offset for r in part.tail] == [10, 11]
    assert part.tail_bytes == 16
    part.keep_tail(12, renumbered([rec(12)], 12))  # continues it
    assert part.tail_base == 10 and len(part.tail) == 3 and part.tail_bytes == 24


def test_the_tail_keeps_at_most_tail_records(
    log: CountingLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(partition_module, "TAIL_RECORDS", 4)
    part = Partition(KEY, log)
    for batch in range(3):
        for i in range(3):
            part.add(rec(batch * 3 + i), None)
        part.commit()
    assert part.tail_base == 5 and [r.offset for r in part.tail] == [5, 6, 7, 8]
    assert part.tail_bytes == 4 * 8
    reads = log.reads
    assert part.read(1, max_records=3) == renumbered([rec(1), rec(2), rec(3)], 1)
    assert log.reads == reads + 1  # behind the tail: from the log


def test_the_tail_keeps_about_tail_bytes_but_at_least_one_record(
    log: CountingLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(partition_module, "TAIL_BYTES", 100)
    part = Partition(KEY, log)
    for i in range(6):
        part.add(rec(i, size=30), None)
    part.commit()
    assert [r.offset for r in part.tail] == [3, 4, 5]
    assert part.tail_bytes == 90
    part.add(rec(6, size=500), None)  # alone larger than TAIL_BYTES
    part.commit()
    assert [r.offset for r in part.tail] == [6] and part.tail_bytes == 500
    assert part.read(6) == renumbered([rec(6, size=500)], 6)


# ================================================================== reads from the log


def test_reads_behind_the_tail_share_one_read_ahead(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    log.append([rec(i) for i in range(20)])
    part = Partition(KEY, log)  # reopened: nothing in memory
    expected = renumbered([rec(i) for i in range(20)], 0)
    assert part.read(3) == expected[3:]
    reads = log.reads
    assert part.read(4, max_records=2) == expected[4:6]
    assert part.read(19, max_records=5) == expected[19:]
    assert log.reads == reads
    assert part.read(0, max_records=2) == expected[:2]  # before the read-ahead: the log
    assert log.reads == reads + 1
    log.close()


def test_a_short_read_does_not_replace_the_read_ahead(log: CountingLog) -> None:
    log.append([rec(i) for i in range(10)])
    part = Partition(KEY, log)
    part.read(0)
    part.read(8, max_records=1)  # served from the read-ahead
    reads = log.reads
    part.read(5, max_records=2)
    assert log.reads == reads
    assert part.read_base == 0 and len(part.read_ahead) == 10


def test_read_below_the_retained_start_raises(tmp_path: Path) -> None:
    small = LogConfig(fsync="never", segment_bytes=200, retention_bytes=400, retention_ms=None)
    log = SegmentedLog.open(tmp_path / "p", small, clock=Clock())
    for i in range(30):
        log.append([rec(i)])  # a batch each: several segments
    assert log.enforce_retention() > 0
    first = log.log_start_offset
    assert first > 0
    part = Partition(KEY, log)  # opened after retention: its tail is empty
    with pytest.raises(OffsetOutOfRange) as caught:
        part.read(first - 1)
    assert caught.value.log_start_offset == first
    with pytest.raises(OffsetOutOfRange):
        part.read_columns(0)
    assert part.read(first)[0] == renumbered([rec(first)], first)[0]
    log.close()


def test_read_columns_from_the_log_equal_the_records(log: CountingLog) -> None:
    written = [
        rec(i, size=8 if i < 10 else 8 + i, properties=b"\x26\x00\x01k\x00\x01v" if i % 4 else b"")
        for i in range(30)
    ]
    for chunk in (written[:10], written[10:25], written[25:]):  # one payload size, then mixed
        log.append(chunk)
    part = Partition(KEY, log)
    cols = part.read_columns(0)
    assert len(cols) == 30
    assert column_rows(cols) == record_rows(renumbered(written, 0))
    assert [cols.topic_at(i) for i in range(30)] == [r.topic for r in written]


def test_read_columns_keeps_what_it_read_for_the_next_reads(log: CountingLog) -> None:
    n = READ_AHEAD_REST + 20
    log.append([rec(i) for i in range(n)])
    part = Partition(KEY, log)
    first = part.read_columns(0)
    reads = log.reads
    later = part.read_columns(20)  # READ_AHEAD_REST records left in the columns kept
    assert log.reads == reads
    assert later.offsets is first.offsets and later.start == 20
    assert column_rows(later) == record_rows(renumbered([rec(i) for i in range(20, n)], 20))
    part.read_columns(21)  # fewer left: read again from there, with what follows
    assert log.reads == reads + 1


def test_tail_columns_are_kept_for_the_next_reads(log: CountingLog) -> None:
    part = Partition(KEY, log)
    for i in range(READ_AHEAD_REST + 5):
        part.add(rec(i), None)
    part.commit()
    first = part.read_columns(0)
    again = part.read_columns(5)
    assert again.offsets is first.offsets and again.start == 5 and len(again) == READ_AHEAD_REST
    fresh = part.read_columns(6)
    assert fresh.offsets is not first.offsets and fresh.offsets[0] == 6


def test_empty_columns() -> None:
    cols = Columns.from_records([])
    assert len(cols) == 0 and column_rows(cols) == []


# ======================================================= a partition another worker owns


def test_a_remote_partition_reads_only_below_the_announced_mark(tmp_path: Path) -> None:
    owner = open_log(tmp_path / "p")
    owner.append([rec(i) for i in range(10)])  # one batch
    reader = LogReader(tmp_path / "p", owner.config, end_offset=0)
    part = PartitionBase(KEY, reader)
    assert not isinstance(part, Partition)
    assert part.end_offset == 0 and part.next_offset() == -1
    assert part.read(0) == []
    part.committed_through(5)  # a no-op here: the mark is what the reader was told
    reader.advance(6)  # a mark inside the batch: offsets 0..5 are committed
    assert [r.offset for r in part.read(0)] == [0, 1, 2, 3, 4, 5]
    cols = part.read_columns(0)
    assert len(cols) == 6 and cols.offsets[cols.stop - 1] == 5
    assert part.columns_ahead is None  # a cut read is not kept: 6.. comes later
    reader.advance(10)
    assert len(part.read_columns(0)) == 10
    owner.close()


def test_a_remote_partition_forwards_instead_of_appending(tmp_path: Path) -> None:
    owner = open_log(tmp_path / "p")
    part = PartitionBase(KEY, LogReader(tmp_path / "p", owner.config))
    part.add_run(T0, "a", "c", [b"1", b"2"], [1, 1], [None, None])
    part.add_rows([(T0, "a", b"3", 1, False, "c", b"")], None)
    assert [r.offset for r in part.pending] == [-1, -1, -1]  # the owner numbers them
    with pytest.raises(NotImplementedError):
        part.commit()
    owner.close()


# ================================================================= against a reference model

Op = tuple[Any, ...]

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 60), min_size=1, max_size=12)),
        st.tuples(st.just("commit")),
        st.tuples(st.just("read"), st.floats(0, 1), st.integers(1, 12)),
        st.tuples(st.just("columns"), st.floats(0, 1)),
        st.tuples(st.just("catch_up"), st.floats(0, 1)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, tail_records=st.integers(1, 40), tail_bytes=st.integers(1, 400))
def test_reads_agree_with_a_list_of_records(
    ops: list[Op], tail_records: int, tail_bytes: int
) -> None:
    """Every read at any committed offset returns the records a plain list holds there:
    across appends, segment rolls, tail trims, read-aheads and column caches."""
    directory = Path(tempfile.mkdtemp(prefix="partition-model-"))
    log = open_log(directory / "p", segment_bytes=300)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(partition_module, "TAIL_RECORDS", tail_records)
            mp.setattr(partition_module, "TAIL_BYTES", tail_bytes)
            mp.setattr(partition_module, "READ_BATCH", 16)
            mp.setattr(partition_module, "READ_AHEAD_REST", 4)
            _run_model(Partition(KEY, log), ops)
    finally:
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


def _run_model(part: Partition, ops: list[Op]) -> None:
    model: list[Record] = []  # committed, offset i at index i
    pending: list[Record] = []
    acked: list[int | None] = []
    n = 0
    for op in ops:
        kind = op[0]
        if kind == "add":
            for size in op[1]:
                r = Record(-1, T0 + n, f"t/{n % 4}", b"%d|" % n + b"x" * size, n % 3)
                part.add(r, acked.append)
                pending.append(r._replace(offset=len(model) + len(pending)))
                n += 1
            assert part.next_offset() == len(model) + len(pending)
        elif kind == "commit":
            acked.clear()
            first, end = part.commit()
            assert (first, end) == (len(model), len(model) + len(pending))
            assert acked == list(range(first, end))
            model += pending
            pending = []
            tail = part.tail
            assert len(tail) <= partition_module.TAIL_RECORDS
            assert [r.offset for r in tail] == list(
                range(part.tail_base, part.tail_base + len(tail))
            )
            if model:
                assert part.tail_base + len(tail) == len(model)
        else:
            offset = round(op[1] * len(model))
            if kind == "read":
                got = part.read(offset, max_records=op[2])
                want = model[offset : offset + op[2]]
                assert got == want[: len(got)]
                assert got or offset == len(model)
            elif kind == "columns":
                cols = part.read_columns(offset)
                assert 0 < len(cols) <= partition_module.READ_BATCH or offset == len(model)
                assert column_rows(cols) == record_rows(model[offset : offset + len(cols)])
            else:  # a subscriber reads from offset until caught up, as the router does
                seen: list[Record] = []
                while offset < len(model):
                    got = part.read(offset)
                    assert got
                    seen += got
                    offset = got[-1].offset + 1
                assert seen == model[len(model) - len(seen) :]
        assert part.end_offset == len(model)


def test_read_batch_is_the_default_read_size(log: CountingLog) -> None:
    """Sanity for the model above: a plain read returns at most READ_BATCH records."""
    log.append([rec(i) for i in range(READ_BATCH + 5)])
    part = Partition(KEY, log)
    assert len(part.read(0)) == READ_BATCH


# ============================================================ a partition another worker owns


def test_a_forwarding_commit_wakes_none_of_its_readers(tmp_path: Path) -> None:
    """The group commit wakes the readers of the partitions it appended to; a partition
    another worker owns only forwarded what was gathered (nothing new to read there yet:
    its readers wake with the owner's announcement, broker.workers.partitions), so they are
    not pumped for nothing, once per iteration (issue 23)."""
    from broker.router.commit import GroupCommit
    from broker.workers.partitions import RemotePartition
    from tests.unit.router.conftest import Harness

    forwarded: list[int] = []
    owner = open_log(tmp_path / "owner")

    class TwoWorkers(Harness):
        def open(self) -> None:
            super().open()
            state = self.router.state

            def make(key: Any) -> Any:
                if key != KEY:
                    return Partition(key, self.streams.log(*key))
                reader = LogReader(owner.directory, owner.config, 0)
                return RemotePartition(key, reader, 1, lambda p, r, a: forwarded.append(len(r)))

            state._make_partition = make

    spec = StreamSpec("s", ("s/#",), 1, LogConfig(fsync="never"))
    h = TwoWorkers(tmp_path / "data", specs=[spec])
    woken: list[Any] = []
    commit = h.router.flush.__self__
    assert isinstance(commit, GroupCommit)
    real_wake = commit.wake
    commit.wake = lambda part: (woken.append(part.key), real_wake(part))[1]
    _, sub = h.connect("sub")
    h.subscribe(sub, "s/#", 1)
    _, pub = h.connect("pub")
    woken.clear()
    h.publish(pub, "s/a", b"x", qos=1, packet_id=1)
    h.run()
    assert forwarded == [1]
    assert woken == []  # before: [KEY], a pump that found nothing
    h.publish(pub, "d/a", b"y", qos=1, packet_id=2)  # the default stream: appended here
    h.run()
    assert woken == [("default", 0)]
    owner.close()
