"""Corrupt batches repaired from a healthy replica (broker/cluster/repair.py): three real
``ClusterNode``s in one process over TCP on 127.0.0.1, real segmented logs, bytes of a sealed
segment damaged as a disk would.

What is asserted: a follower whose read meets a damaged batch gets the leader's copy written in
place (its log then reads every record as proposed, its segment file equals the leader's), counted
once; a leader that meets a damaged batch while catching a follower up sends it nothing of the
damaged bytes, repairs its copy from the other follower, and the follower catches up with the
original bytes; and, without the network, what a replica answers (committed, intact, exactly the
range) and what an asker accepts (CRC, offsets, bytes, epochs).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from broker.cluster.messages import AppendEntries, AppendResp, Entry, HardState
from broker.cluster.node import ClusterNode
from broker.cluster.raft import RaftNode
from broker.cluster.repair import (
    NOT_COMMITTED,
    OK,
    UNAVAILABLE,
    answer,
    check_answer,
    split_batches,
)
from broker.cluster.storage import GroupStorage
from broker.cluster.terms import TermTable
from broker.commitlog import LogConfig, RewriteRefused, SegmentedLog, integrity
from broker.commitlog.batch import encode_batch
from broker.commitlog.integrity import DamagedRange
from tests.unit.cluster.test_node import GROUP, Trio, _propose, _records
from tests.unit.cluster.test_raft import CONFIG, Log, elect

#: Small segments, no retention: many sealed segments to damage.
LOG = LogConfig(segment_bytes=2048, index_interval_bytes=256, retention_ms=None, fsync="always")
KEY = ("s", 0)


class Replicas(Trio):
    """The trio with each log at ``<node>/data/s/0``, the directory of partition 0 of stream
    ``s``, as the broker lays it out (damage reports name the partition by it)."""

    async def start(self, i: int) -> ClusterNode:
        node = ClusterNode(self.settings(i), self.root / f"n{i + 1}")
        node.group_keys = {GROUP: KEY}
        await node.start()
        log = SegmentedLog.open(self.directory(i), self.config)
        node.host_groups({GROUP: GroupStorage.over(log)}, seed=i)
        self.nodes[i] = node
        return node

    def directory(self, i: int) -> Path:
        return self.root / f"n{i + 1}" / "data" / "s" / "0"


@pytest.fixture(autouse=True)
def reports() -> Iterator[list[DamagedRange]]:
    found: list[DamagedRange] = []
    integrity.forget_reports()
    integrity.add_listener(found.append)
    yield found
    integrity.remove_listener(found.append)
    integrity.forget_reports()


def damage_payload(directory: Path, text: bytes) -> Path:
    """Change one byte of ``text`` (a record's payload) in the sealed segment holding it."""
    for path in sorted(directory.glob("*.log"))[:-1]:
        data = bytearray(path.read_bytes())
        at = data.find(text)
        if at >= 0:
            data[at] ^= 0x20
            with open(path, "r+b") as f:  # in place, as a disk would: same inode
                f.write(data)
            return path
    raise AssertionError(f"{text!r} is in no sealed segment of {directory}")


def payloads(log: SegmentedLog) -> list[bytes]:
    out: list[bytes] = []
    offset = log.log_start_offset
    while offset < log.high_watermark:
        chunk = log.read(offset, 100)
        if not chunk:
            break
        out += [r.payload for r in chunk]
        offset = chunk[-1].offset + 1
    return out


async def until(condition: object, timeout: float = 10.0) -> None:
    async def wait() -> None:
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.01)

    await asyncio.wait_for(wait(), timeout)


def test_a_follower_read_meets_damage_and_gets_the_leaders_copy(tmp_path: Path) -> None:
    async def main() -> None:
        trio = Replicas(tmp_path, LOG)
        await asyncio.gather(*(trio.start(i) for i in range(3)))
        try:
            leader = await trio.leader()
            for k in range(30):
                index = _propose(leader, 3, f"p{k:02}")
            await trio.committed_everywhere(index)
            expected = payloads(leader.storages[GROUP].log)
            i = next(j for j, n in enumerate(trio.nodes) if n is not leader)
            follower = trio.nodes[i]
            assert follower is not None
            target = damage_payload(trio.directory(i), b"p05")
            log = follower.storages[GROUP].log
            assert len(payloads(log)) == len(expected) - 3  # skipped, reported
            await until(lambda: follower.repair.repaired.get(KEY) == 1)
            assert payloads(log) == expected
            leader_dir = trio.directory(trio.nodes.index(leader))
            assert target.read_bytes() == (leader_dir / target.name).read_bytes()
            assert follower.status()["repaired"] == [{"stream": "s", "partition": 0, "batches": 1}]
            assert follower.repair.stats.repaired == 1 and leader.repair.stats.answered == 1
        finally:
            for j in range(3):
                if trio.nodes[j] is not None:
                    await trio.stop(j)

    asyncio.run(main())


def test_a_leader_never_sends_a_damaged_batch_and_repairs_it_from_a_follower(
    tmp_path: Path, reports: list[DamagedRange]
) -> None:
    async def main() -> None:
        trio = Replicas(tmp_path, LOG)
        await asyncio.gather(*(trio.start(i) for i in range(3)))
        try:
            leader = await trio.leader()
            away = next(j for j, n in enumerate(trio.nodes) if n is not leader)
            await trio.stop(away)
            for k in range(30):
                index = _propose(leader, 3, f"q{k:02}")
            await trio.committed_everywhere(index)
            expected = payloads(leader.storages[GROUP].log)
            damage_payload(trio.directory(trio.nodes.index(leader)), b"q02")
            # The follower comes back: the leader's read for it meets the damage.
            back = await trio.start(away)
            await trio.committed_everywhere(index)
            assert [r.path.parent for r in reports] == [trio.directory(trio.nodes.index(leader))]
            assert leader.repair.repaired.get(KEY) == 1
            assert payloads(back.storages[GROUP].log) == expected
            assert payloads(leader.storages[GROUP].log) == expected
            for j in range(3):
                assert sorted(p.read_bytes() for p in trio.directory(j).glob("*.log")) == sorted(
                    p.read_bytes() for p in trio.directory(away).glob("*.log")
                )
        finally:
            for j in range(3):
                if trio.nodes[j] is not None:
                    await trio.stop(j)

    asyncio.run(main())


# -- the protocol without the network -----------------------------------------------------------


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[GroupStorage]:
    log = SegmentedLog.open(tmp_path / "s" / "0", LOG)
    s = GroupStorage.over(log)
    for k in range(10):
        batch = bytes(encode_batch(log.end_offset, _records(2, f"r{k}"), leader_epoch=3))
        s.log.append_raw(batch)
        s.terms.append(3, 2)
    s.set_commit(16)  # offsets 0..15 committed
    yield s
    s.close()


def test_a_replica_answers_only_committed_intact_exact_ranges(
    storage: GroupStorage, reports: list[DamagedRange]
) -> None:
    status, batches = answer(storage, 4, 7, 1 << 20)
    assert status == OK and len(batches) == 2
    assert b"".join(batches) == b"".join(storage.log.read_batches(4, 8, 10, 1 << 20))
    assert answer(storage, 14, 17, 1 << 20) == (NOT_COMMITTED, [])  # 16, 17 not committed
    assert answer(storage, 5, 7, 1 << 20) == (UNAVAILABLE, [])  # not a batch boundary
    assert answer(storage, 4, 7, 100) == (UNAVAILABLE, [])  # more than the answer may carry
    path = sorted(storage.log.directory.glob("*.log"))[0]
    data = bytearray(path.read_bytes())
    data[data.find(b"r3")] ^= 1
    with open(path, "r+b") as f:
        f.write(data)
    assert answer(storage, 6, 7, 1 << 20) == (UNAVAILABLE, [])  # damaged here too: reported
    assert [(r.first_offset, r.last_offset) for r in reports] == [(6, 7)]


def test_an_asker_accepts_only_batches_of_the_terms_its_log_holds(storage: GroupStorage) -> None:
    good = storage.log.read_batches(4, 6, 10, 1 << 20)
    assert len(good) == 1
    damage = DamagedRange(storage.log.directory / "00000000000000000000.log", 0, 0, 4, 5, "x")
    damage = damage._replace(position=100, end=100 + len(good[0]))
    check_answer(storage, damage, 4, 5, good)
    other_term = bytes(encode_batch(4, _records(2, "r2"), leader_epoch=4))
    assert len(other_term) == len(good[0])
    with pytest.raises(RewriteRefused, match="epoch 4, this replica's log has term 3"):
        check_answer(storage, damage, 4, 5, [other_term])
    with pytest.raises(RewriteRefused, match="CRC"):
        check_answer(storage, damage, 4, 5, [good[0][:-1] + bytes([good[0][-1] ^ 1])])


def test_an_asker_accepts_a_copy_of_another_length_only_for_a_compacted_log(
    storage: GroupStorage,
) -> None:
    good = storage.log.read_batches(4, 6, 10, 1 << 20)
    damage = DamagedRange(storage.log.directory / "00000000000000000000.log", 100, 0, 4, 5, "x")
    damage = damage._replace(end=100 + len(good[0]) + 9)  # a longer damaged batch
    with pytest.raises(RewriteRefused, match="damaged bytes: not rewritten in place"):
        check_answer(storage, damage, 4, 5, good)
    # $retained / $sessions: each replica compacts at its own time, lengths may differ.
    compacted = replace(storage.log.config, compacted=True, keep_empty_batches=True)
    storage.log.config = compacted
    check_answer(storage, damage, 4, 5, good)


def test_an_answer_is_cut_at_its_batches_lengths() -> None:
    batches = [bytes(encode_batch(i * 2, _records(2, f"x{i}"))) for i in range(3)]
    assert split_batches(b"".join(batches)) == batches
    assert split_batches(b"") == []
    assert split_batches(b"".join(batches)[:-1]) is None
    assert split_batches(b"\x00" * 20) is None


# -- the core never sends what its log cannot read --------------------------------------------


class DamagedLog(Log):
    """The driver's log with entries it cannot read now (damaged, being repaired)."""

    unreadable: frozenset[int] = frozenset()

    def entries(self, first: int, last: int, max_entries: int, max_bytes: int) -> list[Entry]:
        return (
            [] if first in self.unreadable else super().entries(first, last, max_entries, max_bytes)
        )


def test_a_leader_sends_a_follower_only_heartbeats_while_its_next_entry_is_unreadable() -> None:
    entries = [Entry(1, f"e{i}".encode()) for i in range(1, 5)]
    log = DamagedLog(entries)
    core = RaftNode(
        1,
        [1, 2, 3],
        log,
        random.Random(0),
        CONFIG,
        HardState(1, None),
        TermTable.of_terms([1, 1, 1, 1]),
    )
    elect(core, log)
    # Node 3 holds everything, the new term's NOOP (index 5) included: all is committed, so
    # an unreadable entry is being repaired (an uncommitted one would make the leader step
    # down: tests/unit/cluster/test_damaged_leader.py).
    log.apply(core.flushed(5))
    log.apply(core.receive(AppendResp(3, 1, 2, True, 5, 5, 0, None)))
    assert core.commit == 5
    log.unreadable = frozenset({2})
    # Node 2 holds index 1 only: the leader probes it from 2, which it cannot read.
    sent = log.apply(core.receive(AppendResp(2, 1, 2, False, 4, 0, 2, None)))
    assert [m for m in sent if m.to == 2] == []
    beat = [m for m in log.apply(core.tick()) if m.to == 2]
    assert beat == [AppendEntries(1, 2, 2, 0, 0, (), 5)]  # a heartbeat, no entry
    log.unreadable = frozenset()  # repaired
    sent = [m for m in log.apply(core.tick()) if m.to == 2]
    assert len(sent) == 1 and isinstance(sent[0], AppendEntries)
    assert (sent[0].prev_index, sent[0].entries[0]) == (1, entries[1])
