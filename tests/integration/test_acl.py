"""ACLs against the real broker: publish, subscribe, $replay and $share, 3.1.1 and 5.0 codes."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import BrokerFactory, BrokerProcess
from tests.integration.rawclient import RawClient
from tests.integration.test_auth import make_password_file
from tests.mqttbytes import CONNACK, packet, utf8, varint

ACL = """\
# anonymous clients
topic read public/#
pattern readwrite clients/%c/#
user alice
topic readwrite alice/#
topic deny alice/secret/#
user bob
topic read alice/#
topic write bob/#
user carol
topic write alice/#
"""
PUBACK, PUBREC, PUBREL, PUBCOMP = 0x4, 0x5, 0x6, 0x7
GRANTED_QOS1 = 1
DENIED_311 = 0x80
DENIED_5 = 0x87


@pytest.fixture
def acl_broker(broker_factory: BrokerFactory, tmp_path: Path) -> BrokerProcess:
    pw = make_password_file(tmp_path / "passwd", {"alice": "a-pw", "bob": "b-pw", "carol": "c-pw"})
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    return broker_factory(config=f'[auth]\npassword_file = "{pw}"\nacl_file = "{acl}"\n')


def user(
    broker: BrokerProcess, name: str | None, protocol: int = V311, client_id: str = ""
) -> Client:
    c = Client(broker.port, client_id or f"{name}-{protocol}", protocol)
    if name is not None:
        c.paho.username_pw_set(name, f"{name[0]}-pw")
    assert c.connect() == 0
    return c


def raw_login(broker: BrokerProcess, name: str, version: int) -> RawClient:
    body = utf8("MQTT") + bytes([version, 0x02 | 0x80 | 0x40]) + (30).to_bytes(2, "big")
    if version == 5:
        body += varint(0)
    body += utf8(f"raw-{name}") + utf8(name) + utf8(f"{name[0]}-pw")
    c = RawClient(broker.port, version)
    c.send(packet(0x10, body))
    assert c.expect(CONNACK).body[:2] == b"\x00\x00"
    return c


def raw_publish(c: RawClient, topic: str, qos: int, pid: int) -> bytes:
    body = utf8(topic) + struct.pack("!H", pid) + (varint(0) if c.version == 5 else b"")
    c.send(packet(0x30 | qos << 1, body + b"payload"))
    return c.expect(PUBACK if qos == 1 else PUBREC).body


def test_subscribe_allowed_and_denied_311(acl_broker: BrokerProcess) -> None:
    bob = user(acl_broker, "bob")
    assert bob.subscribe("alice/#", 1) == [GRANTED_QOS1]
    assert bob.subscribe("alice/+/x", 1) == [GRANTED_QOS1]
    assert bob.subscribe("bob/#", 1) == [DENIED_311], "write-only"
    assert bob.subscribe("#", 1) == [DENIED_311], "wider than any read rule"
    assert bob.subscribe("public/#", 1) == [DENIED_311], "anonymous rules are not bob's"
    anon = user(acl_broker, None)
    assert anon.subscribe("public/news", 1) == [GRANTED_QOS1]
    assert anon.subscribe("alice/#", 1) == [DENIED_311]
    alice = user(acl_broker, "alice")
    assert alice.subscribe("alice/secret/#", 1) == [DENIED_311], "deny rule covers it"
    assert "SUBSCRIBE '#' denied by the ACL" in acl_broker.log()
    for c in (bob, anon, alice):
        c.disconnect()


def test_subscribe_denied_5(acl_broker: BrokerProcess) -> None:
    bob = user(acl_broker, "bob", V5)
    assert bob.subscribe("alice/#", 1) == [GRANTED_QOS1]
    assert bob.subscribe("bob/#", 1) == [DENIED_5]
    bob.disconnect()


def test_publish_denied_311_is_acked_and_dropped(acl_broker: BrokerProcess) -> None:
    alice = user(acl_broker, "alice")
    assert alice.subscribe("alice/#", 1) == [GRANTED_QOS1]
    bob = user(acl_broker, "bob")
    assert bob.subscribe("alice/#", 1) == [GRANTED_QOS1]
    # bob may only read alice/#: his publishes are acknowledged (3.1.1 has no refusal,
    # mosquitto does the same) at QoS 0, 1 and 2, and stored nowhere.
    for qos in (0, 1, 2):
        bob.publish("alice/from-bob", f"q{qos}", qos=qos)
    alice.publish("alice/hello", "hi", qos=1)
    got = alice.expect(1) + bob.expect(1)
    assert [(m.topic, m.payload) for m in got] == [("alice/hello", b"hi")] * 2
    alice.expect_none(0.3)
    assert "PUBLISH to 'alice/from-bob' denied by the ACL" in acl_broker.log()
    for c in (alice, bob):
        c.disconnect()


def test_publish_denied_5_reason_code(acl_broker: BrokerProcess) -> None:
    bob = raw_login(acl_broker, "bob", 5)
    reason = utf8("not authorized to publish to 'alice/x'")  # its Reason String (0x1F)
    props = b"\x1f" + reason
    assert raw_publish(bob, "alice/x", 1, 1) == b"\x00\x01\x87" + varint(len(props)) + props
    # the QoS 2 flow ends here
    assert raw_publish(bob, "alice/x", 2, 2) == b"\x00\x02\x87" + varint(len(props)) + props
    assert raw_publish(bob, "bob/x", 1, 3) in (b"\x00\x03", b"\x00\x03\x00")
    bob.send(packet(0xC0, b""))  # PINGREQ: the connection is still fine
    bob.expect(0xD)
    bob311 = raw_login(acl_broker, "bob", 4)
    assert raw_publish(bob311, "alice/x", 1, 1) == b"\x00\x01"
    assert raw_publish(bob311, "alice/x", 2, 2) == b"\x00\x02"
    bob311.send(packet(0x62, b"\x00\x02"))  # PUBREL: answered though nothing was stored
    assert bob311.expect(PUBCOMP).body == b"\x00\x02"
    for c in (bob, bob311):
        c.close()


def test_deny_rule_inside_an_allowed_subscription(acl_broker: BrokerProcess) -> None:
    alice = user(acl_broker, "alice")
    assert alice.subscribe("alice/#", 1) == [GRANTED_QOS1]
    carol = user(acl_broker, "carol")
    carol.publish("alice/secret/key", "s", qos=1)
    carol.publish("alice/open", "o", qos=1)
    (msg,) = alice.expect(1)
    assert (msg.topic, msg.payload) == ("alice/open", b"o")
    alice.expect_none(0.3)
    for c in (alice, carol):
        c.disconnect()


def test_replay_checked_against_read_rules(acl_broker: BrokerProcess) -> None:
    carol = user(acl_broker, "carol")
    carol.publish("alice/a", "1", qos=1)
    carol.publish("alice/secret/b", "2", qos=1)
    carol.disconnect()
    bob = user(acl_broker, "bob")
    assert bob.subscribe("$replay/earliest/alice/#", 1) == [GRANTED_QOS1]
    got = bob.expect(2)
    assert sorted(m.payload for m in got) == [b"1", b"2"]
    assert bob.subscribe("$replay/earliest/bob/#", 1) == [DENIED_311]
    bob.disconnect()
    anon = user(acl_broker, None, V5)
    assert anon.subscribe("$replay/earliest/alice/#", 1) == [DENIED_5]
    assert anon.subscribe("$replay/offset:0/public/#", 1) == [GRANTED_QOS1]
    anon.disconnect()
    alice = user(acl_broker, "alice")
    assert alice.subscribe("$replay/earliest/alice/secret/#", 1) == [DENIED_311]
    assert alice.subscribe("$replay/earliest/alice/#", 1) == [GRANTED_QOS1]
    (msg,) = alice.expect(1)
    assert msg.payload == b"1", "the deny rule applies per record in a replay too"
    alice.expect_none(0.3)
    alice.disconnect()


def test_shared_subscriptions_checked_on_the_inner_filter(acl_broker: BrokerProcess) -> None:
    bob = user(acl_broker, "bob", V5)
    assert bob.subscribe("$share/g/alice/#", 1) == [GRANTED_QOS1]
    assert bob.subscribe("$share/g/bob/#", 1) == [DENIED_5]
    bob311 = user(acl_broker, "bob", V311, client_id="bob-311")
    assert bob311.subscribe("$share/g/#", 1) == [DENIED_311]
    carol = user(acl_broker, "carol")
    carol.publish("alice/s", "shared", qos=1)
    (msg,) = bob.expect(1)
    assert msg.payload == b"shared"
    for c in (bob, bob311, carol):
        c.disconnect()


def test_deny_rule_inside_an_allowed_shared_subscription(acl_broker: BrokerProcess) -> None:
    # alice may read alice/# but not alice/secret/#: as a shared-group member she must not
    # get alice/secret/... either, and such a record must not block the group.
    alice = user(acl_broker, "alice", V5)
    assert alice.subscribe("$share/g/alice/#", 1) == [GRANTED_QOS1]
    carol = user(acl_broker, "carol")
    carol.publish("alice/secret/key", "hidden", qos=1)
    carol.publish("alice/open", "seen", qos=1)
    (msg,) = alice.expect(1)
    assert (msg.topic, msg.payload) == ("alice/open", b"seen")
    alice.expect_none(0.3)
    for c in (alice, carol):
        c.disconnect()


def test_client_id_pattern(acl_broker: BrokerProcess) -> None:
    dev = user(acl_broker, None, V5, client_id="dev1")
    assert dev.subscribe("clients/dev1/#", 1) == [GRANTED_QOS1]
    assert dev.subscribe("clients/dev2/#", 1) == [DENIED_5]
    assert dev.subscribe("clients/+/#", 1) == [DENIED_5]
    dev.publish("clients/dev1/up", "ok", qos=1)
    dev.publish("clients/dev2/up", "no", qos=1)
    (msg,) = dev.expect(1)
    assert msg.topic == "clients/dev1/up"
    dev.disconnect()


def test_clients_never_write_sys_topics(broker: BrokerProcess) -> None:
    c = raw_login_anonymous(broker)
    props = b"\x1f" + utf8("not authorized to publish to '$SYS/broker/uptime'")
    assert (
        raw_publish(c, "$SYS/broker/uptime", 1, 1) == b"\x00\x01\x87" + varint(len(props)) + props
    )
    c.close()


def raw_login_anonymous(broker: BrokerProcess) -> RawClient:
    c = RawClient(broker.port, 5)
    body = utf8("MQTT") + bytes([5, 0x02]) + (30).to_bytes(2, "big") + varint(0) + utf8("anon")
    c.send(packet(0x10, body))
    assert c.expect(CONNACK).body[:2] == b"\x00\x00"
    return c
