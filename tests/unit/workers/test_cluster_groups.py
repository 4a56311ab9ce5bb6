"""Which node a cluster node's members follow as the shared groups' home
(broker.workers.cluster_groups): the ``$sessions`` leader in its term. A node holding no
replica of ``$sessions`` (it joined the cluster and no leader added it yet) knows no leader
from Raft; it reads ``$sessions`` remotely, and each fetch answer names the leader and its
term (broker.cluster.fetch): it follows that home (before, it followed none, and its members
were served by no home). Only the node (its transport, its groups) is a stand-in here."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from broker.commitlog import LogConfig
from broker.router.state import SESSIONS
from broker.workers.cluster_group_frames import SESSIONS_GROUP
from broker.workers.cluster_groups import GATHER_SECONDS, ClusterGroupPeers
from broker.workers.remote_partition import RemotePartition

GROUP = "$share/g/t/#"
JOINER = 4


class _Node:
    """A node that joined later: no replica of ``$sessions`` (no storage, no leader)."""

    id = JOINER

    def __init__(self) -> None:
        self.handlers: dict[int, Any] = {}
        self.storages: dict[int, Any] = {}
        self.names = {1: "n1", 2: "n2", 3: "n3", JOINER: "n4"}
        self.group_keys = {SESSIONS_GROUP: SESSIONS}
        self.host = None
        self.loop = SimpleNamespace(call_later=lambda *args: None, time=lambda: 0.0)
        self.transport = SimpleNamespace(
            closed=False, connected=lambda name: True, on_link_lost=lambda name: None
        )

    def leader(self, group: int) -> int | None:
        return None  # as ClusterNode.leader for a group it does not host

    def is_leader(self, group: int) -> bool:
        return False


class _Router:
    def __init__(self, sessions: RemotePartition | None = None) -> None:
        self.partitions = {SESSIONS: sessions}
        self.rehomed: list[Any] = []
        self.frozen: list[bool] = []

    def rehome_groups(self, held: Any, frozen: bool = False) -> None:
        self.rehomed.append(held)
        self.frozen.append(frozen)

    def freeze_groups(self, frozen: bool) -> None:
        self.frozen.append(frozen)


def test_a_node_without_a_sessions_replica_follows_the_leader_its_reads_name() -> None:
    node = _Node()
    service = SimpleNamespace(node=node, remote_leader=lambda part: None)
    sessions = RemotePartition(SESSIONS, LogConfig(), SESSIONS_GROUP, service, [1, 2, 3])  # type: ignore[arg-type]
    router = _Router(sessions)
    peers = ClusterGroupPeers(node, {})  # type: ignore[arg-type]
    peers.start(router)  # type: ignore[arg-type]
    assert peers.home(GROUP) is None and router.rehomed == []  # no answer yet: no leader
    sessions.marks(2, 0, 10, term=1)  # a replica's answer: n2 leads in term 1
    peers.check()
    assert peers.home(GROUP) == 2
    assert router.rehomed == [None]  # its members join n2 (this node holds no group)
    peers.check()
    assert router.rehomed == [None]  # the same home
    sessions.marks(2, 0, 10, term=3)  # n2 elected again: a new home all the same
    peers.check()
    assert (peers.home(GROUP), router.rehomed) == (2, [None, None])
    sessions.marks(1, 0, 10, term=2)  # a replica behind names term 2's leader: not believed
    peers.check()
    assert (peers.home(GROUP), len(router.rehomed)) == (2, 2)
    sessions.marks(3, 0, 10, term=4)
    peers.check()
    assert (peers.home(GROUP), len(router.rehomed)) == (3, 3)


class _Leader(_Node):
    """A node elected ``$sessions``' leader in term 2, an entry of which is committed."""

    id = 2

    def __init__(self) -> None:
        super().__init__()
        self.storages = {SESSIONS_GROUP: object()}
        self.later: list[tuple[float, Any, tuple[Any, ...]]] = []
        self.loop = SimpleNamespace(
            call_later=lambda delay, f, *args: self.later.append((delay, f, args)),
            time=lambda: 0.0,
        )
        terms = SimpleNamespace(term_at=lambda index: 2)
        self._core = SimpleNamespace(term=2, commit=5, terms=terms, transferee=None)

    def leader(self, group: int) -> int | None:
        return self.id

    def is_leader(self, group: int) -> bool:
        return True

    def core(self, group: int) -> Any:
        return self._core


def test_a_new_home_hands_out_nothing_until_the_members_elsewhere_had_time_to_join() -> None:
    """The members on the node that became the home join it at once, those elsewhere at
    their nodes' next check: until then its groups are frozen, or the first to join would
    take every record up to their windows (a joined node's member got none of 200)."""
    node = _Leader()
    router = _Router()
    peers = ClusterGroupPeers(node, {GROUP: b'{"cursors": [], "done": []}'})  # type: ignore[arg-type]
    peers.start(router)  # type: ignore[arg-type]
    assert peers.home(GROUP) is None  # held here
    assert router.rehomed == [{GROUP: {"cursors": [], "done": []}}]
    assert router.frozen == [True]  # held from the persisted positions, handing out nothing
    gathered = [(f, args) for delay, f, args in node.later if delay == GATHER_SECONDS]
    assert len(gathered) == 1
    f, args = gathered[0]
    f(*args)
    assert router.frozen == [True, False]  # then the records go out to all of them
    peers.frozen = True  # a planned hand-over froze them meanwhile: they stay frozen
    f(*args)
    assert router.frozen == [True, False]
