"""The sans-IO SWIM core of one member (the shape of ``broker.cluster.raft``: inputs in, effects
out; no clock, socket or task of its own).

Inputs, each with the driver's clock ``now`` (integer ms, monotonic): ``join(seeds, now)``,
``receive(addr, packet, now)`` (a decoded datagram from ``addr``), ``tick(now)`` (to be called
at or after ``deadline``, and after any input if the driver sleeps until ``deadline``) and
``leave(now)``. Each returns the effects to apply, in order: ``Send`` (encode, put on the wire;
loss is fine) and ``Changed`` (a member's state changed: log it, re-place). Read-only views:
``members`` (node id -> ``Member``), ``incarnation``, ``health`` and the ``stats`` counters.

The protocol (SWIM s3-s4, as hashicorp/memberlist runs it):
- Every protocol period (``probe_interval``) the member pings the next member of a randomized
  round-robin order (SWIM s4.3: a shuffled list, walked, shuffled again at the end; a newcomer
  is inserted at a random position), so that each member is probed within 2n - 1 periods in
  the worst case.
- No ack within ``probe_timeout`` (scaled by the local health): ping-req through
  ``indirect_checks`` random live members (SWIM s3.1), which relay the target's ack or send a
  nack (Lifeguard, "Local Health Aware Probe").
- No ack by the probe's end (one period scaled by the local health; the next probe waits for
  it, as memberlist's probe ticker waits for a probe that runs over): the target becomes
  SUSPECT (SWIM s4.2) and the suspicion is gossiped; a suspected member that hears of it
  refutes by raising its incarnation and gossiping ALIVE. An unrefuted suspicion becomes DEAD
  at its timeout (``health``). A probe acked in time ends there and the next starts one
  period after it began, whatever the score: the score falls by one per successful probe, so
  a member back from a cut (every probe failed, score at its maximum) recovers in as many
  periods, not in the 35 that spacing every probe by the scaled period took at 8x.
- Updates ride on every packet within ``max_datagram`` (SWIM s4.1) and on gossip packets every
  ``gossip_interval`` to ``gossip_nodes`` members, each sent ``retransmit_limit`` times
  (``broadcasts``); a full state exchange (``Sync``) joins a member and repairs what gossip
  missed: with a live member every ``sync_interval`` (memberlist's push-pull), with a dead
  one every ``reconnect_interval``, which merges a healed partition (``statesync``).
- Lifeguard (``SwimConfig.lifeguard``): the local health multiplier, dynamic suspicion
  timeouts with confirmations, nacks, and the buddy system (a ping to a member we suspect
  carries the suspicion, so it refutes at once: Lifeguard, "Buddy System").
- Suspicions probed (ours, with Lifeguard; not in SWIM, Lifeguard or memberlist): a member
  that learns of another's suspicion probes the suspect next (with probability
  (k + 2) / (n - 2): all of them in a small group, a few in a large one), unless its last
  probe was already such a one (members slow to answer can keep suspicions coming, and the
  round-robin order must still reach a silent death). A dead member so gets its independent
  confirmations one period after the first suspicion; a live one gets pings carrying the
  suspicion (the buddy system) and refutes through several paths at once. Hence the minimum
  suspicion timeout takes one confirmation whenever anyone else can give it (``k`` >= 1;
  memberlist's ``suspicion_mult - 2`` is 0 for a multiplier of 2 or less): a lone suspicion
  waits the maximum. A member holding a member DEAD (or LEFT) that hears it suspected tells
  the sender again, whose lone suspicion would otherwise wait out that maximum when every
  copy of the death was lost. A member that hears an older suspicion or death of itself
  queues its ALIVE again, for the same reason. Measured in ``docs/gossip.md``.

Invariants: only this member raises its own incarnation; a member's record changes only by
``members.overrides``; a DEAD or LEFT member is never probed; every packet built fits
``max_datagram`` bytes once encoded. Not thread-safe: one caller at a time.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable

from broker.cluster.gossip.broadcasts import Broadcasts
from broker.cluster.gossip.codec import base_size, update_size
from broker.cluster.gossip.health import Awareness, Suspicion, retransmit_limit, suspicion_bounds
from broker.cluster.gossip.members import GONE, Member, is_confirmation, overrides
from broker.cluster.gossip.messages import (
    Ack,
    Addr,
    Changed,
    Effect,
    Gossip,
    Message,
    Nack,
    Packet,
    Ping,
    PingReq,
    Send,
    State,
    Sync,
    Update,
)
from broker.cluster.gossip.options import SwimConfig, Variant
from broker.cluster.gossip.probes import NACK_SHARE, SEQ_MASK, Probe, Relay
from broker.cluster.gossip.statesync import StateSync

__all__ = ["Swim"]

LIVE = (State.ALIVE, State.SUSPECT)


class Swim(StateSync):
    def __init__(
        self,
        node_id: str,
        addr: Addr,
        rng: random.Random,
        config: SwimConfig | None = None,
        now: int = 0,
        incarnation: int = 0,
        meta: bytes = b"",
    ) -> None:
        """``incarnation``: where to start (a restart may start at 0: hearing itself suspected
        or dead at a higher one, or alive at its own incarnation with another address or
        ``meta``, the member refutes past it). ``meta``: what this member says of itself in
        its ALIVE updates (at most 255 bytes, opaque to the core)."""
        if len(meta) > 255:
            raise ValueError(f"meta of {len(meta)} bytes (at most 255)")
        self.id = node_id
        self.addr = addr
        self.config = config = config or SwimConfig()
        self._rng = rng
        self.now = now
        self.members: dict[str, Member] = {
            node_id: Member(node_id, addr, State.ALIVE, incarnation, now, node_id, meta)
        }
        self._live = 1
        self.health = Awareness(config.awareness_max if config.lifeguard else 1)
        self.stats: Counter[str] = Counter()
        self.leaving = False
        self._broadcasts = Broadcasts()
        self._suspicions: dict[str, Suspicion] = {}
        self._order: list[str] = []
        self._pos = 0
        #: A member to probe next, out of order (:meth:`probe_soon`).
        self._urgent: str | None = None
        #: A member another suspects, to probe next unless the last probe was such a one
        #: (module doc, "Suspicions probed").
        self._suspected: str | None = None
        self._probed_suspect = False
        self._seq = rng.randrange(SEQ_MASK)
        self._probe: Probe | None = None
        self._relays: dict[int, Relay] = {}
        # Members started together spread their probes over the period.
        self._next_probe = now + rng.randrange(config.probe_interval)
        self._next_gossip = now + rng.randrange(config.gossip_interval)
        self._start_syncs(now)
        self._seeds: list[Addr] = []
        self._next_join: int | None = None
        self._out: list[Effect] = []

    # -- views -------------------------------------------------------------------------------

    @property
    def incarnation(self) -> int:
        return self.members[self.id].incarnation

    @property
    def size(self) -> int:
        """Members believed alive or suspect, this one included (n in the formulas)."""
        return self._live

    @property
    def left(self) -> bool:
        """After ``leave``: the goodbye has been sent its retransmit limit; the driver may stop."""
        me = self.members[self.id]
        return self.leaving and me.update() not in self._broadcasts

    @property
    def deadline(self) -> int:
        """When ``tick`` is next due (ms)."""
        times = [self._next_gossip]
        if not self.leaving and self._probe is None:
            times.append(self._next_probe)  # a probe in flight holds the next one back
        if self._probe is not None:
            p = self._probe
            times.append(p.deadline if p.indirect else p.timeout_at)
        times += (s.deadline for s in self._suspicions.values())
        for relay in self._relays.values():
            times.append(relay.expires if relay.nack_at is None else relay.nack_at)
        times += self._sync_deadlines()
        if self._next_join is not None:
            times.append(self._next_join)
        return min(times)

    # -- inputs ------------------------------------------------------------------------------

    def join(self, seeds: Iterable[Addr], now: int) -> list[Effect]:
        """Send our state to each seed, asking for theirs (again every ``join_retry`` until a
        member answers). No seed: the first member of a new cluster."""
        self.now = now
        self._seeds = [seed for seed in seeds if seed != self.addr]
        self._ask_seeds()
        return self._take()

    def leave(self, now: int) -> list[Effect]:
        """Say goodbye (LEFT at our incarnation) and stop probing; keep ticking until ``left``."""
        self.now = now
        if not self.leaving:
            self.leaving = True
            self._probe = None
            me = self.members[self.id]
            me.state, me.since = State.LEFT, now
            self._live -= 1
            self._queue(me.update())
            self._gossip()
        return self._take()

    def announce(self, meta: bytes, now: int) -> list[Effect]:
        """Say ``meta`` of ourselves from now on: ALIVE at a higher incarnation, which alone
        overrides what the members hold of us (SWIM s4.2)."""
        if len(meta) > 255:
            raise ValueError(f"meta of {len(meta)} bytes (at most 255)")
        self.now = now
        me = self.members[self.id]
        if me.meta != meta and not self.leaving:
            me.meta = meta
            me.incarnation += 1
            self._queue(me.update())
        return self._take()

    def probe_soon(self, node: str, now: int) -> list[Effect]:
        """Probe ``node`` next, at once if no probe is in flight: a hint from outside the
        protocol (the node's Raft link to it closed, as a killed process's kernel closes it).
        It only brings a probe forward; a suspicion still needs that probe to fail, directly
        and through ``indirect_checks`` members, so a wrong hint costs one ping. Not in SWIM
        or memberlist: with it a crashed process is suspected one period after its links
        drop, instead of whenever the round-robin order reaches it (up to 2n - 1 periods)."""
        self.now = now
        m = self.members.get(node)
        if m is not None and node != self.id and m.state in LIVE and not self.leaving:
            self._urgent = node
            self._probe_at_once()
            self.stats["probe_hints"] += 1
        return self._take()

    def _probe_at_once(self) -> None:
        """Start the next probe now if none is in flight."""
        if self._probe is None:
            self._next_probe = min(self._next_probe, self.now)

    def receive(self, addr: Addr, packet: Packet, now: int) -> list[Effect]:
        """The updates first (so that an ack carries our refutation of a suspicion the ping
        brought: the buddy system), then the message."""
        self.now = now
        if isinstance(packet.message, Sync):
            self._merge(packet.updates)
        else:
            for update in packet.updates:
                self._apply(update)
        self._handle(addr, packet.message)
        return self._take()

    def tick(self, now: int) -> list[Effect]:
        self.now = now
        for node, suspicion in list(self._suspicions.items()):
            if now >= suspicion.deadline:
                del self._suspicions[node]
                m = self.members[node]
                if m.state is State.SUSPECT and m.incarnation == suspicion.incarnation:
                    self._apply(Update(State.DEAD, node, m.incarnation, self.id))
        for seq, relay in list(self._relays.items()):
            if relay.nack_at is not None and now >= relay.nack_at:
                relay.nack_at = None
                self._send(relay.prober, Nack(relay.seq))
                self.stats["nacks_sent"] += 1
            if now >= relay.expires:
                del self._relays[seq]
        probe = self._probe
        if probe is not None:
            if not probe.indirect and now >= probe.timeout_at:
                self._ping_req(probe)
            if now >= probe.deadline:
                self._probe_failed(probe)
        if self._probe is None and not self.leaving and now >= self._next_probe:
            self._start_probe()
        if now >= self._next_gossip:
            self._next_gossip = now + self.config.gossip_interval
            self._gossip()
        self._sync_tick(now)
        if self._next_join is not None and now >= self._next_join:
            if any(m.state in LIVE for m in self.members.values() if m.node != self.id):
                # Joined. A Sync reply of several datagrams may have lost one: a second full
                # exchange soon, with another member, rather than one sync_interval later.
                self._next_join = None
                if self._next_sync is not None:
                    self._next_sync = min(self._next_sync, now + self.config.join_retry)
            else:
                self._ask_seeds()
        return self._take()

    def _ask_seeds(self) -> None:
        for seed in self._seeds:
            self._send_state(seed, reply=True)
        self._next_join = self.now + self.config.join_retry if self._seeds else None

    # -- probing -----------------------------------------------------------------------------

    def _next_target(self) -> Member | None:
        """The next live member of the randomized round-robin order (SWIM s4.3)."""
        for _ in range(2):
            while self._pos < len(self._order):
                m = self.members[self._order[self._pos]]
                self._pos += 1
                if m.state in LIVE:
                    return m
            self._order = [n for n, m in self.members.items() if n != self.id and m.state in LIVE]
            self._rng.shuffle(self._order)
            self._pos = 0
        return None

    def _start_probe(self) -> None:
        """One probe per period; a probe may run over it (up to the period scaled by the local
        health, ``Probe.deadline``), and the next waits for its end (module doc)."""
        self._next_probe = self.now + self.config.probe_interval
        interval = self.health.scale(self.config.probe_interval)
        self._retell_lone_suspicions()
        target = self._pick_target()
        if target is None:
            return
        seq = self._next_seq()
        timeout = self.health.scale(self.config.probe_timeout)
        self._probe = Probe(seq, target.node, target.addr, self.now + timeout, self.now + interval)
        buddy: list[Update] = []
        if self.config.lifeguard and target.state is State.SUSPECT:
            buddy.append(Update(State.SUSPECT, target.node, target.incarnation, self.id))
        self._send(target.addr, Ping(seq, target.node), buddy)
        self.stats["probes"] += 1

    def _pick_target(self) -> Member | None:
        """A hinted member (:meth:`probe_soon`) first; else a member another suspects, unless
        the last probe was one (however many suspicions come, every other period goes to the
        round-robin order, which must reach a silent death); else the round-robin order."""
        hinted, self._urgent = self._urgent, None
        m = self.members.get(hinted) if hinted is not None else None
        if m is not None and m.state in LIVE:
            return m
        suspect = None
        if self._suspected is not None and not self._probed_suspect:
            suspect = self.members.get(self._suspected)
            self._suspected = None
        self._probed_suspect = suspect is not None and suspect.state is State.SUSPECT
        return suspect if self._probed_suspect else self._next_target()

    def _retell_lone_suspicions(self) -> None:
        """Queue again each suspicion of ours that no one has confirmed and that has left the
        queue: if its transmissions were all lost (we were cut off when we made it), the
        suspected member never heard of it and cannot refute, and our timeout would declare a
        live member dead. Not in SWIM or memberlist; costs a few bytes per period per lone
        suspicion, and a real death brings confirmations that end it."""
        for node, suspicion in self._suspicions.items():
            m = self.members[node]
            if suspicion.origin == self.id and suspicion.confirmations == 0:
                update = Update(State.SUSPECT, node, m.incarnation, self.id)
                if update not in self._broadcasts:
                    self._queue(update)

    def _ping_req(self, probe: Probe) -> None:
        probe.indirect = True
        peers = [
            m
            for m in self.members.values()
            if m.state is State.ALIVE and m.node not in (self.id, probe.target)
        ]
        chosen = self._rng.sample(peers, min(self.config.indirect_checks, len(peers)))
        for m in chosen:
            self._send(m.addr, PingReq(probe.seq, probe.target, probe.addr))
        probe.expected_nacks = len(chosen) if self.config.lifeguard else 0
        self.stats["indirect_probes"] += 1

    def _probe_failed(self, probe: Probe) -> None:
        """Lifeguard, "Local Health Aware Probe": each nack that should have come and did not
        says that we may be the slow one; with no one to ask, the failed probe itself counts
        once."""
        self._probe = None
        self.stats["probe_failures"] += 1
        missing = probe.expected_nacks - probe.nacks
        self.health.apply(missing if probe.expected_nacks else 1)
        m = self.members.get(probe.target)
        if m is not None and m.state in LIVE:
            self._apply(Update(State.SUSPECT, m.node, m.incarnation, self.id))

    def _handle(self, addr: Addr, message: Message) -> None:
        match message:
            case Ping(seq, target):
                if target == self.id:
                    self._send(addr, Ack(seq))
                else:
                    self.stats["pings_for_another"] += 1
            case Ack(seq):
                probe = self._probe
                if probe is not None and seq == probe.seq:
                    # Direct or relayed: a probe answered (memberlist's probeNode).
                    self.health.apply(-1)
                    self._probe = None
                    self.stats["acks"] += 1
                elif (relay := self._relays.pop(seq, None)) is not None:
                    self._send(relay.prober, Ack(relay.seq))
            case Nack(seq):
                if self._probe is not None and seq == self._probe.seq:
                    self._probe.nacks += 1
                    self.stats["nacks_received"] += 1
            case PingReq(seq, target, target_addr):
                ours = self._next_seq()
                cfg = self.config
                nack_at = self.now + int(cfg.probe_timeout * NACK_SHARE) if cfg.lifeguard else None
                self._relays[ours] = Relay(addr, seq, nack_at, self.now + cfg.probe_interval)
                self._send(target_addr, Ping(ours, target))
            case Sync(reply):
                if reply:
                    self._send_state(addr, reply=False)
            case Gossip():
                pass

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & SEQ_MASK
        return self._seq

    # -- state -------------------------------------------------------------------------------

    def _apply(self, update: Update) -> None:
        """Merge one update (``members`` has the rules); pass on whatever was news."""
        if update.node == self.id:
            self._about_me(update)
            return
        m = self.members.get(update.node)
        if m is None:
            # Suspicions and deaths of members we never knew are not news to pass on.
            if update.state is State.ALIVE and update.addr is not None:
                self._add(update, update.addr)
            return
        if is_confirmation(update, m):
            suspicion = self._suspicions.get(update.node)
            if suspicion is not None and suspicion.confirm(update.origin):
                self._queue(update)
            return
        if not overrides(update, m):
            if update.state is State.SUSPECT and m.state in GONE:
                # Its sender missed the death or the goodbye (every copy lost): tell it again,
                # or a lone suspicion of its own waits out its longest timeout.
                self._queue(m.update())
            return
        previous = m.state
        moved = update.state is State.ALIVE and (update.addr, update.meta) != (m.addr, m.meta)
        m.state, m.incarnation, m.since, m.origin = (
            update.state,
            update.incarnation,
            self.now,
            update.origin,
        )
        if update.addr is not None:
            m.addr, m.meta = update.addr, update.meta
        self._live += (update.state in LIVE) - (previous in LIVE)
        self._suspicions.pop(update.node, None)
        if update.state is State.SUSPECT:
            self._suspect(m, update.origin)
            if update.origin != self.id and self.config.lifeguard and self._probes_suspect():
                # Confirm or refute it soon (module doc, "Suspicions probed").
                self._suspected = m.node
                if not self._probed_suspect:
                    self._probe_at_once()
                self.stats["suspicion_probes"] += 1
        self._queue(update)
        if previous is not update.state or moved:
            self._changed(m, previous)

    def _probes_suspect(self) -> bool:
        """Whether to probe a member another suspects: each of the n - 2 others does with
        probability (k + 2) / (n - 2), so that k + 2 of them do on average (all of them in a
        small group), enough for k confirmations with room for loss and no more pings."""
        cfg = self.config
        others = self.size - 2
        wanted = max(1, cfg.suspicion_mult - 2) + 2
        return not self.leaving and (others <= wanted or self._rng.random() * others < wanted)

    def _add(self, update: Update, addr: Addr) -> None:
        m = Member(
            update.node, addr, State.ALIVE, update.incarnation, self.now, update.node, update.meta
        )
        self.members[update.node] = m
        self._live += 1
        # SWIM s4.3: a newcomer goes in at a random position of what is left of this round.
        self._order.insert(self._rng.randint(self._pos, len(self._order)), update.node)
        self._queue(update)
        self._changed(m, None)

    def _suspect(self, m: Member, origin: str) -> None:
        cfg = self.config
        n = self.size
        low, high = suspicion_bounds(
            cfg.suspicion_mult, cfg.suspicion_max_mult, n, cfg.probe_interval
        )
        # One confirmation at least before the minimum, when someone else can give it (doc).
        k = max(0, min(max(1, cfg.suspicion_mult - 2), n - 2))
        if not cfg.lifeguard:
            high, k = low, 0
        self._suspicions[m.node] = Suspicion(
            origin, m.incarnation, self.now, k, low, high, {origin}
        )

    def _about_me(self, update: Update) -> None:
        """Refute (SWIM s4.2): a suspicion or death of us at our incarnation or above, or an
        ALIVE above it (an earlier run's), is answered with ALIVE at a higher incarnation.
        Having to refute is a sign that we are slow (Lifeguard, "Local Health Aware Probe")."""
        me = self.members[self.id]
        if self.leaving or self.config.variant is Variant.NO_REFUTE:
            return
        if update.state is State.ALIVE:
            if update.incarnation < me.incarnation:
                return
            if update.incarnation == me.incarnation and (update.addr, update.meta) == (
                me.addr,
                me.meta,
            ):
                return  # our own record, passed on
            # Above ours (an earlier run's), or ours with another address or meta (an earlier
            # run at the same incarnation, before it was suspected): the members must learn
            # this run's, which only a higher incarnation overrides.
        elif update.incarnation < me.incarnation:
            # Its sender missed our refutation (every copy lost) and holds the suspicion until
            # its timeout: tell our incarnation again (the ack to a buddy ping carries it).
            if me.update() not in self._broadcasts:
                self._queue(me.update())
            return
        else:
            self.health.apply(1)
        me.incarnation = update.incarnation + 1
        self._queue(me.update())
        self.stats["refuted"] += 1

    def _queue(self, update: Update) -> None:
        self._broadcasts.add(update, update_size(update))

    def _changed(self, m: Member, previous: State | None) -> None:
        if previous is State.SUSPECT and m.state is State.ALIVE:
            self.stats["suspicions_refuted"] += 1
        elif m.state is not State.ALIVE:
            self.stats[m.state.name.lower()] += 1
        self._out.append(Changed(m.node, m.addr, m.state, m.incarnation, previous, m.meta))

    # -- dissemination -----------------------------------------------------------------------

    def _send(self, addr: Addr, message: Message, first: list[Update] | None = None) -> None:
        """Send ``message`` to ``addr`` carrying ``first``, then as many queued updates as fit
        in ``max_datagram`` (least sent first); a Gossip with nothing to carry is not sent."""
        updates = first or []
        budget = self.config.max_datagram - base_size(self.id, message)
        budget -= sum(map(update_size, updates))
        limit = retransmit_limit(self.config.retransmit_mult, self.size)
        updates += self._broadcasts.take(budget, limit)
        if isinstance(message, Gossip) and not updates:
            return
        self._out.append(Send(addr, Packet(self.id, message, tuple(updates))))

    def _gossip(self) -> None:
        if not self._broadcasts:
            return
        gone_since = self.now - self.config.gossip_to_dead
        targets = [
            m
            for m in self.members.values()
            if m.node != self.id
            and (m.state in LIVE or (m.state is State.DEAD and m.since > gone_since))
        ]
        for m in self._rng.sample(targets, min(self.config.gossip_nodes, len(targets))):
            self._send(m.addr, Gossip())
        self.stats["gossip_rounds"] += 1

    def _take(self) -> list[Effect]:
        out, self._out = self._out, []
        return out
