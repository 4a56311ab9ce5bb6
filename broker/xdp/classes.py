"""What the filter counts: packet classes and verdicts, shared by the kernel program
(``bpf/mqlog_xdp.c``, which gets these numbers as ``-D`` macros) and the user-space filter.

A counter is kept per (class, verdict) pair, in packets and in bytes (whole frames in the
kernel, UDP payloads in user space: the user-space filter never sees the headers). Not
every pair occurs: only gossip and Raft are ever dropped, and only gossip for its magic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Packet classes, in the kernel program's numbering (its comment says what each holds).
CLASSES: tuple[str, ...] = ("gossip", "raft", "mqtt", "other", "fragment", "ipv6")
#: Verdicts: why a packet passed or was dropped.
VERDICTS: tuple[str, ...] = ("pass", "drop_stranger", "drop_bad_magic")
#: Room in the kernel's allowlist map (members' IPv4 addresses); more are refused loudly.
ALLOWLIST_SIZE = 4096
#: The most ``[cluster] join_from`` networks the kernel program holds.
JOIN_FROM_SIZE = 64


def slot(cls: str, verdict: str) -> int:
    """The counter's index in the kernel's per-CPU array (``cls * N_VERDICTS + verdict``)."""
    return CLASSES.index(cls) * len(VERDICTS) + VERDICTS.index(verdict)


@dataclass
class Counters:
    """Packets and bytes per (class, verdict), as both filters report them."""

    packets: dict[tuple[str, str], int] = field(default_factory=dict)
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, cls: str, verdict: str, size: int, count: int = 1) -> None:
        key = (cls, verdict)
        self.packets[key] = self.packets.get(key, 0) + count
        self.bytes[key] = self.bytes.get(key, 0) + size

    def get(self, cls: str, verdict: str) -> int:
        """Packets counted under (``cls``, ``verdict``)."""
        return self.packets.get((cls, verdict), 0)

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{"packets": {class: {verdict: n}}, "bytes": {...}}``: only the non-zero ones."""
        out: dict[str, dict[str, dict[str, int]]] = {"packets": {}, "bytes": {}}
        for name, table in (("packets", self.packets), ("bytes", self.bytes)):
            for (cls, verdict), n in sorted(table.items()):
                if n:
                    out[name].setdefault(cls, {})[verdict] = n
        return out
