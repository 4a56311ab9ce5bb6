"""The filter where BPF cannot run: the same allowlist and magic checks, on the gossip socket.

Behaviour is the kernel program's for gossip (``bpf/mqlog_xdp.c``): a datagram from an
address that is not a member is dropped (``drop_stranger``), then one that does not start
with the codec's magic (``drop_bad_magic``); the rest pass to the codec, which checks the
MAC. A host of a ``[cluster] join_from`` network passes too (a node joining later: the codec
authenticates it, and the membership lets a stranger through only with a join). Only the
cost differs: each datagram has already crossed the kernel's stack and woken
the event loop. Raft needs no user-space twin: its TCP links authenticate with the cluster
secret before anything else (broker.cluster.peerlink). Only the gossip class is counted
here, in datagrams and payload bytes.
"""

from __future__ import annotations

import ipaddress

from broker.cluster.gossip.codec import MAGIC
from broker.xdp.classes import Counters
from broker.xdp.members import MemberFilter, normalize


class UserSpaceFilter(MemberFilter):
    where = "user space"

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self._counters = Counters()

    def _insert(self, addr: str) -> None:
        pass

    def _remove(self, addr: str) -> None:
        pass

    def accept(self, host: str, data: bytes) -> bool:
        if host not in self._members:  # the usual spelling first: no parsing per datagram
            try:  # an IPv4-mapped IPv6 peer, a scoped IPv6 address
                member = normalize(host.split("%", 1)[0]) in self._members
            except ValueError:
                member = False
            if not member and not self._may_join(host):
                self._counters.add("gossip", "drop_stranger", len(data))
                return False
        if not data.startswith(MAGIC):
            self._counters.add("gossip", "drop_bad_magic", len(data))
            return False
        self._counters.add("gossip", "pass", len(data))
        return True

    def _may_join(self, host: str) -> bool:
        if not self.join_from:
            return False
        try:
            ip = ipaddress.ip_address(normalize(host.split("%", 1)[0]))
        except ValueError:
            return False
        return any(ip in net for net in self.join_from)

    def counters(self) -> Counters:
        return Counters(dict(self._counters.packets), dict(self._counters.bytes))
