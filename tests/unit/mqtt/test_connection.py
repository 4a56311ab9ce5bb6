"""broker/mqtt/connection.py: per-connection state (aliases, client limits, flow control).

Input is hand-built bytes; output PUBLISHes are read back with the (separately tested)
client-side decoder.
"""

from __future__ import annotations

import pytest

from broker.mqtt import Connect, Decoder, PubAck, PubComp, Publish, PubRec
from broker.mqtt.connection import ServerConnection, TopicAliasInvalid
from broker.mqtt.errors import (
    MalformedPacket,
    MQTTError,
    ProtocolError,
    TopicNameInvalid,
    UnsupportedProtocolVersion,
)
from tests.mqttbytes import varint

# CONNECT 5.0, client id 'c', no properties: 00 04 'MQTT' 05 | 02 | 00 3c | 00 | 00 01 63
CONNECT5 = bytes.fromhex("100e00044d5154540502003c00000163")
# CONNECT 3.1.1, client id 'c'
CONNECT4 = bytes.fromhex("100d00044d5154540402003c000163")


def connect5(props: bytes) -> bytes:
    body = bytes.fromhex("00044d5154540502003c") + varint(len(props)) + props + b"\x00\x01c"
    return b"\x10" + varint(len(body)) + body


def publish(
    topic: str, *, qos: int = 0, pid: int = 1, props: bytes | None = b"", dup: bool = False
) -> bytes:
    t = topic.encode()
    body = len(t).to_bytes(2, "big") + t + (pid.to_bytes(2, "big") if qos else b"")
    if props is not None:  # None: 3.1.1, no property block
        body += varint(len(props)) + props
    body += b"x"
    return bytes([0x30 | (qos << 1) | (0x08 if dup else 0)]) + varint(len(body)) + body


def conn5(props: bytes = b"", **kw: int) -> ServerConnection:
    c = ServerConnection(max_packet_size=1 << 20, topic_alias_maximum=kw.pop("tam", 4), **kw)
    (packet,) = c.receive_data(connect5(props))
    assert c.version == 5 and c.connected and isinstance(packet, Connect)
    return c


def code_of(c: ServerConnection, data: bytes) -> int:
    with pytest.raises(MQTTError) as info:
        c.receive_data(data)
    return int(info.value.reason_code)


# ------------------------------------------------------------------ CONNECT


def test_connect_records_client_limits() -> None:
    # 22 0005 topic alias max | 21 0007 receive max | 27 00000100 maximum packet size
    c = conn5(bytes.fromhex("2200052100072700000100"))
    assert (c.client_topic_alias_maximum, c.client_receive_maximum, c.client_max_packet_size) == (
        5,
        7,
        256,
    )


def test_connect_defaults() -> None:
    c = conn5()
    assert (c.client_topic_alias_maximum, c.client_receive_maximum, c.client_max_packet_size) == (
        0,
        65535,
        None,
    )


@pytest.mark.parametrize("props", ["210000", "2700000000"])  # receive max 0, max size 0
def test_zero_limits_are_protocol_errors(props: str) -> None:
    c = ServerConnection(max_packet_size=1 << 20)
    with pytest.raises(MQTTError) as info:
        c.receive_data(connect5(bytes.fromhex(props)))
    assert info.value.reason_code == 0x82
    assert c.requested_level == 5


def test_requested_level_of_a_refused_connect() -> None:
    c = ServerConnection(max_packet_size=1 << 20)
    with pytest.raises(UnsupportedProtocolVersion):
        c.receive_data(bytes.fromhex("100d00044d5154540602003c000163"))  # level 6
    assert c.version is None and c.requested_level == 6


@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_requested_level_across_chunks(chunks: int) -> None:
    data = bytes.fromhex("100d00044d5154540302003c000163")  # 'MQTT' level 3: refused
    c = ServerConnection(max_packet_size=1 << 20)
    with pytest.raises(UnsupportedProtocolVersion):
        for i in range(0, len(data), chunks):
            c.receive_data(data[i : i + chunks])
    assert c.requested_level == 3


def test_second_connect() -> None:
    c = conn5()
    assert code_of(c, CONNECT5) == 0x82  # [MQTT-3.1.0-2]


# ------------------------------------------------------------------ topics


@pytest.mark.parametrize(
    ("topic", "code"),
    [
        ("a/+", 0x90),
        ("#", 0x90),
        ("a/#", 0x90),
        ("", 0x82),  # 5.0 s3.3.2.1: empty topic without an alias
    ],
)
def test_bad_publish_topics_5(topic: str, code: int) -> None:
    assert code_of(conn5(), publish(topic)) == code


def test_empty_topic_311_is_invalid_name() -> None:
    c = ServerConnection(max_packet_size=1 << 20)
    c.receive_data(CONNECT4)
    with pytest.raises(TopicNameInvalid):
        c.receive_data(publish("", props=None))


def test_topic_length_is_counted_in_bytes() -> None:
    c = ServerConnection(max_packet_size=1 << 20, max_topic_length=8)
    c.receive_data(CONNECT4)
    assert c.receive_data(publish("\u00e9" * 4, props=None))  # 8 bytes
    with pytest.raises(TopicNameInvalid):
        c.receive_data(publish("\u00e9" * 5, props=None))  # 5 characters, 10 bytes


def test_topic_levels() -> None:
    c = ServerConnection(max_packet_size=1 << 20, max_topic_levels=3)
    c.receive_data(CONNECT4)
    assert c.receive_data(publish("a/b/c", props=None))
    with pytest.raises(TopicNameInvalid):
        c.receive_data(publish("a/b/c/d", props=None))


# ------------------------------------------------------------------ inbound aliases


def test_inbound_alias_set_used_and_stripped() -> None:
    c = conn5()
    (p1,) = c.receive_data(publish("t/1", props=bytes.fromhex("230002")))
    (p2,) = c.receive_data(publish("", props=bytes.fromhex("230002")))
    assert isinstance(p1, Publish) and isinstance(p2, Publish)
    assert (p1.topic, p2.topic) == ("t/1", "t/1")
    assert p1.properties == {} and p2.properties == {}  # the alias is per connection


@pytest.mark.parametrize(
    ("props", "code"),
    [
        ("230005", 0x94),  # above our maximum of 4 [MQTT-3.3.2-9]
        ("230000", 0x94),  # 0 [MQTT-3.3.2-8]
    ],
)
def test_inbound_alias_out_of_range(props: str, code: int) -> None:
    c = conn5()
    with pytest.raises(MQTTError) as info:
        c.receive_data(publish("t", props=bytes.fromhex(props)))
    assert info.value.reason_code == code


def test_inbound_alias_not_set() -> None:
    c = conn5()
    assert code_of(c, publish("", props=bytes.fromhex("230001"))) == 0x82


def test_inbound_alias_without_any_allowed() -> None:
    c = conn5(tam=0)
    with pytest.raises(TopicAliasInvalid):
        c.receive_data(publish("t", props=bytes.fromhex("230001")))


# ------------------------------------------------------------------ receive maximum (ours)


def test_receive_maximum_exceeded_is_0x93() -> None:
    c = conn5(receive_maximum=2)
    c.receive_data(publish("t", qos=1, pid=1))
    c.receive_data(publish("t", qos=2, pid=2))
    assert code_of(c, publish("t", qos=1, pid=3)) == 0x93


def test_acks_give_quota_back() -> None:
    c = conn5(receive_maximum=2)
    c.receive_data(publish("t", qos=1, pid=1))
    c.receive_data(publish("t", qos=2, pid=2))
    c.send(PubAck(1))
    c.receive_data(publish("t", qos=1, pid=3))  # 1 was acknowledged
    c.send(PubRec(2))  # a successful PUBREC keeps the QoS 2 id in use until PUBCOMP
    with pytest.raises(ProtocolError):
        c.receive_data(publish("t", qos=1, pid=4))


def test_pubcomp_and_refusing_pubrec_give_quota_back() -> None:
    c = conn5(receive_maximum=2)
    c.receive_data(publish("t", qos=2, pid=1))
    c.receive_data(publish("t", qos=2, pid=2))
    c.send(PubRec(1))
    c.send(PubComp(1))
    c.send(PubRec(2, 0x80))  # refused: the flow ends (s4.3.3)
    c.receive_data(publish("t", qos=1, pid=3))
    c.receive_data(publish("t", qos=1, pid=4))
    assert c.inbound_unacked == {3, 4}


def test_qos2_resend_uses_no_new_quota() -> None:
    c = conn5(receive_maximum=1)
    c.receive_data(publish("t", qos=2, pid=9))
    assert c.receive_data(publish("t", qos=2, pid=9, dup=True))  # same message again


def test_qos0_uses_no_quota() -> None:
    c = conn5(receive_maximum=1)
    for _ in range(5):
        c.receive_data(publish("t"))
    assert c.inbound_unacked == set()


def test_311_has_no_receive_maximum() -> None:
    """More unacknowledged QoS 1 PUBLISHes than the (5.0) quota: a 3.1.1 client gets all of
    them through, none refused, none dropped, none counted against it."""
    c = ServerConnection(max_packet_size=1 << 20, receive_maximum=1)
    c.receive_data(CONNECT4)
    events = []
    for pid in range(1, 6):
        events += c.receive_data(publish("t", qos=1, pid=pid, props=None))
    assert events == [Publish("t", b"x", qos=1, packet_id=pid) for pid in range(1, 6)]
    assert c.inbound_unacked == set()


# ------------------------------------------------------------------ device path (plain PUBLISH)


def conn4() -> ServerConnection:
    c = ServerConnection(max_packet_size=1 << 20, receive_maximum=2)
    c.receive_data(CONNECT4)
    return c


def test_no_plain_topic_no_device_path() -> None:
    c = conn4()
    assert c.plain_topic == ""
    assert c.plain_publish(publish("t", qos=1, props=None)) is None
    c.expect_plain("t")
    assert c.plain_publish(publish("t", qos=1, pid=7, props=None)) == ("t", b"x", 1, 7)
    assert c.plain_publish(publish("t", props=None)) == ("t", b"x", 0, 0)


def test_plain_publish_is_what_receive_data_returns() -> None:
    """For each read the device path takes, the decoder gives the same PUBLISH; the reads it
    leaves (None) are the decoder's, which accepts or refuses them."""
    dup = bytes([publish("t", qos=1, props=None)[0] | 0x08]) + publish("t", qos=1, props=None)[1:]
    retain = bytes([0x31]) + publish("t", props=None)[1:]
    body = b"\x00\x01t" + b"y" * 300  # two bytes of remaining length
    taken = [
        publish("t", qos=1, pid=3, props=None),
        publish("t", props=None),
        b"\x30" + varint(len(body)) + body,
    ]
    left = [
        publish("u", qos=1, props=None),  # another topic
        publish("t", qos=2, props=None),
        dup,
        retain,
        publish("t", qos=1, pid=0, props=None),  # [MQTT-2.2.1-3]: the decoder refuses it
        publish("t", props=None) * 2,  # two packets in one read
        publish("t", props=None)[:-1],  # part of one
        b"\x40\x02\x00\x01",  # a PUBACK
    ]
    for data in taken:
        c, d = conn4(), conn4()
        c.expect_plain("t")
        got = c.plain_publish(data)
        assert got is not None, data
        (packet,) = d.receive_data(data)
        assert isinstance(packet, Publish)
        assert got == (packet.topic, packet.payload, packet.qos, packet.packet_id or 0)
    for data in left:
        c = conn4()
        c.expect_plain("t")
        assert c.plain_publish(data) is None, data


def test_plain_publish_after_a_partial_read_is_the_decoders() -> None:
    c = conn4()
    c.expect_plain("t")
    whole = publish("t", qos=1, pid=1, props=None)
    assert c.receive_data(whole[:3]) == []
    assert c.plain_publish(whole[3:] + whole) is None  # something is buffered: the decoder's
    assert len(c.receive_data(whole[3:] + whole)) == 2


def test_plain_publish_5_counts_against_receive_maximum() -> None:
    c = conn5(receive_maximum=2)
    c.expect_plain("t")
    assert c.plain_publish(publish("t", qos=1, pid=1)) == ("t", b"x", 1, 1)
    assert c.plain_publish(publish("t", qos=1, pid=1)) is None  # in use: the decoder decides
    assert c.plain_publish(publish("t", qos=1, pid=2)) == ("t", b"x", 1, 2)
    assert c.inbound_unacked == {1, 2}
    # Over the quota: left to the decoder, which refuses it with 0x93 [MQTT-3.3.4-7].
    assert c.plain_publish(publish("t", qos=1, pid=3)) is None
    assert code_of(c, publish("t", qos=1, pid=3)) == 0x93
    c = conn5(receive_maximum=2)
    c.expect_plain("t")
    c.plain_publish(publish("t", qos=1, pid=1))
    assert c.puback(1) == b"\x40\x02\x00\x01"  # the quota comes back (s4.9)
    assert c.inbound_unacked == set()
    assert c.plain_publish(publish("t", props=bytes.fromhex("0101"))) is None  # properties
    assert c.plain_publish(publish("t")) == ("t", b"x", 0, 0)


# ------------------------------------------------------------------ refusing the CONNECT


def test_refuse_in_the_connects_form() -> None:
    assert conn4().refuse(0x86) == bytes.fromhex("20020004")  # bad user name or password
    assert conn5().refuse(0x86) == bytes.fromhex("2003008600")


@pytest.mark.parametrize(
    ("connect", "expected"),
    [
        ("100d00044d5154540602003c000163", "2003008400"),  # level 6: the 5.0 form, 0x84
        ("100d00044d5154540202003c000163", "20020001"),  # level 2: 3.1.1 form, 1
        ("100f00064d51497364700202003c000163", "20020001"),  # 'MQIsdp' level 2
    ],
)
def test_connect_refusal_of_an_unsupported_level(connect: str, expected: str) -> None:
    c = ServerConnection(max_packet_size=1 << 20)
    with pytest.raises(UnsupportedProtocolVersion) as info:
        c.receive_data(bytes.fromhex(connect))
    assert c.connect_refusal(info.value) == bytes.fromhex(expected)  # [MQTT-3.1.2-2]


def test_connect_refusal_of_a_bad_5_connect_carries_its_reason() -> None:
    c = ServerConnection(max_packet_size=1 << 20)
    with pytest.raises(MQTTError) as info:
        c.receive_data(connect5(bytes.fromhex("210000")))  # receive maximum 0
    assert c.connect_refusal(info.value) == bytes.fromhex("2003008200")
    # A code CONNACK cannot carry (0x93, of a PUBLISH in the CONNECT's read): Protocol Error.
    error = ProtocolError("over the quota", 0x93)
    assert c.connect_refusal(error) == bytes.fromhex("2003008200")
    assert c.connect_refusal(MalformedPacket("bad")) == bytes.fromhex("2003008100")


def test_a_bad_311_connect_is_closed_without_connack() -> None:
    c = ServerConnection(max_packet_size=1 << 20)
    with pytest.raises(MQTTError) as info:
        c.receive_data(bytes.fromhex("100d00044d5154540403003c000163"))  # reserved flag set
    assert c.connect_refusal(info.value) is None  # 3.1.1 s4.8


# ------------------------------------------------------------------ outbound aliases, size


def decode_out(data: bytes) -> Publish:
    d = Decoder(version=5)
    d.feed(data)
    (p,) = d.packets()
    assert isinstance(p, Publish)
    return p


def test_outbound_aliases() -> None:
    c = conn5(bytes.fromhex("220002"))  # the client accepts 2 aliases
    out = []
    for topic in ["a", "a", "b", "c", "b", "c"]:
        data = c.send_publish(topic, b"p", 0, False, False, None, None)
        assert data is not None
        out.append(decode_out(data))
    assert [(p.topic, p.properties.get(0x23)) for p in out] == [
        ("a", 1),
        ("", 1),
        ("b", 2),
        ("c", None),
        ("", 2),
        ("c", None),
    ]


def test_no_outbound_alias_for_311_or_without_client_maximum() -> None:
    c = conn5()
    data = c.send_publish("a", b"p", 0, False, False, None, None)
    data2 = c.send_publish("a", b"p", 0, False, False, None, None)
    assert data == data2 and decode_out(data2).topic == "a"  # type: ignore[arg-type]


def test_too_large_for_client_is_skipped_and_sets_no_alias() -> None:
    # Maximum Packet Size 32, Topic Alias Maximum 4
    c = conn5(bytes.fromhex("2700000020220004"))
    assert c.send_publish("big", b"x" * 64, 1, False, False, 1, None) is None  # [MQTT-3.1.2-25]
    assert not c.outbound_aliases
    data = c.send_publish("big", b"small", 1, False, False, 2, None)
    assert data is not None and len(data) <= 32
    p = decode_out(data)
    assert (p.topic, p.properties.get(0x23)) == ("big", 1)  # the client learns it now


# ------------------------------------------------------------------ properties and wills


def test_client_publish_with_subscription_identifier() -> None:
    # [MQTT-3.3.4-6]
    assert code_of(conn5(), publish("t", props=bytes.fromhex("0b01"))) == 0x82


def test_response_topic_must_be_a_topic_name() -> None:
    assert code_of(conn5(), publish("t", props=bytes.fromhex("0800012b"))) == 0x82
    (p,) = conn5().receive_data(publish("t", props=bytes.fromhex("080001 61".replace(" ", ""))))
    assert isinstance(p, Publish) and p.properties == {0x08: "a"}


@pytest.mark.parametrize("topic", ["a/#", "+", ""])
def test_will_topic_must_be_a_topic_name(topic: str) -> None:
    t = topic.encode()
    body = (
        bytes.fromhex("00044d5154540406003c")
        + b"\x00\x01c"
        + len(t).to_bytes(2, "big")
        + t
        + b"\x00\x01x"
    )
    c = ServerConnection(max_packet_size=1 << 20)
    with pytest.raises(TopicNameInvalid):
        c.receive_data(b"\x10" + varint(len(body)) + body)


def test_will_topic_limits() -> None:
    body = bytes.fromhex("00044d5154540406003c") + b"\x00\x01c" + b"\x00\x07a/b/c/d" + b"\x00\x01x"
    c = ServerConnection(max_packet_size=1 << 20, max_topic_levels=3)
    with pytest.raises(TopicNameInvalid):
        c.receive_data(b"\x10" + varint(len(body)) + body)


def test_the_connect_packet_is_not_kept() -> None:
    """The CONNECT (its password) is handed on, not held for the connection's life."""
    c = ServerConnection(max_packet_size=1 << 20)
    body = b"\x00\x04MQTT\x04\xc2\x00\x3c" + b"\x00\x01c" + b"\x00\x01u" + b"\x00\x06secret"
    (packet,) = c.receive_data(b"\x10" + bytes([len(body)]) + body)
    assert isinstance(packet, Connect) and packet.password == b"secret"
    assert c.connected
    held = [getattr(c, name) for name in ServerConnection.__slots__ if hasattr(c, name)]
    assert not any(isinstance(v, Connect) or v == b"secret" for v in held)


# ------------------------------------------------------------------ parking


def test_decoder_dropped_and_made_again_reads_on() -> None:
    """A parked connection's decoder (broker.net.parking) is dropped and made again: the
    new one knows the connection's version, and a second CONNECT is still refused."""
    c = conn5()
    c.drop_decoder()
    with pytest.raises(RuntimeError):
        c.receive_data(publish("a/b"))  # input while it has none is a bug, not a packet
    c.new_decoder()
    (p,) = c.receive_data(publish("a/b", qos=1, pid=9))
    assert isinstance(p, Publish) and (p.topic, p.packet_id) == ("a/b", 9)
    assert code_of(c, CONNECT5) == 0x82  # [MQTT-3.1.0-2]


def test_decoder_is_not_dropped_with_part_of_a_packet() -> None:
    c = conn5()
    c.receive_data(publish("a/b")[:3])
    assert c.buffered == 3
    with pytest.raises(AssertionError):
        c.drop_decoder()


def test_decoder_keeps_no_read_once_parsed() -> None:
    """The bytes of a read parsed whole are not kept by the decoder (an idle connection held
    its last read, ~60 bytes of an idle one's CONNECT)."""
    d = Decoder(max_packet_size=1 << 20)
    d.feed(CONNECT4 + bytes.fromhex("c000"))  # and a PINGREQ
    assert len(d.packets()) == 2
    assert d.buffered == 0 and d._buf == b""
