"""What survives a broker restart (SIGTERM) and a crash (SIGKILL): retained messages,
persistent sessions, in-flight QoS 1/2, and every acknowledged publish (fsync = always)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import BrokerFactory
from tests.integration.rawclient import RawClient
from tests.mqttbytes import PUBACK, PUBCOMP, PUBREC, PUBREL


def replay_all(port: int, topic: str, protocol: int = V5) -> list[bytes]:
    """Every record the log holds for ``topic``, in order, read with a $replay/earliest
    subscriber up to an end marker published after subscribing."""
    reader = Client(port, "", protocol)
    assert reader.connect() == 0
    reader.subscribe(f"$replay/earliest/{topic}", qos=1)
    reader.publish(topic, "<end>", qos=1)
    out: list[bytes] = []
    while True:
        (m,) = reader.expect(1, timeout=20)
        if m.payload == b"<end>":
            break
        out.append(m.payload)
    reader.disconnect()
    return out


@pytest.mark.parametrize("protocol", [pytest.param(V311, id="v311"), pytest.param(V5, id="v5")])
def test_retained_sessions_and_inflight_survive_restart(
    broker_factory: BrokerFactory, protocol: int
) -> None:
    broker = broker_factory(fsync="always")
    version = 5 if protocol == V5 else 4
    kw = {"session_expiry": 600} if version == 5 else {}
    pub = Client(broker.port, "pub", protocol)
    pub.connect()
    pub.publish("cfg/a", "retained-a", qos=1, retain=True)
    pub.publish("cfg/b", "retained-b", qos=2, retain=True)

    sub = RawClient(broker.port, version)
    sub.connect("dur-sub", clean=False, **kw)
    sub.subscribe("data/#", 2)
    for i in range(4):
        pub.publish("data/x", f"d{i}", qos=2)
    d = sub.deliveries(4)
    sub.ack(PUBREC, d[0].packet_id)  # d0: PUBREC'd, PUBREL outstanding
    assert sub.expect(PUBREL).packet_id == d[0].packet_id
    # d1..d3: unacknowledged
    sub.close()
    for i in range(4, 6):
        pub.publish("data/x", f"d{i}", qos=1)  # published while the subscriber is away
    pub.disconnect()

    broker.restart()

    sub = RawClient(broker.port, version)
    assert sub.connect("dur-sub", clean=False, **kw) == (True, 0)
    assert sub.expect(PUBREL).packet_id == d[0].packet_id
    again = sub.deliveries(3)
    assert [(x.payload, x.packet_id, x.dup) for x in again] == [
        (x.payload, x.packet_id, True) for x in d[1:]
    ]
    sub.ack(PUBCOMP, d[0].packet_id)
    for x in again:
        sub.ack(PUBREC, x.packet_id)
        assert sub.expect(PUBREL).packet_id == x.packet_id
        sub.ack(PUBCOMP, x.packet_id)
    offline = sub.deliveries(2)
    assert [(x.payload, x.qos) for x in offline] == [(b"d4", 1), (b"d5", 1)]
    for x in offline:
        sub.ack(PUBACK, x.packet_id)
    sub.disconnect()

    late = Client(broker.port, "late", protocol)
    late.connect()
    late.subscribe("cfg/#", qos=2)
    got = {(m.topic, m.payload, m.qos, m.retain) for m in late.expect(2)}
    assert got == {("cfg/a", b"retained-a", 1, True), ("cfg/b", b"retained-b", 2, True)}
    late.disconnect()


def test_sigkill_keeps_every_acknowledged_qos1_publish(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(fsync="always")
    pub = Client(broker.port, "loader", V311)
    assert pub.connect() == 0
    mids: dict[int, int] = {}  # paho mid -> message number
    sent = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal sent
        while not stop.is_set() and sent < 400:
            info = pub.paho.publish("load/t", f"n{sent}", qos=1)
            mids[info.mid] = sent
            sent += 1
            time.sleep(0.001)  # spread the load so the kill lands mid-stream

    t = threading.Thread(target=load)
    t.start()
    deadline = time.monotonic() + 10
    while len(pub.published) < 100 and time.monotonic() < deadline:
        time.sleep(0.01)
    broker.kill()
    stop.set()
    t.join()
    pub.paho.loop_stop()
    acked = sorted(mids[m] for m in set(pub.published) if m in mids)
    assert len(acked) >= 100, "the broker acknowledged too little before the kill"
    assert len(acked) < sent, "the kill landed after the whole load; nothing was at risk"

    broker.start()
    stored = replay_all(broker.port, "load/t")
    # Possibly more (appended, ack lost with the crash) but never fewer, and in order.
    numbers = [int(p[1:]) for p in stored]
    assert numbers == sorted(numbers)
    assert set(acked) <= set(numbers), sorted(set(acked) - set(numbers))[:10]


def test_sigkill_keeps_persistent_session_and_offline_messages(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(fsync="always")
    sub = Client(broker.port, "crash-sub", V5, clean=False, session_expiry=600)
    sub.connect()
    sub.subscribe("c/#", qos=1)
    sub.disconnect()
    pub = Client(broker.port, "pub", V5)
    pub.connect()
    for i in range(20):
        pub.publish("c/1", f"k{i}", qos=1)
    pub.disconnect()
    broker.kill()
    broker.start()
    sub = Client(broker.port, "crash-sub", V5, clean=False, session_expiry=600)
    assert sub.connect() == 0
    assert sub.session_present is True
    assert [m.payload for m in sub.expect(20)] == [f"k{i}".encode() for i in range(20)]
    sub.disconnect()


def test_sigkill_qos2_publish_resent_after_crash_is_stored_once(
    broker_factory: BrokerFactory,
) -> None:
    """The PUBREC is only sent once the packet id is durably known (s4.3.3)."""
    broker = broker_factory(fsync="always")
    pub = RawClient(broker.port, 5)
    pub.connect("crash-q2", clean=False, session_expiry=600)
    pub.publish("q2c/t", b"only once", 2, 42)
    assert pub.expect(PUBREC).packet_id == 42
    broker.kill()
    pub.close()
    broker.start()
    pub = RawClient(broker.port, 5)
    assert pub.connect("crash-q2", clean=False, session_expiry=600) == (True, 0)
    pub.publish("q2c/t", b"only once", 2, 42, dup=True)
    assert pub.expect(PUBREC).packet_id == 42
    pub.ack(PUBREL, 42)
    assert pub.expect(PUBCOMP).packet_id == 42
    pub.publish("q2c/t", b"next", 2, 42)  # the id was released durably: a new message
    pub.expect(PUBREC)
    pub.disconnect()
    assert replay_all(broker.port, "q2c/t") == [b"only once", b"next"]


def test_inflight_qos1_delivery_survives_sigkill(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(fsync="always")
    sub = RawClient(broker.port, 4)
    sub.connect("crash-inflight", clean=False)
    sub.subscribe("f/#", 1)
    pub = Client(broker.port, "pub", V311)
    pub.connect()
    pub.publish("f/1", "unacked", qos=1)
    (d,) = sub.deliveries(1)
    broker.kill()
    sub.close()
    broker.start()
    sub = RawClient(broker.port, 4)
    assert sub.connect("crash-inflight", clean=False) == (True, 0)
    (again,) = sub.deliveries(1)  # at least once: delivered again after the crash
    assert again.payload == d.payload
    sub.ack(PUBACK, again.packet_id)
    sub.disconnect()
