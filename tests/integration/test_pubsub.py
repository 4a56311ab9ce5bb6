"""Publish / subscribe through the real broker with paho (3.1.1 and 5.0) and mosquitto clients."""

from __future__ import annotations

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.integration.clients import V5, V311, Client, mosquitto_pub, mosquitto_sub
from tests.integration.conftest import BrokerProcess

PROTOCOLS = [pytest.param(V311, id="v311"), pytest.param(V5, id="v5")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_publish_reaches_subscriber_at_min_qos(
    broker: BrokerProcess, protocol: int, qos: int
) -> None:
    sub = Client(broker.port, "sub", protocol)
    assert sub.connect() == 0
    assert sub.subscribe("devices/+/telemetry", qos=1) == [1]
    pub = Client(broker.port, "pub", protocol)
    assert pub.connect() == 0
    for i in range(20):
        pub.publish(f"devices/{i}/telemetry", f"m{i}", qos=qos)
    msgs = sub.expect(20)
    assert [m.payload for m in sorted(msgs, key=lambda m: int(m.payload[1:]))] == [
        f"m{i}".encode() for i in range(20)
    ]
    assert {m.qos for m in msgs} == {min(qos, 1)}  # [MQTT-3.8.4-8]
    sub.expect_none(0.3)
    pub.disconnect()
    sub.disconnect()


def test_order_per_topic_is_kept(broker: BrokerProcess) -> None:
    sub = Client(broker.port, "sub")
    sub.connect()
    sub.subscribe("a/#", qos=1)
    pub = Client(broker.port, "pub")
    pub.connect()
    for i in range(200):
        pub.publish("a/b", str(i), qos=1, wait=False)
    msgs = sub.expect(200)
    assert [int(m.payload) for m in msgs] == list(range(200))
    sub.disconnect()
    pub.disconnect()


def test_overlapping_subscriptions_deliver_once_at_highest_qos(broker: BrokerProcess) -> None:
    sub = Client(broker.port, "sub", V5)
    sub.connect()
    sub.subscribe("x/#", qos=0)
    sub.subscribe("x/+/z", qos=2)
    pub = Client(broker.port, "pub", V5)
    pub.connect()
    pub.publish("x/y/z", "hello", qos=2)
    (msg,) = sub.expect(1)
    assert msg.qos == 2
    sub.expect_none(0.3)  # [MQTT-3.3.4-2]: one copy only


def test_no_local_and_retain_as_published(broker: BrokerProcess) -> None:
    c = Client(broker.port, "self", V5)
    c.connect()
    c.subscribe("loop/#", qos=1, noLocal=True)
    c.publish("loop/1", "mine", qos=1)
    c.expect_none(0.5)  # [MQTT-3.8.3-3]
    other = Client(broker.port, "other", V5)
    other.connect()
    other.subscribe("loop/#", qos=1, retainAsPublished=True)
    c.publish("loop/2", "kept", qos=1, retain=True)
    (msg,) = other.expect(1)
    assert msg.retain  # retain as published [MQTT-3.3.1-13]


def test_mosquitto_clients_roundtrip(broker: BrokerProcess) -> None:
    for i in range(3):
        mosquitto_pub(broker.port, f"devices/{i}/telemetry", f"t{i}", 1)
    lines = mosquitto_sub(broker.port, "$replay/earliest/devices/#", 3)
    assert sorted(lines) == [f"devices/{i}/telemetry t{i}" for i in range(3)]


def test_retained_delivered_on_subscribe_and_cleared(broker: BrokerProcess) -> None:
    pub = Client(broker.port, "pub")
    pub.connect()
    pub.publish("status/door", "open", qos=1, retain=True)
    sub = Client(broker.port, "sub")
    sub.connect()
    sub.subscribe("status/#", qos=1)
    (msg,) = sub.expect(1)
    assert (msg.topic, msg.payload, msg.retain) == ("status/door", b"open", True)
    pub.publish("status/door", "", qos=1, retain=True)  # [MQTT-3.3.1-10] clears it
    sub.expect(1)  # the live empty message itself
    sub2 = Client(broker.port, "sub2")
    sub2.connect()
    sub2.subscribe("status/#", qos=1)
    sub2.expect_none(0.5)


def test_retained_survives_restart(broker: BrokerProcess) -> None:
    mosquitto_pub(broker.port, "cfg/interval", "30", 1, "-r")
    broker.restart()
    lines = mosquitto_sub(broker.port, "cfg/#", 1)
    assert lines == ["cfg/interval 30"]


def test_replay_forms(broker: BrokerProcess) -> None:
    pub = Client(broker.port, "pub", V5)
    pub.connect()
    for i in range(10):
        pub.publish("r/one", str(i), qos=1)
    c = Client(broker.port, "replayer", V5)
    c.connect()
    c.subscribe("$replay/offset:4/r/one", qos=1)
    msgs = c.expect(6)
    assert [int(m.payload) for m in msgs] == list(range(4, 10))
    offsets = [int(dict(m.properties["UserProperty"])["mqlog-offset"]) for m in msgs]
    assert offsets == list(range(4, 10))
    assert {dict(m.properties["UserProperty"])["mqlog-partition"] for m in msgs} == {"0"}
    pub.publish("r/one", "live", qos=1)  # history, then live
    (live,) = c.expect(1)
    assert live.payload == b"live"
    c.disconnect()
    old = Client(broker.port, "old", V311)
    old.connect()
    old.subscribe("$replay/time:-1h/r/one", qos=1)
    assert len(old.expect(11)) == 11
    latest = Client(broker.port, "latest", V311)
    latest.connect()
    latest.subscribe("$replay/latest/r/#", qos=1)
    latest.expect_none(0.3)


def test_replay_bad_from_is_refused(broker: BrokerProcess) -> None:
    c = Client(broker.port, "bad", V5)
    c.connect()
    assert c.subscribe("$replay/yesterday/a/#", qos=1) == [0x8F]
    c3 = Client(broker.port, "bad3", V311)
    c3.connect()
    assert c3.subscribe("$replay/offset:-1/a", qos=1) == [0x80]


def test_message_expiry_interval_is_replayed_decremented(broker: BrokerProcess) -> None:
    """A replayed message carries what is left of its expiry interval [MQTT-3.3.2-6]. That an
    expired one is not replayed is checked on the router's injected clock, without waiting for
    a second to pass: tests/unit/router/test_message_expiry.py."""
    pub = Client(broker.port, "pub", V5)
    pub.connect()
    keep = Properties(PacketTypes.PUBLISH)
    keep.MessageExpiryInterval = 3600
    pub.publish("exp/a", "long-lived", qos=1, properties=keep)
    c = Client(broker.port, "late", V5)
    c.connect()
    c.subscribe("$replay/earliest/exp/a", qos=1)
    (msg,) = c.expect(1)
    assert msg.payload == b"long-lived"
    assert 3598 <= msg.properties["MessageExpiryInterval"] <= 3600  # [MQTT-3.3.2-6]
