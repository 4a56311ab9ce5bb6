"""read_columns returns the records read returns, as the stored columns: checked against read
by rebuilding each record from the columns with struct (a reference independent of the
decoder), on SegmentedLog and on LogReader, across rolls, gaps (compaction) and limits."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.commitlog import LogConfig, OffsetOutOfRange, Record, SegmentedLog, columns
from broker.commitlog.batch import encode_batch
from broker.commitlog.columns import ColumnRead
from broker.commitlog.reader import LogReader
from broker.commitlog.segment import Segment

SMALL = LogConfig(segment_bytes=4096, index_interval_bytes=512, fsync="never", retention_ms=None)


def rebuild(read: ColumnRead) -> list[Record]:
    """The records described by ``read``, one at a time (from the per-slice views, which
    :meth:`ColumnRead.joined` must join to the same bytes)."""
    n = read.count
    for column in (
        "timestamps",
        "deltas",
        "topic_indexes",
        "client_id_indexes",
        "property_lengths",
        "payload_lengths",
        "qos",
        "flags",
        "properties",
        "payloads",
    ):
        assert read.joined(column) == b"".join(getattr(read, column))

    def ints(code: str, slices: list[memoryview]) -> tuple[int, ...]:
        return struct.unpack(f"<{n}{code}", b"".join(slices))

    stamps, deltas = ints("q", read.timestamps), ints("I", read.deltas)
    topics, clients = ints("I", read.topic_indexes), ints("I", read.client_id_indexes)
    prop_lengths, payload_lengths = (
        ints("I", read.property_lengths),
        ints("I", read.payload_lengths),
    )
    qos, flags = b"".join(read.qos), b"".join(read.flags)
    props, payloads = b"".join(read.properties), b"".join(read.payloads)
    out: list[Record] = []
    slice_, p, q = 0, 0, 0
    for i in range(n):
        while i >= read.run_ends[slice_]:
            slice_ += 1
        start = read.table_starts[slice_]
        out.append(
            Record(
                read.bases[slice_] + deltas[i],
                stamps[i],
                read.strings[start + topics[i]],
                payloads[q : q + payload_lengths[i]],
                qos[i],
                bool(flags[i] & 1),
                read.strings[start + clients[i]],
                props[p : p + prop_lengths[i]],
            )
        )
        p += prop_lengths[i]
        q += payload_lengths[i]
    assert p == len(props) and q == len(payloads)
    return out


def check(log: SegmentedLog | LogReader, offset: int, limit: int, max_bytes: int) -> None:
    expected = log.read(offset, limit, max_bytes)
    got = log.read_columns(offset, limit, max_bytes)
    assert len(got) == len(expected)
    assert rebuild(got) == expected
    if expected:
        assert got.next_offset == expected[-1].offset + 1


def records(rng: random.Random, n: int, start: int) -> list[Record]:
    return [
        Record(
            -1,
            1_000 + start + i,
            f"devices/{rng.randrange(9)}/t",
            rng.randbytes(rng.choice([0, 5, 40, 700])),
            rng.randrange(3),
            rng.random() < 0.3,
            f"c{rng.randrange(4)}",
            rng.choice([b"", b"", b"\x01\x01", b"\x03\x00\x04text"]),
        )
        for i in range(n)
    ]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_matches_read_on_the_writer_and_a_reader(
    tmp_path_factory: pytest.TempPathFactory, seed: int
) -> None:
    rng = random.Random(seed)
    path = tmp_path_factory.mktemp("log")
    with SegmentedLog.open(path, SMALL) as log:
        for i in range(rng.randint(1, 40)):
            log.append(records(rng, rng.choice([1, 3, 30, 200]), i * 200))
        reader = LogReader(path, SMALL, log.end_offset)
        for _ in range(30):
            args = (
                rng.randrange(log.end_offset + 1),
                rng.choice([1, 7, 100, 5000]),
                rng.choice([1, 100, 4096, 1 << 20]),
            )
            check(log, *args)
            check(reader, *args)
        reader.close()


def test_batches_with_gaps_are_sliced_by_their_stored_deltas(tmp_path: Path) -> None:
    """Compaction keeps offsets: a batch whose deltas skip, read from inside a gap."""
    kept = [
        Record(o, 10 * o, f"k/{o % 4}", b"v%d" % o, o % 3, o % 2 == 0, "c", b"")
        for o in (0, 2, 3, 7, 8, 12)
    ]
    seg = Segment.create(tmp_path, 0, SMALL, now_ms=0)
    seg.append(encode_batch(0, kept, keep_offsets=True), fsync=False)
    seg.close()
    with SegmentedLog.open(tmp_path, SMALL) as log:
        for offset in range(13):
            for limit in (1, 2, 100):
                check(log, offset, limit, 1 << 20)
        assert rebuild(log.read_columns(4, 2)) == kept[3:5]


def test_same_errors_and_empty_reads_as_read(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, SMALL) as log:
        log.append(records(random.Random(1), 5, 0))
        assert len(log.read_columns(5)) == 0
        assert len(log.read_columns(0, max_records=0)) == 0
        with pytest.raises(OffsetOutOfRange):
            log.read_columns(6)


def fleet_batch(rng: random.Random, device: int, offset: int) -> list[Record]:
    """What the router's group commit writes for a fleet: 1-3 records of one device (its
    topic, non-ASCII for some, and client id: the same string table batch after batch)."""
    topic = f"devices/{device}/telemetry" + ("/é" if device % 3 == 0 else "")
    return [
        Record(
            offset + i,
            1_000 + offset + i,
            topic,
            rng.randbytes(rng.choice([0, 60])),
            1,
            rng.random() < 0.1,
            f"dev-{device}",
            rng.choice([b"", b"", b"", b"\x03\x00\x04text"]),
        )
        for i in range(rng.choice([1, 1, 2, 3]))
    ]


@pytest.mark.parametrize("memo_entries", [4096, 3])  # 3: the table memo is emptied often
def test_long_reads_over_many_small_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memo_entries: int
) -> None:
    """Thousands of 1-3-record batches with repeated string tables (the memoised ones),
    properties, and compacted batches with gaps, read in long and cut reads."""
    monkeypatch.setattr(columns, "_MEMO_ENTRIES", memo_entries)
    rng = random.Random(memo_entries)
    offset = 0
    seg = Segment.create(tmp_path, 0, SMALL, now_ms=0)
    for _ in range(3000):
        batch = fleet_batch(rng, rng.randrange(8), offset)
        if len(batch) == 3 and rng.random() < 0.5:  # compaction left a gap
            del batch[1]
        seg.append(encode_batch(batch[0].offset, batch, keep_offsets=True), fsync=False)
        offset = batch[-1].offset + 1
    seg.close()
    with SegmentedLog.open(tmp_path, SMALL) as log:
        check(log, 0, 10_000, 1 << 30)
        for _ in range(40):
            check(
                log,
                rng.randrange(offset),
                rng.choice([1, 500, 5000]),
                rng.choice([100, 4096, 1 << 20]),
            )
