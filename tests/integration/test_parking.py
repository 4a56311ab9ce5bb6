"""Parked connections (broker.net.parking) against the real broker: an idle connection's
socket leaves the event loop for the worker's epoll and comes back on input, on output to it,
on its close, on a takeover, on keepalive expiry and at shutdown, with nothing lost.

Each test first waits for ``mqlog_connections_parked`` to count its connections, so it
fails where nothing parks; what follows fails where a parked connection does not resume.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.integration.clients import Client
from tests.integration.conftest import BrokerFactory, BrokerProcess
from tests.integration.rawclient import RawClient
from tests.integration.test_metrics import scrape, value
from tests.integration.test_will import WILL, assert_no_will, watch
from tests.mqttbytes import PUBACK

#: Parks after 0.2 s idle (looked at on the broker's 0.5 s timer: about a second).
PARKING = '[router]\npark_after = "200ms"\n'
VERSIONS = [pytest.param(4, id="v311"), pytest.param(5, id="v5")]


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> BrokerProcess:
    return broker_factory(config=PARKING)


def parked(broker: BrokerProcess) -> int:
    return int(value(scrape(broker), "mqlog_connections_parked"))


def wait_parked(broker: BrokerProcess, n: int, timeout: float = 10.0) -> None:
    """Until ``n`` connections are parked (every worker's, added up)."""
    deadline = time.monotonic() + timeout
    while (now := parked(broker)) != n:
        assert time.monotonic() < deadline, f"{now} connections parked, expected {n}"
        time.sleep(0.1)


@pytest.mark.parametrize("qos", [0, 1])
def test_parked_publisher_reaches_parked_subscriber(broker: BrokerProcess, qos: int) -> None:
    sub = Client(broker.port, "sub", keepalive=60)
    sub.connect()
    sub.subscribe("park/t", qos=qos)
    pub = RawClient(broker.port)
    pub.connect("pub")
    for round_ in range(2):  # the second time over the transport the first resume made
        wait_parked(broker, 2)
        pub.publish("park/t", b"m%d" % round_, qos, packet_id=round_ + 1 if qos else None)
        if qos:
            assert pub.expect(PUBACK).packet_id == round_ + 1
        (m,) = sub.expect(1)
        assert (m.topic, m.payload, m.qos) == ("park/t", b"m%d" % round_, qos)
    sub.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("version", VERSIONS)
def test_parked_client_id_taken_over(broker: BrokerProcess, version: int) -> None:
    expiry = 300 if version == 5 else None  # 5.0: a session outlives its connection so
    old = RawClient(broker.port, version)
    assert old.connect("dev", clean=False, session_expiry=expiry) == (False, 0)
    wait_parked(broker, 1)
    new = RawClient(broker.port, version)
    assert new.connect("dev", clean=False, session_expiry=expiry) == (True, 0)
    disconnect = old.closed_by_broker()
    if version == 5:  # the parked one resumed to be told [MQTT-3.1.4-3]: 0x8E taken over
        assert disconnect is not None and disconnect.body[0] == 0x8E
    new.subscribe("t/x", 1)  # the new connection serves
    new.disconnect()


@pytest.mark.parametrize("version", VERSIONS)
def test_parked_keepalive_expires_and_will_goes_out(broker: BrokerProcess, version: int) -> None:
    w = watch(broker.port)
    c = RawClient(broker.port, version)
    c.connect("dev1", keepalive=3, will=WILL)
    started = time.monotonic()
    wait_parked(broker, 2, timeout=3)  # the watcher too; before the keepalive expires
    # Parked, silent: closed after 1.5 x keepalive all the same [MQTT-3.1.2-24].
    (m,) = w.expect(1, timeout=10)
    assert (m.topic, m.payload) == ("will/dev1", b"dev1 gone")
    assert time.monotonic() - started >= 4.4
    # Its address asked of the parked socket, not of a transport it no longer has.
    assert re.search(r"dev1 \(127\.0\.0\.1:\d+\): keepalive expired", broker.log()), broker.log()
    disconnect = c.closed_by_broker()
    if version == 5:
        assert disconnect is not None and disconnect.body[0] == 0x8D  # keep alive timeout
    assert_no_will(broker.port, w)


@pytest.mark.parametrize("version", VERSIONS)
def test_parked_peer_closing_publishes_will(broker: BrokerProcess, version: int) -> None:
    w = watch(broker.port)
    c = RawClient(broker.port, version)
    c.connect("dev1", will=WILL)
    wait_parked(broker, 2)
    c.close()  # [MQTT-3.1.2-8]: closed without DISCONNECT while parked
    (m,) = w.expect(1)
    assert (m.topic, m.payload) == ("will/dev1", b"dev1 gone")
    deadline = time.monotonic() + 5
    while value(scrape(broker), "mqlog_connections") > 1:  # the watcher's left
        assert time.monotonic() < deadline, "the closed parked connection was kept"
        time.sleep(0.1)


def test_parked_graceful_disconnect_has_no_will(broker: BrokerProcess) -> None:
    w = watch(broker.port)
    c = RawClient(broker.port)
    c.connect("dev1", will=WILL)
    wait_parked(broker, 2)
    c.disconnect()  # read by the resumed connection: the will is dropped [MQTT-3.1.2-10]
    assert_no_will(broker.port, w)


def test_shutdown_with_parked_connections(broker: BrokerProcess) -> None:
    clients = [RawClient(broker.port, 5) for _ in range(3)]
    for i, c in enumerate(clients):
        assert c.connect(f"c{i}") == (False, 0)
    wait_parked(broker, 3)
    assert broker.stop() == 0
    for c in clients:  # each resumed to be told: server shutting down (0x8B)
        disconnect = c.closed_by_broker()
        assert disconnect is not None and disconnect.body[0] == 0x8B


def test_park_after_zero_never_parks(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(config="[router]\npark_after = 0\n")
    c = RawClient(broker.port)
    assert c.connect("idle")[1] == 0
    time.sleep(1.2)
    assert parked(broker) == 0
    c.publish("t", b"x", 0)
    c.disconnect()


def test_resumed_connection_reads_a_packet_split_across_the_park(broker: BrokerProcess) -> None:
    """Input that arrives while parked stays in the kernel until the new transport reads
    it: a PUBLISH in two writes, the second after the resume, is one packet."""
    sub = Client(broker.port, "sub", keepalive=60)
    sub.connect()
    sub.subscribe("park/split", qos=1)
    c = RawClient(broker.port)
    c.connect("pub")
    wait_parked(broker, 2)
    whole = b"\x32\x10\x00\x0apark/split\x00\x07hi"
    c.send(whole[:5])
    time.sleep(0.3)
    c.send(whole[5:])
    assert c.expect(PUBACK).packet_id == 7
    (m,) = sub.expect(1)
    assert (m.topic, m.payload) == ("park/split", b"hi")
    sub.disconnect()
    c.disconnect()
