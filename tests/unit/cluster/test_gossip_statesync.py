"""Full state exchanges of the SWIM core (broker.cluster.gossip.statesync): a partition healed
after both sides declared each other dead merges back by the reconnect, and a DEAD in another
member's table is merged as a suspicion (memberlist's ``mergeState``)."""

from __future__ import annotations

import random

from broker.cluster.gossip.messages import Gossip, Packet, Send, State, Sync, Update
from broker.cluster.gossip.options import SwimConfig
from broker.cluster.gossip.swim import Swim
from tests.unit.cluster.test_gossip_swim import addr, alive, changes, core, sends

A, S, D = State.ALIVE, State.SUSPECT, State.DEAD


def cut_off(me: int, others: list[int], now: int) -> Swim:
    """Member ``me`` of n0..n2, holding each of ``others`` dead at incarnation 0."""
    swim = Swim(f"n{me}", addr(me), random.Random(me), SwimConfig(), now=0)
    swim.receive(addr(9), Packet("n9", Gossip(), tuple(alive(i) for i in range(3))), 0)
    deaths = tuple(Update(D, f"n{i}", 0, f"n{me}") for i in others)
    swim.receive(addr(9), Packet("n9", Gossip(), deaths), now)
    return swim


def test_a_member_held_dead_gets_our_table_every_reconnect_interval() -> None:
    swim = cut_off(0, [1], now=10)  # n2 never answers here either: declared dead in time
    tables = []
    while swim.now < 20_000:
        out = sends(swim.tick(swim.deadline))
        tables += [(swim.now, s.addr) for s in out if s.packet.message == Sync(True)]
    # None to a live member: anti-entropy's first exchange is at sync_interval (30 s).
    assert {a for _, a in tables} == {addr(1), addr(2)}
    interval = SwimConfig().reconnect_interval
    assert [t for t, _ in tables] == list(range(interval, 20_001, interval))


def test_a_healed_partition_merges_back_in_one_exchange() -> None:
    """n0 holds n1 and n2 dead (it was cut off); n1 holds n0 dead. n1's reconnect reaches n0:
    n0 refutes its death, answers with its table, and each holds the other alive; n1 does not
    take n0's word that n2 is dead (it suspects n2 instead, who will refute)."""
    n0 = cut_off(0, [1, 2], now=10)
    n1 = cut_off(1, [0], now=10)
    out: list[Send] = []
    while not out:
        now = n1.deadline
        out = [
            s for s in sends(n1.tick(now)) if (s.addr, s.packet.message) == (addr(0), Sync(True))
        ]
    assert now <= 10 + SwimConfig().reconnect_interval
    answer = sends(n0.receive(addr(1), out[0].packet, now))
    assert n0.incarnation == 1  # refuted
    [table] = [s for s in answer if isinstance(s.packet.message, Sync)]
    n1.receive(addr(0), table.packet, now + 1)
    assert (n1.members["n0"].state, n1.members["n0"].incarnation) == (A, 1)
    assert n1.members["n2"].state is S  # suspected on n0's word, not declared dead
    assert n1.incarnation == 1  # n0 held it dead: refuted, and n0 hears it by gossip
    gossip = [s for s in sends(n1.tick(n1.deadline)) if s.addr == addr(0)]
    for send in gossip:
        n0.receive(addr(1), send.packet, n1.now)
    assert n0.members["n1"].state is A


def test_a_death_in_gossip_is_still_a_death() -> None:
    swim = core(3)
    [changed] = changes(
        swim.receive(addr(1), Packet("n1", Gossip(), (Update(D, "n2", 0, "n1"),)), 5)
    )
    assert changed.state is D
    other = core(3)
    [changed] = changes(
        other.receive(addr(1), Packet("n1", Sync(False), (Update(D, "n2", 0, "n1"),)), 5)
    )
    assert changed.state is S
