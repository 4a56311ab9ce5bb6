"""The keepalive decision [MQTT-3.1.2-24] and the CONNECT timeout, on a fake clock.

The transport is driven directly (no sockets, no event loop): a fake server supplies the
clock and the config, a fake router accepts the CONNECT.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from broker.auth import AuthService
from broker.config import Config, RouterConfig
from broker.metrics.collector import Metrics
from broker.mqtt.connection import keepalive_expired
from broker.mqtt.reason_codes import ReasonCode
from broker.net.keepalive import KeepaliveWheel, keepalive_deadline, link_expired
from broker.net.parking import ParkingLot
from broker.net.transport import MQTTProtocol
from broker.server import TICK_SECONDS, Server
from tests.mqttbytes import connect311


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeRouter:
    def __init__(self) -> None:
        self.connects: list[Any] = []

    def connect(self, link: Any, packet: Any, username: str | None = None) -> tuple[object, int]:
        self.connects.append(packet)
        return object(), packet.keepalive


class FakeServer:
    def __init__(self, clock: FakeClock, connect_timeout: int = 10) -> None:
        self.monotonic = clock
        self.config = Config(
            router=dataclasses.replace(RouterConfig(), connect_timeout=connect_timeout)
        )
        self.router = FakeRouter()
        self.metrics = Metrics()
        self.auth = AuthService(self.config.auth, clock)  # anonymous: no thread needed
        self.links: set[Any] = set()
        self.keepalive: KeepaliveWheel[Any] = KeepaliveWheel(TICK_SECONDS, clock())
        self.parking = ParkingLot(None, 0, clock())  # never parks
        self.flushed: list[Any] = []
        self.peer_flushes = 0  # flush_peers() calls
        self.session_claims = None  # one worker: no session claims
        self.handoff = None  # one worker: no hand-off

    def want_flush(self, link: Any) -> None:
        self.flushed.append(link)

    def flush_peers(self) -> None:
        self.peer_flushes += 1


def connected(keepalive: int) -> tuple[MQTTProtocol, FakeClock]:
    clock = FakeClock()
    server = FakeServer(clock)
    proto = MQTTProtocol(server)  # type: ignore[arg-type]
    proto.data_received(connect311("k", keepalive=keepalive))
    assert server.router.connects, "CONNECT not handed to the router"
    assert proto.keepalive == keepalive
    return proto, clock


@pytest.mark.parametrize(
    ("keepalive", "idle", "expired"),
    [
        (10, 0.0, False),
        (10, 14.99, False),
        (10, 15.0, False),  # exactly 1.5 x: not yet
        (10, 15.01, True),
        (1, 1.49, False),
        (1, 1.51, True),
        (0, 10**6, False),  # 0 turns keepalive off (s3.1.2.10)
        (65535, 98302.0, False),
        (65535, 98303.0, True),
    ],
)
def test_keepalive_expired_function(keepalive: int, idle: float, expired: bool) -> None:
    assert keepalive_expired(keepalive, 50.0, 50.0 + idle) is expired


def test_transport_closes_after_one_and_a_half_keepalive() -> None:
    proto, clock = connected(10)
    clock.now += 15.0
    assert not link_expired(proto, clock())
    clock.now += 0.01
    assert link_expired(proto, clock())


def test_any_packet_restarts_the_keepalive_timer() -> None:
    proto, clock = connected(10)
    clock.now += 14.0
    proto.data_received(bytes.fromhex("c000"))  # PINGREQ
    clock.now += 14.0  # 28 s since CONNECT, 14 s since the last packet
    assert not link_expired(proto, clock())
    clock.now += 1.5
    assert link_expired(proto, clock())


def test_partial_packet_counts_as_activity() -> None:
    # s3.1.2.10 speaks of control packets; bytes of one arriving show the client is alive
    proto, clock = connected(2)
    clock.now += 2.9
    proto.data_received(bytes.fromhex("30"))  # first byte of a PUBLISH
    clock.now += 2.9
    assert not link_expired(proto, clock())


def test_keepalive_zero_never_expires() -> None:
    proto, clock = connected(0)
    clock.now += 10**7
    assert not link_expired(proto, clock())


def test_connect_timeout_on_fake_clock() -> None:
    clock = FakeClock()
    proto = MQTTProtocol(FakeServer(clock, connect_timeout=3))  # type: ignore[arg-type]
    clock.now += 3.0
    assert not link_expired(proto, clock())
    clock.now += 0.01
    assert link_expired(proto, clock())  # s3.1.4: no CONNECT in time


def test_bytes_before_connect_do_not_extend_the_connect_timeout() -> None:
    clock = FakeClock()
    proto = MQTTProtocol(FakeServer(clock, connect_timeout=3))  # type: ignore[arg-type]
    clock.now += 2.0
    proto.data_received(connect311("k", keepalive=60)[:4])  # an incomplete CONNECT
    clock.now += 1.5
    assert link_expired(proto, clock())


# ---------------------------------------------------------------- the wheel


class Closable:
    """What Server.check_keepalives needs of a link, over a real MQTTProtocol's decision."""

    def __init__(self, proto: MQTTProtocol) -> None:
        self.proto = proto
        self.closed: int | None = None
        self.client_id = "k"
        self.peer = "test"

    # What the keepalive check reads (broker.net.keepalive.Watched), from the real protocol.
    session = property(lambda self: self.proto.session)
    connected_at = property(lambda self: self.proto.connected_at)
    connect_timeout = property(lambda self: self.proto.connect_timeout)
    keepalive = property(lambda self: self.proto.keepalive)
    last_received = property(lambda self: self.proto.last_received)

    def close(self, reason_code: int | None = None, reason: str = "") -> None:
        self.closed = reason_code


def ticking(proto: MQTTProtocol, clock: FakeClock, seconds: float) -> Closable:
    """Run the server's keepalive check every tick for up to ``seconds``, until it closes
    the link."""
    server = proto.edge
    link = Closable(proto)
    deadline = keepalive_deadline(proto)
    assert deadline is not None
    server.keepalive = KeepaliveWheel(TICK_SECONDS, clock())
    server.keepalive.file(link, deadline)
    end = clock.now + seconds
    while clock.now < end and link.closed is None:
        clock.now += TICK_SECONDS
        Server.check_keepalives(server, clock.now)  # type: ignore[arg-type]
    return link


def test_a_silent_client_is_closed_at_the_first_tick_after_one_and_a_half_keepalive() -> None:
    proto, clock = connected(10)
    start = clock.now
    link = ticking(proto, clock, 60)
    assert link.closed == 0x8D  # Keep Alive timeout [MQTT-3.1.2-24]
    assert 15.0 < clock.now - start <= 15.0 + TICK_SECONDS


def test_a_live_client_is_looked_at_once_per_one_and_a_half_keepalive() -> None:
    proto, clock = connected(10)
    start = clock.now
    server = proto.edge
    link = Closable(proto)
    server.keepalive.file(link, keepalive_deadline(proto))
    looks = 0
    while clock.now - start < 100:
        clock.now += TICK_SECONDS
        proto.data_received(bytes.fromhex("c000"))  # a PINGREQ every tick
        looks += len(server.keepalive.due(clock.now))
        deadline = keepalive_deadline(proto)
        assert deadline is not None
        server.keepalive.file(link, deadline)
    assert link.closed is None
    assert looks <= 100 / 15 + 1  # not 200, as scanning every tick would


def test_keepalive_zero_leaves_the_wheel() -> None:
    clock = FakeClock()
    server = FakeServer(clock)
    proto = MQTTProtocol(server)  # type: ignore[arg-type]
    server.keepalive.file(proto, keepalive_deadline(proto))  # as connection_made does
    assert len(server.keepalive) == 1
    proto.data_received(connect311("k", keepalive=0))
    assert keepalive_deadline(proto) is None
    assert len(server.keepalive) == 0
    # Past any deadline a CONNECT could file (the longest keepalive is 65535 s, x 1.5); the
    # wheel walks every slot up to it, so not further.
    assert server.keepalive.due(clock.now + 1.5 * 65535 + 1) == []


def test_the_connect_timeout_is_kept_by_the_wheel() -> None:
    clock = FakeClock()
    server = FakeServer(clock, connect_timeout=3)
    proto = MQTTProtocol(server)  # type: ignore[arg-type]
    link = ticking(proto, clock, 10)
    assert link.closed == 0x8D
    assert 3.0 < clock.now - 1000.0 <= 3.0 + TICK_SECONDS


def test_the_connect_refiles_a_shorter_deadline() -> None:
    clock = FakeClock()
    server = FakeServer(clock, connect_timeout=30)
    proto = MQTTProtocol(server)  # type: ignore[arg-type]
    server.keepalive.file(proto, keepalive_deadline(proto))
    proto.data_received(connect311("k", keepalive=2))  # keepalive 2: expires at 3 s, not at 30
    assert server.keepalive.due(clock.now + 2.9) == []
    assert server.keepalive.due(clock.now + 3.0) == [proto]


def test_wheel_hands_each_item_out_once_and_skips_discarded_and_refiled() -> None:
    wheel: KeepaliveWheel[str] = KeepaliveWheel(0.5, 100.0)
    wheel.file("a", 101.0)
    wheel.file("b", 101.2)
    wheel.file("c", 101.0)
    wheel.file("d", 99.0)  # already past: looked at on the next tick
    wheel.discard("c")
    wheel.file("b", 105.0)  # moved later: the entry at 101.5 is stale
    assert wheel.due(100.4) == []
    assert wheel.due(100.5) == ["d"]
    assert wheel.due(101.6) == ["a"]
    assert wheel.due(104.9) == []
    assert wheel.due(200.0) == ["b"]
    assert len(wheel) == 0


def test_wheel_after_most_items_left_keeps_the_rest() -> None:
    """Handing out more items than stay copies the rest into a dict of their size (a dict
    keeps its table after deletions: the parking wheel empties as its connections park)."""
    wheel: KeepaliveWheel[int] = KeepaliveWheel(0.5, 100.0)
    for i in range(1000):
        wheel.file(i, 101.0)
    wheel.file(1000, 110.0)
    assert wheel.due(101.0) == list(range(1000))
    assert len(wheel) == 1
    wheel.file(1000, 120.0)  # moved: the entry at 110 is stale
    assert wheel.due(115.0) == []
    assert wheel.due(120.0) == [1000]


def test_a_link_closed_writes_the_workers_frames_before_its_last_output() -> None:
    """A close writes the link's output at once (not at the end of the iteration): the
    frames to the other workers go first, as ``Server._flush_links`` sends them (its
    docstring: a commit's announcement before its PUBACK)."""
    proto, _ = connected(10)
    server = proto.edge
    assert server.peer_flushes == 0
    proto.close(ReasonCode.SERVER_SHUTTING_DOWN, "stopping")
    assert server.peer_flushes == 1
