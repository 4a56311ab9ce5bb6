"""Who adopts the sessions of gone members (broker.workers.orphans): the ``$sessions`` leader,
and not those of a member whose replica it heard from lately.

The node is a stand-in holding what ``Orphans`` reads (its gossip members, its ``$sessions``
replica's role and its followers' CheckQuorum flags); the clock is simulated. The claims
themselves are tested in test_replicated_sessions.py.
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
from broker.workers.orphans import HEARD_TIMEOUTS, Orphans
from broker.workers.replicated_sessions import Owner

GROUP = 7
ELECTION_TIMEOUT = 1.0
N1, N2, N3 = (node_id_of(n) for n in ("n1", "n2", "n3"))


class Clock:
    """The node's loop as Orphans uses it: ``time`` (simulated) and ``create_task``."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.tasks: list[Any] = []

    def time(self) -> float:
        return self.now

    def create_task(self, coro: Any) -> Any:
        coro.close()  # the claim itself is not under test here
        task = asyncio.Future[None](loop=asyncio.new_event_loop())
        self.tasks.append(task)
        return task


@dataclass
class Node:
    name: str
    members: dict[str, State]
    leads: bool = True
    hosts_sessions: bool = True
    #: Follower node id -> its CheckQuorum flag (heard from this election timeout).
    active: dict[int, bool] = field(default_factory=dict)
    loop: Clock = field(default_factory=Clock)

    def __post_init__(self) -> None:
        self.group_keys = {GROUP: SESSIONS}
        self.settings = SimpleNamespace(election_timeout=ELECTION_TIMEOUT)
        self.names = {node_id_of(n): n for n in self.members}
        self.membership = SimpleNamespace(core_members=self._core_members)

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

    def core(self, group: int) -> Any:
        progress = {n: SimpleNamespace(active=a) for n, a in self.active.items()}
        return SimpleNamespace(progress=progress)


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


def quiet(node: Node, ticks: int, o: Orphans) -> None:
    """``ticks`` half-second ticks pass."""
    for _ in range(ticks):
        node.loop.now += 0.5
        o.tick()


def test_a_healed_node_that_does_not_lead_sessions_adopts_nothing() -> None:
    """The bug: n1, back from a cut, still holds n2 dead and sees n3 alive; under the old rule
    it had "a majority alive" with itself the lowest live name and took n2's clients. It is not
    the ``$sessions`` leader (n2 or n3 is), so it adopts none of n2's sessions."""
    node = Node("n1", {"n1": State.ALIVE, "n2": State.DEAD, "n3": State.ALIVE}, leads=False)
    o = orphans(node, {"watcher": Owner(N2, 3)})
    quiet(node, 10, o)
    assert node.loop.tasks == [] and o.claiming == set()
    gone = o.gone()
    assert gone is not None and set(gone) == {N2}
    assert o.adoptable(gone) == {}


def test_the_leader_adopts_a_silent_gone_members_sessions() -> None:
    node = Node("n2", {"n1": State.DEAD, "n2": State.ALIVE, "n3": State.ALIVE})
    node.active = {N1: False, N3: True}
    o = orphans(node, {"a": Owner(N1, 1), "b": Owner(N3, 1)})
    quiet(node, 2 * HEARD_TIMEOUTS, o)  # newly elected: it waits until it heard from everyone
    assert o.claiming == set()
    quiet(node, 1, o)
    assert o.claiming == {"a"}  # n1's session, not n3's


def test_the_leader_leaves_the_sessions_of_a_member_it_hears_from() -> None:
    """The leader's gossip still has n1 dead (healed, n1 has not yet refuted), but n1's
    replica answers its heartbeats: n1's new clients stay there."""
    node = Node("n2", {"n1": State.DEAD, "n2": State.ALIVE, "n3": State.ALIVE})
    node.active = {N1: True, N3: True}
    o = orphans(node, {"new": Owner(N1, 9)})
    quiet(node, 20, o)
    assert o.claiming == set()
    # Cut off again: once its replica has been silent two election timeouts, it adopts.
    node.active[N1] = False
    quiet(node, 2 * HEARD_TIMEOUTS, o)
    assert o.claiming == set()
    quiet(node, 1, o)
    assert o.claiming == {"new"}


def test_a_leader_that_steps_down_stops_adopting() -> None:
    node = Node("n2", {"n1": State.DEAD, "n2": State.ALIVE, "n3": State.ALIVE})
    o = orphans(node)
    quiet(node, 2 * HEARD_TIMEOUTS + 1, o)
    gone = o.gone()
    assert gone is not None and set(o.adoptable(gone) or {}) == {N1}
    node.leads = False
    assert o.adoptable(gone) == {}
    node.leads = True  # elected again: it waits again
    assert o.adoptable(gone) == {}


def test_several_workers_gossip_and_the_sessions_host_tell_the_others() -> None:
    """Worker 0 gossips and tells who is gone; the worker hosting ``$sessions`` (here another)
    tells whom the node adopts; a third worker adopts what the host said."""
    zero = Node("n2", {"n1": State.DEAD, "n2": State.ALIVE}, hosts_sessions=False)
    host = Node("n2", {}, hosts_sessions=True)
    host.membership = None  # type: ignore[assignment]
    third = Node("n2", {}, hosts_sessions=False)
    third.membership = None  # type: ignore[assignment]
    workers = [orphans(zero), orphans(host), orphans(third, {"a": Owner(N1, 1)})]
    for i, w in enumerate(workers):
        others = [x for j, x in enumerate(workers) if j != i]
        w.tell = lambda message, others=others: [x.told(message) for x in others]
    for _ in range(2 * HEARD_TIMEOUTS + 1):
        for n in (zero, host, third):
            n.loop.now += 0.5
        for w in workers:
            w.tick()
    assert set(workers[1]._told["gone"]) == {N1}
    assert set(workers[2]._told["adopt"]) == {N1}
    assert workers[2].claiming == {"a"}
