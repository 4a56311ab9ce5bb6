"""The SWIM core, message by message: precedence (SWIM s4.2), refutation, suspicion timeouts
(Lifeguard, "Local Health Aware Suspicion"), the local health multiplier and nacks ("Local
Health Aware Probe"), the buddy system and the retransmit limit (SWIM s4.1)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from broker.cluster.gossip.broadcasts import Broadcasts
from broker.cluster.gossip.health import (
    retransmit_limit,
    suspicion_bounds,
    suspicion_timeout,
)
from broker.cluster.gossip.members import Member, is_confirmation, overrides
from broker.cluster.gossip.messages import (
    Ack,
    Changed,
    Effect,
    Gossip,
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
from broker.cluster.gossip.swim import Swim

A, S, D, L = State.ALIVE, State.SUSPECT, State.DEAD, State.LEFT


def addr(i: int) -> tuple[str, int]:
    return (f"10.0.0.{i}", 7946)


def alive(i: int, incarnation: int = 0) -> Update:
    return Update(A, f"n{i}", incarnation, f"n{i}", addr(i))


def core(members: int = 1, **config: object) -> Swim:
    """n0 knowing n1..n(members-1), all alive at incarnation 0."""
    swim = Swim("n0", addr(0), random.Random(7), SwimConfig(**config), now=0)  # type: ignore[arg-type]
    swim.receive(addr(1), Packet("n1", Gossip(), tuple(alive(i) for i in range(1, members))), 0)
    return swim


def sends(effects: list[Effect]) -> list[Send]:
    return [e for e in effects if isinstance(e, Send)]


def changes(effects: list[Effect]) -> list[Changed]:
    return [e for e in effects if isinstance(e, Changed)]


def run_until_probe(swim: Swim) -> Send:
    """Tick until the core pings someone; that ping."""
    for _ in range(10):
        for send in sends(swim.tick(swim.deadline)):
            if isinstance(send.packet.message, Ping):
                return send
    raise AssertionError("no probe")


# -- precedence (SWIM s4.2) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("held", "held_inc", "state", "inc", "wins"),
    [
        (A, 1, A, 2, True),
        (A, 1, A, 1, False),
        (A, 1, S, 1, True),
        (A, 1, S, 0, False),
        (A, 1, D, 1, True),
        (A, 1, D, 0, False),
        (A, 1, L, 1, True),
        (S, 1, A, 1, False),
        (S, 1, A, 2, True),
        (S, 1, S, 1, False),  # a confirmation, not a change
        (S, 1, S, 2, True),
        (S, 1, D, 1, True),
        (S, 1, D, 0, False),
        (D, 1, A, 1, False),
        (D, 1, A, 2, True),  # a rejoin or a refutation
        (D, 1, S, 5, False),
        (D, 1, L, 5, False),
        (L, 1, A, 2, True),
        (L, 1, S, 3, False),
        (L, 1, D, 3, False),
    ],
)
def test_precedence(held: State, held_inc: int, state: State, inc: int, wins: bool) -> None:
    member = Member("n1", addr(1), held, held_inc, 0, "n1")
    update = Update(state, "n1", inc, "n2", addr(1) if state is A else None)
    assert overrides(update, member) is wins


def test_a_suspicion_at_the_same_incarnation_is_a_confirmation() -> None:
    member = Member("n1", addr(1), S, 3, 0, "n2")
    assert is_confirmation(Update(S, "n1", 3, "n4"), member)
    assert not is_confirmation(Update(S, "n1", 4, "n4"), member)


def test_stale_updates_never_undo_a_death_at_a_higher_incarnation() -> None:
    swim = core(3)
    swim.receive(addr(1), Packet("n1", Gossip(), (Update(D, "n2", 4, "n1"),)), 10)
    swim.receive(addr(2), Packet("n2", Gossip(), (Update(A, "n2", 4, "n2", addr(2)),)), 20)
    assert swim.members["n2"].state is D
    swim.receive(addr(2), Packet("n2", Gossip(), (Update(A, "n2", 5, "n2", addr(2)),)), 30)
    assert (swim.members["n2"].state, swim.members["n2"].incarnation) == (A, 5)


# -- refutation ------------------------------------------------------------------------------


def test_a_suspected_member_refutes_with_a_higher_incarnation() -> None:
    swim = core(3)
    out = swim.receive(addr(1), Packet("n1", Ping(9, "n0"), (Update(S, "n0", 0, "n1"),)), 5)
    assert swim.incarnation == 1
    assert (
        swim.health.score == 1
    )  # having to refute is a sign of being slow (Lifeguard, "Local Health Aware Probe")
    [ack] = sends(out)
    assert ack.packet.message == Ack(9)
    assert Update(A, "n0", 1, "n0", addr(0)) in ack.packet.updates  # the ack carries it


def test_a_death_notice_about_oneself_is_refuted_past_its_incarnation() -> None:
    swim = core(2)
    swim.receive(addr(1), Packet("n1", Gossip(), (Update(D, "n0", 6, "n1"),)), 5)
    assert swim.incarnation == 7 and swim.members["n0"].state is A


def test_old_suspicions_of_oneself_are_ignored() -> None:
    swim = core(2)
    swim.receive(addr(1), Packet("n1", Gossip(), (Update(S, "n0", 0, "n1"),)), 5)
    swim.receive(addr(1), Packet("n1", Gossip(), (Update(S, "n0", 0, "n1"),)), 6)
    assert swim.incarnation == 1


def test_a_stale_suspicion_of_oneself_is_answered_with_the_current_incarnation() -> None:
    """n1 missed every copy of our refutation and still suspects us at incarnation 0: its
    buddy ping's ack must carry our ALIVE at 1 again, or n1 declares us dead at its timeout."""
    swim = core(3)
    swim.receive(addr(2), Packet("n2", Gossip(), (Update(S, "n0", 0, "n2"),)), 5)
    refutation = Update(A, "n0", 1, "n0", addr(0))
    now = 5
    while refutation in swim._broadcasts:  # its retransmit limit, spent
        now += 200
        swim.tick(now)
    out = swim.receive(addr(1), Packet("n1", Ping(9, "n0"), (Update(S, "n0", 0, "n1"),)), now)
    [ack] = sends(out)
    assert ack.packet.message == Ack(9) and refutation in ack.packet.updates
    assert swim.incarnation == 1  # told again, not raised


def test_the_no_refute_variant_does_not_refute() -> None:
    swim = core(2, variant=Variant.NO_REFUTE)
    swim.receive(addr(1), Packet("n1", Gossip(), (Update(S, "n0", 0, "n1"),)), 5)
    assert swim.incarnation == 0


# -- probing, suspicion, Lifeguard -----------------------------------------------------------


def test_a_failed_probe_asks_k_members_then_suspects_and_the_health_score_rises() -> None:
    swim = core(6)  # n0 and five others
    ping = run_until_probe(swim)
    target = ping.packet.message
    assert isinstance(target, Ping)
    started = swim.now
    out = swim.tick(started + 500)  # probe_timeout: ping-req through indirect_checks members
    reqs = [s for s in sends(out) if isinstance(s.packet.message, PingReq)]
    assert len(reqs) == 3 and all(r.addr != ping.addr for r in reqs)
    swim.receive(reqs[0].addr, Packet("nX", Nack(target.seq)), started + 900)
    out = swim.tick(started + 1000)  # the period's end: no ack
    [changed] = changes(out)
    assert (changed.node, changed.state) == (target.target, S)
    assert swim.health.score == 2  # two nacks missing out of three
    # The next probe starts at once (the failed one used its whole period); its timeout and
    # its end are three times as long (score + 1).
    assert any(isinstance(s.packet.message, Ping) for s in sends(out))
    probe = swim._probe
    assert probe is not None
    assert (probe.timeout_at, probe.deadline) == (started + 1000 + 3 * 500, started + 1000 + 3000)


def answer_probes(swim: Swim, until: int) -> list[tuple[int, int]]:
    """Ack every ping of ``swim`` 5 ms after it is sent, until ``until`` ms: (when each ping
    was sent, the score once it was acked)."""
    pings: list[tuple[int, int]] = []
    while swim.deadline <= until:
        for send in sends(swim.tick(swim.deadline)):
            if isinstance(send.packet.message, Ping):
                ack = Packet(send.packet.message.target, Ack(send.packet.message.seq))
                swim.receive(send.addr, ack, swim.now + 5)
                pings.append((swim.now - 5, swim.health.score))
    return pings


def test_answered_probes_keep_the_base_period_so_the_score_falls_one_a_period() -> None:
    """memberlist's probe ticker runs at the base interval and only a probe that runs over
    stretches it: a member back from a cut, its score at the maximum (7), is healthy again
    after 7 answered probes, 7 s, not after 8 + 7 + ... + 2 = 35 s of stretched periods."""
    swim = core(5)
    swim.health.apply(7)
    pings = answer_probes(swim, until=9000)
    sent = [t for t, _ in pings]
    assert all(b - a == 1000 for a, b in itertools.pairwise(sent))
    assert [score for _, score in pings[:8]] == [6, 5, 4, 3, 2, 1, 0, 0]


def test_an_unanswered_probe_runs_its_scaled_period_and_the_next_waits_for_it() -> None:
    """At score 3 a probe may run 4 periods before its target is suspected; no other probe
    starts meanwhile, and the core is never due in the past (a driver would spin)."""
    swim = core(5)
    swim.health.apply(3)
    first = run_until_probe(swim).packet.message
    assert isinstance(first, Ping)
    started = swim.now
    pings: list[Ping] = []
    while swim.now < started + 4000:
        assert swim.deadline > swim.now
        out = swim.tick(swim.deadline)
        pings += [s.packet.message for s in sends(out) if isinstance(s.packet.message, Ping)]
    assert swim.now == started + 4000
    assert [c.state for c in changes(out) if c.node == first.target] == [S]
    assert len(pings) == 1  # the next probe, as the first ended


def test_a_relayed_ack_lowers_the_score_as_a_direct_one_does() -> None:
    swim = core(5)
    swim.health.apply(2)
    ping = run_until_probe(swim)
    assert isinstance(ping.packet.message, Ping)
    out = swim.tick(swim.now + 3 * 500)  # the direct ping's (scaled) timeout: ping-req
    [req, *_] = [s for s in sends(out) if isinstance(s.packet.message, PingReq)]
    swim.receive(req.addr, Packet("nX", Ack(ping.packet.message.seq)), swim.now + 20)
    assert swim.health.score == 1 and swim._probe is None


def test_an_ack_in_time_lowers_the_score_and_nothing_is_suspected() -> None:
    swim = core(3)
    swim.health.apply(4)
    ping = run_until_probe(swim)
    assert isinstance(ping.packet.message, Ping)
    out = swim.receive(ping.addr, Packet("n1", Ack(ping.packet.message.seq)), swim.now + 10)
    assert swim.health.score == 3 and not changes(out)
    assert not changes(swim.tick(swim.now + 5000))


def test_without_lifeguard_the_score_stays_at_zero() -> None:
    swim = core(3, lifeguard=False)
    run_until_probe(swim)
    swim.tick(swim.now + 500)
    swim.tick(swim.now + 1000)
    assert swim.health.score == 0


def test_an_intermediary_relays_the_ack_or_nacks() -> None:
    swim = core(3)
    out = swim.receive(addr(1), Packet("n1", PingReq(77, "n2", addr(2))), 1000)
    [ping] = sends(out)
    assert ping.addr == addr(2) and isinstance(ping.packet.message, Ping)
    relayed = swim.receive(addr(2), Packet("n2", Ack(ping.packet.message.seq)), 1100)
    assert [(s.addr, s.packet.message) for s in sends(relayed)] == [(addr(1), Ack(77))]
    # Another ping-req whose target stays silent: a nack at 80% of probe_timeout.
    out = swim.receive(addr(1), Packet("n1", PingReq(78, "n2", addr(2))), 2000)
    assert not [s for s in sends(swim.tick(2399)) if isinstance(s.packet.message, Nack)]
    nacks = [s for s in sends(swim.tick(2400)) if isinstance(s.packet.message, Nack)]
    assert [(s.addr, s.packet.message) for s in nacks] == [(addr(1), Nack(78))]


def test_a_ping_to_a_suspect_carries_the_suspicion_buddy_system() -> None:
    swim = core(2)
    swim.receive(addr(3), Packet("n3", Gossip(), (Update(S, "n1", 0, "n3"),)), 1)
    ping = run_until_probe(swim)
    assert ping.addr == addr(1)
    assert Update(S, "n1", 0, "n0") in ping.packet.updates


def test_the_suspicion_timeout_shrinks_with_independent_confirmations() -> None:
    swim = core(10)  # n = 10: min = 4 s, max = 24 s, k = suspicion_mult - 2 = 2
    swim.receive(addr(3), Packet("n3", Gossip(), (Update(S, "n1", 0, "n3"),)), 1000)
    suspicion = swim._suspicions["n1"]
    assert suspicion.deadline == 1000 + 24_000
    swim.receive(addr(3), Packet("n3", Gossip(), (Update(S, "n1", 0, "n3"),)), 1100)
    assert suspicion.deadline == 1000 + 24_000  # the same origin counts once
    swim.receive(addr(4), Packet("n4", Gossip(), (Update(S, "n1", 0, "n4"),)), 1200)
    assert suspicion.deadline == 1000 + math.floor(24_000 - 20_000 * math.log(2) / math.log(3))
    swim.receive(addr(5), Packet("n5", Gossip(), (Update(S, "n1", 0, "n5"),)), 1300)
    assert suspicion.deadline == 1000 + 4000
    assert not [c for c in changes(swim.tick(4999)) if c.node == "n1"]
    [dead] = [c for c in changes(swim.tick(5000)) if c.node == "n1"]
    assert dead.state is D


def test_a_lone_suspicion_waits_the_maximum_even_at_a_multiplier_of_two() -> None:
    """memberlist's k = suspicion_mult - 2 is 0 at 2: the minimum at once. Here one
    confirmation is needed whenever another member can give it (n > 2)."""
    swim = core(5, suspicion_mult=2)  # n = 5: min 2 s, max 12 s, k = 1
    swim.receive(addr(3), Packet("n3", Gossip(), (Update(S, "n1", 0, "n3"),)), 1000)
    suspicion = swim._suspicions["n1"]
    assert suspicion.deadline == 1000 + 12_000
    swim.receive(addr(4), Packet("n4", Gossip(), (Update(S, "n1", 0, "n4"),)), 2100)
    assert suspicion.deadline == 1000 + 2000
    pair = core(2, suspicion_mult=2)  # n = 2: nobody else to confirm, the minimum at once
    pair.receive(addr(1), Packet("n1", Gossip(), (Update(S, "n1", 0, "n0"),)), 1000)
    assert pair._suspicions["n1"].deadline == 1000 + 2000


def test_a_suspicion_heard_from_another_member_is_probed_at_once() -> None:
    """The suspect is the next member probed (at once: no probe in flight), with the
    suspicion on the ping (the buddy system); without Lifeguard the order is not changed."""
    for lifeguard in (True, False):
        swim = core(5, lifeguard=lifeguard)
        swim.receive(addr(3), Packet("n3", Gossip(), (Update(S, "n2", 0, "n3"),)), 10)
        assert swim.stats["suspicion_probes"] == lifeguard
        if lifeguard:
            assert swim.deadline == 10
            [ping] = [s for s in sends(swim.tick(10)) if isinstance(s.packet.message, Ping)]
            assert isinstance(ping.packet.message, Ping) and ping.packet.message.target == "n2"
            assert Update(S, "n2", 0, "n0") in ping.packet.updates
        else:
            assert swim._urgent is None


def test_suspicion_probes_leave_every_other_period_to_the_round_robin_order() -> None:
    """However many suspicions come, a probe of a suspect is never followed by another: the
    order must still reach a member that died silently."""
    swim = core(5)
    kinds = []
    for i in range(6):
        n, origin = 1 + i % 2, 3 + i % 2
        swim.receive(addr(n), Packet(f"n{n}", Gossip(), (alive(n, i + 1),)), swim.now)
        heard = (Update(S, f"n{n}", i + 1, f"n{origin}"),)
        swim.receive(addr(origin), Packet(f"n{origin}", Gossip(), heard), swim.now)
        ping = run_until_probe(swim)
        assert isinstance(ping.packet.message, Ping)
        kinds.append(
            "suspect" if swim._probed_suspect and ping.packet.message.target == f"n{n}" else "order"
        )
        ack = Packet(ping.packet.message.target, Ack(ping.packet.message.seq))
        swim.receive(ping.addr, ack, swim.now)
    assert kinds == ["suspect", "order"] * 3


def test_a_member_held_dead_is_told_again_to_whoever_still_suspects_it() -> None:
    swim = core(5)
    swim.receive(addr(3), Packet("n3", Gossip(), (Update(D, "n1", 0, "n3"),)), 10)
    for _ in range(20):  # every copy of the death sent (its retransmit limit)
        swim.tick(swim.deadline)
    assert Update(D, "n1", 0, "n3") not in swim._broadcasts
    swim.receive(addr(2), Packet("n2", Gossip(), (Update(S, "n1", 0, "n2"),)), swim.now)
    assert swim.members["n1"].state is D
    sent = [u for e in sends(swim.tick(swim.now + 500)) for u in e.packet.updates]
    assert Update(D, "n1", 0, "n3") in sent


def test_without_lifeguard_the_suspicion_timeout_is_fixed_at_the_minimum() -> None:
    swim = core(10, lifeguard=False)
    swim.receive(addr(3), Packet("n3", Gossip(), (Update(S, "n1", 0, "n3"),)), 1000)
    assert swim._suspicions["n1"].deadline == 1000 + 4000


def test_a_refutation_cancels_the_suspicion() -> None:
    swim = core(10)
    swim.receive(addr(3), Packet("n3", Gossip(), (Update(S, "n1", 0, "n3"),)), 1000)
    out = swim.receive(addr(1), Packet("n1", Gossip(), (alive(1, 1),)), 2000)
    assert [(c.node, c.previous, c.state) for c in changes(out)] == [("n1", S, A)]
    assert "n1" not in swim._suspicions
    assert swim.stats["suspicions_refuted"] == 1


@pytest.mark.parametrize(
    ("n", "bounds"), [(1, (4000, 24000)), (10, (4000, 24000)), (100, (8000, 48000))]
)
def test_suspicion_bounds(n: int, bounds: tuple[int, int]) -> None:
    assert suspicion_bounds(4, 6, n, 1000) == bounds


def test_suspicion_timeout_formula() -> None:
    assert suspicion_timeout(0, 3, 2000, 30_000) == 30_000
    assert suspicion_timeout(3, 3, 2000, 30_000) == 2000
    assert suspicion_timeout(9, 3, 2000, 30_000) == 2000  # never below the minimum
    assert suspicion_timeout(5, 0, 2000, 30_000) == 2000  # k = 0: the minimum at once
    one = suspicion_timeout(1, 3, 2000, 30_000)
    assert one == math.floor(30_000 - 28_000 * math.log(2) / math.log(4)) == 16_000


# -- dissemination ---------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "limit"), [(1, 4), (9, 4), (10, 8), (99, 8), (100, 12), (200, 12)])
def test_retransmit_limit_is_lambda_log_n(n: int, limit: int) -> None:
    assert retransmit_limit(4, n) == limit


def test_an_update_is_sent_limit_times_least_sent_first_and_a_newer_one_replaces_it() -> None:
    queue = Broadcasts()
    queue.add(alive(1), 20)
    assert [queue.take(1000, limit=3) for _ in range(2)] == [[alive(1)], [alive(1)]]
    queue.add(alive(2), 20)
    assert queue.take(30, limit=3) == [alive(2)]  # the least sent goes first
    assert queue.take(1000, limit=3) == [alive(2), alive(1)]
    assert queue.take(1000, limit=3) == [alive(2)]  # alive(1) reached its limit
    assert queue.take(1000, limit=3) == []
    queue.add(alive(3), 20)
    queue.add(alive(3, 1), 20)
    assert queue.take(1000, limit=3) == [alive(3, 1)]


def test_a_core_stops_gossiping_an_update_after_the_retransmit_limit() -> None:
    swim = core(5)  # n = 5: limit 4 transmissions per update
    news = Update(D, "n4", 0, "n2")
    swim.receive(addr(2), Packet("n2", Gossip(), (news,)), 1)
    carried = 0
    for _ in range(200):
        out = sends(swim.tick(swim.deadline))
        # Full tables (to the dead n4 every reconnect_interval) are not gossip.
        carried += sum(news in s.packet.updates for s in out if s.packet.message != Sync(True))
    assert carried == retransmit_limit(4, swim.size) == 4


def test_join_asks_the_seeds_until_one_answers_and_sync_replies_with_the_table() -> None:
    swim = Swim("n0", addr(0), random.Random(1), SwimConfig(), now=0)
    out = swim.join([addr(1), addr(0)], 0)
    assert [(s.addr, s.packet.message) for s in sends(out)] == [(addr(1), Sync(True))]
    again = [s for s in sends(swim.tick(2000)) if isinstance(s.packet.message, Sync)]
    assert [s.addr for s in again] == [addr(1)]
    swim.receive(addr(1), Packet("n1", Sync(False), (alive(1), alive(2))), 2100)
    assert swim.size == 3
    assert not [s for s in sends(swim.tick(4000)) if isinstance(s.packet.message, Sync)]
    reply = sends(swim.receive(addr(2), Packet("n2", Sync(True), (alive(2),)), 4100))
    [table] = [s for s in reply if isinstance(s.packet.message, Sync)]
    assert table.packet.message == Sync(False)
    assert {u.node for u in table.packet.updates} == {"n0", "n1", "n2"}


def test_a_leaving_member_says_goodbye_and_stops_probing() -> None:
    swim = core(4)
    out = swim.leave(100)
    goodbye = Update(L, "n0", 0, "n0")
    assert any(goodbye in s.packet.updates for s in sends(out))
    for _ in range(50):
        out = swim.tick(swim.deadline)
        assert not [s for s in sends(out) if isinstance(s.packet.message, Ping)]
    assert swim.left
    other = core(3)
    [changed] = changes(
        other.receive(addr(0), Packet("n0x", Gossip(), (Update(L, "n1", 0, "n1"),)), 1)
    )
    assert (changed.node, changed.state) == ("n1", L)


def test_round_robin_probes_every_member_within_2n_minus_1_periods() -> None:
    """SWIM s4.3: with a shuffled order walked to its end, the gap between two probes of the
    same member is at most 2(n - 1) - 1 probes (n - 1 others)."""
    swim = core(6)
    last: dict[str, int] = {}
    for k in range(60):
        ping = run_until_probe(swim)
        message = ping.packet.message
        assert isinstance(message, Ping)
        if message.target in last:
            assert k - last[message.target] <= 2 * 5 - 1
        last[message.target] = k
        swim.receive(ping.addr, Packet(message.target, Ack(message.seq)), swim.now + 5)
    assert len(last) == 5


def test_a_restarted_member_refutes_its_death_and_comes_back() -> None:
    old = core(3)
    old.receive(addr(1), Packet("n1", Gossip(), (Update(D, "n2", 3, "n1"),)), 10)
    assert old.members["n2"].state is D
    # n2 restarts at incarnation 0, joins through n0 and hears from n0's table that it is dead.
    fresh = Swim("n2", addr(2), random.Random(5), SwimConfig(), now=20)
    [ask] = sends(fresh.join([addr(0)], 20))
    reply = sends(old.receive(addr(2), ask.packet, 30))
    assert old.members["n2"].state is D  # its ALIVE at 0 does not beat DEAD at 3
    for send in reply:
        fresh.receive(addr(0), send.packet, 40)
    assert fresh.incarnation == 4
    out = sends(fresh.tick(fresh.deadline))
    for send in out:
        old.receive(addr(2), send.packet, fresh.now)
    assert (old.members["n2"].state, old.members["n2"].incarnation) == (A, 4)


def test_probe_soon_probes_that_member_next_and_at_once() -> None:
    """A hint (the node's Raft link to n3 closed) brings a probe of n3 forward: sent at once
    when no probe is in flight, next after the one in flight otherwise; it suspects no one
    by itself, and a hint about an unknown or dead member is ignored."""
    swim = core(5)
    first = run_until_probe(swim)
    assert isinstance(first.packet.message, Ping)
    busy = first.packet.message.target
    other = next(f"n{i}" for i in range(1, 5) if f"n{i}" != busy)
    assert sends(swim.probe_soon(other, swim.now)) == []  # a probe is in flight
    swim.receive(first.addr, Packet(busy, Ack(first.packet.message.seq)), swim.now + 1)
    probe = run_until_probe(swim)
    assert isinstance(probe.packet.message, Ping) and probe.packet.message.target == other
    swim.receive(probe.addr, Packet(other, Ack(probe.packet.message.seq)), swim.now + 1)
    # No probe in flight: the hinted member is pinged as soon as the core is ticked.
    now = swim.now + 2
    swim.probe_soon(busy, now)
    assert swim.deadline == now
    [ping] = [s for s in sends(swim.tick(now)) if isinstance(s.packet.message, Ping)]
    assert isinstance(ping.packet.message, Ping) and ping.packet.message.target == busy
    assert all(m.state is A for m in swim.members.values())
    swim.probe_soon("n99", now)
    assert swim._urgent is None and swim.stats["probe_hints"] == 2


def test_meta_is_learned_and_a_restart_at_the_same_incarnation_refutes_past_its_old_record() -> (
    None
):
    """An ALIVE's meta is kept with the member and reported in ``Changed``; a new meta at a
    higher incarnation is a change; a member that hears its own record at its incarnation
    with another meta (an earlier run's) refutes, so the others learn this run's."""
    swim = core(1)
    [new] = changes(swim.receive(addr(1), Packet("n1", Gossip(), (meta_alive(1, 0, b"a"),)), 0))
    assert (new.node, new.meta, new.previous) == ("n1", b"a", None)
    assert swim.members["n1"].meta == b"a"
    assert (
        changes(swim.receive(addr(1), Packet("n1", Gossip(), (meta_alive(1, 0, b"b"),)), 1)) == []
    )
    [moved] = changes(swim.receive(addr(1), Packet("n1", Gossip(), (meta_alive(1, 1, b"b"),)), 2))
    assert (moved.state, moved.previous, moved.meta) == (A, A, b"b")
    assert swim.members["n1"].update().meta == b"b"

    restarted = Swim("n0", addr(0), random.Random(1), SwimConfig(), now=0, meta=b"new")
    restarted.receive(addr(1), Packet("n1", Sync(False), (meta_alive(0, 0, b"old"),)), 0)
    assert restarted.incarnation == 1 and restarted.stats["refuted"] == 1
    restarted.receive(addr(1), Packet("n1", Gossip(), (restarted.members["n0"].update(),)), 1)
    assert restarted.incarnation == 1  # its own record passed on: nothing to refute


def meta_alive(i: int, incarnation: int, meta: bytes) -> Update:
    return Update(A, f"n{i}", incarnation, f"n{i}", addr(i), meta)
