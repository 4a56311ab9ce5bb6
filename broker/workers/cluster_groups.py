"""Shared subscription groups across a cluster's nodes: each record of a group goes to exactly
one member, wherever its client is connected [MQTT-4.8.2].

This is the several-worker protocol of broker.workers.groups (JOIN, LEAVE, DONE to the
group's home, DELIVER to the member's worker) over the node transport, with one home for
every group: the worker hosting ``$sessions`` on the node leading it (with several workers
per node, the other workers of every node reach it through their node's ``$sessions``
worker: broker.workers.cluster_group_frames). Why that node: every node knows it from Raft,
there is at most one per term, and it holds every committed ``$sessions`` record (Raft
s5.4.1, Leader Completeness), so the positions its predecessor committed are there when it
takes over; a home chosen by hashing over the live members would need its own agreement on
who is alive and could take over before it applied them. Its cost: one node spreads every group's
records (the records themselves are read by each member's node from its own replica, or its
remote reads; a DELIVER names only a partition and an offset).

The home persists each group's ``done`` positions (broker.router.store: below them every
record was sent at QoS 0 or acknowledged) in ``$sessions``, and every node applies them
(:attr:`broker.workers.replicated_sessions.ClusterSessions.groups`); a new group's are
committed before its first member's SUBACK leaves (broker.router.shared), so a record
published after it is never before where a next home starts. When the leadership moves (a
new term: the same node elected again is a new home too), the leader holds the groups from
those positions, once an entry of its term committed (it
applied every earlier one then), and the members on every node join it again; it hands out
nothing for :data:`GATHER_SECONDS` first, so that the records spread over all of them, not
over those that joined first (as a Kafka group's rebalance waits for its members). If the home
died or was cut off, a record in flight there goes out again to some member: at least once,
with duplicates, never lost. A planned hand-over (the balancer, an operator's transfer, a
node leaving) waits first for what the home handed out to be done and commits the positions
then (:meth:`ClusterGroupPeers._before_transfer`): nothing goes out twice. A node
whose link to the home closes joins it again when the link is back; the home gives what the
members of a node it lost the link to had outstanding to the other members, as a worker's
death does on one node (and so for a worker of a node that dies, as its node reports), and
asks that node to join again once its link to it is back.

Each node checks every :data:`CHECK_SECONDS` whether the leader changed (and on a JOIN,
LEAVE or DONE it receives: it may learn its own election just before its members do), and
whether its links are up; a link that closes is acted on at once (frames may have been lost
on it even if it is open again by the next check); whenever it joins a home again, the
node's other workers are told to as well. Called only from the worker's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson

from broker.cluster.node import ClusterNode
from broker.cluster.placement import node_id_of
from broker.cluster.raft import NotLeader
from broker.router.state import SESSIONS
from broker.workers.cluster_group_frames import REJOIN, ClusterGroupFrames, node_of
from broker.workers.mesh import owner_of
from broker.workers.remote_partition import RemotePartition

if TYPE_CHECKING:
    from broker.router.router import Router
    from broker.workers.runtime import WorkerRuntime

log = logging.getLogger("broker.cluster")

#: Seconds between two checks of the home (the ``$sessions`` leader) and of the links to it
#: or to its members' nodes.
CHECK_SECONDS = 0.25
#: Seconds a planned hand-over of the groups waits at most for what the home handed out to
#: be done (a member that does not acknowledge gets it again from the next home).
HANDOVER_SECONDS = 2.0
#: Seconds between two looks at whether it is.
DRAIN_SECONDS = 0.01
#: Seconds a new home hands out nothing while the members on every node join it: each node
#: notices the move at its next check, and its JOINs take a link's round trip; the first
#: members to join would otherwise take every record up to their windows, the others none.
GATHER_SECONDS = 2 * CHECK_SECONDS
#: The admin action of a worker that tells it to join the groups' home again.
REJOIN_ACTION = "rejoin_groups"


class ClusterGroupPeers(ClusterGroupFrames):
    """:class:`~broker.router.hooks.GroupPeers` of a cluster node's worker hosting
    ``$sessions`` (broker.workers.cluster_group_frames). ``states``: every group's latest
    positions record as applied here (never replaced). See the module docstring;
    :meth:`start` once the node serves."""

    def __init__(self, node: ClusterNode, states: Mapping[str, bytes]) -> None:
        super().__init__(node)
        self.states = states
        #: ``$sessions``' Raft group, if this worker hosts it (set by :meth:`start`).
        self.sessions_group: int | None = None
        #: The ``$sessions`` term of :attr:`home_node`'s office as the home.
        self.home_term: int | None = None
        self.home_up = True
        self.node.handlers[REJOIN] = self._on_rejoin
        #: At the home: nodes whose members it let go for want of a link (:data:`REJOIN`).
        self.let_go: set[int] = set()
        #: A planned hand-over in preparation: the node ``$sessions`` goes to, and until when
        #: it waits for the records handed out (:meth:`_before_transfer`).
        self.handing_over: tuple[int, float] | None = None
        #: Prepared: the next transfer goes ahead. ``frozen``: the groups hand out nothing.
        self.handover_ready = False
        self.frozen = False

    # ------------------------------------------------------------ the checks

    def start(self, router: Router) -> None:
        """The node serves: hold the groups if it leads ``$sessions``, and check from now on."""
        self.router = router
        keys = self.node.group_keys.items()
        self.sessions_group = next((g for g, key in keys if key == SESSIONS), None)
        # A link that closes may have lost frames (a DONE, a DELIVER) even if it is open
        # again by the next check: told at once, beside the gossip's probe (formation).
        transport = self.node.transport
        gossip = transport.on_link_lost

        def link_lost(name: str) -> None:
            gossip(name)
            self._link_lost(node_id_of(name))

        transport.on_link_lost = link_lost
        if self.sessions_group is not None and self.node.host is not None:
            self.node.host.before_transfer[self.sessions_group] = self._before_transfer
        self._tick()

    def _tick(self) -> None:
        if self.node.transport.closed:
            return  # the node is stopping
        self.check()
        self.node.loop.call_later(CHECK_SECONDS, self._tick)

    def check(self) -> None:
        """Follow the ``$sessions`` leader, and the links to the nodes the groups involve."""
        router, g = self.router, self.sessions_group
        if router is None or g is None:
            return
        leader, term = self._sessions_leader(g, router)
        me = leader == self.node.id
        if not me:
            self.early.clear()
        # A home is a leader in a term: the same node leading again in a later term (its
        # worker restarted faster than an election, or it won back the office) holds the
        # groups anew, from their committed positions, and every member joins it again.
        moved = leader is not None and (leader, term) != (self.home_node, self.home_term)
        if me and moved and not self._ready(g):
            return  # the home it follows until then may still answer
        if leader is not None and moved:
            self.home_node, self.home_term = leader, term
            self.home_up = True
            self.let_go.clear()
            log.info(
                "cluster: shared groups: held by node %s from now on (term %d)%s",
                self.node.names.get(leader, leader),
                term,
                " (here)" if me else "",
            )
            self.frozen, self.handing_over = False, None  # the groups it froze are dropped
            router.rehome_groups(self._persisted() if me else None, me)
            self.rejoin_workers()  # the node's other workers' members join it too
            self.handle_early()
            if me:
                self.node.loop.call_later(GATHER_SECONDS, self._gathered, term)
        elif self.home_node == self.node.id:
            transferring = self.handing_over or self.node.core(g).transferee is not None
            if self.frozen and me and not transferring:
                self._thaw()  # the hand-over failed: this node leads still
            self._members_lost()
        elif self.home_node is not None:
            name = self.node.names.get(self.home_node, "")
            up = self.node.transport.connected(name)
            if up and not self.home_up:
                log.info("cluster: shared groups: the link to node %s is back: joining again", name)
                router.rejoin_groups(self.home_node)
                self.rejoin_workers()
            self.home_up = up

    def _gathered(self, term: int | None) -> None:
        """The members of the groups held here since ``term`` had time to join: records go
        out (unless a planned hand-over froze them meanwhile, or the office ended)."""
        here = (self.home_node, self.home_term) == (self.node.id, term)
        if here and not self.frozen and self.router is not None:
            self.router.freeze_groups(False)

    def _sessions_leader(self, g: int, router: Router) -> tuple[int | None, int | None]:
        """``$sessions``' (group ``g``) leader and its term as this node knows them (None,
        None: no leader known). A node holding no replica of it (one that joined the cluster
        and is not added to it yet, broker.cluster.reshape) reads it remotely: each answer
        of a replica names the leader and its term (broker.cluster.fetch), and its members
        follow that home as anyone's do."""
        if g in self.node.storages:
            leader = self.node.leader(g)
            return leader, self.node.core(g).term if leader is not None else None
        part = router.partitions.get(SESSIONS)
        if not isinstance(part, RemotePartition) or part.leader_hint is None:
            return None, None
        return (
            (part.leader_hint, part.leader_term) if part.leader_term is not None else (None, None)
        )

    def _ready(self, g: int) -> bool:
        """Whether this leader of ``$sessions`` (group ``g``) applied every group position
        committed before its term: it holds them all (Raft s5.4.1), but learns which are
        committed only once an entry of its own term is (s5.4.2); applied here with the
        commit (broker.workers.replicated). A group it did not find would start at the end
        of its partitions, after records published since its members' SUBACKs."""
        core = self.node.core(g)
        return core.terms.term_at(core.commit) == core.term

    def _persisted(self) -> dict[str, dict[str, Any]]:
        """Every group's state as committed in ``$sessions`` and applied here."""
        return {full: orjson.loads(state) for full, state in self.states.items()}

    def _link_lost(self, node: int) -> None:
        """A link to or from ``node`` closed."""
        if self.home_node == self.node.id:
            self._let_go(node)
        elif node == self.home_node:
            self.home_up = False  # join again once a link is up

    def _members_lost(self) -> None:
        """At the home: members on a node it has no link to leave their groups; those let
        go are asked to join again once the link is back (:data:`REJOIN`)."""
        connected = self.node.transport.connected
        names = self.node.names
        for node in [n for n in self.let_go if connected(names.get(n, ""))]:
            self.let_go.discard(node)
            self.node.send(node, REJOIN, b"")
        nodes = {node_of(member) for member in self._members()}
        nodes.discard(self.node.id)  # the other workers here: the mesh reports a death (LEFT)
        for node in nodes:
            if not connected(names.get(node, "")):
                self._let_go(node)

    def _let_go(self, node: int) -> None:
        """At the home: ``node``'s members leave their groups (the link to it is or was
        down), and what they had outstanding goes to the others."""
        router = self.router
        members = {member for member in self._members() if node_of(member) == node}
        if router is None or node == self.node.id or not members:
            return
        log.warning(
            "cluster: shared groups: the link to node %s was lost: its members leave, what "
            "they had outstanding goes to the others",
            self.node.names.get(node, node),
        )
        for member in members:
            router.worker_left(member)
        self.let_go.add(node)

    def _members(self) -> set[int]:
        """The addresses of the members of the groups held here on other workers."""
        router = self.router
        groups = router.groups.values() if router is not None else ()
        return {m.worker for group in groups for ms in group.remote.values() for m in ms}

    def _on_rejoin(self, frm: int, body: memoryview) -> None:
        if self.router is not None and frm == self.home_node:
            log.info("cluster: shared groups: node %s asks to join again", self.node.names[frm])
            self.router.rejoin_groups(frm)
            self.rejoin_workers()

    # ------------------------------------------------------------ a planned hand-over

    def _before_transfer(self, to: int) -> bool:
        """``$sessions``' leadership is to go to node ``to`` (the balancer, an operator's
        transfer, this node leaving): its groups first stop handing out records, wait for
        those handed out to be done (at most :data:`HANDOVER_SECONDS`) and store their
        positions, then this asks for the transfer again; the next home, starting from
        them, sends nothing twice (an unplanned change sends again what was in flight)."""
        router = self.router
        if self.handover_ready:
            self.handover_ready = False
            return True
        if router is None or self.home_node != self.node.id or not router.groups:
            return True
        if self.handing_over is None:
            log.info(
                "cluster: shared groups: handing them to node %s once what was sent is done",
                self.node.names.get(to, to),
            )
            self.handing_over = (to, self.node.loop.time() + HANDOVER_SECONDS)
            self.frozen = True
            router.freeze_groups(True)
            self._drain()
        return False

    def _drain(self) -> None:
        router, handing_over = self.router, self.handing_over
        if router is None or handing_over is None:
            return
        if not router.groups_drained() and self.node.loop.time() < handing_over[1]:
            self.node.loop.call_later(DRAIN_SECONDS, self._drain)
            return
        router.store_groups(self._stored)

    def _stored(self, stored: bool) -> None:
        """The positions of the groups are in ``$sessions`` (or not): hand over."""
        handing_over, self.handing_over = self.handing_over, None
        g = self.sessions_group
        if not stored or handing_over is None or g is None or not self.node.is_leader(g):
            self._thaw()
            return
        self.handover_ready = True
        try:
            self.node.transfer_leadership(g, handing_over[0])
        except (NotLeader, ValueError) as e:
            log.warning("cluster: shared groups: the hand-over failed: %s", e)
            self.handover_ready = False
            self._thaw()

    def _thaw(self) -> None:
        self.frozen = False
        if self.router is not None:
            self.router.freeze_groups(False)


def share_across_workers(runtime: WorkerRuntime, peers: ClusterGroupPeers) -> None:
    """Several workers on a cluster node: the shared groups are the cluster's. The worker
    hosting ``$sessions`` (``peers`` is its own) reaches the home for the node and relays
    the other workers' frames (broker.workers.cluster_group_frames); the others see it as
    every group's home, and join again when it says so. No worker loads a group at start:
    the home holds them from their committed positions."""
    sessions_worker = owner_of(SESSIONS, runtime.count)
    runtime.groups_here = False
    mesh = runtime.mesh
    if runtime.index == sessions_worker:
        runtime.shared_groups = peers
        peers.join_workers(
            runtime.index, runtime.groups, lambda: runtime.tell_all(REJOIN_ACTION, None)
        )
        peer_down = mesh.on_peer_down

        def worker_down(worker: int) -> None:
            if peer_down is not None:
                peer_down(worker)
            peers.worker_down(worker)

        mesh.on_peer_down = worker_down
        return
    runtime.groups.home_of = lambda group: sessions_worker

    def rejoin(argument: object) -> None:
        if runtime.router is not None:
            runtime.router.rejoin_groups(sessions_worker)

    runtime.actions[REJOIN_ACTION] = rejoin
