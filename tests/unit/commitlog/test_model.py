"""SegmentedLog against a simple in-memory reference model (hypothesis stateful testing).

The model is a dict ``offset -> Record`` plus ``log_start_offset`` and ``end_offset``. Rules
drive the real log (append, read, offset_for_time, roll, reopen, retention with a fake clock,
flush, compaction) and every step checks that the log says exactly what the model says.

Segment boundaries are an implementation choice (they depend on the encoded size), so the
model reads them from ``log.segments`` when a rule's expected outcome depends on them
(retention deletes whole closed segments; compaction rewrites closed segments only).

Timestamps are multiples of 10 ms and the fake clock is always at 5 (mod 10) ms, so
"older than retention_ms" is never decided by a tie (or by float rounding of the clock).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import ClassVar

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from broker.commitlog.batch import read_header
from broker.commitlog.config import LogConfig
from broker.commitlog.errors import OffsetOutOfRange
from broker.commitlog.log import SegmentedLog
from broker.commitlog.record import Record

T0_MS = 1_700_000_000_000
RETENTION_MS = 2_000
RETENTION_BYTES = 7_000

SETTINGS = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class FakeClock:
    """A clock in seconds (like ``time.time``) that only moves when a rule says so."""

    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> float:
        return self.now_ms / 1000.0


# --- strategies ------------------------------------------------------------------------------

PLAIN_TOPICS = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00+#"),
    min_size=1,
    max_size=12,
)
KEYED_TOPICS = st.sampled_from(["k/a", "k/b", "k/c", "k/d", "k/é", "k/f"])


def _payloads(max_size: int) -> st.SearchStrategy[bytes]:
    # Mostly small, sometimes bigger than a segment's index interval.
    return st.one_of(st.binary(max_size=40), st.binary(min_size=41, max_size=max_size))


def record_fields(topics: st.SearchStrategy[str], max_payload: int) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            "topic": topics,
            "payload": _payloads(max_payload),
            "qos": st.integers(0, 2),
            "retain": st.booleans(),
            "client_id": st.text(max_size=8),
            "properties": st.binary(max_size=12),
        }
    )


# --- model ---------------------------------------------------------------------------------


class LogModel(RuleBasedStateMachine):
    """Shared machinery: the model, the real log, and checks that compare them."""

    CONFIG: ClassVar[LogConfig]
    TOPICS: ClassVar[st.SearchStrategy[str]]

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="mqlog-model-"))
        self.dir = self.tmp / "0"
        self.clock = FakeClock(T0_MS + 5)
        self.log = SegmentedLog.open(self.dir, self.CONFIG, clock=self.clock)
        self.records: dict[int, Record] = {}
        self.start = 0
        self.end = 0
        self.last_ts = T0_MS

    def teardown(self) -> None:
        try:
            self.log.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- model helpers --

    def surviving(self, from_offset: int) -> list[Record]:
        return [self.records[o] for o in sorted(self.records) if o >= from_offset]

    def next_timestamp(self, step: int) -> int:
        # Non-decreasing, multiples of 10, near the clock (ties are frequent on purpose).
        base = max(self.last_ts, (self.clock.now_ms // 10) * 10 - 50)
        self.last_ts = base + 10 * step
        return self.last_ts

    def check_read_all(self) -> None:
        """Reading from log_start_offset to the end returns exactly the model's records."""
        got: list[Record] = []
        offset = self.log.log_start_offset
        while offset < self.log.end_offset:
            chunk = self.log.read(offset, max_records=7)
            if not chunk:  # compaction may leave no record between offset and end_offset
                break
            got.extend(chunk)
            offset = chunk[-1].offset + 1
        assert got == self.surviving(self.start)

    # -- rules common to both machines --

    @initialize(data=st.data(), batches=st.integers(0, 12))
    def prime(self, data: st.DataObject, batches: int) -> None:
        """Start most runs with a few segments, so retention and compaction have work."""
        for _ in range(batches):
            self.append(
                data,
                data.draw(st.integers(1, 12)),
                data.draw(st.lists(st.integers(0, 1), min_size=12, max_size=12)),
            )

    @rule(
        data=st.data(),
        n=st.integers(1, 12),
        steps=st.lists(st.integers(0, 1), min_size=12, max_size=12),
    )
    def append(self, data: st.DataObject, n: int, steps: list[int]) -> None:
        batch = []
        for i in range(n):
            f = data.draw(record_fields(self.TOPICS, 600))
            # The offset passed in is ignored by the log: pass garbage on purpose.
            batch.append(Record(offset=-12345, timestamp=self.next_timestamp(steps[i]), **f))
        first = self.log.append(batch)
        assert first == self.end
        for i, r in enumerate(batch):
            self.records[first + i] = r._replace(offset=first + i)
        self.end += n

    @rule(
        where=st.sampled_from(["start", "end", "inside", "below", "above", "negative"]),
        pick=st.integers(0, 10_000),
        max_records=st.integers(1, 30),
        max_bytes=st.sampled_from([1, 64, 500, 4096, 1 << 20]),
    )
    def read(self, where: str, pick: int, max_records: int, max_bytes: int) -> None:
        if where == "start":
            offset = self.start
        elif where == "end":
            offset = self.end
        elif where == "inside":
            offset = self.start + pick % max(1, self.end - self.start)
        elif where == "below":
            offset = self.start - 1 - pick % 5
        elif where == "above":
            offset = self.end + 1 + pick % 5
        else:
            offset = -1 - pick % 3
        if offset < self.start or offset > self.end:
            with pytest.raises(OffsetOutOfRange) as info:
                self.log.read(offset, max_records=max_records, max_bytes=max_bytes)
            err = info.value
            assert (err.offset, err.log_start_offset, err.end_offset) == (
                offset,
                self.start,
                self.end,
            )
            return
        got = self.log.read(offset, max_records=max_records, max_bytes=max_bytes)
        expected = self.surviving(offset)
        assert len(got) <= max_records
        if expected:
            # At least one record when one exists, even if bigger than max_bytes.
            assert got, f"read({offset}, {max_records}, {max_bytes}) returned []"
        assert got == expected[: len(got)]
        if max_bytes == 1 << 20:  # far more than max_records records of this model: no limit
            assert len(got) == min(max_records, len(expected))

    @rule(where=st.integers(-3, 10_000), exact=st.booleans())
    def offset_for_time(self, where: int, exact: bool) -> None:
        records = self.surviving(self.start)
        if exact and records:
            ts = records[where % len(records)].timestamp
        else:
            ts = T0_MS - 100 + where * 5
        expected = next((r.offset for r in records if r.timestamp >= ts), self.end)
        got = self.log.offset_for_time(ts)
        # Compaction leaves gaps: any answer from which a read returns the same records is
        # the same answer (no surviving record in [got, expected)).
        assert self.start <= got <= expected, (ts, got, expected)
        assert not [o for o in self.records if got <= o < expected], (ts, got, expected)

    @rule()
    def roll(self) -> None:
        self.log.roll()
        assert self.log.segments[-1] == self.end

    @rule()
    def reopen(self) -> None:
        self.log.close()
        self.log = SegmentedLog.open(self.dir, self.CONFIG, clock=self.clock)
        self.check_read_all()

    @rule(due=st.booleans())
    def flush(self, due: bool) -> None:
        if due:
            self.log.flush_if_due(self.clock.now_ms)
        else:
            self.log.flush()

    @invariant()
    def offsets_match(self) -> None:
        assert self.log.end_offset == self.end
        assert self.log.log_start_offset == self.start
        segments = self.log.segments
        assert segments == sorted(segments)
        assert segments[0] <= self.start or not segments
        assert segments[-1] <= self.end


class PlainLogModel(LogModel):
    """A telemetry stream: retention by age (fake clock) and size; 2 KiB segments."""

    CONFIG = LogConfig(
        segment_bytes=2048,
        index_interval_bytes=256,
        fsync="never",
        retention_ms=RETENTION_MS,
        retention_bytes=RETENTION_BYTES,
    )
    TOPICS = PLAIN_TOPICS

    @rule(
        explicit=st.booleans(),
        advance_ms=st.sampled_from([0, 10, 300, 1_000, 2_500, 6_000, 60_000]),
    )
    def time_passes_and_retention_runs(self, explicit: bool, advance_ms: int) -> None:
        """The fake clock moves on, then the cleaner enforces retention (``now_ms`` passed in,
        or read from the log's clock)."""
        self.clock.now_ms += advance_ms
        segments = self.log.segments
        closed = len(segments) - 1
        now = self.clock.now_ms
        sizes = [(self.dir / f"{base:020d}.log").stat().st_size for base in segments]
        # By age: the longest prefix of closed segments whose newest record is older than
        # retention_ms (timestamps are non-decreasing: every such closed segment).
        by_age = 0
        ambiguous = False
        for i in range(closed):
            stamps = [
                r.timestamp for o, r in self.records.items() if segments[i] <= o < segments[i + 1]
            ]
            if not stamps:
                ambiguous = True  # an empty closed segment has no newest timestamp
                break
            if now - max(stamps) <= RETENTION_MS:
                break
            by_age += 1
        # Then by size, oldest first. "Total size" is read two ways, both accepted: delete
        # while the log exceeds retention_bytes (at most that much left), or only while the
        # log stays at or above it after the deletion (Kafka's retention.bytes).
        at_most = at_least = by_age
        total = sum(sizes[by_age:])
        while at_most < closed and total > RETENTION_BYTES:
            total -= sizes[at_most]
            at_most += 1
        total = sum(sizes[by_age:])
        while at_least < closed and total - sizes[at_least] >= RETENTION_BYTES:
            total -= sizes[at_least]
            at_least += 1
        deleted = self.log.enforce_retention(now if explicit else None)
        event(f"retention deleted {min(deleted, 2)}+ segments")
        if ambiguous:
            assert deleted >= at_least
        else:
            assert at_least <= deleted <= at_most, (segments, sizes, now, deleted, by_age)
        after = self.log.segments
        assert after == segments[deleted:]
        if deleted:
            self.start = after[0]
            for o in [o for o in self.records if o < self.start]:
                del self.records[o]
        self.check_read_all()


class IntervalLogModel(PlainLogModel):
    """The same stream under fsync=interval, whose rolls sync only at the next flush: rolled
    segments wait for it while retention may delete them and the log may be reopened."""

    CONFIG = dataclasses.replace(PlainLogModel.CONFIG, fsync="interval")


class CompactedLogModel(LogModel):
    """An internal keyed stream: few topics, tombstones, compaction of closed segments."""

    CONFIG = LogConfig(
        segment_bytes=1024,
        index_interval_bytes=128,
        fsync="never",
        retention_ms=None,
        compacted=True,
    )
    TOPICS = KEYED_TOPICS

    @rule(topic=KEYED_TOPICS)
    def tombstone(self, topic: str) -> None:
        r = Record(offset=0, timestamp=self.next_timestamp(1), topic=topic, payload=b"")
        first = self.log.append([r])
        assert first == self.end
        self.records[first] = r._replace(offset=first)
        self.end += 1

    @rule()
    def compact(self) -> None:
        active_base = self.log.segments[-1]
        closed = {o: r for o, r in self.records.items() if o < active_base}
        active = {o: r for o, r in self.records.items() if o >= active_base}
        latest_closed: dict[str, int] = {}
        for o in sorted(closed):
            latest_closed[closed[o].topic] = o
        in_active = {r.topic for r in active.values()}
        must_remove = {o for o, r in closed.items() if not r.payload or latest_closed[r.topic] != o}
        # A record superseded only by one in the active segment may go or stay.
        may_remove = {o for o, r in closed.items() if r.topic in in_active} - must_remove

        batches = self._batches()
        removed = self.log.compact()
        event("compaction removed records" if removed else "compaction removed nothing")
        if self.CONFIG.keep_empty_batches:  # every batch keeps its offsets (Raft's entries)
            assert self._batches() == batches
        else:  # the batches left keep theirs
            assert set(self._batches()) <= set(batches)

        old_start = self.start
        new_start = self.log.log_start_offset
        got = {r.offset: r for r in self._read_from(max(old_start, new_start))}
        gone = set(self.records) - set(got)
        assert must_remove <= gone, sorted(must_remove - gone)
        assert gone - must_remove <= may_remove, sorted(gone - must_remove - may_remove)
        assert removed == len(gone), (removed, len(gone))
        for o in gone:
            del self.records[o]
        for o, r in got.items():
            assert self.records[o] == r
        # log_start_offset may move up past records that compaction removed, never past one
        # that survives.
        first_left = min(self.records, default=self.end)
        assert old_start <= new_start <= first_left
        self.start = new_start
        assert self.log.end_offset == self.end
        assert self.log.segments[-1] == active_base

    def _batches(self) -> list[tuple[int, int, int]]:
        """(base offset, next offset, leader epoch) of every batch of the log."""
        log = self.log
        if log.end_offset == log.log_start_offset:
            return []
        found = log.read_batches(log.log_start_offset, log.end_offset, 1 << 30, 1 << 40)
        return [(h.base_offset, h.next_offset, h.leader_epoch) for h in map(read_header, found)]

    def _read_from(self, offset: int) -> list[Record]:
        out: list[Record] = []
        while offset < self.log.end_offset:
            chunk = self.log.read(offset, max_records=50)
            if not chunk:
                break
            out.extend(chunk)
            offset = chunk[-1].offset + 1
        return out

    @invariant()
    def keys_are_latest_values(self) -> None:
        # A consumer that replays the whole log ends with the same key -> value map as the
        # model, whatever compaction removed.
        def final_state(records: list[Record]) -> dict[str, bytes]:
            state: dict[str, bytes] = {}
            for r in records:
                if r.payload:
                    state[r.topic] = r.payload
                else:
                    state.pop(r.topic, None)
            return state

        assert final_state(self._read_from(self.start)) == final_state(self.surviving(self.start))


TestPlainLog = pytest.mark.slow(PlainLogModel.TestCase)
TestPlainLog.settings = SETTINGS
TestIntervalLog = pytest.mark.slow(IntervalLogModel.TestCase)
TestIntervalLog.settings = SETTINGS
TestCompactedLog = pytest.mark.slow(CompactedLogModel.TestCase)
TestCompactedLog.settings = SETTINGS


class RaftCompactedLogModel(CompactedLogModel):
    """A compacted log whose batches are Raft entries: emptied ones stay as placeholders."""

    CONFIG = dataclasses.replace(CompactedLogModel.CONFIG, keep_empty_batches=True)


TestRaftCompactedLog = pytest.mark.slow(RaftCompactedLogModel.TestCase)
TestRaftCompactedLog.settings = SETTINGS
