"""Where a node's reshaper wants each group's replicas (broker.cluster.reshape): placement over
the members gossip counts, a node that joined counted at once, a leaving one left out while
the others make up the replication factor, a gone one (dead past replace_after) left out; the
preferred leader follows. And the member list a node persists (broker.cluster.formation):
who founded the cluster and whether this node joined it later. And the notices that make a
removed replica give its copy up."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from broker.cluster import formation
from broker.cluster.gossip.members import Member
from broker.cluster.gossip.messages import State
from broker.cluster.hardstate import write_atomically
from broker.cluster.placement import node_id_of, replicas
from broker.cluster.raft import Role
from broker.cluster.reshape import _REMOVED, ASKED, HEARD, REMOVED, TOLD, Reshaper

NAMES = ["n1", "n2", "n3", "n4"]
IDS = {node_id_of(n): n for n in NAMES}


def _reshaper(tmp_path: Path, states: dict[str, State], leaving: set[str]) -> Reshaper:
    members = [Member(n, ("10.0.0.1", 7946), s, 0, 0, n, b"") for n, s in states.items()]
    membership = SimpleNamespace(
        core_members=lambda: members,
        leaving=lambda: {n for n in leaving if n != "n1"},
        meta=SimpleNamespace(leaving="n1" in leaving),
    )
    node: Any = SimpleNamespace(
        id=node_id_of("n1"),
        loop=SimpleNamespace(time=lambda: 1000.0),  # 1000 s: past replace_after (300 s)
        settings=SimpleNamespace(
            replication_factor=3, gossip=SimpleNamespace(replace_after=300.0), worker=(0, 1)
        ),
        membership=membership,
        names=dict(IDS),
        replication={},
        everywhere={99},
        state_dir=tmp_path,
        handlers={},
    )
    return Reshaper(node)


def _want(r: Reshaper, g: int) -> set[str]:
    eligible, _, leaving = r.eligible()
    return {IDS[n] for n in r.wanted(g, eligible, leaving)}


def test_a_joined_node_counts_and_a_leaving_one_does_not(tmp_path: Path) -> None:
    alive = dict.fromkeys(NAMES, State.ALIVE)
    r = _reshaper(tmp_path, alive, set())
    groups = range(40)
    # Placement over the four: the newcomer n4 gets its share, everywhere-groups all four.
    assert all(_want(r, g) == {IDS[n] for n in replicas(g, IDS, 3)} for g in groups)
    assert any("n4" in _want(r, g) for g in groups)
    assert _want(r, 99) == set(NAMES)
    # n2 leaving: no group wants it, three others remain.
    r = _reshaper(tmp_path, alive, {"n2"})
    assert all(_want(r, g) == {"n1", "n3", "n4"} for g in groups)
    assert _want(r, 99) == {"n1", "n3", "n4"}
    # n2 and n3 leaving: only two others, so both keep their replicas.
    r = _reshaper(tmp_path, alive, {"n2", "n3"})
    assert all(_want(r, g) == {IDS[n] for n in replicas(g, IDS, 3)} for g in groups)


def test_a_member_gone_past_replace_after_is_left_out(tmp_path: Path) -> None:
    states = {**dict.fromkeys(NAMES, State.ALIVE), "n3": State.DEAD}
    r = _reshaper(tmp_path, states, set())
    eligible, live, _ = r.eligible()
    assert {IDS[n] for n in eligible} == {"n1", "n2", "n4"}
    assert node_id_of("n3") not in live
    assert all(_want(r, g) == {"n1", "n2", "n4"} for g in range(10))


def test_members_file_keeps_the_founders_and_the_joined_flag(tmp_path: Path) -> None:
    path = tmp_path / "members"
    three = {n: ("10.0.0.1", 7950) for n in NAMES[:3]}
    formation.save_members(path, three)
    known = formation.load_members(path)
    assert known is not None and known.founders == NAMES[:3] and not known.joined
    four = {**three, "n4": ("10.0.0.4", 7950)}
    formation.save_members(path, four, founders=NAMES[:3])
    known = formation.load_members(path)
    assert known is not None and set(known.members) == set(NAMES)
    assert known.founders == NAMES[:3]
    formation.save_members(path, four, joined=True)
    known = formation.load_members(path)
    assert known is not None and known.joined and known.founders == NAMES


class _Host:
    """The MultiRaft side the notices touch: each group's core, and remove_group."""

    def __init__(self, cores: dict[int, Any]) -> None:
        self.cores = cores
        self.removed: list[int] = []

    def core(self, g: int) -> Any:
        return self.cores[g]

    def remove_group(self, g: int) -> None:
        self.removed.append(g)
        del self.cores[g]


def _core(role: Role, members: set[int], last_index: int = 5, commit: int = 5) -> Any:
    return SimpleNamespace(
        role=role,
        leader=None,
        commit=commit,
        membership=SimpleNamespace(last_index=last_index),
        configuration=SimpleNamespace(members=members, voters=members),
    )


def _notices(tmp_path: Path, cores: dict[int, Any]) -> tuple[Reshaper, Any, list[Any]]:
    sent: list[Any] = []
    node: Any = SimpleNamespace(
        id=1,
        host=_Host(cores),
        storages=dict.fromkeys(cores),
        names={1: "n1", 2: "n2", 3: "n3"},
        settings=SimpleNamespace(worker=(0, 1)),
        state_dir=tmp_path,
        handlers={},
        send=lambda to, kind, body: sent.append((to, kind, _REMOVED.unpack(body))) or True,
        untrack=lambda g: None,
        label=lambda g: f"group {g}",
    )
    return Reshaper(node), node, sent


def test_a_leader_answers_a_replica_its_committed_configuration_lacks(tmp_path: Path) -> None:
    r, _, sent = _notices(
        tmp_path,
        {
            7: _core(Role.LEADER, {1, 2}),  # 3 removed, committed
            8: _core(Role.LEADER, {1, 2}, last_index=6),  # a change in flight
            9: _core(Role.LEADER, {1, 2, 3}),  # 3 is a member
        },
    )
    for g in (7, 8, 9):
        r.node.handlers[REMOVED](3, memoryview(_REMOVED.pack(g, ASKED)))
    assert sent == [(3, REMOVED, (7, TOLD))]


def test_a_replica_told_it_was_removed_gives_the_group_up(tmp_path: Path) -> None:
    r, node, sent = _notices(
        tmp_path, {7: _core(Role.FOLLOWER, {1, 2, 3}), 8: _core(Role.LEADER, {1, 2, 3})}
    )
    given: list[tuple[int, int]] = []
    r.on_removed = lambda g, leader: given.append((g, leader))
    node.handlers[REMOVED](2, memoryview(_REMOVED.pack(7, TOLD)))
    node.handlers[REMOVED](2, memoryview(_REMOVED.pack(8, TOLD)))  # a leader: stale notice
    assert sent == [(2, REMOVED, (7, HEARD)), (2, REMOVED, (8, HEARD))]
    assert node.host.removed == [7] and given == [(7, 2)] and 7 not in node.storages
    # The leader stops telling once heard.
    r.untold[7] = {3}
    node.handlers[REMOVED](3, memoryview(_REMOVED.pack(7, HEARD)))
    assert r.untold[7] == set()
    # Noted: a restart does not host it again by placement's guess.
    assert Reshaper(node).removed == {7}


def _worker(tmp_path: Path, index: int) -> Reshaper:
    node = SimpleNamespace(settings=SimpleNamespace(worker=(index, 2)), state_dir=tmp_path)
    node.handlers = {}
    return Reshaper(node)  # type: ignore[arg-type]


def test_each_worker_notes_the_groups_removed_from_it_in_a_file_of_its_own(tmp_path: Path) -> None:
    """Each worker's groups are its own: worker 1 noting its removals must not drop worker
    0's (a restart would host such a group again by placement's guess)."""
    zero, one = _worker(tmp_path, 0), _worker(tmp_path, 1)
    for reshaper, g in ((zero, 5), (one, 6)):
        reshaper.removed.add(g)
        write_atomically(reshaper._removed_file, orjson.dumps(sorted(reshaper.removed)))
    assert [_worker(tmp_path, i).removed for i in (0, 1)] == [{5}, {6}]
