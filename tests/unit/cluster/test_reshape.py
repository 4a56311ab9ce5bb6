"""Where a node's reshaper wants each group's replicas (broker.cluster.reshape): placement over
the members gossip counts, a node that joined counted at once, a leaving one left out while
the others make up the replication factor, a gone one (dead past replace_after) left out; the
preferred leader follows. And the member list a node persists (broker.cluster.formation):
who founded the cluster and whether this node joined it later."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from broker.cluster import formation
from broker.cluster.gossip.members import Member
from broker.cluster.gossip.messages import State
from broker.cluster.placement import node_id_of, replicas
from broker.cluster.reshape import Reshaper

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
        settings=SimpleNamespace(replication_factor=3, gossip=SimpleNamespace(replace_after=300.0)),
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
