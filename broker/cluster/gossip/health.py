"""Lifeguard's local health multiplier ("Local Health Aware Probe") and dynamic suspicion
timeouts ("Local Health Aware Suspicion"), and the sizes that grow with the group
(memberlist's util.go): all pure arithmetic.

The local health score ``score`` is in [0, max - 1]; the probe timeout and how long a probe
may run before its target is suspected are multiplied by ``score + 1``. It rises when this
member may be the slow one: a probe whose intermediaries sent fewer nacks than expected (+ the
missing ones; + 1 when no intermediary was asked), and each time it must refute a suspicion of
itself (+ 1); it falls by 1 on each successful probe, direct or relayed (memberlist's
awareness.go and probeNode). A slow member thus waits longer for acks and its failing probes
come less often, instead of suspecting healthy members whose acks it was too slow to read;
its answered probes keep the base period, so the score falls as fast as they succeed.

A suspicion of a member starts at ``max_ms`` and shrinks towards ``min_ms`` as independent
suspicions of the same member (by other origins) arrive:
``timeout(c) = max(min, max - (max - min) * log(c + 1) / log(k + 1))`` for ``c``
confirmations, ``k`` the number wanted to reach the minimum (memberlist's suspicion.go). The
member that suspects first waits long unless others agree, so its own slowness alone cannot
declare a death quickly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Awareness", "Suspicion", "retransmit_limit", "suspicion_bounds", "suspicion_timeout"]


def retransmit_limit(mult: int, n: int) -> int:
    """How many times an update is sent: ``mult * ceil(log10(n + 1))`` (SWIM s4.1's lambda log n;
    memberlist's retransmitLimit) for a group of ``n`` members."""
    return mult * math.ceil(math.log10(n + 1))


def suspicion_bounds(mult: int, max_mult: int, n: int, interval: int) -> tuple[int, int]:
    """(min, max) suspicion timeouts in ms: min = ``mult * max(1, log10(n)) * interval``
    (memberlist's suspicionTimeout), max = ``max_mult * min``."""
    low = int(mult * max(1.0, math.log10(max(1, n))) * interval)
    return low, max_mult * low


def suspicion_timeout(confirmations: int, k: int, min_ms: int, max_ms: int) -> int:
    """The total suspicion timeout (ms since the suspicion began) after ``confirmations``
    independent confirmations, ``k`` of which bring it to ``min_ms``."""
    if k < 1:
        return min_ms
    frac = math.log(confirmations + 1) / math.log(k + 1)
    return max(min_ms, math.floor(max_ms - frac * (max_ms - min_ms)))


@dataclass(slots=True)
class Suspicion:
    """One suspected member's timer: started at ``start`` (ms) for ``incarnation`` on
    ``origin``'s word; ``seen`` holds the origins counted (``origin`` included, so it never
    confirms itself)."""

    origin: str
    incarnation: int
    start: int
    k: int
    min_ms: int
    max_ms: int
    seen: set[str] = field(default_factory=set)
    #: When the suspected member is declared dead (ms), unless refuted first.
    deadline: int = 0

    def __post_init__(self) -> None:
        self._reckon()

    @property
    def confirmations(self) -> int:
        return len(self.seen) - 1

    def _reckon(self) -> None:
        timeout = suspicion_timeout(self.confirmations, self.k, self.min_ms, self.max_ms)
        self.deadline = self.start + timeout

    def confirm(self, origin: str) -> bool:
        """Count ``origin``'s suspicion; False if already counted or ``k`` already reached
        (then the confirmation is not worth passing on either)."""
        if self.confirmations >= self.k or origin in self.seen:
            return False
        self.seen.add(origin)
        self._reckon()
        return True


@dataclass(slots=True)
class Awareness:
    """The local health score; ``maximum`` 1 (Lifeguard off) pins it at 0."""

    maximum: int
    score: int = 0

    def apply(self, delta: int) -> None:
        self.score = min(self.maximum - 1, max(0, self.score + delta))

    def scale(self, ms: int) -> int:
        return ms * (self.score + 1)
