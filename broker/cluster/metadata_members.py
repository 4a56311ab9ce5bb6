"""The metadata group's members follow the cluster's: a node that joins after formation
becomes one, a node that leaves or is replaced stops being one (issue 21).

The metadata group (``broker.cluster.metadata_group``) starts with the nodes the cluster formed
with. pysyncobj changes its members one at a time (``dynamicMembershipChange``: a change takes
effect when its entry is appended and the leader proposes no other until it committed, the
single-server changes of the Raft thesis s4.1); this module decides which change, on the
group's leader, every :data:`PASS_SECONDS`, from what this node's gossip says
(:func:`next_change`):

- **add** a node that is alive in gossip, has a Raft address here (it passed the transport's
  checks: the secret, the worker count) and is not leaving: a node joined through
  ``ClusterNode.admit`` is one as soon as gossip announced it;
- **remove** a member that left (``mqlog cluster leave`` ends with it stopping: gossip says
  *left*) or that is dead or left for longer than ``[cluster] replace_after`` (the member
  reshape replaces). Additions go first, so that a replacement joins before the member it
  replaces goes, and the group never shrinks below what it was while a member is missing.

A node that joins starts its replica of the group with every member it knows as its peers
(:func:`first_peers`; pysyncobj accepts a connection only from a peer it knows, so it must
know the leader that will add it), and learns the group's real members from the group's own
log once added (pysyncobj applies each change entry on append). Until it is added its
proposals wait: the first start's check of its stream definitions completes once the leader
added it (within a pass of gossip announcing it). It does not campaign before it caught up
with a leader once (``MetadataGroup.open``'s ``quiet``), so its arrival costs the group no
election.

A node of an earlier release runs the group without dynamic membership: it ignores the change
entries, so its members would differ from the others'. Upgrade every node before a node
joins (a rolling restart; each keeps its members, :data:`~broker.cluster.metadata_group.MEMBERS`).
A peer a joiner starts with that is no member yet (another joiner, which the leader adds next)
makes the joiner's majorities one node larger until then: such a majority holds at least
ceil(n/2) of the n members even if that peer is in it, and so intersects every majority of
the members (ceil(n/2) + floor(n/2) + 1 > n), which is what Raft's safety rests on.

Gossip decides who should be a member; the group's log alone decides who is one: a stale view
of the members can delay a change or propose one pysyncobj refuses, and a change committed
is never undone by a node that did not hear of it.

The same pass carries a stream's replication factor changed in the metadata (``mqlog cluster
set-replication``, ``broker.cluster.metadata`` invariant 2) to the node
(:meth:`MetadataMembers.follow_replication`): each group of the stream gets the new factor
in ``ClusterNode.replication``, and ``broker.cluster.reshape``'s planner on each group's
leader adds a learner, promotes it once caught up, or removes a voter, one change at a time
per group, until the group has that many voters (capped at the members).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from broker.cluster.gossip.messages import State
from broker.cluster.membership_service import MembershipService
from broker.cluster.metadata import LocalStreams
from broker.cluster.metadata_group import MetadataGroup
from broker.cluster.nodesettings import NodeSettings
from broker.cluster.peers import PeerTransport

logger = logging.getLogger("broker.cluster")

#: Seconds between two passes (each proposes at most one change).
PASS_SECONDS = 1.0
#: Seconds a starting node waits for the metadata group to confirm its stream definitions
#: before it serves with them unconfirmed (a node cut off from the majority).
METADATA_WAIT_SECONDS = 10.0


class FactorsHost(Protocol):
    """What :func:`follow_factors` needs of a node (``broker.cluster.node.ClusterNode``)."""

    group_keys: dict[int, tuple[str, int]]  # group -> (stream, partition)
    replication: dict[int, int]  # group -> its replication factor, as reshape places it
    everywhere: set[int]  # groups on every node: no replication factor of their own


class MembersHost(Protocol):
    """What this module needs of its node (``broker.cluster.node.ClusterNode``, worker 0)."""

    name: str
    loop: Any
    settings: NodeSettings
    membership: MembershipService | None
    transport: PeerTransport  # its ``members``: each other member's Raft address
    founders: dict[int, str]
    joined: bool
    state_dir: Path
    local_streams: LocalStreams
    group_keys: dict[int, tuple[str, int]]  # group -> (stream, partition)
    replication: dict[int, int]  # group -> its replication factor, as reshape places it
    everywhere: set[int]  # groups on every node: no replication factor of their own


def first_peers(
    name: str, founders: Iterable[str], members: Iterable[str], joined: bool
) -> list[str]:
    """The peers a replica that saved no members starts with: the founders (the group's first
    members), or, on a node that joined, every member it knows (module docstring)."""
    return sorted(set(members if joined else founders) - {name})


def next_change(
    me: str,
    config: set[str],
    alive: set[str],
    leaving: set[str],
    left: set[str],
    gone: set[str],
) -> tuple[str, str] | None:
    """The next change of the group's members ``config`` (names) on its leader ``me``:
    ``("add", name)`` for an ``alive`` node outside it, not ``leaving``; else
    ``("remove", name)`` for a member that ``left`` or is ``gone`` (dead or left longer
    than ``replace_after``); else None. A leader never removes itself (pysyncobj refuses
    it; once it stops, the next leader does)."""
    for name in sorted(alive - config - leaving - left):
        return "add", name
    for name in sorted((config & (left | gone)) - {me}):
        return "remove", name
    return None


class MetadataMembers:
    """Runs the passes (module docstring) as a task of ``group``."""

    def __init__(self, host: MembersHost, group: MetadataGroup) -> None:
        self.host = host
        self.group = group

    async def run(self) -> None:
        while True:
            await asyncio.sleep(PASS_SECONDS)
            try:
                self.step()
            except Exception:  # a bug: logged, and the next pass tries again
                logger.exception("cluster: metadata: a members pass failed")

    def step(self) -> None:
        """One pass: name the members the node knows, place with the committed replication
        factors; on the leader, one change of the members if due."""
        addresses = {**self.host.transport.members, self.host.name: self.host.settings.bind}
        self.group.learn(addresses)
        if self.group.ready:
            self.follow_replication()
        membership = self.host.membership
        gossip = self.host.settings.gossip
        if membership is None or gossip is None:
            return  # no gossip (the node's unit tests): the members stay the founders
        if self.group.changing is not None or not self.group.leads():
            return
        now_ms = self.host.loop.time() * 1000
        limit_ms = gossip.replace_after * 1000
        alive, left, gone = set(), set(), set()
        for m in membership.core_members():
            if m.state is State.ALIVE and m.node in addresses:
                alive.add(m.node)
            if m.state is State.LEFT:
                left.add(m.node)
            if m.state in (State.DEAD, State.LEFT) and now_ms - m.since >= limit_ms:
                gone.add(m.node)
        change = next_change(
            self.host.name,
            set(self.group.member_names()),
            alive,
            membership.leaving(),
            left,
            gone,
        )
        if change is not None:
            logger.info("cluster: metadata: %s member %s (gossip: %s)", *change, _why(change, left))
            self.group.change(*change)

    def follow_replication(self) -> None:
        """Each hosted group's replication factor as the metadata has its stream's (once
        caught up with a leader: a stale local copy would undo a change): the leaders'
        reshape passes then add or remove replicas to match (module docstring)."""
        follow_factors(self.host, committed_factors(self.group))


def committed_factors(group: MetadataGroup) -> dict[str, int]:
    """Each stream's replication factor as the metadata group's replica has it."""
    with group.replica.lock:
        return {name: d.replication_factor for name, (d, _) in group.replica.state.streams.items()}


def follow_factors(host: FactorsHost, factors: Mapping[str, int]) -> None:
    """Each hosted group's replication factor as ``factors`` has its stream's (worker 0's
    :meth:`MetadataMembers.follow_replication`, or on another worker what worker 0 told,
    ``broker.cluster.worker_view``)."""
    moved: dict[str, tuple[int | None, int]] = {}
    for g, (stream, _) in host.group_keys.items():
        factor = factors.get(stream)
        if g in host.everywhere or factor is None or host.replication.get(g) == factor:
            continue
        moved.setdefault(stream, (host.replication.get(g), factor))
        host.replication[g] = factor
    for stream, (before, after) in moved.items():
        logger.info(
            "cluster: stream %s: replication factor %s -> %d (the cluster's): its "
            "partitions' leaders move replicas to match",
            stream,
            before,
            after,
        )


def _why(change: tuple[str, str], left: set[str]) -> str:
    if change[0] == "add":
        return "alive, not a member"
    return "left" if change[1] in left else "gone longer than replace_after"


async def open_metadata(host: MembersHost, members: Mapping[str, tuple[str, int]]) -> MetadataGroup:
    """Open worker 0's replica of the metadata group, agree on the stream definitions
    (``MetadataGroup.agree``) and start the passes. Raises ``MetadataError``."""
    s = host.settings
    peers = first_peers(s.name, host.founders.values(), members, host.joined)
    group = await MetadataGroup.open(
        s.name,
        members,
        s.secret,
        host.state_dir,
        s.election_timeout,
        s.heartbeat_interval,
        [s.name, *peers],
        quiet=host.joined,
    )
    group.spawn(MetadataMembers(host, group).run())
    try:
        await group.agree(host.local_streams, METADATA_WAIT_SECONDS)
    except BaseException:
        await group.close()
        raise
    return group
