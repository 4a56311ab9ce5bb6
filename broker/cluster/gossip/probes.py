"""The records of the probes in flight in the SWIM core (``swim``): our own probe of a member,
and the pings we send for another member's ping-req (SWIM s3.1)."""

from __future__ import annotations

from dataclasses import dataclass

from broker.cluster.gossip.messages import Addr

__all__ = ["NACK_SHARE", "SEQ_MASK", "Probe", "Relay"]

SEQ_MASK = 0xFFFF_FFFF
#: An intermediary nacks when the target has not acked within this share of probe_timeout, so
#: that the nack reaches the prober before its period ends (Lifeguard, "Local Health Aware Probe").
NACK_SHARE = 0.8


@dataclass(slots=True)
class Probe:
    """Our probe ``seq`` of ``target``; the times are the driver's ms."""

    seq: int
    target: str
    addr: Addr
    timeout_at: int  # direct ping's end: ping-req then
    deadline: int  # the probe's end (the period scaled by the local health): suspect then
    indirect: bool = False
    expected_nacks: int = 0
    nacks: int = 0


@dataclass(slots=True)
class Relay:
    """A ping sent for ``prober``'s ping-req ``seq``."""

    prober: Addr
    seq: int
    nack_at: int | None
    expires: int
