"""Shared subscriptions ``$share/<group>/<filter>`` (MQTT 5.0 s4.8.2; also offered to 3.1.1
clients, as mosquitto does): a group is one position per partition, and each record goes to
exactly one member."""

from __future__ import annotations

import time
import urllib.request
from collections import Counter
from typing import Any

import orjson
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.integration.clients import V5, V311, Client, Message, SubProcess
from tests.integration.conftest import BrokerFactory, BrokerProcess

STREAMS = """
[[streams]]
name = "telemetry"
topic_filter = ["devices/#"]
partitions = 4
"""
GROUP = "$share/g/devices/#"


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> BrokerProcess:
    return broker_factory(config=STREAMS)


def publish_all(port: int, n: int, start: int = 0, qos: int = 1) -> list[bytes]:
    """Publish ``n`` messages over 12 topics (so over all 4 partitions); all acknowledged."""
    pub = Client(port, f"pub-{start}")
    assert pub.connect() == 0
    payloads = []
    for i in range(start, start + n):
        payloads.append(f"m{i}".encode())
        pub.publish(f"devices/d{i % 12}/telemetry", payloads[-1], qos=qos, wait=False)
    pub.publish("devices/sync", "", qos=1)  # acked after everything before it (one session)
    pub.disconnect()
    return payloads


def drain(clients: list[Client], n: int, timeout: float = 10.0) -> list[list[Message]]:
    """Collect messages (except the sync marker) until ``n`` arrived over all ``clients``."""
    got: list[list[Message]] = [[] for _ in clients]
    deadline = time.monotonic() + timeout
    while sum(map(len, got)) < n:
        assert time.monotonic() < deadline, f"got {[len(g) for g in got]} of {n}"
        for c, out in zip(clients, got, strict=True):
            while not c.messages.empty():
                m = c.messages.get()
                if m.topic != "devices/sync":
                    out.append(m)
        time.sleep(0.01)
    return got


def quiet(broker: BrokerProcess, clients: list[Client]) -> None:
    """No member gets anything more (besides sync markers). Waited for as events, not for a
    fixed time: first every shared group is at rest in the admin API (no lag, no orphaned
    deliveries waiting for a member), so the broker has nothing more to hand out; then each
    client sends an UNSUBSCRIBE (of a filter it never had): whatever the broker wrote to it
    before comes ahead of the UNSUBACK on the same connection, and paho hands it over first."""
    deadline = time.monotonic() + 10
    while True:
        groups = sessions(broker)["shared_groups"]
        if all(not g["orphans"] and all(p["lag"] == 0 for p in g["positions"]) for g in groups):
            break
        assert time.monotonic() < deadline, f"shared groups not at rest: {groups}"
        time.sleep(0.02)
    for c in clients:
        c.paho.unsubscribe("quiet/barrier")
        c.unsubacks.get(timeout=10)
        while not c.messages.empty():
            m = c.messages.get()
            assert m.topic == "devices/sync", f"unexpected extra delivery {m}"


def sessions(broker: BrokerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(broker.http_url + "/api/v1/sessions", timeout=5) as r:
        data: dict[str, Any] = orjson.loads(r.read())
    return data


def test_each_message_to_exactly_one_member_of_each_group(broker: BrokerProcess) -> None:
    members = [
        Client(broker.port, "a", V311),
        Client(broker.port, "b", V5),
        Client(broker.port, "c", V311),
    ]
    for m in members:
        assert m.connect() == 0
        assert m.subscribe(GROUP, qos=1) == [1]
    other_group = Client(broker.port, "h1", V5)
    other_group.connect()
    other_group.subscribe("$share/h/devices/#", qos=1)
    plain = Client(broker.port, "plain", V311)
    plain.connect()
    plain.subscribe("devices/+/telemetry", qos=1)

    sent = publish_all(broker.port, 120)
    got = drain(members, len(sent))
    quiet(broker, members)
    payloads = [m.payload for g in got for m in g]
    assert Counter(payloads) == Counter(sent)  # each exactly once across the group
    assert all(len(g) >= 10 for g in got), [len(g) for g in got]  # spread over all members
    assert {m.qos for g in got for m in g} == {1}
    assert not any(m.retain for g in got for m in g)
    # Another group and a plain subscriber each get every message too.
    assert sorted(m.payload for m in drain([other_group], len(sent))[0]) == sorted(sent)
    assert sorted(m.payload for m in drain([plain], len(sent))[0]) == sorted(sent)

    # One position per partition for the group, at the high-water mark once drained.
    (group,) = [g for g in sessions(broker)["shared_groups"] if g["subscription"] == GROUP]
    assert sorted(group["members"]) == ["a", "b", "c"]
    telemetry = [p for p in group["positions"] if p["stream"] == "telemetry"]
    assert sorted(p["partition"] for p in telemetry) == [0, 1, 2, 3]
    assert all(p["lag"] == 0 for p in telemetry)
    assert sum(p["offset"] for p in telemetry) == len(sent) + 1  # + the sync marker


def test_member_gets_its_own_qos_and_subscription_identifier(broker: BrokerProcess) -> None:
    q0 = Client(broker.port, "q0", V311)
    q0.connect()
    q0.subscribe("$share/mixed/devices/#", qos=0)
    q1 = Client(broker.port, "q1", V5)
    q1.connect()
    props = Properties(PacketTypes.SUBSCRIBE)
    props.SubscriptionIdentifier = 7
    q1.subscribe("$share/mixed/devices/#", qos=1, properties=props)
    sent = publish_all(broker.port, 40)
    got = drain([q0, q1], len(sent))
    assert sorted(m.payload for g in got for m in g) == sorted(sent)
    assert got[0] and got[1]
    assert {m.qos for m in got[0]} == {0}  # min(published 1, subscribed 0) [MQTT-3.8.4-8]
    assert {m.qos for m in got[1]} == {1}
    assert all(m.properties.get("SubscriptionIdentifier") == [7] for m in got[1])


def test_no_retained_messages_for_shared_subscriptions(broker: BrokerProcess) -> None:
    pub = Client(broker.port, "pub")
    pub.connect()
    pub.publish("devices/d1/status", "online", qos=1, retain=True)
    shared = Client(broker.port, "shared", V5)
    shared.connect()
    shared.subscribe(GROUP, qos=1)
    plain = Client(broker.port, "plain", V5)
    plain.connect()
    plain.subscribe("devices/#", qos=1)
    (msg,) = plain.expect(1)
    assert msg.retain and msg.payload == b"online"
    shared.expect_none(0.5)  # s4.8.2: retained messages are not sent to shared subscriptions
    pub.publish("devices/d1/status", "still", qos=1, retain=True)
    (live,) = shared.expect(1)
    assert live.payload == b"still" and not live.retain


@pytest.mark.parametrize("protocol", [pytest.param(V311, id="v311"), pytest.param(V5, id="v5")])
@pytest.mark.parametrize("leave", ["dropped", "disconnected", "unsubscribed"])
def test_unacked_deliveries_of_a_leaving_member_go_to_another(
    broker: BrokerProcess, protocol: int, leave: str
) -> None:
    # "slow" never acknowledges; when its clean session ends, or it unsubscribes (even with a
    # persistent session that stays), what it held goes to "fast".
    persistent = leave == "unsubscribed"
    slow = Client(
        broker.port,
        "slow",
        protocol,
        manual_ack=True,
        clean=not persistent,
        session_expiry=300 if persistent and protocol == V5 else None,
    )
    fast = Client(broker.port, "fast", protocol)
    for c in (slow, fast):
        assert c.connect() == 0
        assert c.subscribe(GROUP, qos=1) == [1]
    sent = publish_all(broker.port, 30)
    held, first = drain([slow, fast], len(sent))
    assert held and first, "both members must have had a share"
    if leave == "disconnected":
        slow.disconnect()
    elif leave == "dropped":
        slow.drop()
    else:
        slow.paho.unsubscribe(GROUP)
    (redelivered,) = drain([fast], len(held))
    assert sorted(m.payload for m in redelivered) == sorted(m.payload for m in held)
    quiet(broker, [fast])
    # And the group goes on with the remaining member.
    more = publish_all(broker.port, 10, start=100)
    (after,) = drain([fast], len(more))
    assert sorted(m.payload for m in after) == sorted(more)


def test_members_join_and_leave(broker: BrokerProcess) -> None:
    a = Client(broker.port, "a", V5)
    a.connect()
    a.subscribe(GROUP, qos=1)
    sent = publish_all(broker.port, 12)
    (got,) = drain([a], len(sent))
    assert sorted(m.payload for m in got) == sorted(sent)

    b = Client(broker.port, "b", V311)
    b.connect()
    b.subscribe(GROUP, qos=1)
    sent = publish_all(broker.port, 40, start=100)
    got_a, got_b = drain([a, b], len(sent))
    assert Counter(m.payload for m in got_a + got_b) == Counter(sent)
    assert got_a and got_b  # the new member takes its share at once

    a.paho.unsubscribe(GROUP)
    assert a.unsubacks.get(timeout=5) == [0]
    sent = publish_all(broker.port, 20, start=200)
    (got_b,) = drain([b], len(sent))
    assert sorted(m.payload for m in got_b) == sorted(sent)
    quiet(broker, [a])

    # With no member left the group keeps its position (a consumer group): what was
    # published meanwhile goes to the next member, from where the group stood.
    b.disconnect()
    deadline = time.monotonic() + 5
    while any(g["members"] for g in sessions(broker)["shared_groups"]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sent = publish_all(broker.port, 8, start=300)
    c = Client(broker.port, "c", V311)
    c.connect()
    c.subscribe(GROUP, qos=1)
    (got_c,) = drain([c], len(sent))
    assert sorted(m.payload for m in got_c) == sorted(sent)
    quiet(broker, [c])


def test_mosquitto_sub_members(broker: BrokerProcess) -> None:
    subs = [SubProcess(broker.port, GROUP, "-q", "1", "-i", f"mosq{i}") for i in range(2)]
    try:
        deadline = time.monotonic() + 10
        while True:  # the admin API shows when both have subscribed
            groups = sessions(broker)["shared_groups"]
            if groups and sorted(groups[0]["members"]) == ["mosq0", "mosq1"]:
                break
            assert time.monotonic() < deadline, groups
            time.sleep(0.05)
        sent = publish_all(broker.port, 40)
        expected = len(sent) + 1  # + the sync marker, delivered to one of them
        deadline = time.monotonic() + 10
        while sum(len(s.wait_for(0, 0)) for s in subs) < expected:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        lines = [s.wait_for(0, 0) for s in subs]
        assert all(lines), "both mosquitto_sub members get a share"
        payloads = [
            ln.split(" ", 1)[1].encode()
            for out in lines
            for ln in out
            if not ln.startswith("devices/sync")
        ]
        assert Counter(payloads) == Counter(sent)
        assert all(ln.startswith("devices/") for out in lines for ln in out)
    finally:
        for s in subs:
            s.stop()


def test_persistent_member_keeps_unacked_until_its_session_expires(broker: BrokerProcess) -> None:
    # A persistent member that drops keeps what it held (it may come back for it, s4.8.2);
    # once its session expires, those messages go to another member.
    p = Client(broker.port, "p", V5, clean=False, session_expiry=300, manual_ack=True)
    q = Client(broker.port, "q", V5)
    for c in (p, q):
        assert c.connect() == 0
        assert c.subscribe(GROUP, qos=1) == [1]
    sent = publish_all(broker.port, 20)
    held, _ = drain([p, q], len(sent))
    assert held
    p.drop()
    p = Client(broker.port, "p", V5, clean=False, session_expiry=1, manual_ack=True)
    assert p.connect() == 0 and p.session_present
    (again,) = drain([p], len(held))  # resent to it, with DUP [MQTT-4.4.0-1]
    assert sorted(m.payload for m in again) == sorted(m.payload for m in held)
    assert all(m.dup for m in again)
    quiet(broker, [q])
    p.drop()  # still unacknowledged; its session now expires after 1 s
    (redelivered,) = drain([q], len(held), timeout=10)
    assert sorted(m.payload for m in redelivered) == sorted(m.payload for m in held)
