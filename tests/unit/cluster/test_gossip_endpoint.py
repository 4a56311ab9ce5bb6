"""Four gossip endpoints on 127.0.0.1, real UDP and the event loop's clock (a fast protocol
period): they converge, one closed is declared dead by the others, one leaving is seen as
left, and a stranger's datagrams (wrong magic, wrong secret, a replay) are dropped and counted
while the group carries on."""

from __future__ import annotations

import asyncio
import random
import socket

import uvloop

from broker.cluster.gossip.codec import encode
from broker.cluster.gossip.endpoint import GossipEndpoint, open_endpoint
from broker.cluster.gossip.messages import Changed, Packet, Ping, State
from broker.cluster.gossip.options import SwimConfig

SECRET = b"s" * 32
#: A protocol period of 50 ms: the whole test takes about a second.
FAST = SwimConfig(
    probe_interval=50,
    probe_timeout=20,
    gossip_interval=10,
    suspicion_mult=3,
    join_retry=100,
    sync_interval=2000,
)
WITHIN_S = 15.0


def states(endpoints: list[GossipEndpoint], node: str) -> set[State]:
    return {e.core.members[node].state for e in endpoints if node in e.core.members}


async def scenario() -> None:
    changes: list[tuple[str, Changed]] = []
    endpoints = [
        await open_endpoint(
            f"n{i}",
            ("127.0.0.1", 0),
            SECRET,
            FAST,
            random.Random(i),
            on_change=lambda c, i=i: changes.append((f"n{i}", c)),  # type: ignore[misc]
        )
        for i in range(4)
    ]
    first = endpoints[0]
    first.join([])
    for e in endpoints[1:]:
        e.join([first.core.addr])
    for e in endpoints:
        await e.until(lambda e=e: e.core.size == 4, WITHIN_S)  # type: ignore[misc]

    # A stranger: HTTP bytes, a datagram under another secret, and a replay of a member's.
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    target = first.core.addr
    stranger.sendto(b"GET / HTTP/1.1\r\n\r\n", target)
    stranger.sendto(encode(Packet("n9", Ping(1, "n0")), b"x" * 32, 1, 1), target)
    genuine = encode(Packet("n9", Ping(1, "n0")), SECRET, 1, 1)
    stranger.sendto(genuine, target)
    stranger.sendto(genuine, target)
    stranger.close()
    await first.until(
        lambda: (
            first.counters["dropped_bad_magic"] == 1
            and first.counters["dropped_bad_mac"] == 1
            and first.counters["dropped_replayed"] == 1
        ),
        WITHIN_S,
    )
    assert first.counters["errors"] == 0

    # kill: n3 stops answering; the three others declare it dead.
    endpoints[3].close()
    others = endpoints[:3]
    for e in others:
        await e.until(lambda e=e: e.core.members["n3"].state is State.DEAD, WITHIN_S)  # type: ignore[misc]
    assert {n for n, c in changes if c.node == "n3" and c.state is State.SUSPECT} == {
        "n0",
        "n1",
        "n2",
    }

    # leave: n2 says goodbye; the two others see it as left, not dead.
    await endpoints[2].leave(WITHIN_S)
    for e in endpoints[:2]:
        await e.until(lambda e=e: e.core.members["n2"].state is State.LEFT, WITHIN_S)  # type: ignore[misc]
    assert states(endpoints[:2], "n0") == states(endpoints[:2], "n1") == {State.ALIVE}
    for e in endpoints[:2]:
        e.close()


def test_endpoints_converge_detect_a_death_see_a_leave_and_drop_strangers() -> None:
    asyncio.run(scenario())


def test_under_uvloop_a_probe_hint_reschedules_a_tick_already_due() -> None:
    """uvloop hands back a plain Handle (no ``when()``) for a time already past: two hints in
    a row (a Raft link to the member closing both ways) reschedule such a tick; the probe
    goes out and the member is still alive afterwards (the broker runs on uvloop)."""

    async def main() -> None:
        a = await open_endpoint("a", ("127.0.0.1", 0), SECRET, FAST, random.Random(1))
        b = await open_endpoint("b", ("127.0.0.1", 0), SECRET, FAST, random.Random(2))
        try:
            a.join([])
            b.join([a.core.addr])
            await a.until(lambda: a.core.size == 2, WITHIN_S)
            probes = a.core.stats["probes"]
            a.probe_soon("b")
            a.probe_soon("b")
            assert a.counters["errors"] == 0
            await a.until(lambda: a.core.stats["probes"] > probes, WITHIN_S)
            assert a.core.members["b"].state is State.ALIVE
            assert a.core.stats["probe_hints"] == 2
        finally:
            a.close()
            b.close()

    uvloop.run(main())
