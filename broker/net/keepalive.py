"""Keepalive deadlines of many connections without looking at every connection every tick.

A server must close a connection that sends nothing for one and a half times its Keep Alive
[MQTT-3.1.2-24], and may close one that sends no CONNECT in reasonable time (s3.1.4). Scanning
every connection on every timer tick (every 0.5 s) cost 10,000 checks a second per 5,000
idle devices. Here each connection is filed in a slot of the wheel by its deadline as known
when it was filed, and looked at only when that slot comes due: one look per 1.5 x keepalive
while it is alive. Data arriving does not touch the wheel (that is the hot path): the look
finds the deadline moved and files it again.

Sans-IO: times are seconds of one monotonic clock, passed in. Called from one event loop.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from broker.mqtt.connection import keepalive_expired

__all__ = ["KeepaliveWheel", "Watched", "keepalive_deadline", "link_expired"]

T = TypeVar("T", bound=Hashable)


class KeepaliveWheel(Generic[T]):
    """Items (connections) by deadline, in slots of ``resolution`` seconds.

    Invariant: an item is in at most one live slot (``_slot_of``); a slot's list may also
    hold stale entries of items filed again or discarded since, which :meth:`due` skips.
    """

    __slots__ = ("_cursor", "_slot_of", "_slots", "resolution")

    def __init__(self, resolution: float, now: float) -> None:
        if resolution <= 0:
            raise ValueError("resolution must be positive")
        self.resolution = resolution
        self._slots: dict[int, list[T]] = {}
        self._slot_of: dict[T, int] = {}
        self._cursor = math.floor(now / resolution)  # every slot up to here was handed out

    def __len__(self) -> int:
        return len(self._slot_of)

    def file(self, item: T, deadline: float) -> None:
        """Look at ``item`` again once ``deadline`` has passed (replacing an earlier filing)."""
        slot = max(math.ceil(deadline / self.resolution), self._cursor + 1)
        if self._slot_of.get(item) == slot:
            return
        self._slot_of[item] = slot
        self._slots.setdefault(slot, []).append(item)

    def discard(self, item: T) -> None:
        """Forget ``item`` (its connection closed, or it has no keepalive)."""
        self._slot_of.pop(item, None)

    def due(self, now: float) -> list[T]:
        """Items whose filed deadline is at or before ``now``, each once, removed from the
        wheel: the caller closes the expired ones and files the others again."""
        last = math.floor(now / self.resolution)
        out: list[T] = []
        slots = self._slots
        slot_of = self._slot_of
        for slot in range(self._cursor + 1, last + 1):
            items = slots.pop(slot, None)
            if not items:
                continue
            for item in items:
                if slot_of.get(item) == slot:
                    del slot_of[item]
                    out.append(item)
        self._cursor = max(self._cursor, last)
        if len(out) > len(slot_of):
            # A dict keeps its table after deletions: most items left (parked, closed), so
            # the rest are copied into one of their size (linear in what was handed out).
            self._slot_of = dict(slot_of)
        return out


class Watched(Protocol):
    """What the keepalive check reads of a connection (broker.net.transport's)."""

    @property
    def session(self) -> object | None: ...
    @property
    def connected_at(self) -> float: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def keepalive(self) -> int: ...
    @property
    def last_received(self) -> float: ...


def link_expired(link: Watched, now: float) -> bool:
    """[MQTT-3.1.2-24]: nothing received for 1.5 x keepalive; or no CONNECT in time."""
    if link.session is None:
        return now - link.connected_at > link.connect_timeout
    return keepalive_expired(link.keepalive, link.last_received, now)


def keepalive_deadline(link: Watched) -> float | None:
    """When :func:`link_expired` may next become true if nothing arrives; None when it never
    will (keepalive 0, s3.1.2.10)."""
    if link.session is None:
        return link.connected_at + link.connect_timeout
    if link.keepalive <= 0:
        return None
    return link.last_received + 1.5 * link.keepalive
