"""A leader whose own uncommitted entry is damaged on its disk (issue 25): it steps down and a
healthy replica leads (or, when a follower's copy commits it first, it leads on and its copy is
repaired from that follower), on three RaftNode cores over three real GroupStorages (the
synchronous message pump of ``test_storage``; the damage is a byte changed in the leader's
segment file, in place, as a disk would). Without the step-down the leader keeps sending
heartbeats only (it can send neither the damaged entry nor anything after it) and the group
stalls for as long as it leads: the first test then fails waiting for a new leader.

Timing the damage between the append and the read on real nodes is not practical (the leader
reads its entry back within the same round that appended it); the simulator covers the
interleavings (``broker.cluster.simdamage``)."""

from __future__ import annotations

from pathlib import Path

from broker.cluster.raft import RaftNode, Role
from broker.cluster.repair import OK, answer, check_answer
from broker.cluster.storage import encode_entry
from broker.commitlog import integrity
from broker.commitlog.integrity import DamagedRange
from tests.unit.cluster.test_storage import Cluster, records


def damage(directory: Path, text: bytes) -> None:
    """Change one byte of ``text`` (a record's payload) in the segment that holds it, in place."""
    for path in sorted(directory.glob("*.log")):
        data = bytearray(path.read_bytes())
        at = data.find(text)
        if at >= 0:
            data[at] ^= 0x20
            with path.open("r+b") as f:
                f.write(data)
            return
    raise AssertionError(f"{text!r} is in no segment of {directory}")


def propose_cut_off(cluster: Cluster, lead: RaftNode, n: int, tag: str, to: set[int]) -> int:
    """Propose an entry of ``n`` records on ``lead`` that reaches only the nodes ``to`` (their
    answers are lost): it stays uncommitted. Returns its first index."""
    first = lead.terms.last_index + 1
    entry = encode_entry(records(n, tag), lead.terms.last_index, lead.term)
    cluster.apply(lead.id, lead.propose(*entry))
    sent = list(cluster.wire)
    cluster.wire.clear()
    for m in sent:
        if m.to in to:
            cluster.apply(m.to, cluster.cores[m.to].receive(m))
    cluster.wire.clear()
    return first


def new_leader(cluster: Cluster, old: RaftNode, ticks: int = 200) -> RaftNode:
    for _ in range(ticks):
        cluster.tick()
        leads = [c for c in cluster.cores.values() if c.role is Role.LEADER]
        if len(leads) == 1 and leads[0].id != old.id:
            return leads[0]
    raise AssertionError(f"node {old.id} still leads, or nobody does")


def test_a_leader_with_a_damaged_uncommitted_entry_steps_down_and_it_is_overwritten(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path)
    lead = cluster.leader()
    cluster.propose(lead, 2, "ok")
    cluster.tick(3)
    committed = lead.commit
    assert all(c.commit == committed for c in cluster.cores.values())

    # An entry only the leader has, damaged on its disk before any follower got it.
    first = propose_cut_off(cluster, lead, 3, "bad", to=set())
    damage(tmp_path / f"n{lead.id}", b"bad1")
    assert lead.commit == committed < first

    new = new_leader(cluster, lead)
    assert lead.role is Role.FOLLOWER
    cluster.propose(new, 2, "after")
    cluster.tick(5)
    assert (lead.id, first) in cluster.truncations  # the damaged suffix, nothing committed
    end = new.terms.last_index
    for node in range(3):
        assert cluster.cores[node].commit == end
        assert cluster.batches(node) == cluster.batches(new.id)
    payloads = [r.payload for r in cluster.storages[lead.id].log.read(0, max_records=100)]
    assert b"after1" in payloads and not any(p.startswith(b"bad") for p in payloads)
    cluster.close()


def test_a_follower_holding_the_entry_intact_lets_it_commit_and_repairs_the_leader(
    tmp_path: Path,
) -> None:
    """The follower's acknowledgement commits the entry before the leader reads it for the
    other follower: the leader keeps leading (heartbeats only to that follower) and its
    damaged copy, now committed, is the repairer's; once rewritten from the follower's (the
    steps of ``broker.cluster.repairer``, by hand: no event loop here), the other catches up
    with the original bytes."""
    found: list[DamagedRange] = []
    integrity.add_listener(found.append)
    try:
        cluster = Cluster(tmp_path)
        lead = cluster.leader()
        cluster.propose(lead, 2, "ok")
        cluster.tick(3)
        holder, lacking = sorted(set(cluster.cores) - {lead.id})
        first = propose_cut_off(cluster, lead, 3, "kept", to={holder})
        damage(tmp_path / f"n{lead.id}", b"kept1")
        cluster.tick(10)
        assert lead.role is Role.LEADER and lead.commit == first + 2  # with the holder's copy
        assert cluster.cores[lacking].terms.last_index == first - 1  # nothing past the damage
        assert len(found) == 1

        storage = cluster.storages[lead.id]
        offsets = storage.log.damaged_offsets(found[0])
        assert offsets == (first - 1, first + 1)
        status, batches = answer(cluster.storages[holder], *offsets, 1 << 20)
        assert status == OK
        check_answer(storage, found[0], *offsets, batches)
        assert storage.log.rewrite(found[0], batches) == 1
        cluster.tick(5)
        for node in (lead.id, lacking):
            assert cluster.batches(node) == cluster.batches(holder)
        cluster.close()
    finally:
        integrity.remove_listener(found.append)
