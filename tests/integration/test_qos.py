"""QoS 1 and 2 flows end to end (s4.3), duplicate detection and redelivery (s4.4).

Hand-built packets (tests/integration/rawmqtt.py) play the part of clients that withhold
acknowledgements or resend with DUP, which paho does not let a test do at will.
"""

from __future__ import annotations

import pytest

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import BrokerProcess
from tests.integration.rawclient import RawClient
from tests.mqttbytes import PUBACK, PUBCOMP, PUBREC, PUBREL

VERSIONS = [pytest.param(4, id="v311"), pytest.param(5, id="v5")]


def log_copies(port: int, topic: str, protocol: int = V5) -> list[bytes]:
    """Every record the log holds for ``topic``, read back with a $replay/earliest reader."""
    reader = Client(port, "", protocol)
    reader.connect()
    reader.subscribe(f"$replay/earliest/{topic}", qos=1)
    reader.publish(topic, "<end>", qos=1)  # marks the end of what was there before
    out: list[bytes] = []
    while True:
        (m,) = reader.expect(1)
        if m.payload == b"<end>":
            break
        out.append(m.payload)
    reader.disconnect()
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_qos1_publish_flow(broker: BrokerProcess, version: int) -> None:
    sub = RawClient(broker.port, version)
    sub.connect("q1-sub")
    assert sub.subscribe("q1/#", 1) == [1]
    pub = RawClient(broker.port, version)
    pub.connect("q1-pub")
    for pid in (1, 2, 3):
        pub.publish("q1/a", f"m{pid}".encode(), 1, pid)
    assert [pub.expect(PUBACK).packet_id for _ in range(3)] == [1, 2, 3]  # [MQTT-4.3.2-4]
    got = sub.deliveries(3)
    assert [d.payload for d in got] == [b"m1", b"m2", b"m3"]
    assert all(d.qos == 1 and not d.dup and d.packet_id for d in got)
    assert len({d.packet_id for d in got}) == 3  # [MQTT-2.2.1-3] unused ids while in flight
    for d in got:
        sub.ack(PUBACK, d.packet_id)
    pub.disconnect()
    sub.disconnect()


@pytest.mark.parametrize("version", VERSIONS)
def test_qos2_publish_flow_both_directions(broker: BrokerProcess, version: int) -> None:
    sub = RawClient(broker.port, version)
    sub.connect("q2-sub")
    sub.subscribe("q2/#", 2)
    pub = RawClient(broker.port, version)
    pub.connect("q2-pub")
    pub.publish("q2/a", b"exactly once", 2, 10)
    assert pub.expect(PUBREC).packet_id == 10  # [MQTT-4.3.3-8]
    pub.ack(PUBREL, 10)
    assert pub.expect(PUBCOMP).packet_id == 10  # [MQTT-4.3.3-11]

    (d,) = sub.deliveries(1)
    assert (d.payload, d.qos, d.dup) == (b"exactly once", 2, False)
    sub.ack(PUBREC, d.packet_id)
    rel = sub.expect(PUBREL)  # [MQTT-4.3.3-4]
    assert rel.packet_id == d.packet_id and rel.flags == 0x02
    sub.ack(PUBCOMP, d.packet_id)
    sub.expect_nothing(3, 0.3)
    pub.disconnect()
    sub.disconnect()


@pytest.mark.parametrize("version", VERSIONS)
def test_qos2_resend_before_pubrel_is_stored_once(broker: BrokerProcess, version: int) -> None:
    """A QoS 2 PUBLISH resent with DUP after a reconnect is not a new message (s4.3.3)."""
    pub = RawClient(broker.port, version)
    kw = {"session_expiry": 300} if version == 5 else {}
    pub.connect("q2-dup", clean=False, **kw)
    pub.publish("dup/x", b"once", 2, 77)
    assert pub.expect(PUBREC).packet_id == 77
    pub.close()  # lost the PUBREC as far as the client knows

    pub = RawClient(broker.port, version)
    assert pub.connect("q2-dup", clean=False, **kw) == (True, 0)
    pub.publish("dup/x", b"once", 2, 77, dup=True)  # [MQTT-4.4.0-1] resend, DUP = 1
    assert pub.expect(PUBREC).packet_id == 77
    pub.ack(PUBREL, 77)
    assert pub.expect(PUBCOMP).packet_id == 77
    # After PUBCOMP the packet id is free again: the same id is a new message [MQTT-4.3.3-9].
    pub.publish("dup/x", b"second", 2, 77)
    assert pub.expect(PUBREC).packet_id == 77
    pub.ack(PUBREL, 77)
    pub.expect(PUBCOMP)
    pub.disconnect()
    assert log_copies(broker.port, "dup/x") == [b"once", b"second"]


def test_qos2_resend_in_the_same_connection_is_stored_once(broker: BrokerProcess) -> None:
    pub = RawClient(broker.port, 4)
    pub.connect("q2-same")
    for _ in range(3):
        pub.publish("dup/same", b"one copy", 2, 5, dup=True)
    for _ in range(3):
        assert pub.expect(PUBREC).packet_id == 5
    pub.ack(PUBREL, 5)
    pub.expect(PUBCOMP)
    pub.disconnect()
    assert log_copies(broker.port, "dup/same") == [b"one copy"]


def test_qos2_dedup_survives_broker_restart(broker: BrokerProcess) -> None:
    pub = RawClient(broker.port, 5)
    pub.connect("q2-restart", clean=False, session_expiry=300)
    pub.publish("dup/r", b"kept once", 2, 9)
    pub.expect(PUBREC)
    pub.close()
    broker.restart()
    pub = RawClient(broker.port, 5)
    assert pub.connect("q2-restart", clean=False, session_expiry=300) == (True, 0)
    pub.publish("dup/r", b"kept once", 2, 9, dup=True)
    assert pub.expect(PUBREC).packet_id == 9
    pub.ack(PUBREL, 9)
    assert pub.expect(PUBCOMP).packet_id == 9
    pub.disconnect()
    assert log_copies(broker.port, "dup/r") == [b"kept once"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("restart", [False, True], ids=["reconnect", "restart"])
def test_unacknowledged_qos1_redelivered_with_dup(
    broker: BrokerProcess, version: int, restart: bool
) -> None:
    kw = {"session_expiry": 300} if version == 5 else {}
    sub = RawClient(broker.port, version)
    sub.connect("redeliver", clean=False, **kw)
    sub.subscribe("rd/#", 1)
    pub = Client(broker.port, "pub", V5 if version == 5 else V311)
    pub.connect()
    for i in range(3):
        pub.publish("rd/1", f"p{i}", qos=1)
    first = sub.deliveries(3)
    sub.ack(PUBACK, first[0].packet_id)  # only the first one
    sub.expect_nothing(3, 0.2)
    sub.close()
    pub.disconnect()
    if restart:
        broker.restart()

    sub = RawClient(broker.port, version)
    assert sub.connect("redeliver", clean=False, **kw) == (True, 0)
    again = sub.deliveries(2)
    # [MQTT-4.4.0-1]: same packet ids, DUP = 1, in the original order [MQTT-4.6.0-1].
    assert [(d.payload, d.packet_id, d.dup, d.qos) for d in again] == [
        (d.payload, d.packet_id, True, 1) for d in first[1:]
    ]
    for d in again:
        sub.ack(PUBACK, d.packet_id)
    sub.expect_nothing(3, 0.3)
    sub.close()
    sub = RawClient(broker.port, version)
    assert sub.connect("redeliver", clean=False, **kw) == (True, 0)
    sub.expect_nothing(3, 0.3)  # acknowledged: nothing left to resend
    sub.disconnect()


@pytest.mark.parametrize("restart", [False, True], ids=["reconnect", "restart"])
def test_qos2_outbound_resumes_at_the_right_step(broker: BrokerProcess, restart: bool) -> None:
    """Unacknowledged PUBLISH is resent with DUP; a PUBREC'd one gets its PUBREL again."""
    sub = RawClient(broker.port, 5)
    sub.connect("q2-out", clean=False, session_expiry=300)
    sub.subscribe("o/#", 2)
    pub = Client(broker.port, "pub", V5)
    pub.connect()
    pub.publish("o/1", "recd", qos=2)
    pub.publish("o/1", "unacked", qos=2)
    a, b = sub.deliveries(2)
    sub.ack(PUBREC, a.packet_id)
    assert sub.expect(PUBREL).packet_id == a.packet_id
    sub.close()
    pub.disconnect()
    if restart:
        broker.restart()

    sub = RawClient(broker.port, 5)
    assert sub.connect("q2-out", clean=False, session_expiry=300) == (True, 0)
    # [MQTT-4.4.0-1]: PUBREL for the PUBREC'd one, the PUBLISH again for the other.
    assert sub.expect(PUBREL).packet_id == a.packet_id
    (d,) = sub.deliveries(1)
    assert (d.payload, d.packet_id, d.dup) == (b"unacked", b.packet_id, True)
    sub.ack(PUBCOMP, a.packet_id)
    sub.ack(PUBREC, d.packet_id)
    assert sub.expect(PUBREL).packet_id == d.packet_id
    sub.ack(PUBCOMP, d.packet_id)
    sub.expect_nothing(3, 0.3)
    sub.disconnect()


def test_paho_qos2_roundtrip_many(broker: BrokerProcess) -> None:
    sub = Client(broker.port, "many-sub", V5)
    sub.connect()
    sub.subscribe("m/#", qos=2)
    pub = Client(broker.port, "many-pub", V5)
    pub.connect()
    mids = {pub.publish("m/1", str(i), qos=2, wait=False) for i in range(200)}
    msgs = sub.expect(200)
    assert [int(m.payload) for m in msgs] == list(range(200))
    assert {m.qos for m in msgs} == {2}
    sub.expect_none(0.3)
    assert mids <= pub.published  # every flow reached PUBCOMP (on_publish)
    pub.disconnect()
    sub.disconnect()


def test_receive_maximum_bounds_unacknowledged_deliveries(broker: BrokerProcess) -> None:
    """The server sends no more than the client's Receive Maximum unacknowledged
    QoS > 0 PUBLISHes [MQTT-3.3.4-9]."""
    sub = RawClient(broker.port, 5)
    sub.connect("rm2", receive_maximum=2)
    sub.subscribe("rm/#", 1)
    pub = Client(broker.port, "pub", V5)
    pub.connect()
    for i in range(5):
        pub.publish("rm/1", f"r{i}", qos=1)
    got = sub.deliveries(2)
    sub.expect_nothing(3, 0.3)  # quota exhausted
    sub.ack(PUBACK, got[0].packet_id)
    (third,) = sub.deliveries(1)
    sub.expect_nothing(3, 0.2)
    for d in (got[1], third):
        sub.ack(PUBACK, d.packet_id)
    rest = sub.deliveries(2)
    assert [d.payload for d in [*got, third, *rest]] == [f"r{i}".encode() for i in range(5)]
    sub.disconnect()
    pub.disconnect()
