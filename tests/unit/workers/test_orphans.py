"""Who adopts the sessions of gone members (broker.workers.orphans): the ``$sessions`` leader,
and not those of a member its Raft host still hears from.

The node is a stand-in holding what ``Orphans`` reads (its gossip members, its ``$sessions``
replica's role, the nodes its Raft host heard from within an election timeout:
``MultiRaft.silent``, tested in test_multiraft.py). The claims themselves are tested in
test_replicated_sessions.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from broker.cluster.gossip.members import Member
from broker.cluster.gossip.messages import State
from broker.cluster.placement import node_id_of
from broker.router.state import SESSIONS
from broker.workers.orphans import Orphans
from broker.workers.replicated_sessions import Owner

GROUP = 7
N1, N2, N3 = (node_id_of(n) for n in ("n1", "n2", "n3"))


class Loop:
    """The node's loop as Orphans uses it: ``time`` and ``create_task`` (the claim itself is
    not run here: each task started is recorded)."""

    def __init__(self) -> None:
        self.tasks: list[str] = []

    def time(self) -> float:
        return 1000.0

    def create_task(self, coro: Any) -> Any:
        self.tasks.append(coro.cr_frame.f_locals["client_id"])
        coro.close()
        return asyncio.Future[None](loop=asyncio.new_event_loop())


@dataclass
class Node:
    name: str
    members: dict[str, State]
    leads: bool = True
    hosts_sessions: bool = True
    #: The nodes its Raft host heard from within an election timeout.
    heard: set[int] = field(default_factory=set)
    loop: Loop = field(default_factory=Loop)

    def __post_init__(self) -> None:
        self.group_keys = {GROUP: SESSIONS}
        self.names = {node_id_of(n): n for n in self.members}
        self.membership: Any = SimpleNamespace(core_members=self._core_members)
        self.host = SimpleNamespace(silent=lambda node: node not in self.heard)

    @property
    def storages(self) -> dict[int, object]:
        return {GROUP: object()} if self.hosts_sessions else {}

    def _core_members(self) -> list[Member]:
        return [Member(n, ("10.0.0.1", 7946), s, 0, 0, n) for n, s in self.members.items()]

    def leader(self, group: int) -> int:
        """The ``$sessions`` leader as this node knows it: itself, else n3."""
        return node_id_of(self.name) if self.leads else N3

    def is_leader(self, group: int) -> bool:
        return self.leader(group) == node_id_of(self.name)


class Sessions:
    """What Orphans needs of ClusterSessions: the owners, one worker."""

    def __init__(self, node: Node, owners: dict[str, Owner]) -> None:
        self.node = node
        self.worker = (0, 1)
        self.router = object()
        self.serving = True
        self.owners = owners

    def home(self, client_id: str) -> bool:
        return True

    async def claim(self, client_id: str, adopt: Callable[[bytes], None], **kw: Any) -> None:
        raise AssertionError("not awaited here")


def orphans(node: Node, owners: dict[str, Owner] | None = None) -> Orphans:
    return Orphans(Sessions(node, owners or {}))  # type: ignore[arg-type]


def test_a_healed_node_that_does_not_lead_sessions_adopts_nothing() -> None:
    """The bug: n1, back from a cut, still holds n2 dead and sees n3 alive; under the old rule
    it had "a majority alive" with itself the lowest live name and took n2's clients. It is not
    the ``$sessions`` leader (n3 is), so it adopts none of n2's sessions."""
    node = Node("n1", {"n1": State.ALIVE, "n2": State.DEAD, "n3": State.ALIVE}, leads=False)
    node.heard = {N3}  # n2 silent too: n1 cannot reach it yet
    o = orphans(node, {"watcher": Owner(N2, 3)})
    o.tick()
    assert node.loop.tasks == []
    gone = o.gone()
    assert gone is not None and set(gone) == {N2}
    assert o.adoptable(gone) == {}


def test_the_leader_adopts_the_sessions_of_a_gone_member_it_does_not_hear() -> None:
    node = Node("n2", {"n1": State.DEAD, "n2": State.ALIVE, "n3": State.ALIVE}, heard={N3})
    o = orphans(node, {"a": Owner(N1, 1), "b": Owner(N3, 1), "c": Owner(N2, 1)})
    o.tick()
    assert node.loop.tasks == ["a"]  # n1's session only
    o.tick()
    assert node.loop.tasks == ["a"]  # being claimed: not twice


def test_the_leader_leaves_the_sessions_of_a_member_it_hears_from() -> None:
    """The leader's gossip still has n1 dead (healed, n1 has not yet refuted), but its Raft
    host hears n1: n1's new clients stay there. Once n1 falls silent, it adopts them."""
    node = Node("n2", {"n1": State.DEAD, "n2": State.ALIVE, "n3": State.ALIVE}, heard={N1, N3})
    o = orphans(node, {"new": Owner(N1, 9)})
    o.tick()
    assert node.loop.tasks == []
    node.heard = {N3}
    o.tick()
    assert node.loop.tasks == ["new"]


def test_a_leader_that_steps_down_stops_adopting() -> None:
    node = Node("n2", {"n1": State.LEFT, "n2": State.ALIVE, "n3": State.ALIVE}, heard={N3})
    o = orphans(node)
    gone = o.gone()
    assert gone is not None and set(o.adoptable(gone) or {}) == {N1}  # left: adopted too
    node.leads = False
    assert o.adoptable(gone) == {}


def test_several_workers_gossip_and_the_sessions_host_tell_the_others() -> None:
    """Worker 0 gossips and tells who is gone; the worker hosting ``$sessions`` (here another)
    tells whom the node adopts; a third worker adopts what the host said."""
    zero = Node("n2", {"n1": State.DEAD, "n2": State.ALIVE}, hosts_sessions=False)
    host = Node("n2", {}, heard={N3})
    third = Node("n2", {}, hosts_sessions=False)
    host.membership = third.membership = None
    workers = [orphans(zero), orphans(host), orphans(third, {"a": Owner(N1, 1)})]
    for i, w in enumerate(workers):
        others = [x for j, x in enumerate(workers) if j != i]
        w.tell = lambda message, others=others: [x.told(message) for x in others]
    for _ in range(2):
        for w in workers:
            w.tick()
    assert set(workers[1]._told["gone"]) == {N1}
    assert set(workers[2]._told["adopt"]) == {N1}
    assert third.loop.tasks == ["a"] and zero.loop.tasks == host.loop.tasks == []
