"""How a node learns its members at start: the persisted member list, gossip, and the other
workers' wait for worker 0.

The member list (``DATA/cluster/members``: ``{"members": {name: [host, raft_port]}, "gossip":
{name: [host, gossip_port]}}``) is written once the cluster formed, so that a restart forms at
once, with members down (Raft's groups then decide who leads). Its ``gossip`` part (absent in
lists written before gossip) is where a restarted node looks for members besides its seeds.

With gossip (the broker's way, ``NodeSettings.gossip``):

- worker 0 runs the membership (``broker.cluster.membership_service``, whose docstring says why
  worker 0): a new cluster forms once every seed is a live member with valid metadata
  (:meth:`MembershipService.formed`); the Raft transport then dials each member at the Raft
  address its metadata gave, and later at any new one gossip announces;
- worker ``i`` > 0 waits until worker 0 wrote the member list, then dials each member's
  ``raft_port + i``: one gossip member per node, one list for all its workers.

Without (``NodeSettings.gossip`` None, the node's unit tests): ``seeds`` are the other
members' Raft addresses and the cluster forms once every seed authenticated through the
transport (``broker.cluster.peers``), each worker keeping its own list.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import orjson

from broker.cluster.hardstate import write_atomically
from broker.cluster.membership_service import MembershipService
from broker.cluster.nodesettings import NodeSettings
from broker.cluster.peers import PeerTransport

logger = logging.getLogger("broker.cluster")

Members = dict[str, tuple[str, int]]

#: Seconds between two looks for worker 0's member list (workers 1 and up).
POLL_SECONDS = 0.2


def load_members(path: Path) -> tuple[Members, Members] | None:
    """The persisted (Raft addresses, gossip addresses) by name, or None before formation."""
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None

    def addrs(table: dict[str, list[object]]) -> Members:
        return {name: (str(a[0]), int(str(a[1]))) for name, a in table.items()}

    return addrs(data["members"]), addrs(data.get("gossip", {}))


def save_members(path: Path, members: Members, gossip: Members | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body: dict[str, object] = {"members": {n: list(a) for n, a in sorted(members.items())}}
    if gossip:
        body["gossip"] = {n: list(a) for n, a in sorted(gossip.items())}
    write_atomically(path, orjson.dumps(body))


async def by_gossip(
    s: NodeSettings,
    state_dir: Path,
    transport: PeerTransport,
    membership: MembershipService | None,
    log_every: float,
) -> Members:
    """The members (this worker's Raft address of each, this node's included) once formed;
    ``transport`` (started) dials each one. ``membership``: worker 0's, None for the others
    (module docstring)."""
    assert s.gossip is not None
    index = s.worker[0]
    shared = state_dir / "members"  # worker 0's, read by all
    if membership is not None:
        known = load_members(shared)
        await membership.start(known[1].values() if known else ())
        if known is None:
            logger.info(
                "cluster: forming with gossip seeds %s",
                ", ".join(f"{h}:{p}" for h, p in s.gossip.seeds) or "none",
            )
            members = await membership.formed(log_every)
            save_members(shared, members, membership.gossip_addresses())
        else:
            members = known[0]
        formed = set(members)

        def learned(name: str, addr: tuple[str, int]) -> None:
            # Members of the formed cluster moving; joiners are a later step's (issue 21).
            if name in formed:
                transport.learn(name, addr)

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
        members = known[0]
    mine = {name: (host, port + index) for name, (host, port) in members.items()}
    for name, addr in mine.items():
        transport.learn(name, addr)
    return mine
