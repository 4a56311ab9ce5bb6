"""MQTT 5 features end to end: topic aliases both ways, receive maximum both ways, maximum
packet size, properties passed through, problem/response information, subscription
identifiers, the message expiry interval (expiry itself is checked on a fake clock in
tests/unit/router/test_message_expiry.py). Raw sockets use hand-built bytes
(tests/mqttbytes.py); paho checks that a real client library reads our answers the same way.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.integration.clients import V5, Client, mosquitto_pub, mosquitto_sub
from tests.integration.conftest import BrokerProcess
from tests.integration.rawclient import open_session, read_packet, wait_closed
from tests.mqttbytes import connack5, connect5, disconnect5, packet, publish5, utf8

MAX_INFLIGHT = 3


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory, module_workers: int) -> Iterator[BrokerProcess]:
    b = BrokerProcess(
        Path(tmp_path_factory.mktemp("mqtt5")),
        f"[router]\nmax_inflight = {MAX_INFLIGHT}\n",
        workers=module_workers,
    )
    b.start()
    yield b
    b.stop()


def sub_client(mb: BrokerProcess, cid: str, topic: str, qos: int = 1, **kw: object) -> Client:
    c = Client(mb.port, cid, V5, **kw)  # type: ignore[arg-type]
    assert c.connect() == 0
    assert c.subscribe(topic, qos=qos) == [qos]
    return c


def raw_subscribe(s: socket.socket, topic: str, qos: int = 1, props: bytes = b"") -> None:
    # SUBSCRIBE (82) | packet id 00 01 | properties | filter | options (QoS)
    s.sendall(
        packet(
            0x82,
            bytes.fromhex("0001") + bytes([len(props)]) + props + utf8(topic) + bytes([qos]),
        )
    )
    first, body = read_packet(s)
    assert first == 0x90 and body[-1] == qos, body.hex()  # SUBACK granted


def raw_publish(
    s: socket.socket,
    topic: str,
    payload: bytes,
    *,
    qos: int = 0,
    pid: int = 0,
    props: bytes = b"",
    dup: bool = False,
) -> None:
    body = utf8(topic) + (pid.to_bytes(2, "big") if qos else b"")
    first = 0x30 | (qos << 1) | (0x08 if dup else 0)
    s.sendall(packet(first, body + bytes([len(props)]) + props + payload))


# ------------------------------------------------------------------ topic aliases, inbound


def test_inbound_topic_alias_resolved(mb: BrokerProcess) -> None:
    sub = sub_client(mb, "alias-in-sub", "alias/#")
    s, body = open_session(mb.port, connect5("alias-in"))
    assert connack5(body)[2][0x22] >= 1  # Topic Alias Maximum announced (s3.2.2.3.8)
    raw_publish(s, "alias/one", b"first", props=bytes.fromhex("230001"))  # set alias 1
    raw_publish(s, "", b"second", props=bytes.fromhex("230001"))  # use alias 1
    raw_publish(s, "alias/two", b"third", props=bytes.fromhex("230001"))  # remap alias 1
    raw_publish(s, "", b"fourth", props=bytes.fromhex("230001"))
    msgs = sub.expect(4)
    assert [(m.topic, m.payload) for m in msgs] == [
        ("alias/one", b"first"),
        ("alias/one", b"second"),
        ("alias/two", b"third"),
        ("alias/two", b"fourth"),
    ]
    assert all("TopicAlias" not in m.properties for m in msgs)  # not forwarded
    s.close()
    sub.disconnect()


@pytest.mark.parametrize(
    ("publish", "code"),
    [
        # PUBLISH 'a' with Topic Alias 0 [MQTT-3.3.2-8] -> 0x94
        pytest.param("3008000161032300 0078", 0x94, id="alias-0"),
        # Topic Alias 65535, above the maximum we announced [MQTT-3.3.2-9] -> 0x94
        pytest.param("300800016103 23ffff 78", 0x94, id="alias-above-maximum"),
        # empty topic with alias 5 never set (s3.3.2.3.4) -> Protocol Error 0x82
        pytest.param("3007 0000 03 230005 78", 0x82, id="alias-unknown"),
    ],
)
def test_inbound_topic_alias_errors(mb: BrokerProcess, publish: str, code: int) -> None:
    bystander = sub_client(mb, "alias-err-by", "alias-err/#")
    s, _ = open_session(mb.port, connect5("alias-err"))
    s.sendall(bytes.fromhex(publish.replace(" ", "")))
    out, _ = wait_closed(s)
    assert disconnect5(out[0], out[2:])[0] == code
    s.close()
    pub = Client(mb.port, "alias-err-pub", V5)
    assert pub.connect() == 0
    pub.publish("alias-err/x", "still", qos=1)
    assert bystander.expect(1)[0].payload == b"still"
    pub.disconnect()
    bystander.disconnect()


# ------------------------------------------------------------------ topic aliases, outbound


def test_outbound_topic_alias_on_raw_socket(mb: BrokerProcess) -> None:
    # CONNECT with Topic Alias Maximum 2 (22 00 02)
    s, _ = open_session(mb.port, connect5("alias-out", props=bytes.fromhex("220002")))
    raw_subscribe(s, "ao/#", qos=0)
    pub = Client(mb.port, "alias-out-pub", V5)
    assert pub.connect() == 0
    for topic, payload in [
        ("ao/a", "1"),
        ("ao/a", "2"),
        ("ao/b", "3"),
        ("ao/c", "4"),
        ("ao/b", "5"),
    ]:
        pub.publish(topic, payload, qos=1)
    got = [publish5(*read_packet(s)) for _ in range(5)]
    # (topic as sent, alias, payload): the second PUBLISH to a topic carries an empty topic
    # and the alias [MQTT-3.3.2-12]; only 2 aliases exist, so ao/c goes out in full.
    assert [(t, p.get(0x23), pl) for t, _, p, pl in got] == [
        ("ao/a", 1, b"1"),
        ("", 1, b"2"),
        ("ao/b", 2, b"3"),
        ("ao/c", None, b"4"),
        ("", 2, b"5"),
    ]
    s.close()
    pub.disconnect()


def test_outbound_aliases_are_per_connection(mb: BrokerProcess) -> None:
    # Neither paho 2.2 nor libmosquitto (mosquitto_sub) resolve aliases a server sends
    # (both refuse a zero-length topic), so this is checked on raw sockets [MQTT-3.3.2-7]:
    # a new connection of the same session starts with no aliases.
    cid = "alias-reconnect"
    tam = bytes.fromhex("2200041100000078")  # Topic Alias Maximum 4, Session Expiry 120
    pub = Client(mb.port, "alias-reconnect-pub", V5)
    assert pub.connect() == 0
    for round_ in range(2):
        flags = 0x02 if round_ == 0 else 0x00  # clean start, then resume the session
        s, _ = open_session(mb.port, connect5(cid, flags=flags, props=tam))
        if round_ == 0:
            raw_subscribe(s, "ar/#", qos=0)
        pub.publish("ar/x", "a", qos=1)
        pub.publish("ar/x", "b", qos=1)
        got = [publish5(*read_packet(s)) for _ in range(2)]
        assert [(t, p[0x23], pl) for t, _, p, pl in got] == [("ar/x", 1, b"a"), ("", 1, b"b")]
        s.sendall(bytes.fromhex("e000"))  # DISCONNECT
        wait_closed(s)
        s.close()
    pub.disconnect()


def test_no_outbound_alias_without_client_maximum(mb: BrokerProcess) -> None:
    s, _ = open_session(mb.port, connect5("alias-none"))
    raw_subscribe(s, "an/#", qos=0)
    pub = Client(mb.port, "alias-none-pub", V5)
    assert pub.connect() == 0
    pub.publish("an/a", "1", qos=1)
    pub.publish("an/a", "2", qos=1)
    got = [publish5(*read_packet(s)) for _ in range(2)]
    assert [(t, 0x23 in p) for t, _, p, _ in got] == [("an/a", False), ("an/a", False)]
    s.close()
    pub.disconnect()


# ------------------------------------------------------------------ maximum packet size


def test_client_maximum_packet_size_skips_larger_deliveries(mb: BrokerProcess) -> None:
    # CONNECT with Maximum Packet Size 64 (27 00000040) and Topic Alias Maximum 4 (22 0004)
    s, _ = open_session(mb.port, connect5("mps-sub", props=bytes.fromhex("2700000040220004")))
    raw_subscribe(s, "mps/#", qos=1)
    pub = Client(mb.port, "mps-pub", V5)
    assert pub.connect() == 0
    pub.publish("mps/t", b"x" * 200, qos=1)  # too large: never sent [MQTT-3.1.2-25]
    pub.publish("mps/t", "small", qos=1)
    pub.publish("mps/u", b"y" * 100, qos=1)
    pub.publish("mps/u", "tiny", qos=1)
    first = publish5(*read_packet(s))
    second = publish5(*read_packet(s))
    # The skipped packet set no alias, so the first one the client sees names its topic.
    assert (first[0], first[2].get(0x23), first[3]) == ("mps/t", 1, b"small")
    assert (second[0], second[3]) == ("mps/u", b"tiny")
    for _, pid, _, _ in (first, second):
        assert pid is not None
        s.sendall(bytes.fromhex("4002") + pid.to_bytes(2, "big"))  # PUBACK
    s.sendall(bytes.fromhex("c000"))
    assert read_packet(s) == (0xD0, b"")  # nothing else was queued before the PINGRESP
    s.close()
    pub.disconnect()


# ------------------------------------------------------------------ receive maximum


def test_receive_maximum_announced_and_enforced_inbound(mb: BrokerProcess) -> None:
    s, body = open_session(mb.port, connect5("rm-in"))
    assert connack5(body)[2][0x21] == MAX_INFLIGHT  # Receive Maximum (s3.2.2.3.3)
    for pid in range(1, MAX_INFLIGHT + 1):  # QoS 2, PUBREL withheld: all stay unacked
        raw_publish(s, "rm/in", b"q2", qos=2, pid=pid)
        first, rec = read_packet(s)
        assert first == 0x50 and rec[:2] == pid.to_bytes(2, "big")  # PUBREC
    s.sendall(bytes.fromhex("62020001"))  # PUBREL 1
    assert read_packet(s) == (0x70, bytes.fromhex("0001"))  # PUBCOMP 1: quota comes back
    raw_publish(s, "rm/in", b"q1", qos=1, pid=9)  # back at the limit, still allowed
    assert read_packet(s)[0] == 0x40
    raw_publish(s, "rm/in", b"q2", qos=2, pid=2, dup=True)  # resend of an unfinished id
    assert read_packet(s)[0] == 0x50  # PUBREC again, and it used no new quota
    raw_publish(s, "rm/in", b"q2", qos=2, pid=4)  # the third unacknowledged: allowed
    assert read_packet(s)[0] == 0x50
    raw_publish(s, "rm/in", b"q2", qos=2, pid=5)  # a fourth
    out, _ = wait_closed(s)
    assert disconnect5(out[0], out[2:])[0] == 0x93  # Receive Maximum exceeded (s3.3.4)
    s.close()


def test_receive_maximum_with_paho_publishers(mb: BrokerProcess) -> None:
    sub = sub_client(mb, "rm-paho-sub", "rmp/#")
    pub = Client(mb.port, "rm-paho-pub", V5)
    pub.paho.max_inflight_messages_set(MAX_INFLIGHT)  # a client honouring our maximum
    assert pub.connect() == 0
    for i in range(30):
        pub.publish("rmp/a", str(i), qos=1, wait=False)
    msgs = sub.expect(30)
    assert [m.payload for m in msgs] == [str(i).encode() for i in range(30)]
    assert pub.disconnects.empty()
    pub.disconnect()
    # (paho ignores Receive Maximum from CONNACK and keeps 20 in flight; whether a burst
    # exceeds ours depends on timing, so the 0x93 answer is tested on a raw socket above.)
    sub.disconnect()


def test_receive_maximum_outbound(mb: BrokerProcess) -> None:
    # CONNECT with Receive Maximum 2 (21 0002): at most 2 unacked QoS 1 deliveries.
    s, _ = open_session(mb.port, connect5("rm-out", props=bytes.fromhex("210002")))
    raw_subscribe(s, "rmo/#", qos=1)
    pub = Client(mb.port, "rm-out-pub", V5)
    assert pub.connect() == 0
    for i in range(4):
        pub.publish("rmo/a", str(i), qos=1)
    got = [publish5(*read_packet(s)) for _ in range(2)]
    s.settimeout(0.4)
    with pytest.raises(TimeoutError):
        s.recv(1)  # [MQTT-3.3.4-9]: a third one waits for an acknowledgement
    pid = got[0][1]
    assert pid is not None
    s.sendall(bytes.fromhex("4002") + pid.to_bytes(2, "big"))  # PUBACK the first
    third = publish5(*read_packet(s))
    assert [g[3] for g in got] + [third[3]] == [b"0", b"1", b"2"]
    s.close()
    pub.disconnect()


# ------------------------------------------------------------------ properties passed through


def test_publish_properties_pass_through_unchanged(mb: BrokerProcess) -> None:
    sub = sub_client(mb, "props-sub", "props/#")
    pub = Client(mb.port, "props-pub", V5)
    assert pub.connect() == 0
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = ("k", "v1")
    props.UserProperty = ("k", "v2")  # a repeated key, order kept [MQTT-3.3.2-18]
    props.UserProperty = ("other", "\u00e9t\u00e9")
    props.ContentType = "application/json"
    props.PayloadFormatIndicator = 1
    props.ResponseTopic = "props/reply"
    props.CorrelationData = b"\x00\x01\xff"
    props.MessageExpiryInterval = 3600
    pub.publish("props/a", '{"x": 1}', qos=1, properties=props)
    (m,) = sub.expect(1)
    p = m.properties
    assert p["UserProperty"] == [("k", "v1"), ("k", "v2"), ("other", "\u00e9t\u00e9")]
    assert p["ContentType"] == "application/json"
    assert p["PayloadFormatIndicator"] == 1
    assert p["ResponseTopic"] == "props/reply"
    assert bytes.fromhex(p["CorrelationData"]) == b"\x00\x01\xff"
    assert 3598 <= p["MessageExpiryInterval"] <= 3600  # decremented by time held [MQTT-3.3.2-6]
    sub.disconnect()
    pub.disconnect()


def test_properties_on_raw_socket(mb: BrokerProcess) -> None:
    s, _ = open_session(mb.port, connect5("props-raw"))
    raw_subscribe(s, "pr/#", qos=0)
    # 01 01 payload format UTF-8 | 03 'text/plain' content type | 26 'a' 'b' user property
    props = bytes.fromhex("0101") + b"\x03" + utf8("text/plain") + b"\x26" + utf8("a") + utf8("b")
    raw_publish(s, "pr/x", b"hello", props=props)
    topic, _, got, payload = publish5(*read_packet(s))
    assert (topic, payload) == ("pr/x", b"hello")
    assert got == {0x01: 1, 0x03: "text/plain", 0x26: [("a", "b")]}
    s.close()


def test_properties_with_mosquitto_clients(mb: BrokerProcess) -> None:
    # A retained message is delivered on SUBSCRIBE, so mosquitto_sub needs no start-up wait.
    props = [
        "-D",
        "publish",
        "user-property",
        "k",
        "v",
        "-D",
        "publish",
        "content-type",
        "text/plain",
        "-D",
        "publish",
        "response-topic",
        "mq/reply",
        "-D",
        "publish",
        "correlation-data",
        "abc",
        "-D",
        "publish",
        "payload-format-indicator",
        "1",
        "-D",
        "publish",
        "message-expiry-interval",
        "100",
    ]
    mosquitto_pub(mb.port, "mq/a", "hi", 1, "-r", *props, version="mqttv5")
    (line,) = mosquitto_sub(
        mb.port,
        "mq/#",
        1,
        "-F",
        "%t|%C|%R|%D|%F|%P|%S|%E|%p",
        "-D",
        "subscribe",
        "subscription-identifier",
        "42",
        version="mqttv5",
    )
    fields = line.split("|")
    assert fields[:7] == ["mq/a", "text/plain", "mq/reply", "abc", "1", "k:v", "42"]
    assert 98 <= int(fields[7]) <= 100 and fields[8] == "hi"
    mosquitto_pub(mb.port, "mq/a", "", 1, "-r", version="mqttv5")  # clear the retained one


# ------------------------------------------------------------------ problem / response info


@pytest.mark.parametrize(("rpi", "has_reason"), [(None, True), (1, True), (0, False)])
def test_reason_string_only_when_problem_information_allowed(
    mb: BrokerProcess, rpi: int | None, has_reason: bool
) -> None:
    props = b"" if rpi is None else bytes([0x17, rpi])  # Request Problem Information
    s, _ = open_session(mb.port, connect5(f"rpi-{rpi}", props=props))
    s.sendall(bytes.fromhex("3005000123007a"))  # PUBLISH to '#': Topic Name invalid
    out, _ = wait_closed(s)
    code, dprops = disconnect5(out[0], out[2:])
    assert code == 0x90
    assert (0x1F in dprops) is has_reason  # [MQTT-3.1.2-29] honoured on DISCONNECT too
    s.close()


def test_request_response_information(mb: BrokerProcess) -> None:
    s, body = open_session(mb.port, connect5("rri", props=bytes.fromhex("1901")))
    info = connack5(body)[2].get(0x1A)  # Response Information (s3.2.2.3.15)
    assert isinstance(info, str) and info
    s.close()
    s, body = open_session(mb.port, connect5("rri0"))
    assert 0x1A not in connack5(body)[2]  # not asked, not sent
    s.close()
    props = Properties(PacketTypes.CONNECT)
    props.RequestResponseInformation = 1
    c = Client(mb.port, "rri-paho", V5, connect_properties=props)
    assert c.connect() == 0
    assert c.connack_properties["ResponseInformation"]
    c.disconnect()


# ------------------------------------------------------------------ subscription identifiers


def test_subscription_identifiers_delivered(mb: BrokerProcess) -> None:
    c = Client(mb.port, "subid", V5)
    assert c.connect() == 0
    p7 = Properties(PacketTypes.SUBSCRIBE)
    p7.SubscriptionIdentifier = 7
    assert c.subscribe("sid/#", 1, properties=p7) == [1]
    p9 = Properties(PacketTypes.SUBSCRIBE)
    p9.SubscriptionIdentifier = 9
    assert c.subscribe("sid/+/x", 1, properties=p9) == [1]
    pub = Client(mb.port, "subid-pub", V5)
    assert pub.connect() == 0
    pub.publish("sid/a/x", "both", qos=1)
    pub.publish("sid/b", "one", qos=1)
    both, one = c.expect(2)
    assert sorted(both.properties["SubscriptionIdentifier"]) == [7, 9]  # [MQTT-3.3.4-3]
    assert one.properties["SubscriptionIdentifier"] == [7]
    c.disconnect()
    pub.disconnect()


def test_subscription_identifier_on_raw_socket(mb: BrokerProcess) -> None:
    s, _ = open_session(mb.port, connect5("subid-raw"))
    raw_subscribe(s, "sr/#", qos=0, props=bytes.fromhex("0b8101"))  # id 129 (varint 81 01)
    raw_publish(s, "sr/a", b"x")
    _, _, props, _ = publish5(*read_packet(s))
    assert props[0x0B] == [129]
    s.close()
