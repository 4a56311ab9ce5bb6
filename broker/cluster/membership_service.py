"""The node's gossip membership: the SWIM + Lifeguard endpoint (``broker.cluster.gossip``) on
``bind:gossip_port`` (UDP), what the members announce of themselves
(``broker.cluster.nodemeta``), the views and counters it exports, and the allowlist.

**Which process gossips.** Worker 0 of each node, alone. The supervisor (several workers)
runs no event loop and no thread so that its forks stay clean, and a single-worker node has
no supervisor at all; worker 0 exists in both shapes and already hosts what is held once per
node (the metadata group, ``broker.cluster.metadata_group``, and the HTTP API). One gossip
member per node means one UDP port and one incarnation per node; the other workers read the
member list worker 0 writes (``DATA/cluster/members``, ``broker.cluster.node``). What gossip
then says of a node is what its worker 0 does: a worker 0 that crashes is restarted by the
supervisor within a fraction of a second, well within the suspicion timeout, and comes back
at a higher incarnation (it hears its earlier record and refutes past it).

**Formation.** A node joins through its seeds (gossip addresses; host names resolved here,
again every :data:`RESOLVE_SECONDS` while a seed is unknown). A new cluster forms once every
seed is a live member with valid metadata (:meth:`MembershipService.formed`), as the static
member list did; the node then persists the member list, so that a restart forms at once.

**The allowlist** (:meth:`MembershipService.subscribe`): the hosts that may send gossip and
Raft traffic to this node: every alive or suspect member's, every member's declared dead (or
that left: ``mqlog cluster leave``, a drain for maintenance) less than ``[cluster]
replace_after`` ago, and the seeds' (a seed answers a join before it is a member; without it
a filter would drop the answer). Such a member stays on it that long because the filter in
front of the codec (broker/xdp/) would otherwise drop the ALIVE with which it refutes a false
death or comes back after a restart, and it could not rejoin unless it is a seed; past
``replace_after`` its replicas are re-created elsewhere (issue 21) and it is a stranger until
it joins again through a seed (or from a ``[cluster] join_from`` network, which the filter
lets through to the MAC check: how a node added after formation joins). Observers (the XDP
filter, ``broker/xdp/``) are called with the whole set at once and again on every change. The
same set applies in user space here (the endpoint's ``accept``): an authenticated datagram
from any other host is dropped and counted as ``dropped_stranger`` unless it is a state
exchange (``Sync``: a join, or the anti-entropy that lets a member wrongly declared dead
refute) or carries its sender's own ALIVE (a refutation, a restarted member coming back).

Raft's timeouts are independent of all this: gossip decides who is a member, never an
election (issue 21, item 6). Runs on the event loop of worker 0; not thread-safe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from broker.cluster.gossip.endpoint import GossipEndpoint, open_endpoint
from broker.cluster.gossip.members import Member
from broker.cluster.gossip.messages import Addr, Changed, Packet, State, Sync
from broker.cluster.nodemeta import MetaError, NodeMeta
from broker.cluster.nodesettings import GossipSettings

__all__ = ["MembershipService"]

logger = logging.getLogger("broker.cluster.gossip")

#: Seconds between two resolutions of the seeds' host names while one is unknown.
RESOLVE_SECONDS = 5.0
LIVE = (State.ALIVE, State.SUSPECT)
#: The counters always in :meth:`MembershipService.stats` (0 until counted).
COUNTERS = (
    "probes",
    "probe_failures",
    "indirect_probes",
    "acks",
    "suspect",
    "suspicions_refuted",
    "refuted",
    "probe_hints",
    "dead",
    "left",
    "gossip_rounds",
    "sent",
    "received",
    "dropped_bad_magic",
    "dropped_bad_version",
    "dropped_bad_mac",
    "dropped_malformed",
    "dropped_replayed",
    "dropped_stranger",
    "errors",
    "bad_meta",
)

Allowlist = frozenset[str]


class GossipFilter(Protocol):
    """What the membership needs of the cluster interface's filter (broker.xdp): a predicate
    on each datagram before the codec, and an allowlist to keep."""

    @property
    def members(self) -> frozenset[str]: ...
    def accept(self, host: str, data: bytes) -> bool: ...
    def set_members(self, addrs: Iterable[str]) -> None: ...


class MembershipService:
    """See the module docstring. ``name``: this node's id; ``settings``: where to gossip and
    what to announce; ``secret``: the cluster secret (the datagrams' HMAC key)."""

    def __init__(self, name: str, settings: GossipSettings, secret: bytes) -> None:
        self.name = name
        self.settings = settings
        self._secret = secret
        #: What this node announces of itself now (:meth:`announce` changes it).
        self.meta = settings.meta
        self.endpoint: GossipEndpoint | None = None
        #: Decoded metadata of the members that announced a valid one.
        self.metas: dict[str, NodeMeta] = {}
        #: Members whose metadata was refused, with why (logged once per announcement).
        self.bad_meta: dict[str, str] = {}
        #: Each seed as configured -> its IP address (resolved at start, and the missing ones
        #: again while formation waits).
        self._resolved: dict[Addr, Addr] = {}
        self.counters: Counter[str] = Counter()
        #: Called with (member, its Raft address) when a member is first heard of with valid
        #: metadata or announces another address (the node's transport dials it).
        self.on_member: Callable[[str, tuple[str, int]], None] = lambda name, addr: None
        self._observers: list[Callable[[Allowlist], None]] = []
        self._allowed: Allowlist = frozenset()
        self._changed = asyncio.Event()
        #: The Raft address last passed to :attr:`on_member`, per member.
        self._told: dict[str, tuple[str, int]] = {}
        #: Sees each datagram before the codec (:meth:`guard`).
        self.prefilter: Callable[[str, bytes], bool] | None = None

    # -- life --------------------------------------------------------------------------------

    async def start(self, known: Iterable[Addr] = ()) -> None:
        """Bind the gossip port and join through the seeds and ``known`` (gossip addresses
        of the members a restart remembers)."""
        s = self.settings
        self.endpoint = await open_endpoint(
            self.name,
            s.bind,
            self._secret,
            s.swim,
            on_change=self._on_change,
            meta=self.meta.encode(),
            accept=self._accept,
            prefilter=self.prefilter,
        )
        await self._resolve()
        joined = list(dict.fromkeys([*self.seeds, *known]))
        self.endpoint.join(joined)
        self._publish()

    @property
    def seeds(self) -> list[Addr]:
        """The seeds resolved so far, as IP addresses."""
        return list(self._resolved.values())

    async def _resolve(self) -> None:
        """Resolve the seeds not resolved yet (a host name that does not resolve now is
        logged and left for the next try)."""
        loop = asyncio.get_running_loop()
        for host, port in self.settings.seeds:
            if (host, port) in self._resolved:
                continue
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
            except OSError as e:
                logger.warning("gossip: seed %s:%d does not resolve: %s", host, port, e)
                continue
            self._resolved[host, port] = (str(infos[0][4][0]), port)

    async def formed(self, log_every: float) -> dict[str, tuple[str, int]]:
        """Wait until every seed is a live member with valid metadata (logging which are
        missing every ``log_every`` seconds, re-resolving host names), then return every
        live member's Raft address by name, this node's included."""
        while True:
            missing = self.missing_seeds()
            if not missing:
                return self.raft_addresses()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), log_every)
            except TimeoutError:
                logger.info(
                    "cluster: waiting for seeds %s (gossip)", ", ".join(_addr(a) for a in missing)
                )
                if len(self._resolved) < len(self.settings.seeds):
                    await self._resolve()
                    assert self.endpoint is not None
                    self.endpoint.join(self.seeds)
                    self._publish()

    def missing_seeds(self) -> list[Addr]:
        """The seeds (as configured) not resolved yet, or from whose address no live member
        with valid metadata gossips."""
        live = {
            m.addr
            for m in self.core_members()
            if m.state in LIVE and (m.node in self.metas or m.node == self.name)
        }
        return [seed for seed in self.settings.seeds if self._resolved.get(seed) not in live]

    def raft_addresses(self) -> dict[str, tuple[str, int]]:
        """Every live member's Raft address (its gossip host, its announced ``raft_port``)."""
        out = {}
        for m in self.core_members():
            meta = self.meta if m.node == self.name else self.metas.get(m.node)
            if m.state in LIVE and meta is not None:
                out[m.node] = (m.addr[0], meta.raft_port)
        return out

    def announce(self, **changes: Any) -> None:
        """Announce this node's metadata with ``changes`` (``NodeMeta`` fields: ``cluster``
        once formed, ``leaving`` when draining) from now on."""
        self.meta = dataclasses.replace(self.meta, **changes)
        if self.endpoint is not None:
            self.endpoint.announce(self.meta.encode())

    def cluster_ids(self) -> dict[str, str]:
        """Live member -> the id of the member list it formed with, for those that did."""
        return {
            m.node: meta.cluster
            for m in self.core_members()
            if m.state in LIVE and (meta := self.metas.get(m.node)) is not None and meta.cluster
        }

    def leaving(self) -> set[str]:
        """The members that announce they are leaving (``mqlog cluster leave``)."""
        return {n for n, meta in self.metas.items() if meta.leaving}

    def gossip_addresses(self) -> dict[str, Addr]:
        """Every member's gossip address (to persist: a restart joins through them too)."""
        return {m.node: m.addr for m in self.core_members() if m.node != self.name}

    def probe_soon(self, node: str) -> None:
        """The node's Raft link to ``node`` closed: probe it next (``Swim.probe_soon``; a
        hint that brings a probe forward, never a suspicion by itself)."""
        if self.endpoint is not None:
            self.endpoint.probe_soon(node)

    async def leave(self, timeout: float) -> None:
        """Say goodbye (``mqlog cluster leave``): the others mark this member left, not
        dead, once it has been gossiped (or ``timeout`` s), then stop gossiping."""
        if self.endpoint is not None:
            await self.endpoint.leave(timeout)

    def close(self) -> None:
        """Stop gossiping, without a goodbye: a stopped node is a failed one to the others
        until it comes back (:meth:`leave` says goodbye first)."""
        if self.endpoint is not None:
            self.endpoint.close()

    # -- the allowlist -----------------------------------------------------------------------

    def guard(self, gate: GossipFilter) -> None:
        """Before :meth:`start`: ``gate`` (broker.xdp's filter, in the kernel or its user-space
        twin) sees every datagram before the codec, and keeps this allowlist together with
        what it allowed at start (this node, the configured seeds), so a seed not yet a
        member can answer a join."""
        self.prefilter = gate.accept
        base = gate.members

        def keep(allowed: Allowlist) -> None:
            gate.set_members(a for a in allowed | base if _is_ip(a))

        self.subscribe(keep)

    def subscribe(self, observer: Callable[[Allowlist], None]) -> None:
        """Call ``observer`` with the allowlist now and after every change (module doc)."""
        self._observers.append(observer)
        observer(self._allowed)

    @property
    def allowlist(self) -> Allowlist:
        return self._allowed

    def _publish(self) -> None:
        now_ms = asyncio.get_running_loop().time() * 1000
        hosts = {m.addr[0] for m in self.core_members() if self._allowed_member(m, now_ms)}
        hosts.update(a[0] for a in self.seeds)
        allowed = frozenset(hosts)
        if allowed == self._allowed:
            return
        self._allowed = allowed
        for observer in self._observers:
            try:
                observer(allowed)
            except Exception:
                logger.exception("gossip: allowlist observer %r failed", observer)

    def _allowed_member(self, m: Member, now_ms: float) -> bool:
        if m.state in LIVE:
            return True
        # Dead, or left (``mqlog cluster leave`` for maintenance): for replace_after.
        return now_ms - m.since < self.settings.replace_after * 1000

    def _accept(self, addr: Addr, packet: Packet) -> bool:
        if addr[0] in self._allowed or isinstance(packet.message, Sync):
            return True
        return any(u.node == packet.sender and u.state is State.ALIVE for u in packet.updates)

    # -- changes -----------------------------------------------------------------------------

    def _on_change(self, change: Changed) -> None:
        """The endpoint logged the change; here the metadata is decoded, the transport told
        of a new Raft address, the allowlist and the formation waiters updated."""
        if change.state is State.ALIVE:
            self._learn_meta(change)
        elif change.state in (State.DEAD, State.LEFT):
            # Off the allowlist once dead or left for replace_after (the module doc's).
            asyncio.get_running_loop().call_later(self.settings.replace_after + 0.05, self._publish)
        self._publish()
        self._changed.set()

    def _learn_meta(self, change: Changed) -> None:
        try:
            meta = NodeMeta.decode(change.meta)
        except MetaError as e:
            self.counters["bad_meta"] += 1
            self.bad_meta[change.node] = str(e)
            logger.error("gossip: member %s announced bad metadata, ignored: %s", change.node, e)
            return
        self.bad_meta.pop(change.node, None)
        ours = self.settings.meta
        if meta.workers != ours.workers:
            logger.error(
                "gossip: member %s runs %d workers, this node %d: every node needs the same "
                "router.workers (their Raft links are refused)",
                change.node,
                meta.workers,
                ours.workers,
            )
        self.metas[change.node] = meta
        raft = (change.addr[0], meta.raft_port)
        if self._told.get(change.node) != raft:
            self._told[change.node] = raft
            self.on_member(change.node, raft)

    # -- views -------------------------------------------------------------------------------

    def core_members(self) -> list[Member]:
        return list(self.endpoint.core.members.values()) if self.endpoint is not None else []

    def view(self) -> list[dict[str, Any]]:
        """The members for ``GET /api/v1/cluster`` (``members``): state and incarnation as
        gossip has them here, and what each announced."""
        out = []
        for m in sorted(self.core_members(), key=lambda m: m.node):
            meta = self.meta if m.node == self.name else self.metas.get(m.node)
            out.append(
                {
                    "id": m.node,
                    "gossip": _addr(m.addr),
                    "state": m.state.name.lower(),
                    "incarnation": m.incarnation,
                    "self": m.node == self.name,
                    "raft": _addr((m.addr[0], meta.raft_port)) if meta else None,
                    "workers": meta.workers if meta else None,
                    "mqtt": meta.mqtt if meta else "",
                    "http": meta.http if meta else "",
                }
            )
        return out

    def stats(self) -> dict[str, int]:
        """The counters for metrics (``mqlog_gossip_*``): the core's protocol counters and the
        endpoint's datagram counters (drops by reason)."""
        zeros = dict.fromkeys(COUNTERS, 0)
        if self.endpoint is None:
            return {**zeros, **self.counters}
        ep = self.endpoint
        return {
            **zeros,
            **self.counters,
            **ep.core.stats,
            **ep.counters,
            "health": ep.core.health.score,
            "incarnation": ep.core.incarnation,
        }


def _addr(a: tuple[str, int]) -> str:
    host, port = a
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
