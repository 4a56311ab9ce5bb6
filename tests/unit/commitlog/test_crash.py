"""Crash recovery of SegmentedLog: torn tails, flipped bits, lost or garbage indexes.

The tests know nothing of the batch format. They learn where the last batch starts from the
size of the active ``.log`` before and after the last append, damage the bytes in between, and
check that recovery keeps every intact batch and nothing else: ``end_offset`` is the last
batch's base offset, every earlier record reads back unchanged, and the next append continues
from there. Damage is applied to two images of the directory: a *crash* image (copied while the
log was open: no clean-shutdown state, active indexes possibly never written) and a *clean* one
(after close). Index files are the log's cache: deleting or garbling them must not change any
answer, and they come back.

Index lookups are checked against a bisect reference (floor lookup over the sorted keys),
through the log's public API and directly on ``OffsetIndex`` / ``TimeIndex`` (internal API).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from broker.commitlog.config import LogConfig
from broker.commitlog.index import OffsetIndex, TimeIndex
from broker.commitlog.log import SegmentedLog
from broker.commitlog.record import Record

T0_MS = 1_700_000_000_000
CONFIG = LogConfig(segment_bytes=1 << 20, index_interval_bytes=64, fsync="never")
MULTI_SEGMENT = LogConfig(segment_bytes=1500, index_interval_bytes=100, fsync="never")


def make_batch(first_seq: int, n: int, payload_size: int = 9) -> list[Record]:
    return [
        Record(
            offset=0,
            timestamp=T0_MS + 10 * (first_seq + i),
            topic=f"dev/{(first_seq + i) % 5}/t",
            payload=bytes([(first_seq + i) % 251]) * payload_size,
            qos=(first_seq + i) % 3,
            retain=(first_seq + i) % 2 == 0,
            client_id=f"c{first_seq % 3}",
            properties=b"\x26\x00\x01k\x00\x01v" if i == 0 else b"",
        )
        for i in range(n)
    ]


def with_offsets(records: list[Record], first: int) -> list[Record]:
    return [r._replace(offset=first + i) for i, r in enumerate(records)]


def read_all(log: SegmentedLog) -> list[Record]:
    out: list[Record] = []
    offset = log.log_start_offset
    while offset < log.end_offset:
        chunk = log.read(offset, max_records=100)
        assert chunk, f"read({offset}) returned [] before end_offset {log.end_offset}"
        out.extend(chunk)
        offset = chunk[-1].offset + 1
    return out


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def restore(directory: Path, files: dict[str, bytes]) -> None:
    for p in directory.iterdir():
        if p.is_file() and p.name not in files:
            p.unlink()
    for name, data in files.items():
        (directory / name).write_bytes(data)


def segment_file(directory: Path, base: int, suffix: str) -> Path:
    return directory / f"{base:020d}{suffix}"


class Written:
    """A log on disk with known batches, and where its last batch lies in the active segment.

    Two images of the directory are kept: ``crash`` (taken while the log was open, after a
    flush: what a crash leaves, no clean-shutdown state, indexes of the active segment possibly
    not written yet) and ``clean`` (after ``close()``). The directory is left clean.
    """

    def __init__(self, directory: Path, batches: list[list[Record]], config: LogConfig) -> None:
        self.directory = directory
        self.config = config
        self.records: list[Record] = []
        self.bases: list[int] = []
        log = SegmentedLog.open(directory, config)
        for i, batch in enumerate(batches):
            if i == len(batches) - 1:
                log.flush()
                self.active = log.segments[-1]
                self.last_start = segment_file(directory, self.active, ".log").stat().st_size
            base = log.append(batch)
            self.bases.append(base)
            self.records.extend(with_offsets(batch, base))
        log.flush()
        if log.segments[-1] != self.active:  # the last append rolled: it starts a segment
            self.active = log.segments[-1]
            self.last_start = 0
        self.crash = snapshot(directory)
        log.close()
        self.clean = snapshot(directory)
        self.last_end = len(self.crash[self.log_name])
        assert self.last_end == len(self.clean[self.log_name]) > self.last_start

    def image(self, kind: str) -> dict[str, bytes]:
        return dict(self.crash if kind == "crash" else self.clean)

    @property
    def log_name(self) -> str:
        return f"{self.active:020d}.log"

    def expect_recovered_to(self, batch_index: int) -> None:
        """Open the (damaged) directory: batches before batch_index survive, nothing else."""
        base = self.bases[batch_index]
        log = SegmentedLog.open(self.directory, self.config)
        try:
            assert log.end_offset == base
            assert read_all(log) == [r for r in self.records if r.offset < base]
            # The log is usable again at the cut: the next append takes the lost offset.
            again = make_batch(9000, 2)
            assert log.append(again) == base
            assert log.read(base) == with_offsets(again, base)
        finally:
            log.close()


@pytest.fixture
def written(tmp_path: Path) -> Written:
    batches = [make_batch(10 * i, 1 + i % 4) for i in range(6)]
    return Written(tmp_path / "p0", batches, CONFIG)


IMAGES = ["crash", "clean"]


@pytest.mark.parametrize("image", IMAGES)
def test_truncate_every_byte_of_last_batch(written: Written, image: str) -> None:
    last = len(written.bases) - 1
    log_bytes = written.crash[written.log_name]
    for cut in range(written.last_start, written.last_end):
        files = written.image(image)
        files[written.log_name] = log_bytes[:cut]
        restore(written.directory, files)
        written.expect_recovered_to(last)


def bit_positions(start: int, end: int) -> Iterator[tuple[int, int]]:
    """Every byte of [start, end), two bits per byte (a rotating sample of the eight)."""
    for pos in range(start, end):
        yield pos, pos % 8
        yield pos, (pos * 5 + 3) % 8


@pytest.mark.parametrize("image", IMAGES)
def test_flip_bits_in_last_batch(written: Written, image: str) -> None:
    last = len(written.bases) - 1
    log_bytes = written.crash[written.log_name]
    for pos, bit in bit_positions(written.last_start, written.last_end):
        damaged = bytearray(log_bytes)
        damaged[pos] ^= 1 << bit
        files = written.image(image)
        files[written.log_name] = bytes(damaged)
        restore(written.directory, files)
        try:
            written.expect_recovered_to(last)
        except Exception as exc:
            raise AssertionError(
                f"flip of bit {bit} at byte {pos - written.last_start} of the last batch"
            ) from exc


def test_corrupt_middle_batch_is_passed_over_not_truncated(written: Written) -> None:
    # After a crash, a corrupt batch in the middle of the active segment: a crash tears only
    # the end, so this is damage. The intact batches after it verify (CRC, offsets that
    # continue) and were acknowledged: recovery keeps them; reads pass over the damaged batch
    # alone (on_corruption = "skip"), which is reported (issue 25).
    files = written.image("crash")
    damaged = bytearray(files[written.log_name])
    damaged[len(damaged) // 2] ^= 0x10
    files[written.log_name] = bytes(damaged)
    restore(written.directory, files)
    log = SegmentedLog.open(written.directory, written.config)
    try:
        assert log.end_offset == written.records[-1].offset + 1
        got = read_all_gaps(log)
        lost = [r for r in written.records if r not in got]
        kept = [r for r in written.records if r in got]
        assert got == kept and lost  # nothing altered, in order; one batch lost
        bases = [*written.bases, log.end_offset]
        first = lost[0].offset
        assert first in bases and lost[-1].offset + 1 == bases[bases.index(first) + 1]
    finally:
        log.close()


def read_all_gaps(log: SegmentedLog) -> list[Record]:
    """:func:`read_all` where a read may skip offsets (damaged ranges passed over)."""
    out: list[Record] = []
    offset = log.log_start_offset
    while offset < log.end_offset:
        chunk = log.read(offset, max_records=100)
        if not chunk:
            break
        out.extend(chunk)
        offset = chunk[-1].offset + 1
    return out


def test_zero_filled_tail_is_dropped(written: Written) -> None:
    # What a crash can leave after a size-extending write: the new length, but zero pages.
    files = written.image("crash")
    files[written.log_name] += b"\x00" * 300
    restore(written.directory, files)
    log = SegmentedLog.open(written.directory, written.config)
    try:
        assert log.end_offset == written.records[-1].offset + 1
        assert read_all(log) == written.records
    finally:
        log.close()
    assert segment_file(written.directory, written.active, ".log").stat().st_size == (
        written.last_end
    )


# --- indexes -----------------------------------------------------------------------------------


@pytest.fixture
def many_segments(tmp_path: Path) -> Written:
    rng = random.Random(7)
    batches = []
    seq = 0
    for _ in range(60):
        n = rng.randint(1, 5)
        batches.append(make_batch(seq, n, payload_size=rng.randint(0, 60)))
        seq += n
    w = Written(tmp_path / "p1", batches, MULTI_SEGMENT)
    assert len({name[:20] for name in w.clean if name.endswith(".log")}) >= 4, "few segments"
    return w


def check_lookups(log: SegmentedLog, records: list[Record], rng: random.Random) -> None:
    """Every offset reads as itself; time lookups agree with a bisect over the timestamps."""
    offsets = [r.offset for r in records]
    stamps = [r.timestamp for r in records]
    for r in records:
        assert log.read(r.offset, max_records=1) == [r]
    for _ in range(300):
        o = rng.randrange(offsets[0], offsets[-1] + 1)
        got = log.read(o, max_records=3)
        i = bisect.bisect_left(offsets, o)
        assert got == records[i : i + 3]
    for ts in [stamps[0] - 1, *stamps, *(s + 5 for s in stamps), stamps[-1] + 1]:
        i = bisect.bisect_left(stamps, ts)
        expected = offsets[i] if i < len(offsets) else log.end_offset
        assert log.offset_for_time(ts) == expected, ts


@settings(max_examples=60, deadline=None)
@given(
    base=st.integers(0, 1 << 40),
    steps=st.lists(st.tuples(st.integers(1, 500), st.integers(1, 5000)), max_size=60),
    probes=st.lists(st.integers(-10, 40_000), max_size=40),
)
def test_offset_index_floor_lookup(
    tmp_path_factory: pytest.TempPathFactory,
    base: int,
    steps: list[tuple[int, int]],
    probes: list[int],
) -> None:
    path = tmp_path_factory.mktemp("idx") / "x.index"
    index = OffsetIndex(path, base)
    keys: list[int] = []
    positions: list[int] = []
    o, p = base, 0
    for do, dp in steps:
        o, p = o + do, p + dp
        index.append(o, p)
        keys.append(o)
        positions.append(p)
    index.write(fsync=False)
    loaded = OffsetIndex.load(path, base, p + 1)
    for probe in [*probes, *keys, *(k - 1 for k in keys)]:
        target = base + probe if probe < 30_000 else (keys[-1] if keys else base) + probe
        i = bisect.bisect_right(keys, target) - 1
        expected = (keys[i], positions[i]) if i >= 0 else (base, 0)
        assert index.lookup(target) == expected
        assert loaded.lookup(target) == expected


@settings(max_examples=60, deadline=None)
@given(
    base=st.integers(0, 1 << 40),
    stamps=st.lists(st.integers(T0_MS - 50, T0_MS + 50), max_size=60),
    probes=st.lists(st.integers(T0_MS - 60, T0_MS + 60), max_size=40),
)
def test_time_index_lookup_before(
    tmp_path_factory: pytest.TempPathFactory, base: int, stamps: list[int], probes: list[int]
) -> None:
    # One record per offset with out-of-order timestamps; the index keeps the max so far.
    path = tmp_path_factory.mktemp("tidx") / "x.timeindex"
    index = TimeIndex(path, base)
    entry_ts: list[int] = []
    entry_off: list[int] = []
    for i, ts in enumerate(stamps):
        index.maybe_append(ts, base + i)
        if not entry_ts or ts > entry_ts[-1]:
            entry_ts.append(ts)
            entry_off.append(base + i)
    index.write(fsync=False)
    loaded = TimeIndex.load(path, base, base + len(stamps))
    for probe in [*probes, *stamps]:
        i = bisect.bisect_left(entry_ts, probe) - 1  # last entry with timestamp < probe
        expected = entry_off[i] if i >= 0 else None
        assert index.lookup_before(probe) == expected
        assert loaded.lookup_before(probe) == expected
        if expected is not None:  # the promise that makes the lookup safe
            assert all(t < probe for t in stamps[: expected - base + 1])


def index_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in (".index", ".timeindex"))


def test_index_lookups_match_bisect_reference(many_segments: Written) -> None:
    log = SegmentedLog.open(many_segments.directory, many_segments.config)
    try:
        check_lookups(log, many_segments.records, random.Random(1))
        # Segment choice is a floor lookup over the base offsets.
        bases = log.segments
        for r in many_segments.records:
            seg = bases[bisect.bisect_right(bases, r.offset) - 1]
            assert seg <= r.offset
            nxt = bases[bases.index(seg) + 1] if seg != bases[-1] else log.end_offset
            assert r.offset < nxt
    finally:
        log.close()


def test_deleted_indexes_are_rebuilt(many_segments: Written) -> None:
    d = many_segments.directory
    before = index_files(d)
    assert before
    for p in before:
        p.unlink()
    log = SegmentedLog.open(d, many_segments.config)
    try:
        check_lookups(log, many_segments.records, random.Random(2))
    finally:
        log.close()
    assert [p.name for p in index_files(d)] == [p.name for p in before]
    # Rebuilt indexes answer the same after another restart.
    log = SegmentedLog.open(d, many_segments.config)
    try:
        check_lookups(log, many_segments.records, random.Random(3))
    finally:
        log.close()


def garbage(kind: str, original: bytes, rng: random.Random) -> bytes:
    if kind == "random":
        return rng.randbytes(len(original))
    if kind == "random-longer":
        return rng.randbytes(len(original) + 37)
    if kind == "ff":
        return b"\xff" * max(len(original), 24)
    if kind == "half":
        return original[: len(original) // 2 + 1]
    if kind == "zeros":
        return b"\x00" * (len(original) + 4096)
    raise ValueError(kind)


GARBAGE_KINDS = ["random", "random-longer", "ff", "half", "zeros"]


@pytest.mark.parametrize("image", IMAGES)
@pytest.mark.parametrize("kind", GARBAGE_KINDS)
def test_garbage_active_indexes(many_segments: Written, kind: str, image: str) -> None:
    # After a crash the active segment's index files may hold anything.
    rng = random.Random(kind)
    d = many_segments.directory
    restore(d, many_segments.image(image))
    for suffix in (".index", ".timeindex"):
        p = segment_file(d, many_segments.active, suffix)
        p.write_bytes(garbage(kind, p.read_bytes() if p.exists() else b"", rng))
    log = SegmentedLog.open(d, many_segments.config)
    try:
        check_lookups(log, many_segments.records, random.Random(4))
        again = make_batch(5000, 3)
        base = log.append(again)
        assert log.read(base) == with_offsets(again, base)
    finally:
        log.close()


@pytest.mark.parametrize("kind", GARBAGE_KINDS)
def test_garbage_closed_indexes(many_segments: Written, kind: str) -> None:
    # Indexes are a cache of the log: a garbled one must not change any answer.
    rng = random.Random(kind)
    d = many_segments.directory
    for p in index_files(d):
        p.write_bytes(garbage(kind, p.read_bytes(), rng))
    log = SegmentedLog.open(d, many_segments.config)
    try:
        check_lookups(log, many_segments.records, random.Random(5))
    finally:
        log.close()


def test_offset_for_time_with_clock_stepping_back(tmp_path: Path) -> None:
    # Wall clocks step back (NTP). The contract is literal: the first offset whose timestamp
    # is >= ts, whatever came before it.
    rng = random.Random(11)
    log = SegmentedLog.open(tmp_path / "p2", MULTI_SEGMENT)
    records: list[Record] = []
    ts = T0_MS
    try:
        for i in range(80):
            ts += rng.choice([0, 10, 10, 30, -200])
            batch = [make_batch(i, 1)[0]._replace(timestamp=ts)]
            base = log.append(batch)
            records.extend(with_offsets(batch, base))
        log.close()
        log = SegmentedLog.open(tmp_path / "p2", MULTI_SEGMENT)
        stamps = sorted({r.timestamp for r in records})
        for target in [stamps[0] - 1, *stamps, *(s + 1 for s in stamps)]:
            expected = next((r.offset for r in records if r.timestamp >= target), log.end_offset)
            assert log.offset_for_time(target) == expected, target
    finally:
        log.close()


def test_truncation_is_logged(written: Written, caplog: pytest.LogCaptureFixture) -> None:
    files = written.image("crash")
    files[written.log_name] = files[written.log_name][: written.last_end - 3]
    restore(written.directory, files)
    with caplog.at_level("INFO", logger="broker.commitlog"):
        log = SegmentedLog.open(written.directory, written.config)
        log.close()
    assert any(rec.name.startswith("broker.commitlog") for rec in caplog.records)


@pytest.mark.parametrize("image", IMAGES)
def test_reopened_active_segment_keeps_taking_appends(tmp_path: Path, image: str) -> None:
    # Recovery hands back the same active segment: a restart alone never rolls it, whatever
    # the records' timestamps (here older than segment_ms, as replayed or imported data are).
    d = tmp_path / "p3"
    log = SegmentedLog.open(d, CONFIG)
    log.append(make_batch(0, 2))
    log.flush()
    crash = snapshot(d)
    log.close()
    if image == "crash":
        restore(d, crash)
    for i in range(3):
        log = SegmentedLog.open(d, CONFIG)
        try:
            log.append(make_batch(10 * (i + 1), 1))
            assert log.segments == [0], f"restart {i} rolled: {log.segments}"
        finally:
            log.close()


@pytest.mark.parametrize("compacted", [False, True])
def test_rolled_segment_that_lost_its_tail(tmp_path: Path, compacted: bool) -> None:
    # fsync=interval rolls without fsync; the next flush syncs. A crash before it can leave a
    # closed segment without its last batches while the next segment kept data. A log that is
    # not compacted has no gaps between segments: recovery keeps the prefix (the segments
    # after the gap go). In a compacted log a gap is what compaction leaves: it stays.
    d = tmp_path / "p5"
    config = LogConfig(
        segment_bytes=1500, index_interval_bytes=100, fsync="interval", compacted=compacted
    )
    log = SegmentedLog.open(d, config)
    records: list[Record] = []
    ends: dict[int, list[tuple[int, int]]] = {}  # segment -> (batch base, start position)
    for i in range(30):
        batch = make_batch(10 * i, 1 + i % 3)
        base = log.append(batch)
        segment = log.segments[-1]
        size = segment_file(d, segment, ".log").stat().st_size
        ends.setdefault(segment, []).append((base, size))
        records.extend(with_offsets(batch, base))
    crash = snapshot(d)
    log.close()
    segments = sorted(ends)
    assert len(segments) >= 4
    victim = segments[1]
    # The victim's last batch is lost: its file ends where that batch started.
    lost_base = ends[victim][-1][0]
    cut = ends[victim][-2][1]
    crash[f"{victim:020d}.log"] = crash[f"{victim:020d}.log"][:cut]
    restore(d, crash)
    log = SegmentedLog.open(d, config)
    try:
        if compacted:
            assert log.segments == segments
            assert read_all(log) == [r for r in records if not lost_base <= r.offset < segments[2]]
        else:
            assert log.segments == segments[:2] and log.end_offset == lost_base
            assert read_all(log) == [r for r in records if r.offset < lost_base]
            again = make_batch(9000, 2)
            assert log.append(again) == lost_base
            assert not segment_file(d, segments[2], ".log").exists()
    finally:
        log.close()


def test_empty_time_index_beside_an_offset_index_is_rebuilt(tmp_path: Path) -> None:
    # A rolled segment's index files are written without fsync until the next flush: after
    # a crash the .timeindex may be empty while the .index is not. With the largest timestamp
    # early in the segment, trusting it would hide that timestamp from offset_for_time.
    d = tmp_path / "p6"
    config = LogConfig(segment_bytes=1 << 20, index_interval_bytes=100, fsync="interval")
    log = SegmentedLog.open(d, config)
    stamps = [T0_MS + 1000, *(T0_MS + i for i in range(20))]
    for i, ts in enumerate(stamps):
        log.append([make_batch(i, 1)[0]._replace(timestamp=ts)])
    log.roll()
    log.append(make_batch(100, 1))
    log.close()
    assert segment_file(d, 0, ".index").stat().st_size > 0
    segment_file(d, 0, ".timeindex").write_bytes(b"")
    log = SegmentedLog.open(d, config)
    try:
        assert log.offset_for_time(T0_MS + 1000) == 0
        assert log.offset_for_time(T0_MS + 1001) == log.end_offset
    finally:
        log.close()
    assert segment_file(d, 0, ".timeindex").stat().st_size > 0
