"""Piggybacked dissemination (SWIM s4.1, memberlist's TransmitLimitedQueue).

Each update waits in the queue until it has been sent ``limit`` times (``health.
retransmit_limit``: lambda * ceil(log10(n + 1))), riding on pings, acks, ping-reqs and gossip
packets. The least-sent updates go first (a new one reaches more members sooner: infection
style), the newest first among equals. A newer update about a member replaces the queued one:
a member is only ever gossiped in its latest known state.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.cluster.gossip.messages import Update

__all__ = ["Broadcasts"]


@dataclass(slots=True)
class _Queued:
    update: Update
    size: int
    transmits: int
    order: int


class Broadcasts:
    def __init__(self) -> None:
        self._queued: dict[str, _Queued] = {}
        self._order = 0
        #: Updates sent (each transmission counted once): the dissemination rounds metric.
        self.transmitted = 0

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, update: Update) -> bool:
        queued = self._queued.get(update.node)
        return queued is not None and queued.update == update

    def add(self, update: Update, size: int) -> None:
        """Queue ``update`` (``size`` bytes on the wire), replacing any queued update about the
        same member."""
        self._order += 1
        self._queued[update.node] = _Queued(update, size, 0, self._order)

    def take(self, budget: int, limit: int) -> list[Update]:
        """Updates whose sizes add up to at most ``budget`` bytes, least sent first; each taken
        counts one transmission and leaves the queue at ``limit``."""
        if not self._queued:
            return []
        chosen: list[Update] = []
        for queued in sorted(self._queued.values(), key=lambda q: (q.transmits, -q.order)):
            if queued.size > budget:
                continue
            budget -= queued.size
            chosen.append(queued.update)
            queued.transmits += 1
            if queued.transmits >= limit:
                del self._queued[queued.update.node]
        self.transmitted += len(chosen)
        return chosen
