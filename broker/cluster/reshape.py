"""A node's side of a cluster that changes shape: replicas of dead members re-created on live
nodes (issue 21 item 3), one single-server membership change at a time per group.

Each balance tick (:meth:`Reshaper.tick`, from ``ClusterNode``'s clock), for every group this
node leads, the replicas placement wants are computed over the members that are not gone
(``broker.cluster.placement.replicas``: the same rendezvous order as the first placement, so
a member's departure moves only the groups it held), where *gone* is dead or left for longer
than ``[cluster] replace_after`` as this node's gossip membership sees it
(``broker.cluster.membership_service``); :func:`~broker.cluster.reconfigure.next_step` then
names the next change (remove the dead voter, add a learner on the new node, promote it once
caught up) and the host proposes it. Gossip decides who is gone; Raft alone decides what a
group's configuration is: every change goes through the group's log, and a stale view of the
members can only delay a change or propose one the core refuses, never lose data.

A node that a leader replicates a group to that it does not host (it was added as a learner)
hosts it on the first such message (:meth:`Reshaper.join`, ``MultiRaft.on_unknown_group``):
the worker gives the group's storage and serves the partition from it from then on
(:attr:`Reshaper.on_join`, ``RemoteFetches.promote``); until its log brings the group's
configuration the core knows the leader as the only voter and itself as a learner, so it
never campaigns on a guess. At a restart the node hosts the groups whose log names it
(``RemoteFetches.place``).

Not in this step: joining nodes (a member learned after formation; ``MultiRaft.add_node``),
moving a leaving node's replicas, rebalancing, and a removed node giving its replica up (its
old core stays quiet: PreVote and stickiness keep it from disrupting the group).

Works with one worker per node (the gossip membership is worker 0's). Called from the node's
event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from broker.cluster.gossip.messages import State
from broker.cluster.membership import ChangeKind, ChangeRefused, Configuration
from broker.cluster.membership_service import MembershipService
from broker.cluster.multiraft import MultiRaft
from broker.cluster.nodesettings import NodeSettings
from broker.cluster.placement import node_id_of, replicas
from broker.cluster.raft import NotLeader, Role
from broker.cluster.reconfigure import next_step, take
from broker.cluster.storage import GroupStorage

logger = logging.getLogger("broker.cluster")

LIVE = (State.ALIVE, State.SUSPECT)


class ReshapeHost(Protocol):
    """What the reshaper needs of its node (``broker.cluster.node.ClusterNode``)."""

    id: int
    loop: Any  # its event loop: ``time()`` is the gossip membership's clock
    settings: NodeSettings
    host: MultiRaft | None
    membership: MembershipService | None
    names: dict[int, str]
    storages: dict[int, GroupStorage]
    replication: dict[int, int]

    def track(self, g: int, term: int) -> None: ...
    def label(self, g: int) -> str: ...
    def wake(self) -> None: ...


class Reshaper:
    """See the module docstring."""

    def __init__(self, node: ReshapeHost) -> None:
        self.node = node
        #: Set by the worker: the storage of a group it may host (its partition is read
        #: remotely now and will be served from this storage), or None.
        self.on_join: Callable[[int], GroupStorage | None] = lambda g: None
        self.changes = 0
        self.joined = 0

    def join(self, g: int, leader: int) -> None:
        """``leader`` replicates group ``g`` to this node, which does not host it."""
        node, host = self.node, self.node.host
        if host is None or g in node.storages:
            return
        storage = self.on_join(g)
        if storage is None:
            return
        membership = storage.membership(Configuration.of({leader}, {node.id}))
        core = host.add_group(
            g, [leader, node.id], storage, storage.hard_state, storage.terms.copy(), membership
        )
        node.storages[g] = storage
        node.track(g, core.term)
        self.joined += 1
        logger.info(
            "cluster: %s: joined as a replica (its leader %s added this node)",
            node.label(g),
            node.names.get(leader, leader),
        )

    def tick(self) -> None:
        """One planner pass over the groups this node leads (module docstring)."""
        node, host, membership = self.node, self.node.host, self.node.membership
        if host is None or membership is None or node.settings.gossip is None:
            return
        members = membership.core_members()
        if not members:
            return
        now_ms = node.loop.time() * 1000
        limit_ms = node.settings.gossip.replace_after * 1000
        gone = {
            node_id_of(m.node)
            for m in members
            if m.state not in LIVE and now_ms - m.since >= limit_ms
        }
        live = {node_id_of(m.node) for m in members if m.state in LIVE} | {node.id}
        if not gone and live >= set(node.names):
            return  # every member up: placement as formed (the balancer's)
        eligible = [n for n in node.names if n not in gone]
        for g in list(node.storages):
            core = host.core(g)
            if core.role is not Role.LEADER:
                continue
            rf = node.replication.get(g, node.settings.replication_factor)
            step = next_step(core, replicas(g, eligible, rf), live)
            if step is None:
                continue
            try:
                take(host, g, step)
            except (ChangeRefused, NotLeader, ValueError) as e:
                logger.info("cluster: %s: %s not taken now: %s", node.label(g), step, e)
                continue
            self.changes += 1
            what = "leadership to" if step.kind is None else _VERB[step.kind]
            logger.info(
                "cluster: %s: %s %s", node.label(g), what, node.names.get(step.node, step.node)
            )
        node.wake()


_VERB = {
    ChangeKind.ADD_LEARNER: "adding a learner on",
    ChangeKind.PROMOTE: "promoting",
    ChangeKind.REMOVE: "removing",
}
