"""The SWIM core's tunables (``SwimConfig``), hashicorp/memberlist's ``DefaultLANConfig`` values
unless said otherwise, and the known-bad variants the tests switch on (``Variant``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Variant(enum.Enum):
    """Known-bad behaviours, for the tests and the simulator only."""

    CORRECT = "correct"
    #: A member told it is suspected does not refute (no incarnation bump, SWIM s4.2).
    NO_REFUTE = "no-refute"


@dataclass(frozen=True, slots=True)
class SwimConfig:
    """Durations are milliseconds of the driver's clock."""

    #: The protocol period T' (SWIM s3.1): one probe per period; a probe may run over it, up to
    #: the period scaled by the local health (its target is suspected then).
    probe_interval: int = 1000
    #: How long the direct ping waits for its ack before ping-req (scaled by the local health).
    probe_timeout: int = 500
    #: k, the members asked to ping-req a target that missed its direct ping (SWIM s3.1).
    indirect_checks: int = 3
    #: lambda: each update is sent retransmit_mult * ceil(log10(n + 1)) times (SWIM s4.1).
    retransmit_mult: int = 4
    #: The minimum suspicion timeout is suspicion_mult * max(1, log10(n)) * probe_interval.
    suspicion_mult: int = 4
    #: The maximum (where Lifeguard's "Local Health Aware Suspicion" starts) is this times the
    #: minimum.
    suspicion_max_mult: int = 6
    #: The local health score stays in [0, awareness_max - 1]; probe timeouts scale by score + 1.
    awareness_max: int = 8
    #: Every gossip_interval, pending updates go to gossip_nodes random members as well as on
    #: the probes' own messages (memberlist's gossip; SWIM alone only piggybacks).
    gossip_interval: int = 200
    gossip_nodes: int = 3
    #: Dead members still receive gossip this long (so a falsely declared one learns and
    #: refutes); memberlist's GossipToTheDeadTime.
    gossip_to_dead: int = 30_000
    #: Anti-entropy: every sync_interval, a full state exchange with one random live member
    #: (memberlist's push-pull); 0 = off.
    sync_interval: int = 30_000
    #: Reconnect: every reconnect_interval, while a member is held dead (not left), a full
    #: state exchange with one of them: how a healed partition merges back (``statesync``;
    #: serf's reconnect, every 30 s there); 0 = off.
    reconnect_interval: int = 2000
    #: A node whose seeds did not answer asks them again this often.
    join_retry: int = 2000
    #: Largest datagram the core builds, in bytes (an Ethernet MTU less IP/UDP headers, with
    #: room to spare for tunnels).
    max_datagram: int = 1400
    #: Lifeguard's three refinements and its nacks; off gives plain SWIM with
    #: memberlist's pre-Lifeguard fixed suspicion timeout (the minimum above).
    lifeguard: bool = True
    variant: Variant = Variant.CORRECT

    def __post_init__(self) -> None:
        if not 0 < self.probe_timeout < self.probe_interval:
            raise ValueError("probe_timeout must be in (0, probe_interval)")
        if self.suspicion_mult < 1 or self.suspicion_max_mult < 1 or self.awareness_max < 1:
            raise ValueError("suspicion_mult, suspicion_max_mult, awareness_max must be >= 1")
