"""What a shared group needs to move between a cluster's nodes (broker.workers.cluster_groups),
on a router over a real log: the ``done`` positions it persists (below them every record was
acknowledged), a new home continuing from them (at least once [MQTT-4.8.2]), and a member's
node waiting for a record its home saw committed before this replica did."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from broker.commitlog import Record
from broker.mqtt.packets import SubAck, Subscribe, Subscription
from broker.router.hooks import SingleWorker
from broker.router.partition import READ_BATCH, Partition
from broker.router.state import SESSIONS
from tests.unit.router.conftest import Harness
from tests.unit.router.test_runs import _Peers

GROUP = "$share/g/t/+"


def _persisted(h: Harness) -> dict[str, Any]:
    """The group's latest state record in ``$sessions``."""
    log = h.streams.log(*SESSIONS)
    records = [r for r in log.read(log.log_start_offset, 10_000) if r.topic == GROUP]
    state: dict[str, Any] = orjson.loads(records[-1].payload)
    return state


def test_done_positions_stop_at_the_first_unacknowledged_record(h: Harness) -> None:
    fast, a = h.connect("fast", 4)
    slow, b = h.connect("slow", 4)
    for s in (a, b):
        h.subscribe(s, GROUP, 1)
    _, pub = h.connect("pub", 4)
    for i in range(6):
        h.publish(pub, "t/x", b"%d" % i, 1, i + 1)
    h.run()
    got = {"fast": fast.take(), "slow": slow.take()}
    assert sorted(p.payload for sent in got.values() for p in sent) == [b"%d" % i for i in range(6)]
    for p in got["fast"]:
        h.router.puback(a, p.packet_id)  # the slow member acknowledges nothing
    h.tick(1)
    state = _persisted(h)
    first_unacked = min(int(p.payload) for p in got["slow"])
    assert state["cursors"] == [["default", 0, 6]]  # handed out: one node continues here
    assert state["done"] == [["default", 0, first_unacked]]  # a new home continues here

    # A new home (here: the same router, its groups dropped and held again from the record)
    # gives every record not done to the members again: at least once.
    h.router.rehome_groups({GROUP: state})
    h.run()
    again = sorted(int(p.payload) for p in fast.take() + slow.take())
    assert again == list(range(first_unacked, 6))


class _Elsewhere(SingleWorker):
    """A member's side: every group is held by another node (1)."""

    def __init__(self) -> None:
        self.group_peers = _Peers()


def test_a_record_not_yet_committed_here_waits_for_the_commit(h: Harness) -> None:
    """The home read it committed; this replica learns the commit a round later: the record
    is not counted done (lost) but sent once it is readable here."""
    h.hooks = _Elsewhere()
    h.restart()
    link, s = h.connect("member", 4)
    h.router.subscribe(s, Subscribe(1, [Subscription(GROUP, 1)]))
    h.run()
    _, pub = h.connect("pub", 4)
    h.publish(pub, "t/x", b"0", 1, 1)
    h.run()
    h.router.remote_deliver(GROUP, "member", 1, ("default", 0), 1, 1)  # not here yet
    assert link.take() == []
    assert h.hooks.group_peers.done_offsets == []  # type: ignore[attr-defined]
    h.publish(pub, "t/x", b"1", 1, 2)
    h.run()
    assert [p.payload for p in link.take()] == [b"1"]


class _NotFetchedYet(Partition):
    """A partition this node reads remotely (broker.workers.remote_partition): nothing is
    readable until ``fetched`` (the fetch a read starts is answered)."""

    __slots__ = ()
    fetched_remotely = True
    fetched = False

    def read(self, offset: int, max_records: int = READ_BATCH) -> list[Record]:
        return super().read(offset, max_records) if _NotFetchedYet.fetched else []


def test_a_record_not_fetched_here_yet_waits_for_the_fetch(h: Harness) -> None:
    """A member's node holding no replica of the partition reads the record the home sent
    remotely: until the fetch is answered it is not readable, and it waits for it (before,
    it was taken for one retention deleted, reported done, and lost to the group)."""
    h.hooks = _Elsewhere()
    h.restart()
    link, s = h.connect("member", 4)
    h.router.subscribe(s, Subscribe(1, [Subscription(GROUP, 1)]))
    h.run()
    _, pub = h.connect("pub", 4)
    h.publish(pub, "t/x", b"0", 1, 1)
    h.run()
    part = h.router.partitions[("default", 0)]
    part.__class__ = _NotFetchedYet
    _NotFetchedYet.fetched = False
    h.router.remote_deliver(GROUP, "member", 1, ("default", 0), 0, 1)
    assert link.take() == []
    assert h.hooks.group_peers.done_offsets == []  # type: ignore[attr-defined]
    _NotFetchedYet.fetched = True  # the answer arrived: the partition's readers are woken
    h.router.wake(part)
    assert [p.payload for p in link.take()] == [b"0"]


def _stored(h: Harness) -> bool:
    """Whether the group's positions are in ``$sessions``."""
    log = h.streams.log(*SESSIONS)
    return any(r.topic == GROUP for r in log.read(log.log_start_offset, 10_000))


def test_a_new_groups_suback_follows_its_stored_positions(h: Harness) -> None:
    """The positions a new group starts at are in the log before its first member's SUBACK
    leaves: a cluster's next home starts the group there, not at the end of the partitions
    it finds (a record published after the SUBACK would be lost to the group). Fails if the
    SUBACK leaves at once (before this, with the positions written at the next tick)."""
    link, s = h.connect("first", 4)
    stored_at_suback: list[bool] = []
    send = link.send

    def send_noting(packet: Any) -> None:
        if isinstance(packet, SubAck):
            stored_at_suback.append(_stored(h))
        send(packet)

    link.send = send_noting  # type: ignore[method-assign]
    h.router.subscribe(s, Subscribe(1, [Subscription(GROUP, 1)]))
    assert link.of(SubAck) == []  # not stored yet
    h.run()
    assert stored_at_suback == [True]
    # A second member of the stored group is answered at once.
    link2, s2 = h.connect("second", 4)
    h.router.subscribe(s2, Subscribe(1, [Subscription(GROUP, 1)]))
    assert len(link2.of(SubAck)) == 1


class _Home(SingleWorker):
    """The home's side: every group is held here, a member joins from node 2."""

    def __init__(self) -> None:
        self.group_peers = _Joined()


class _Joined(_Peers):
    def __init__(self) -> None:
        super().__init__()
        self.joined_at: list[tuple[str, bool]] = []
        self.stored: Any = None

    def home(self, group: str) -> int | None:
        return None

    def joined(self, worker: int, group: str, client_id: str) -> None:
        self.joined_at.append((client_id, self.stored()))


def test_the_home_answers_a_join_of_a_new_group_once_it_is_stored(h: Harness) -> None:
    h.hooks = _Home()
    h.restart()
    peers: _Joined = h.hooks.group_peers  # type: ignore[assignment]
    peers.stored = lambda: _stored(h)
    h.router.remote_join(2, GROUP, "far", 1, 1, None, 4, 10, None)
    assert peers.joined_at == []
    h.run()
    assert peers.joined_at == [("far", True)]
    h.router.remote_join(2, GROUP, "far2", 1, 1, None, 4, 10, None)
    assert peers.joined_at[1:] == [("far2", True)]  # stored already: at once


def test_a_members_suback_waits_for_its_home_to_answer(h: Harness) -> None:
    """On a member's node the SUBACK of a shared subscription leaves once the group's home
    says it joined (broker.workers.groups JOINED), after the SUBACKs held before it."""
    h.hooks = _Elsewhere()
    h.restart()
    link, s = h.connect("member", 4)
    h.router.subscribe(s, Subscribe(1, [Subscription(GROUP, 1)]))
    h.router.subscribe(s, Subscribe(2, [Subscription("t/plain", 1)]))
    h.run()
    assert link.of(SubAck) == []
    h.router.group_joined(GROUP, "member")
    assert [p.packet_id for p in link.of(SubAck)] == [1, 2]


def test_a_frozen_group_hands_out_nothing_and_stores_its_drained_positions(h: Harness) -> None:
    """Before a planned hand-over (broker.workers.cluster_groups) the home's groups stop
    handing out records; once what was handed out is acknowledged the done positions are
    the cursors, and those are stored: the next home starts after every acknowledged record."""
    link, s = h.connect("m", 4)
    h.subscribe(s, GROUP, 1)
    _, pub = h.connect("pub", 4)
    h.publish(pub, "t/x", b"0", 1, 1)
    h.run()
    (sent,) = link.take()
    h.router.freeze_groups(True)
    h.publish(pub, "t/x", b"1", 1, 2)
    h.run()
    assert link.take() == []  # frozen: not handed out
    assert not h.router.groups_drained()  # "0" is not acknowledged
    h.router.puback(s, sent.packet_id)
    assert h.router.groups_drained()
    stored: list[bool] = []
    h.router.store_groups(stored.append)
    h.run()
    assert stored == [True]
    assert _persisted(h)["done"] == [["default", 0, 1]]  # the next home starts at "1"
    h.router.freeze_groups(False)
    assert [p.payload for p in link.take()] == [b"1"]


def test_a_group_held_frozen_hands_out_to_every_member_joined_before_the_thaw(h: Harness) -> None:
    """A new home holds its groups frozen while the members on other nodes join
    (broker.workers.cluster_groups.GATHER_SECONDS): the records then go round robin to all of
    them, not to the first member up to its window."""
    first, a = h.connect("first", 4)
    h.subscribe(a, GROUP, 1)
    h.run()
    state = _persisted(h)
    h.router.freeze_groups(True)
    _, pub = h.connect("pub", 4)
    for i in range(6):
        h.publish(pub, "t/x", b"%d" % i, 1, i + 1)
    h.run()
    h.router.rehome_groups({GROUP: state}, True)  # held anew, frozen; "first" joined again
    h.run()
    assert first.take() == []
    later, b = h.connect("later", 4)
    h.subscribe(b, GROUP, 1)  # joins before the thaw
    h.run()
    h.router.freeze_groups(False)
    got = {"first": first.take(), "later": later.take()}
    assert sorted(p.payload for sent in got.values() for p in sent) == [b"%d" % i for i in range(6)]
    assert len(got["later"]) == 3  # round robin over both, not four to the first


@pytest.mark.parametrize("crash", [True, False])
def test_a_group_held_again_continues_from_its_first_record_not_done(
    h: Harness, crash: bool
) -> None:
    """A clean session had records of the group, unacknowledged, when the broker (or the
    group's home worker) was killed, or stopped (its sessions ended, the records given
    back): a group continuing from where it had handed out to (its cursors, past them)
    never delivered them again. It continues from its ``done`` positions (at least once
    [MQTT-4.8.2])."""
    member, m = h.connect("m", 4)
    h.subscribe(m, GROUP, 1)
    _, pub = h.connect("pub", 4)
    for i in range(3):
        h.publish(pub, "t/x", b"%d" % i, 1, i + 1)
    h.run()
    assert [p.payload for p in member.take()] == [b"0", b"1", b"2"]  # none acknowledged
    if crash:
        h.tick(1)  # the group's positions written
        h.streams.close()  # killed: no router.close()
        h.open()
    else:
        h.drop(m, member)  # a stop closes its connection: the session ends
        h.restart()
    again, a = h.connect("another", 4)
    h.subscribe(a, GROUP, 1)
    h.run()
    assert [p.payload for p in again.take()] == [b"0", b"1", b"2"]
