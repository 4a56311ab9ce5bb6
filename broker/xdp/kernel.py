"""The XDP filter in the kernel: ``bpf/mqlog_xdp.c`` compiled by bcc, attached by a bpf_link.

:meth:`KernelFilter.load` compiles the program with this node's ports (about 3.5 s of
clang: call it from a thread, not the event loop), attaches it to the interface through a
bpf_link (broker.xdp.system_bcc says why not bcc's netlink attach) and returns the filter.
The allowlist is the program's ``allowlist`` hash map (IPv4 source address in network byte
order -> 1), and ``[cluster] join_from`` its ``join_from`` LPM trie (IPv4 prefixes); the
counters its per-CPU ``counters`` array, summed over CPUs when read.

Lifetime: :meth:`close` closes the link (the program is detached at once) and frees the
program and maps. A process that dies without closing it detaches it all the same, since
the kernel closes its descriptors; a restarted broker attaches a new one. The link's
descriptor is close-on-exec, and the broker forks no process after loading it.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.cluster.gossip.codec import MAGIC
from broker.xdp.classes import ALLOWLIST_SIZE, CLASSES, JOIN_FROM_SIZE, VERDICTS, Counters
from broker.xdp.members import MemberFilter, Network
from broker.xdp.system_bcc import import_bcc, xdp_link

#: The program's source (the repository's bpf/, next to the broker package).
SOURCE = Path(__file__).resolve().parents[2] / "bpf" / "mqlog_xdp.c"


@dataclass(frozen=True, slots=True)
class Ports:
    """What the program classifies by: the gossip port (UDP), the Raft ports (TCP, the
    metadata group's ``raft_port - 1`` up to the last worker's ``raft_port + workers - 1``)
    and up to three client listener ports (MQTT, TLS, WebSocket; 0 = none)."""

    gossip: int
    raft_first: int
    raft_last: int
    mqtt: tuple[int, ...]

    def cflags(self) -> list[str]:
        mqtt = [*self.mqtt, 0, 0, 0][:3]
        flags = [
            f"-DGOSSIP_PORT={self.gossip}",
            f"-DRAFT_PORT_FIRST={self.raft_first}",
            f"-DRAFT_PORT_LAST={self.raft_last}",
            *(f"-DMQTT_PORT_{i}={port}" for i, port in enumerate(mqtt)),
            *(f"-DMAGIC_{i}={byte}" for i, byte in enumerate(MAGIC)),
            f"-DALLOWLIST_SIZE={ALLOWLIST_SIZE}",
            f"-DJOIN_FROM_SIZE={JOIN_FROM_SIZE}",
            f"-DN_CLASSES={len(CLASSES)}",
            f"-DN_VERDICTS={len(VERDICTS)}",
        ]
        flags += [f"-DCLASS_{name.upper()}={i}" for i, name in enumerate(CLASSES)]
        flags += [f"-DVERDICT_{name.upper()}={i}" for i, name in enumerate(VERDICTS)]
        return flags


def _key(addr: str) -> int:
    """An IPv4 address as the map's u32 key: its network-order bytes read in host order."""
    return int(struct.unpack("=I", socket.inet_aton(addr))[0])


class KernelFilter(MemberFilter):
    where = "kernel"

    def __init__(self, bpf: Any, link_fd: int, interface: str, mode: str) -> None:
        super().__init__(None)
        self._bpf = bpf
        self._link_fd = link_fd
        self.interface = interface
        self.mode = mode
        self._allowlist = bpf.get_table("allowlist")
        self._join_from = bpf.get_table("join_from")
        self._counters = bpf.get_table("counters")

    @classmethod
    def load(cls, ports: Ports, interface: str, mode: str) -> KernelFilter:
        """Compile, load and attach. Raises BccMissing, OSError (no such interface, no
        privilege, the kernel refused the program or the link) or bcc's Exception (the
        compilation failed: no kernel headers)."""
        ifindex = socket.if_nametoindex(interface)
        bcc = import_bcc()
        bpf = bcc.BPF(src_file=str(SOURCE).encode(), cflags=ports.cflags())
        try:
            fn = bpf.load_func(b"xdp_filter", bcc.BPF.XDP)
            link_fd = xdp_link(fn.fd, ifindex, mode)
        except BaseException:
            bpf.cleanup()
            raise
        return cls(bpf, link_fd, interface, mode)

    def _insert(self, addr: str) -> None:
        if ":" in addr:
            return  # the program passes all IPv6 (and counts it): nothing to hold
        if len(self._members) >= ALLOWLIST_SIZE:
            raise ValueError(f"{addr}: the XDP allowlist is full ({ALLOWLIST_SIZE} members)")
        table = self._allowlist
        table[table.Key(_key(addr))] = table.Leaf(1)

    def _remove(self, addr: str) -> None:
        if ":" not in addr:
            table = self._allowlist
            del table[table.Key(_key(addr))]

    def _insert_network(self, net: Network) -> None:
        if net.version != 4:
            return  # the program passes all IPv6
        if len(self.join_from) >= JOIN_FROM_SIZE:
            raise ValueError(f"{net}: more than {JOIN_FROM_SIZE} join_from networks")
        table = self._join_from
        table[table.Key(net.prefixlen, _key(str(net.network_address)))] = table.Leaf(1)

    def _remove_network(self, net: Network) -> None:
        if net.version == 4:
            table = self._join_from
            del table[table.Key(net.prefixlen, _key(str(net.network_address)))]

    def accept(self, host: str, data: bytes) -> bool:
        return True  # the program already dropped what the socket must not see

    def counters(self) -> Counters:
        out = Counters()
        table = self._counters
        n_verdicts = len(VERDICTS)
        for i in range(len(CLASSES) * n_verdicts):
            per_cpu = table.getvalue(table.Key(i))
            packets = sum(int(c.packets) for c in per_cpu)
            if packets:
                size = sum(int(c.bytes) for c in per_cpu)
                out.add(CLASSES[i // n_verdicts], VERDICTS[i % n_verdicts], size, packets)
        return out

    def close(self) -> None:
        if self._link_fd >= 0:
            os.close(self._link_fd)  # detaches the program
            self._link_fd = -1
            self._bpf.cleanup()

    def status(self) -> dict[str, Any]:
        return {**super().status(), "interface": self.interface, "mode": self.mode}
