"""The allowlist both filters share: which source addresses are cluster members.

The membership subsystem owns the truth (alive and suspect members stay allowed; a member
that left or was declared dead is removed) and calls :meth:`MemberFilter.set_members` with
the whole set on every change; :meth:`allow` and :meth:`deny` change one address. Addresses
are IP literals, kept normalized (``ipaddress``'s text form), so that ``"10.0.0.01"`` style
spellings never make two entries of one address.

Single-threaded: the event loop that owns the filter calls these (the kernel filter's map
updates are system calls that do not block).
"""

from __future__ import annotations

import ipaddress
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from broker.xdp.classes import Counters

log = logging.getLogger("broker.xdp")


def normalize(addr: str) -> str:
    """``addr``'s canonical text form; ValueError when it is not an IP address. An
    IPv4-mapped IPv6 address (``::ffff:10.0.0.1``, a dual-stack socket's view) is its IPv4."""
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class MemberFilter(ABC):
    """What the broker and the membership code see of either filter (kernel or user space):
    the allowlist, the gossip socket's predicate, the counters, a status block, close."""

    #: "kernel" (the XDP program) or "user space" (the gossip socket's predicate).
    where: str

    def __init__(self, reason: str | None) -> None:
        #: Why the kernel filter is not in use (None when it is).
        self.reason = reason
        self._members: set[str] = set()
        #: Networks whose hosts may ask to join (``[cluster] join_from``): their datagrams
        #: pass the user-space filter to the codec, which authenticates them and lets a
        #: stranger through only with a join (broker.cluster.membership_service).
        self.join_from: tuple[Network, ...] = ()

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def allow(self, addr: str) -> None:
        """Let gossip and Raft from ``addr`` through (ValueError: not an IP address)."""
        addr = normalize(addr)
        if addr not in self._members:
            self._insert(addr)
            self._members.add(addr)

    def deny(self, addr: str) -> None:
        """Drop gossip and Raft from ``addr`` from now on (no error when it was not allowed)."""
        addr = normalize(addr)
        if addr in self._members:
            self._remove(addr)
            self._members.discard(addr)

    def set_members(self, addrs: Iterable[str]) -> None:
        """Make the allowlist exactly ``addrs``: the membership code's one call on every
        change of the member list (adds before removes, so a member in both the old and the
        new set is never out for a moment)."""
        wanted = {normalize(a) for a in addrs}
        for addr in sorted(wanted - self._members):
            self.allow(addr)
        for addr in sorted(self._members - wanted):
            self.deny(addr)

    def set_join_from(self, networks: Iterable[str]) -> None:
        """Make :attr:`join_from` exactly ``networks`` (CIDR text; host bits ignored)."""
        wanted = tuple(dict.fromkeys(ipaddress.ip_network(n, strict=False) for n in networks))
        for net in wanted:
            if net not in self.join_from:
                self._insert_network(net)
                self.join_from += (net,)
        for net in self.join_from:
            if net not in wanted:
                self._remove_network(net)
        self.join_from = wanted

    def _insert_network(self, net: Network) -> None:  # noqa: B027 (the kernel filter's)
        """Let gossip from ``net``'s hosts through (the user-space filter reads join_from)."""

    def _remove_network(self, net: Network) -> None:  # noqa: B027 (the kernel filter's)
        """Stop letting gossip from ``net``'s hosts through."""

    @abstractmethod
    def _insert(self, addr: str) -> None: ...

    @abstractmethod
    def _remove(self, addr: str) -> None: ...

    @abstractmethod
    def accept(self, host: str, data: bytes) -> bool:
        """The gossip socket's predicate for a datagram from ``host`` (``GossipEndpoint``'s
        ``accept``): False drops it before it is decoded."""

    @abstractmethod
    def counters(self) -> Counters: ...

    def close(self) -> None:  # noqa: B027 (only the kernel filter holds anything)
        """Stop filtering (the kernel filter detaches); idempotent."""

    def status(self) -> dict[str, Any]:
        """The ``xdp`` block of ``GET /api/v1/cluster`` (and of the metrics)."""
        return {
            "enabled": self.where == "kernel",
            "filter": self.where,
            "reason": self.reason,
            "members": sorted(self._members),
            **self.counters().as_dict(),
        }
