"""Full state exchanges of the SWIM core (mixed into ``Swim``): what repairs a view gossip
could not, memberlist's push-pull and serf's reconnect.

- Anti-entropy (memberlist's push-pull): every ``sync_interval`` a member sends its whole
  table to a random live member, which answers with its own; each merges the other's.
- Reconnect: every ``reconnect_interval``, while a member is held DEAD (not LEFT), the whole
  table goes to one of them, at random. A partition that lasted past the death declarations
  leaves both sides holding the other dead, and then nothing crosses the cut once healed: a
  DEAD member is never probed, gossip reaches the dead only while updates are queued, for
  ``gossip_to_dead`` after the death, and anti-entropy goes to live members. memberlist leaves
  this to serf, which tries a dead member every 30 s (``ReconnectInterval``); a node cut off
  past its death declaration then kept the others dead, and they it, for a minute after the
  heal (tests/integration/test_cluster_heal.py). The member that gets the table hears itself
  dead and refutes (SWIM s4.2); its answer, built after that, carries its new incarnation,
  and both sides gossip the ALIVE on. Its cost: one table (a datagram per 30 members or so)
  per ``reconnect_interval`` per member while a member is dead; a member that left or was
  removed is not tried.
- Merge (memberlist's ``mergeState``): a DEAD in another member's table is taken as a
  SUSPECT. A member back from a cut still holds the others dead at their incarnations,
  which would override the ALIVE the receiver holds at the same incarnation and declare live
  members dead on its word; suspected instead, they hear of it, refute, and stay alive. A
  death of this member itself is refuted either way, and a LEFT is final.
"""

from __future__ import annotations

import random

from broker.cluster.gossip.codec import base_size, update_size
from broker.cluster.gossip.members import Member
from broker.cluster.gossip.messages import Addr, Effect, Packet, Send, State, Sync, Update
from broker.cluster.gossip.options import SwimConfig

__all__ = ["StateSync"]


class StateSync:
    """Full state exchanges; ``Swim`` owns the state declared here and provides ``_apply``."""

    id: str
    config: SwimConfig
    members: dict[str, Member]
    now: int
    _rng: random.Random
    _out: list[Effect]
    _next_sync: int | None
    _next_reconnect: int | None

    def _apply(self, update: Update) -> None:
        raise NotImplementedError  # Swim's

    def _start_syncs(self, now: int) -> None:
        cfg = self.config
        self._next_sync = now + cfg.sync_interval if cfg.sync_interval else None
        self._next_reconnect = now + cfg.reconnect_interval if cfg.reconnect_interval else None

    def _sync_deadlines(self) -> list[int]:
        return [t for t in (self._next_sync, self._next_reconnect) if t is not None]

    def _sync_tick(self, now: int) -> None:
        if self._next_sync is not None and now >= self._next_sync:
            self._next_sync = now + self.config.sync_interval
            self._exchange(State.ALIVE)
        if self._next_reconnect is not None and now >= self._next_reconnect:
            self._next_reconnect = now + self.config.reconnect_interval
            self._exchange(State.DEAD)

    def _exchange(self, state: State) -> None:
        """Our table to a random member held in ``state``, asking for theirs."""
        peers = [m for m in self.members.values() if m.node != self.id and m.state is state]
        if peers:
            self._send_state(self._rng.choice(peers).addr, reply=True)

    def _merge(self, updates: tuple[Update, ...]) -> None:
        """Another member's table (module docstring: a DEAD of another is a SUSPECT)."""
        for u in updates:
            if u.state is State.DEAD and u.node != self.id:
                u = Update(State.SUSPECT, u.node, u.incarnation, self.id)
            self._apply(u)

    def _send_state(self, addr: Addr, reply: bool) -> None:
        """Our whole table, ourselves first, in as many Sync packets as it takes (only the first
        asks for a reply)."""
        ours = [self.members[self.id].update()]
        ours += (m.update() for n, m in self.members.items() if n != self.id)
        while ours:
            message = Sync(reply)
            budget = self.config.max_datagram - base_size(self.id, message)
            chunk: list[Update] = []
            while ours and (size := update_size(ours[0])) <= budget and len(chunk) < 255:
                budget -= size
                chunk.append(ours.pop(0))
            self._out.append(Send(addr, Packet(self.id, message, tuple(chunk))))
            reply = False
