"""Persistent sessions, clean start, session expiry and takeover against the real broker.

3.1.1: clean-session = 0 keeps the session (s3.1.2.4); 5.0: clean-start = 0 plus a Session
Expiry Interval keeps it for that long after the connection closes (s3.1.2.11.2).
"""

from __future__ import annotations

import subprocess

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.integration.clients import V5, V311, Client, mosquitto_pub, mosquitto_sub
from tests.integration.conftest import BrokerProcess
from tests.integration.rawclient import RawClient
from tests.mqttbytes import DISCONNECT

PROTOCOLS = [pytest.param(V311, id="v311"), pytest.param(V5, id="v5")]


def persistent(port: int, client_id: str, protocol: int, expiry: int = 300) -> Client:
    """A client whose session outlives its connection (clean = False)."""
    return Client(
        port, client_id, protocol, clean=False, session_expiry=expiry if protocol == V5 else None
    )


def payloads(msgs: list) -> list[bytes]:  # type: ignore[type-arg]
    return [m.payload for m in msgs]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_offline_messages_delivered_in_order_on_resume(
    broker: BrokerProcess, protocol: int
) -> None:
    sub = persistent(broker.port, "s1", protocol)
    assert sub.connect() == 0
    assert sub.session_present is False  # no session existed [MQTT-3.2.2-3]
    assert sub.subscribe("home/+/temp", qos=1) == [1]
    sub.disconnect()

    pub = Client(broker.port, "pub", protocol)
    pub.connect()
    for i in range(30):
        pub.publish(f"home/{i % 3}/temp", f"m{i}", qos=1)
    pub.publish("home/x/humidity", "not mine", qos=1)
    pub.disconnect()

    sub = persistent(broker.port, "s1", protocol)
    assert sub.connect() == 0
    assert sub.session_present is True  # [MQTT-3.2.2-2]
    msgs = sub.expect(30)  # no new SUBSCRIBE: the subscription is part of the session
    # Order is kept per topic [MQTT-4.6.0-5]; check it per topic, and that nothing is missing.
    for room in range(3):
        got = [m.payload for m in msgs if m.topic == f"home/{room}/temp"]
        assert got == [f"m{i}".encode() for i in range(room, 30, 3)]
    assert {m.qos for m in msgs} == {1}
    sub.expect_none(0.3)
    sub.disconnect()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_persistent_session_survives_broker_restart(broker: BrokerProcess, protocol: int) -> None:
    sub = persistent(broker.port, "s-restart", protocol)
    sub.connect()
    sub.subscribe("fleet/#", qos=2)
    sub.disconnect()
    pub = Client(broker.port, "pub", protocol)
    pub.connect()
    for i in range(10):
        pub.publish("fleet/truck1", f"before-{i}", qos=2)
    pub.disconnect()

    broker.restart()

    pub = Client(broker.port, "pub", protocol)
    pub.connect()
    for i in range(5):
        pub.publish("fleet/truck1", f"after-{i}", qos=2)
    pub.disconnect()
    sub = persistent(broker.port, "s-restart", protocol)
    assert sub.connect() == 0
    assert sub.session_present is True
    msgs = sub.expect(15)  # (all QoS 2: paho hands QoS 2 messages over at PUBREL time)
    assert payloads(msgs) == [f"before-{i}".encode() for i in range(10)] + [
        f"after-{i}".encode() for i in range(5)
    ]
    assert {m.qos for m in msgs} == {2}
    sub.expect_none(0.3)
    sub.disconnect()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_clean_start_discards_the_session(broker: BrokerProcess, protocol: int) -> None:
    sub = persistent(broker.port, "s-clean", protocol)
    sub.connect()
    sub.subscribe("c/#", qos=1)
    sub.disconnect()
    pub = Client(broker.port, "pub", protocol)
    pub.connect()
    pub.publish("c/1", "while away", qos=1)

    fresh = Client(broker.port, "s-clean", protocol, clean=True)
    assert fresh.connect() == 0
    assert fresh.session_present is False  # [MQTT-3.1.2-4], [MQTT-3.2.2-1]
    fresh.expect_none(0.5)  # neither the queued message nor the subscription survived
    pub.publish("c/2", "after clean", qos=1)
    fresh.expect_none(0.3)
    fresh.disconnect()

    # The clean session left nothing behind either [MQTT-3.1.2-6] (3.1.1) / expiry 0 (5.0).
    again = persistent(broker.port, "s-clean", protocol)
    again.connect()
    assert again.session_present is False
    again.disconnect()
    pub.disconnect()


def test_session_present_false_for_unknown_client_with_clean_false(broker: BrokerProcess) -> None:
    raw = RawClient(broker.port, 4)
    assert raw.connect("never-seen", clean=False) == (False, 0)
    raw.disconnect()
    raw = RawClient(broker.port, 4)
    assert raw.connect("never-seen", clean=False) == (True, 0)  # now it exists
    raw.disconnect()


def test_session_expiry_ends_the_session(broker: BrokerProcess) -> None:
    # A will with a long delay is published when the session ends [MQTT-3.1.3-9]... it is the
    # observable event that the session expired, so the test need not guess a sleep.
    watcher = Client(broker.port, "watcher", V5)
    watcher.connect()
    watcher.subscribe("wills/#", qos=1)
    raw = RawClient(broker.port, 5)
    assert raw.connect(
        "short",
        clean=False,
        session_expiry=1,
        will=("wills/short", b"ended", 1, False),
        will_delay=3600,
    ) == (False, 0)
    raw.subscribe("e/#", 1)
    raw.close()  # abnormal: the will waits for its delay or the end of the session
    (will,) = watcher.expect(1, timeout=5)
    assert will.payload == b"ended"

    pub = Client(broker.port, "pub", V5)
    pub.connect()
    pub.publish("e/1", "too late", qos=1)
    c = Client(broker.port, "short", V5, clean=False, session_expiry=60)
    assert c.connect() == 0
    assert c.session_present is False
    c.expect_none(0.3)
    c.disconnect()


def test_session_expiry_counts_from_disconnect_not_connect(broker: BrokerProcess) -> None:
    """A 2 s session is kept while connected for longer than that, and resumed in time."""
    c = Client(broker.port, "long-conn", V5, clean=False, session_expiry=2)
    c.connect()
    c.subscribe("k/#", qos=1)
    pub = Client(broker.port, "pub", V5)
    pub.connect()
    # Be connected for longer than the expiry, waiting on real round trips rather than a sleep.
    for i in range(3):
        pub.publish("k/1", f"live{i}", qos=1)
        c.expect(1)
        c.subscribe("k/#", qos=1)  # a full round trip through the broker
    c.disconnect()
    pub.publish("k/1", "queued", qos=1)
    c = Client(broker.port, "long-conn", V5, clean=False, session_expiry=2)
    assert c.connect() == 0
    assert c.session_present is True
    assert payloads(c.expect(1)) == [b"queued"]
    c.disconnect()


def test_disconnect_can_shorten_session_expiry_to_zero(broker: BrokerProcess) -> None:
    c = Client(broker.port, "shorten", V5, clean=False, session_expiry=300)
    c.connect()
    c.subscribe("z/#", qos=1)
    props = Properties(PacketTypes.DISCONNECT)
    props.SessionExpiryInterval = 0  # s3.14.2.2.2: the session ends with this connection
    c.paho.disconnect(properties=props)
    c.paho.loop_stop()
    again = Client(broker.port, "shorten", V5, clean=False, session_expiry=300)
    again.connect()
    assert again.session_present is False
    again.disconnect()


def test_takeover_v5_sends_0x8e_and_keeps_the_session(broker: BrokerProcess) -> None:
    first = RawClient(broker.port, 5)
    first.connect("dup-id", clean=False, session_expiry=300)
    assert first.subscribe("t/#", 1) == [1]
    pub = Client(broker.port, "pub", V5)
    pub.connect()
    pub.publish("t/a", "one", qos=1)
    (d,) = first.deliveries(1)
    first.ack(4, d.packet_id)  # PUBACK
    pub.publish("t/a", "two", qos=1)
    first.deliveries(1)  # "two" is in flight, never acknowledged by the first connection

    second = Client(broker.port, "dup-id", V5, clean=False, session_expiry=300)
    assert second.connect() == 0
    assert second.session_present is True
    disc = first.closed_by_broker()
    assert disc is not None and disc.type == DISCONNECT
    assert disc.body[0] == 0x8E  # Session taken over [MQTT-3.1.4-3]

    # The unacknowledged delivery is resent to the new connection, then live ones follow.
    (redelivered,) = second.expect(1)
    assert (redelivered.payload, redelivered.dup) == (b"two", True)
    pub.publish("t/a", "three", qos=1)
    assert payloads(second.expect(1)) == [b"three"]
    second.expect_none(0.3)
    second.disconnect()
    pub.disconnect()


def test_takeover_v311_closes_the_first_connection(broker: BrokerProcess) -> None:
    first = RawClient(broker.port, 4)
    first.connect("dup311", clean=False)
    first.subscribe("u/#", 1)
    second = RawClient(broker.port, 4)
    assert second.connect("dup311", clean=False) == (True, 0)
    assert first.closed_by_broker() is None  # 3.1.1 has no server DISCONNECT
    pub = Client(broker.port, "pub")
    pub.connect()
    pub.publish("u/1", "for the second", qos=1)
    (d,) = second.deliveries(1)
    assert d.payload == b"for the second"
    second.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
def test_mosquitto_sub_persistent_session(broker: BrokerProcess, version: str) -> None:
    """mosquitto_sub -c: subscribe and leave, messages published with mosquitto_pub while
    it is away, then the same client id gets them on its return, across a restart too."""
    ident = ["-c", "-i", "mosq-persist", "-q", "1"]
    if version == "mqttv5":
        ident += ["-x", "600"]
    subprocess.run(
        [
            "mosquitto_sub",
            "-h",
            "127.0.0.1",
            "-p",
            str(broker.port),
            "-t",
            "mosq/#",
            "-E",
            "-V",
            version,
            *ident,
        ],
        check=True,
        timeout=15,
    )  # -E: exit on SUBACK
    for i in range(3):
        mosquitto_pub(broker.port, "mosq/a", f"v{i}", 1, version=version)
    broker.restart()
    mosquitto_pub(broker.port, "mosq/a", "v3", 1, version=version)
    lines = mosquitto_sub(broker.port, "mosq/#", 4, *ident, version=version)
    assert lines == [f"mosq/a v{i}" for i in range(4)]
