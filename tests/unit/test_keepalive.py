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
from broker.metrics import Metrics
from broker.mqtt.connection import keepalive_expired
from broker.transport import MQTTProtocol


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
        self.config = Config(router=dataclasses.replace(RouterConfig(),
                                                        connect_timeout=connect_timeout))
        self.router = FakeRouter()
        self.metrics = Metrics()
        self.auth = AuthService(self.config.auth, clock)  # anonymous: no thread needed
        self.links: set[Any] = set()
        self.flushed: list[Any] = []
        self.runtime = None  # one worker: no session claims

    def want_flush(self, link: Any) -> None:
        self.flushed.append(link)


def connect311(keepalive: int) -> bytes:
    # CONNECT | 00 04 'MQTT' 04 | flags 02 | keepalive | client id 'k'
    return bytes.fromhex("100d00044d5154540402") + keepalive.to_bytes(2, "big") + \
        bytes.fromhex("00016b")


def connected(keepalive: int) -> tuple[MQTTProtocol, FakeClock]:
    clock = FakeClock()
    server = FakeServer(clock)
    proto = MQTTProtocol(server)  # type: ignore[arg-type]
    proto.data_received(connect311(keepalive))
    assert server.router.connects, "CONNECT not handed to the router"
    assert proto.keepalive == keepalive
    return proto, clock


@pytest.mark.parametrize(("keepalive", "idle", "expired"), [
    (10, 0.0, False),
    (10, 14.99, False),
    (10, 15.0, False),   # exactly 1.5 x: not yet
    (10, 15.01, True),
    (1, 1.49, False),
    (1, 1.51, True),
    (0, 10**6, False),   # 0 turns keepalive off (s3.1.2.10)
    (65535, 98302.0, False),
    (65535, 98303.0, True),
])
def test_keepalive_expired_function(keepalive: int, idle: float, expired: bool) -> None:
    assert keepalive_expired(keepalive, 50.0, 50.0 + idle) is expired


def test_transport_closes_after_one_and_a_half_keepalive() -> None:
    proto, clock = connected(10)
    clock.now += 15.0
    assert not proto.keepalive_expired(clock())
    clock.now += 0.01
    assert proto.keepalive_expired(clock())


def test_any_packet_restarts_the_keepalive_timer() -> None:
    proto, clock = connected(10)
    clock.now += 14.0
    proto.data_received(bytes.fromhex("c000"))  # PINGREQ
    clock.now += 14.0  # 28 s since CONNECT, 14 s since the last packet
    assert not proto.keepalive_expired(clock())
    clock.now += 1.5
    assert proto.keepalive_expired(clock())


def test_partial_packet_counts_as_activity() -> None:
    # s3.1.2.10 speaks of control packets; bytes of one arriving show the client is alive
    proto, clock = connected(2)
    clock.now += 2.9
    proto.data_received(bytes.fromhex("30"))  # first byte of a PUBLISH
    clock.now += 2.9
    assert not proto.keepalive_expired(clock())


def test_keepalive_zero_never_expires() -> None:
    proto, clock = connected(0)
    clock.now += 10**7
    assert not proto.keepalive_expired(clock())


def test_connect_timeout_on_fake_clock() -> None:
    clock = FakeClock()
    proto = MQTTProtocol(FakeServer(clock, connect_timeout=3))  # type: ignore[arg-type]
    clock.now += 3.0
    assert not proto.keepalive_expired(clock())
    clock.now += 0.01
    assert proto.keepalive_expired(clock())  # s3.1.4: no CONNECT in time


def test_bytes_before_connect_do_not_extend_the_connect_timeout() -> None:
    clock = FakeClock()
    proto = MQTTProtocol(FakeServer(clock, connect_timeout=3))  # type: ignore[arg-type]
    clock.now += 2.0
    proto.data_received(connect311(60)[:4])  # an incomplete CONNECT
    clock.now += 1.5
    assert proto.keepalive_expired(clock())
