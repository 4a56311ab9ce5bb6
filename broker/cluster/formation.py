"""How a node learns its members at start: the persisted member list, gossip, and the other
workers' wait for worker 0.

The member list (``DATA/cluster/members``: ``{"members": {name: [host, raft_port]}, "gossip":
{name: [host, gossip_port]}, "founders": [name], "joined": bool}``) is written once the
cluster formed, so that a restart forms at once, with members down (Raft's groups then decide
who leads), and again when a member joins later (so that a restart counts it in placement
even while it is down). Its ``gossip`` part (absent in lists written before gossip) is where
a restarted node looks for members besides its seeds; ``founders`` (absent before joins: the
members) are the nodes the cluster formed with, whose placement was each group's first
configuration.

**Forming or joining.** A node that starts with no member list waits for its seeds as below;
then, if a live member announces that it formed with another member list
(``NodeMeta.cluster``, :func:`~broker.cluster.nodemeta.cluster_id`), this node *joins* that
cluster (issue 21): it hosts no group by placement's guess, only those whose leader adds it
(``broker.cluster.reshape``), and says so in its list (``joined``), so that a restart does
the same. The members that formed together announce the same id, so that one of them
forming a moment after another does not take it for a join. Members heard of after
formation are dialled as they are announced (:attr:`Formation` ``on_new``: the node adds them
to its Raft transport and placement).

With gossip (the broker's way, ``NodeSettings.gossip``):

- worker 0 runs the membership (``broker.cluster.membership_service``, whose docstring says why
  worker 0): a new cluster forms once every seed is a live member with valid metadata
  (:meth:`MembershipService.formed`); the Raft transport then dials each member at the Raft
  address its metadata gave, and later at any new one gossip announces;
- worker ``i`` > 0 waits until worker 0 wrote the member list, then dials each member's
  ``raft_port + i``: one gossip member per node, one list for all its workers; members heard
  of later come from what worker 0 tells it (``broker.cluster.worker_view``).

Without (``NodeSettings.gossip`` None, the node's unit tests): ``seeds`` are the other
members' Raft addresses and the cluster forms once every seed authenticated through the
transport (``broker.cluster.peers``), each worker keeping its own list.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import orjson

from broker.cluster.hardstate import write_atomically
from broker.cluster.membership_service import MembershipService
from broker.cluster.nodemeta import cluster_id
from broker.cluster.nodesettings import NodeSettings
from broker.cluster.peers import PeerTransport

logger = logging.getLogger("broker.cluster")

Members = dict[str, tuple[str, int]]

#: Seconds between two looks for worker 0's member list (workers 1 and up).
POLL_SECONDS = 0.2


class Formation(NamedTuple):
    """What a node formed with: its members' Raft addresses by name (this node's included),
    whether it joined a cluster formed before it, and the founders (the module docstring)."""

    members: Members
    joined: bool
    founders: list[str]


class Known(NamedTuple):
    """A persisted member list."""

    members: Members
    gossip: Members
    joined: bool
    founders: list[str]


def load_members(path: Path) -> Known | None:
    """The persisted member list, or None before formation."""
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None

    def addrs(table: dict[str, list[object]]) -> Members:
        return {name: (str(a[0]), int(str(a[1]))) for name, a in table.items()}

    members = addrs(data["members"])
    founders = [str(n) for n in data.get("founders", members)]
    return Known(members, addrs(data.get("gossip", {})), bool(data.get("joined")), founders)


def save_members(
    path: Path,
    members: Members,
    gossip: Members | None = None,
    joined: bool = False,
    founders: list[str] | None = None,
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body: dict[str, object] = {"members": {n: list(a) for n, a in sorted(members.items())}}
    if gossip:
        body["gossip"] = {n: list(a) for n, a in sorted(gossip.items())}
    if founders is not None and set(founders) != set(members):
        body["founders"] = sorted(founders)
    if joined:
        body["joined"] = True
    write_atomically(path, orjson.dumps(body))


async def by_gossip(
    s: NodeSettings,
    state_dir: Path,
    transport: PeerTransport,
    membership: MembershipService | None,
    log_every: float,
    on_new: Callable[[str], None] = lambda name: None,
) -> Formation:
    """The members (this worker's Raft address of each, this node's included) once formed;
    ``transport`` (started) dials each one. ``membership``: worker 0's, None for the others
    (module docstring); ``on_new``: called with each member heard of after formation, once
    the transport dials it."""
    assert s.gossip is not None
    index = s.worker[0]
    shared = state_dir / "members"  # worker 0's, read by all
    joined = False
    if membership is not None:
        known = load_members(shared)
        await membership.start(known.gossip.values() if known else ())
        if known is None:
            logger.info(
                "cluster: forming with gossip seeds %s",
                ", ".join(f"{h}:{p}" for h, p in s.gossip.seeds) or "none",
            )
            members = await membership.formed(log_every)
            joined, founders = _joins(membership, members), sorted(members)
            save_members(shared, members, membership.gossip_addresses(), joined)
        else:
            members, joined, founders = known.members, known.joined, known.founders
        membership.announce(cluster=cluster_id(founders))
        formed = dict(members)

        def learned(name: str, addr: tuple[str, int]) -> None:
            meta = membership.metas.get(name)
            if name not in formed and meta is not None and meta.workers != s.worker[1]:
                return  # refused (another worker count, logged by the membership)
            transport.learn(name, addr)
            if formed.get(name) != addr:
                new = name not in formed
                formed[name] = addr
                save_members(shared, formed, membership.gossip_addresses(), joined, founders)
                if new:
                    on_new(name)

        membership.on_member = learned
        transport.on_link_lost = membership.probe_soon
    else:
        waited = 0.0
        while (known := load_members(shared)) is None:
            await asyncio.sleep(POLL_SECONDS)
            waited += POLL_SECONDS
            if waited >= log_every:
                waited = 0.0
                logger.info("cluster: worker %d waiting for worker 0's member list", index)
        members, joined, founders = known.members, known.joined, known.founders
    mine = {name: (host, port + index) for name, (host, port) in members.items()}
    for name, addr in mine.items():
        transport.learn(name, addr)
    return Formation(mine, joined, founders)


def _joins(membership: MembershipService, members: Members) -> bool:
    """Whether this node, which just formed with ``members``, joins a cluster that formed
    before it: a live member announces another member list's id (the module docstring)."""
    mine = cluster_id(members)
    others = {n: c for n, c in membership.cluster_ids().items() if c != mine}
    if others:
        logger.info(
            "cluster: joining the cluster of %s (formed before this node): replicas come as "
            "their leaders add this node",
            ", ".join(sorted(others)),
        )
    return bool(others)
