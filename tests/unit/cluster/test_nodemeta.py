"""The gossip metadata a node announces (broker.cluster.nodemeta) and what the membership does
with the members' (broker.cluster.membership_service): the encoding round trip, a strict
decoder that ignores unknown keys, the 255-byte bound; the allowlist and the user-space
filter's rule for strangers."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.cluster.gossip.members import Member
from broker.cluster.gossip.messages import Changed, Gossip, Packet, Ping, State, Sync, Update
from broker.cluster.gossip.options import SwimConfig
from broker.cluster.membership_service import MembershipService
from broker.cluster.nodemeta import MAX_META, MetaError, NodeMeta, cluster_id
from broker.cluster.nodesettings import GossipSettings

ports = st.integers(1, 65535)
addresses = st.text(alphabet="0123456789.:[]abcdef", max_size=45)


@given(ports, st.integers(1, 65535), addresses, addresses)
def test_round_trip(raft: int, workers: int, mqtt: str, http: str) -> None:
    meta = NodeMeta(raft, workers, mqtt, http)
    data = meta.encode()
    assert len(data) <= MAX_META
    assert NodeMeta.decode(data) == meta


def test_the_encoding_is_small_json_and_unknown_keys_are_ignored() -> None:
    data = NodeMeta(7950, 2, "10.0.0.1:1883", "10.0.0.1:8080").encode()
    assert data == b'{"raft":7950,"workers":2,"mqtt":"10.0.0.1:1883","http":"10.0.0.1:8080"}'
    assert NodeMeta(7950, 1).encode() == b'{"raft":7950,"workers":1}'
    later = b'{"raft":7950,"workers":1,"zone":"eu-1","draining":true}'
    assert NodeMeta.decode(later) == NodeMeta(7950, 1)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "not JSON"),
        (b"\xff", "not JSON"),
        (b"[7950, 1]", "not a JSON object"),
        (b'{"workers": 1}', "integers"),
        (b'{"raft": "7950", "workers": 1}', "integers"),
        (b'{"raft": true, "workers": 1}', "integers"),
        (b'{"raft": 7950, "workers": 1.5}', "integers"),
        (b'{"raft": 0, "workers": 1}', "raft port 0"),
        (b'{"raft": 65536, "workers": 1}', "raft port"),
        (b'{"raft": 7950, "workers": 0}', "worker count 0"),
        (b'{"raft": 7950, "workers": 1, "mqtt": 1883}', "strings"),
    ],
)
def test_bad_meta_is_refused_with_a_reason(data: bytes, says: str) -> None:
    with pytest.raises(MetaError, match=says):
        NodeMeta.decode(data)


def test_meta_over_255_bytes_is_refused_at_encoding() -> None:
    with pytest.raises(MetaError, match="at most 255"):
        NodeMeta(7950, 1, "m" * 200, "h" * 100).encode()


def _service() -> MembershipService:
    settings = GossipSettings(
        bind=("127.0.0.1", 0),
        seeds=[("127.0.0.1", 1)],
        swim=SwimConfig(),
        meta=NodeMeta(7950, 1),
    )
    return MembershipService("n1", settings, b"s" * 32)


def test_allowlist_and_the_stranger_rule() -> None:
    """Members' and seeds' hosts are allowed; an authenticated datagram from another host is
    refused unless it is a Sync or carries its sender's own ALIVE; observers hear every
    change; a member's bad metadata is refused and counted, its Raft address never dialled."""

    async def main() -> None:
        service = _service()
        heard: list[frozenset[str]] = []
        dialled: list[tuple[str, tuple[str, int]]] = []
        service.on_member = lambda name, addr: dialled.append((name, addr))
        await service.start()
        try:
            service.subscribe(heard.append)
            assert heard == [frozenset({"127.0.0.1"})]  # itself and the seed
            stranger = ("10.9.9.9", 7946)
            ping = Packet("n9", Ping(1, "n1"))
            assert not service._accept(stranger, ping)
            assert service._accept(stranger, Packet("n9", Sync(True)))
            own = Update(State.ALIVE, "n9", 3, "n9", stranger, b"")
            assert service._accept(stranger, Packet("n9", Gossip(), (own,)))
            other = Update(State.ALIVE, "n8", 3, "n8", ("10.9.9.8", 7946), b"")
            assert not service._accept(stranger, Packet("n9", Gossip(), (other,)))

            good = NodeMeta(7960, 1).encode()
            service._on_change(Changed("n2", ("10.0.0.2", 7946), State.ALIVE, 0, None, good))
            assert dialled == [("n2", ("10.0.0.2", 7960))]
            service._on_change(Changed("n3", ("10.0.0.3", 7946), State.ALIVE, 0, None, b"junk"))
            assert service.stats()["bad_meta"] == 1 and "n3" in service.bad_meta
            assert dialled == [("n2", ("10.0.0.2", 7960))]
        finally:
            service.close()

    asyncio.run(main())


def test_a_dead_member_stays_allowed_for_replace_after_then_goes() -> None:
    """A member declared dead, or that left, stays on the allowlist (so it can refute or
    rejoin through a filter in front of the codec) for ``replace_after``, then is off it;
    observers hear the removal when the time passes."""

    async def main() -> None:
        settings = GossipSettings(
            ("127.0.0.1", 0), [("127.0.0.1", 1)], SwimConfig(), NodeMeta(7950, 1), 0.3
        )
        service = MembershipService("n1", settings, b"s" * 32)
        await service.start()
        now = int(asyncio.get_running_loop().time() * 1000)

        def member(node: str, host: str, state: State, since: int) -> Member:
            return Member(node, (host, 7946), state, 1, since, node)

        members = [
            member("n2", "10.0.0.2", State.ALIVE, now),
            member("n3", "10.0.0.3", State.DEAD, now),
            member("n4", "10.0.0.4", State.LEFT, now),
            member("n5", "10.0.0.5", State.DEAD, now - 10_000),
            member("n6", "10.0.0.6", State.SUSPECT, now),
        ]
        service.core_members = lambda: members  # type: ignore[method-assign]
        heard: list[frozenset[str]] = []
        try:
            service.subscribe(heard.append)
            service._on_change(Changed("n3", ("10.0.0.3", 7946), State.DEAD, 1, State.SUSPECT))
            # n4 left just now (a drain for maintenance): allowed as long as a dead one.
            assert service.allowlist == {
                "127.0.0.1",
                "10.0.0.2",
                "10.0.0.3",
                "10.0.0.4",
                "10.0.0.6",
            }
            await asyncio.sleep(0.5)
            assert service.allowlist == {"127.0.0.1", "10.0.0.2", "10.0.0.6"}
            assert heard[-1] == service.allowlist
        finally:
            service.close()

    asyncio.run(main())


async def _two_members(seed: str) -> tuple[MembershipService, MembershipService]:
    """Members "a" (Raft port 7950) and "b" (7960) on real UDP on 127.0.0.1, fast timings; b
    joins through a, named by ``seed``."""
    fast = SwimConfig(probe_interval=50, probe_timeout=20, gossip_interval=10, join_retry=50)
    a = MembershipService(
        "a", GossipSettings(("127.0.0.1", 0), [], fast, NodeMeta(7950, 1)), b"k" * 32
    )
    await a.start()
    assert a.endpoint is not None
    port = a.endpoint.core.addr[1]
    b = MembershipService(
        "b", GossipSettings(("127.0.0.1", 0), [(seed, port)], fast, NodeMeta(7960, 1)), b"k" * 32
    )
    await b.start()
    return a, b


def test_two_services_see_each_other_and_the_allowlist_follows(
    unused_udp_port: int = 0,
) -> None:
    """Real UDP on 127.0.0.1: two members join, each sees the other alive with its metadata,
    and the stats carry every counter (0 until counted)."""

    async def main() -> None:
        a, b = await _two_members(seed="localhost")
        assert a.endpoint is not None
        port = a.endpoint.core.addr[1]
        try:
            assert b.seeds == [("127.0.0.1", port)]
            raft = await asyncio.wait_for(b.formed(1.0), 10)
            assert raft == {"a": ("127.0.0.1", 7950), "b": ("127.0.0.1", 7960)}
            view = {m["id"]: m for m in b.view()}
            assert view["a"]["state"] == "alive" and view["a"]["raft"] == "127.0.0.1:7950"
            stats = b.stats()
            assert stats["dropped_stranger"] == 0 and stats["received"] > 0
        finally:
            a.close()
            b.close()

    random.seed(0)
    asyncio.run(main())


def test_the_cluster_id_and_the_leaving_flag_round_trip() -> None:
    meta = NodeMeta(7950, 1, cluster=cluster_id(["n2", "n1"]), leaving=True)
    assert NodeMeta.decode(meta.encode()) == meta
    assert cluster_id(["n1", "n2"]) == meta.cluster != cluster_id(["n1", "n2", "n3"])
    with pytest.raises(MetaError, match="leaving a boolean"):
        NodeMeta.decode(b'{"raft": 7950, "workers": 1, "leaving": 1}')


def test_a_member_announces_new_metadata_and_the_others_hear_it() -> None:
    """``announce`` (a higher incarnation) replaces what the members hold of this one: the
    id of the member list it formed with, then that it is leaving."""

    async def main() -> None:
        a, b = await _two_members(seed="127.0.0.1")
        try:
            await asyncio.wait_for(b.formed(1.0), 10)
            assert b.cluster_ids() == {} and b.leaving() == set()
            a.announce(cluster="abc")
            a.announce(leaving=True)
            for _ in range(200):
                if b.leaving() == {"a"}:
                    break
                await asyncio.sleep(0.01)
            assert b.cluster_ids() == {"a": "abc"} and b.leaving() == {"a"}
            assert b.raft_addresses()["a"] == ("127.0.0.1", 7950)  # the rest unchanged
        finally:
            a.close()
            b.close()

    asyncio.run(main())
