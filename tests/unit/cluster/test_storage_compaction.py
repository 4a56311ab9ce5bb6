"""GroupStorage over a compacted partition log: compaction keeps every entry's first index,
term and count (a batch it emptied is a CONTROL_COMPACTED control batch read back as a DATA
entry), so the entries read back after compaction and after a reopen are the same Raft log,
and a follower that appends them verbatim stores the same batches and records."""

from __future__ import annotations

import dataclasses
from itertools import accumulate
from pathlib import Path

import pytest

from broker.cluster.messages import Entry, EntryKind
from broker.cluster.storage import GroupStorage, StorageError, encode_entry
from broker.commitlog import LogConfig, Record
from broker.commitlog.batch import CONTROL_COMPACTED, decode_control, encode_control, read_header

COMPACTED = LogConfig(
    segment_bytes=1 << 20,
    compacted=True,
    keep_empty_batches=True,
    retention_ms=None,
    fsync="interval",
)
ROLL = (0, ())


def entry(storage: GroupStorage, term: int, keys: tuple[str, ...]) -> Entry:
    """A NOOP (no keys) or a DATA entry writing ``keys``, to append next."""
    if not keys:
        return Entry(term, b"", EntryKind.NOOP)
    index = storage.terms.last_index
    batch = [Record(0, 1000 + index, key, f"{key}@{index}".encode()) for key in keys]
    payload, count = encode_entry(batch, index, term)
    return Entry(term, payload, EntryKind.DATA, count)


def compacted_storage(directory: Path) -> tuple[GroupStorage, list[int]]:
    """Entries of terms 1-3 over three segments, compacted; returns the storage and the first
    index of every entry as it was appended."""
    storage = GroupStorage.open(directory, COMPACTED)
    plan = [
        (1, ()),
        (1, ("a", "b", "c")),  # keeps a: a gap at the end
        (1, ("b",)),  # emptied: the last entry of the first segment
        ROLL,
        (2, ()),
        (2, ("c", "d")),  # emptied
        (2, ("e", "b", "f")),  # keeps e, f: a gap inside
        (3, ("d",)),
        ROLL,
        (3, ("b", "c")),  # the active segment
    ]
    firsts = []
    for term, keys in plan:
        if (term, keys) == ROLL:
            storage.log.roll()
            continue
        firsts.append(storage.terms.last_index + 1)
        storage.append(firsts[-1], [entry(storage, term, keys)])
    storage.set_commit(storage.terms.last_index)
    return storage, firsts


def shape(entries: list[Entry]) -> list[tuple[int, int, EntryKind]]:
    return [(e.term, e.count, e.kind) for e in entries]


def test_compaction_keeps_every_entry_where_it_was(tmp_path: Path) -> None:
    storage, firsts = compacted_storage(tmp_path / "leader")
    last = storage.terms.last_index
    before = storage.entries(1, last, 100, 1 << 30)
    terms = storage.terms.runs()
    # Offsets 2 (b), 3 (c), 4 (b), 6 (c), 7 (d) and 9 (b, superseded in the active segment).
    assert storage.log.compact() == 6
    after = storage.entries(1, last, 100, 1 << 30)
    assert shape(after) == shape(before)
    assert list(accumulate([e.count for e in after], initial=1))[:-1] == firsts
    assert sum(e.count for e in after) == storage.log.end_offset - storage.log.log_start_offset
    placeholders = [
        first
        for first, e in zip(firsts, after, strict=True)
        if e.kind is EntryKind.DATA and read_header(e.payload).attributes
    ]
    assert placeholders == [5, 7]
    assert {decode_control(after[firsts.index(i)].payload)[0] for i in (5, 7)} == {
        CONTROL_COMPACTED
    }
    assert [storage.entry_start(i) for i in (4, 5, 8, 10, 11)] == [2, 5, 7, 9, 9]
    records = storage.log.read(0)
    assert [(r.offset, r.topic) for r in records] == [
        (1, "a"),
        (8, "e"),
        (10, "f"),
        (11, "d"),
        (12, "b"),
        (13, "c"),
    ]
    storage.close()
    storage = GroupStorage.open(tmp_path / "leader", COMPACTED)
    try:
        assert storage.entries(1, last, 100, 1 << 30) == after
        assert storage.terms.runs() == terms and storage.terms.last_index == last
        # A follower appends the compacted entries verbatim: the same batches, the same records.
        follower = GroupStorage.open(tmp_path / "follower", COMPACTED)
        try:
            follower.append(1, after)
            follower.set_commit(last)
            assert follower.entries(1, last, 100, 1 << 30) == after
            assert follower.terms.runs() == terms
            assert follower.log.read(0) == records
        finally:
            follower.close()
    finally:
        storage.close()


def test_a_data_entry_holding_a_noop_batch_is_refused(tmp_path: Path) -> None:
    storage = GroupStorage.open(tmp_path, COMPACTED)
    try:
        noop = encode_control(0, 1, int(EntryKind.NOOP), b"", 0)
        with pytest.raises(StorageError, match="control batch"):
            storage.append(1, [Entry(1, noop, EntryKind.DATA, 1)])
        placeholder = encode_control(0, 1, CONTROL_COMPACTED, b"", 0, last_offset_delta=2)
        storage.append(1, [Entry(1, placeholder, EntryKind.DATA, 3)])
        assert storage.terms.last_index == 3 and storage.log.end_offset == 3
        assert storage.entries(1, 3, 10, 1 << 20) == [Entry(1, placeholder, EntryKind.DATA, 3)]
    finally:
        storage.close()


def test_a_compacted_log_that_drops_emptied_batches_is_refused(tmp_path: Path) -> None:
    local = dataclasses.replace(COMPACTED, keep_empty_batches=False)
    with pytest.raises(StorageError, match="keep_empty_batches"):
        GroupStorage.open(tmp_path, local)
