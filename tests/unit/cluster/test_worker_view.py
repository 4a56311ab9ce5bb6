"""What worker 0's gossip sees, told to a node's other workers (broker.cluster.worker_view):
worker 1 dials a member it did not know at that member's Raft port + 1, admits it to its
groups' host, and plans over the same survey as worker 0 (who counts, who is live, who
leaves) until the view is older than STALE_SECONDS."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from broker.cluster.gossip.members import Member
from broker.cluster.gossip.messages import State
from broker.cluster.placement import node_id_of
from broker.cluster.reshape import STALE_SECONDS, Reshaper
from broker.cluster.worker_view import hear, view_of

NAMES = ["n1", "n2", "n3", "n4"]
RAFT = {n: (f"10.0.0.{i + 1}", 7950) for i, n in enumerate(NAMES)}


def _node(tmp_path: Path, index: int, names: list[str], membership: Any = None) -> Any:
    learned: dict[str, tuple[str, int]] = {}
    admitted: list[str] = []
    clock = SimpleNamespace(now=1000.0)
    node: Any = SimpleNamespace(
        name="n1",
        id=node_id_of("n1"),
        loop=SimpleNamespace(time=lambda: clock.now),
        clock=clock,
        settings=SimpleNamespace(
            worker=(index, 2),
            replication_factor=3,
            gossip=SimpleNamespace(replace_after=300.0),
        ),
        membership=membership,
        names={node_id_of(n): n for n in names},
        replication={},
        everywhere=set(),
        metadata=None,
        group_keys={},
        state_dir=tmp_path / f"w{index}",
        handlers={},
        host=SimpleNamespace(peers=[node_id_of(n) for n in names if n != "n1"]),
        learned=learned,
        admitted=admitted,
    )
    node.transport = SimpleNamespace(
        members={n: (RAFT[n][0], RAFT[n][1] + index) for n in names if n != "n1"},
        learn=lambda name, addr: learned.__setitem__(name, addr),
    )

    def admit(name: str) -> None:
        admitted.append(name)
        node.names[node_id_of(name)] = name
        node.host.peers.append(node_id_of(name))

    node.admit = admit
    node.state_dir.mkdir()
    node.reshape = Reshaper(node)
    return node


def test_worker_1_learns_a_newcomer_and_plans_over_worker_0s_survey(tmp_path: Path) -> None:
    states = {"n1": State.ALIVE, "n2": State.ALIVE, "n3": State.DEAD, "n4": State.ALIVE}
    members = [Member(n, ("10.0.0.9", 7946), s, 0, 0, n, b"") for n, s in states.items()]
    membership = SimpleNamespace(
        core_members=lambda: members,
        leaving=lambda: {"n2"},
        meta=SimpleNamespace(leaving=False),
    )
    zero = _node(tmp_path, 0, NAMES, membership)
    one = _node(tmp_path, 1, NAMES[:3])  # n4 joined after this worker read the member list
    assert not one.reshape.surveyed()
    view = orjson.loads(orjson.dumps(view_of(zero)))  # as it crosses the mesh
    hear(one, view)
    # n4 is dialled at its worker 1's Raft port and admitted; the known ones are left alone.
    assert one.learned == {"n4": ("10.0.0.4", 7951)}
    assert one.admitted == ["n4"]
    # The same survey as worker 0's: n3 gone (dead past replace_after), n2 leaving.
    assert one.reshape.eligible() == zero.reshape.eligible()
    eligible, live, leaving = one.reshape.eligible()
    assert sorted(eligible) == sorted(node_id_of(n) for n in ("n1", "n2", "n4"))
    assert node_id_of("n3") not in live
    assert leaving == {node_id_of("n2")}
    assert one.reshape.surveyed()
    # Told again: nothing new to dial or admit.
    hear(one, view)
    assert one.admitted == ["n4"]
    # Worker 0 silent for longer than STALE_SECONDS: worker 1 plans nothing.
    one.clock.now += STALE_SECONDS + 0.1
    assert not one.reshape.surveyed()


def test_worker_0_tells_on_each_planner_pass(tmp_path: Path) -> None:
    members: list[Member] = []  # gossip has heard of no member yet
    membership = SimpleNamespace(
        core_members=lambda: members, leaving=set, meta=SimpleNamespace(leaving=False)
    )
    zero = _node(tmp_path, 0, NAMES, membership)
    zero.storages = {}
    zero.settings.heartbeat_interval = 0.1
    zero.wake = lambda: None
    told: list[dict[str, Any]] = []
    zero.reshape.tell = lambda: told.append(view_of(zero))
    for tick in range(1, 31):  # three seconds of 100 ms ticks: one pass a second
        zero.reshape.tick(tick)
    assert told == []  # it plans nothing yet, and tells nothing the others would plan over
    members += [Member(n, ("10.0.0.9", 7946), State.ALIVE, 0, 0, n, b"") for n in NAMES]
    for tick in range(31, 61):
        zero.reshape.tick(tick)
    assert len(told) == 3
    assert set(told[-1]["members"]) == {"n2", "n3", "n4"}


def test_worker_1_follows_the_replication_factors_worker_0_tells(tmp_path: Path) -> None:
    """``mqlog cluster set-replication`` commits in the metadata group, worker 0's alone: the
    others learn the factors from its view, for the groups of theirs (not those on every
    node, and not before worker 0 caught up with the metadata group)."""
    zero = _node(tmp_path, 0, NAMES)
    one = _node(tmp_path, 1, NAMES)
    one.group_keys = {11: ("rf", 1), 13: ("rf", 3), 20: ("$sessions", 0), 30: ("other", 0)}
    one.replication = {11: 3, 13: 3, 20: 4, 30: 3}
    one.everywhere = {20}
    definition = SimpleNamespace(replication_factor=2)
    replica = SimpleNamespace(
        lock=threading.Lock(),
        state=SimpleNamespace(streams={"rf": (definition, None), "$sessions": (definition, None)}),
    )
    zero.metadata = SimpleNamespace(ready=False, replica=replica)
    hear(one, orjson.loads(orjson.dumps(view_of(zero))))
    assert one.replication == {11: 3, 13: 3, 20: 4, 30: 3}  # not caught up: nothing told
    zero.metadata.ready = True
    hear(one, orjson.loads(orjson.dumps(view_of(zero))))
    assert one.replication == {11: 2, 13: 2, 20: 4, 30: 3}
