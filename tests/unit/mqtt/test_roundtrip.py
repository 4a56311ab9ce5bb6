"""Round trips through the codec: ``decode(encode(p, v)) == p`` for every packet and version.

The expected property placement (which packet may carry which property) is restated here
from MQTT 5.0 Table 2-4 rather than imported, so the test is a second reading of the spec.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.mqtt import (
    Auth,
    ConnAck,
    Connect,
    Decoder,
    Disconnect,
    LocalProtocolError,
    MalformedPacket,
    Packet,
    PingReq,
    PingResp,
    PropertyId,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
    encode,
    encode_publish,
)
from broker.mqtt.properties import decode_properties, encode_properties

P = PropertyId


def decode_one(data: bytes, version: int, server: bool = False) -> Packet:
    """Decode exactly one packet from ``data`` (all of it) with a fresh decoder."""
    dec = Decoder() if server else Decoder(version=version)
    dec.feed(data)
    packets = dec.packets()
    assert len(packets) == 1, packets
    assert dec.buffered == 0
    return packets[0]


def roundtrip(packet: Packet, version: int) -> bytes:
    data = encode(packet, version)
    decoded = decode_one(data, version, server=isinstance(packet, Connect))
    assert decoded == packet
    assert type(decoded) is type(packet)
    return data


# --------------------------------------------------------------------------- fixed examples

PACKETS_ALL_VERSIONS: list[Packet] = [
    ConnAck(False, 0),
    ConnAck(True, 0),
    Publish("a/b", b"hello", 0),
    Publish("a/b", b"", 1, True, True, 65535),
    Publish("devices/123/telemetry", bytes(64), 2, False, False, 1),
    Publish("ünïcødé/🙂", b"\x00\xff" * 100, 1, False, False, 42),
    PubAck(1),
    PubRec(2),
    PubRel(3),
    PubComp(65535),
    Subscribe(7, [Subscription("a/+/c", 0), Subscription("#", 1), Subscription("x", 2)]),
    SubAck(7, [0, 1, 2, 0x80]),
    Unsubscribe(8, ["a/+/c", "#"]),
    UnsubAck(8),
    PingReq(),
    PingResp(),
    Disconnect(),
]


@pytest.mark.parametrize("version", [3, 4, 5])
@pytest.mark.parametrize("packet", PACKETS_ALL_VERSIONS, ids=lambda p: type(p).__name__)
def test_roundtrip_every_packet_type(packet: Packet, version: int) -> None:
    roundtrip(packet, version)


@pytest.mark.parametrize("code", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("version", [3, 4])
def test_connack_311_return_codes(code: int, version: int) -> None:
    assert roundtrip(ConnAck(False, code), version) == bytes((0x20, 2, 0, code))


CONNECTS: list[tuple[Connect, int]] = []
for _level, _name in ((3, "MQIsdp"), (4, "MQTT"), (5, "MQTT")):
    CONNECTS += [
        (Connect("", _level, _name), _level),
        (Connect("client-1", _level, _name, False, 60), _level),
        (Connect("c", _level, _name, True, 65535, Will("will/t", b"bye", 2, True)), _level),
        (
            Connect("c", _level, _name, True, 10, Will("w", b"", 1, False), "user", b"\x00pw"),
            _level,
        ),
        (Connect("c", _level, _name, False, 0, None, "user", None), _level),
    ]
CONNECTS.append((Connect("c", 5, "MQTT", True, 0, None, None, b"token-only"), 5))


@pytest.mark.parametrize(("packet", "version"), CONNECTS)
def test_roundtrip_connect(packet: Connect, version: int) -> None:
    data = roundtrip(packet, version)
    dec = Decoder()
    dec.feed(data)
    dec.packets()
    assert dec.version == version


def test_connect_level3_wire_header() -> None:
    data = encode(Connect("c", 3, "MQIsdp"), 3)
    assert data[2:11] == b"\x00\x06MQIsdp\x03"


V5_ONLY: list[Packet] = [
    ConnAck(True, 0x00, {P.SESSION_EXPIRY_INTERVAL: 10, P.ASSIGNED_CLIENT_IDENTIFIER: "auto"}),
    ConnAck(False, 0x87, {P.REASON_STRING: "no"}),
    PubAck(1, 0x10),
    PubAck(1, 0x80, {P.REASON_STRING: "quota", P.USER_PROPERTY: [("a", "1")]}),
    PubRec(5, 0x91),
    PubRel(6, 0x92, {P.REASON_STRING: "gone"}),
    PubComp(7, 0x92),
    Subscribe(
        9,
        [
            Subscription("a/b", 2, True, True, 2),
            Subscription("$share/g/c/#", 1, False, True, 1),
        ],
        {P.SUBSCRIPTION_IDENTIFIER: [268_435_455]},
    ),
    SubAck(9, [0x02, 0x01, 0x00, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2]),
    SubAck(9, [], {P.REASON_STRING: "empty"}),
    Unsubscribe(10, ["a/b"], {P.USER_PROPERTY: [("k", "v")]}),
    UnsubAck(10, [0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91]),
    Disconnect(0x04),
    Disconnect(0x8E, {P.REASON_STRING: "taken over", P.SERVER_REFERENCE: "other"}),
    Disconnect(0x00, {P.SESSION_EXPIRY_INTERVAL: 0}),
    Auth(),
    Auth(0x18, {P.AUTHENTICATION_METHOD: "SCRAM-SHA-1", P.AUTHENTICATION_DATA: b"\x01\x02"}),
    Auth(0x19),
    Publish("", b"aliased", 1, False, False, 3, {P.TOPIC_ALIAS: 4}),
]


@pytest.mark.parametrize("packet", V5_ONLY, ids=lambda p: type(p).__name__)
def test_roundtrip_v5_only(packet: Packet) -> None:
    roundtrip(packet, 5)


# --------------------------------------------------------------------------- short forms


def test_v5_short_forms() -> None:
    """s3.4.2.1, s3.14.2.1, s3.15.2.1: reason 0x00 and no properties are omitted."""
    assert encode(PubAck(1), 5) == b"\x40\x02\x00\x01"
    assert encode(PubRel(1), 5) == b"\x62\x02\x00\x01"
    assert encode(PubAck(1, 0x10), 5) == b"\x40\x03\x00\x01\x10"
    assert encode(Disconnect(), 5) == b"\xe0\x00"
    assert encode(Disconnect(0x04), 5) == b"\xe0\x01\x04"
    assert encode(Auth(), 5) == b"\xf0\x00"
    assert encode(PingReq(), 4) == b"\xc0\x00"
    assert encode(PingResp(), 5) == b"\xd0\x00"
    # and the long forms decode to the same packets
    assert decode_one(b"\x40\x04\x00\x01\x00\x00", 5) == PubAck(1)
    assert decode_one(b"\xe0\x02\x00\x00", 5) == Disconnect()


def test_v311_packets_carry_no_properties() -> None:
    """Properties exist only in 5.0; at levels 3/4 they are not sent (codec contract)."""
    publish = Publish("t", b"x", 1, False, False, 1, {P.MESSAGE_EXPIRY_INTERVAL: 5})
    assert decode_one(encode(publish, 4), 4) == Publish("t", b"x", 1, False, False, 1)
    assert decode_one(encode(UnsubAck(3, [0x11]), 4), 4) == UnsubAck(3, [])


# --------------------------------------------------------------------------- every property

# Table 2-4 of MQTT 5.0, restated: property -> (sample value, packet kinds that may carry it).
PROPERTY_TABLE: dict[PropertyId, tuple[Any, set[str]]] = {
    P.PAYLOAD_FORMAT_INDICATOR: (1, {"PUBLISH", "WILL"}),
    P.MESSAGE_EXPIRY_INTERVAL: (0xFFFF_FFFF, {"PUBLISH", "WILL"}),
    P.CONTENT_TYPE: ("application/json", {"PUBLISH", "WILL"}),
    P.RESPONSE_TOPIC: ("reply/here", {"PUBLISH", "WILL"}),
    P.CORRELATION_DATA: (b"\x00corr\xff", {"PUBLISH", "WILL"}),
    P.SUBSCRIPTION_IDENTIFIER: ([128], {"PUBLISH", "SUBSCRIBE"}),
    P.SESSION_EXPIRY_INTERVAL: (3600, {"CONNECT", "CONNACK", "DISCONNECT"}),
    P.ASSIGNED_CLIENT_IDENTIFIER: ("auto-1", {"CONNACK"}),
    P.SERVER_KEEP_ALIVE: (30, {"CONNACK"}),
    P.AUTHENTICATION_METHOD: ("SCRAM-SHA-256", {"CONNECT", "CONNACK", "AUTH"}),
    P.AUTHENTICATION_DATA: (b"\x01\x02\x03", {"CONNECT", "CONNACK", "AUTH"}),
    P.REQUEST_PROBLEM_INFORMATION: (0, {"CONNECT"}),
    P.WILL_DELAY_INTERVAL: (60, {"WILL"}),
    P.REQUEST_RESPONSE_INFORMATION: (1, {"CONNECT"}),
    P.RESPONSE_INFORMATION: ("resp/", {"CONNACK"}),
    P.SERVER_REFERENCE: ("other:1883", {"CONNACK", "DISCONNECT"}),
    P.REASON_STRING: (
        "because",
        {
            "CONNACK",
            "PUBACK",
            "PUBREC",
            "PUBREL",
            "PUBCOMP",
            "SUBACK",
            "UNSUBACK",
            "DISCONNECT",
            "AUTH",
        },
    ),
    P.RECEIVE_MAXIMUM: (65535, {"CONNECT", "CONNACK"}),
    P.TOPIC_ALIAS_MAXIMUM: (10, {"CONNECT", "CONNACK"}),
    P.TOPIC_ALIAS: (7, {"PUBLISH"}),
    P.MAXIMUM_QOS: (1, {"CONNACK"}),
    P.RETAIN_AVAILABLE: (0, {"CONNACK"}),
    P.USER_PROPERTY: (
        [("k", "v"), ("k", "v2"), ("ä", "")],
        {
            "CONNECT",
            "CONNACK",
            "PUBLISH",
            "WILL",
            "PUBACK",
            "PUBREC",
            "PUBREL",
            "PUBCOMP",
            "SUBSCRIBE",
            "SUBACK",
            "UNSUBSCRIBE",
            "UNSUBACK",
            "DISCONNECT",
            "AUTH",
        },
    ),
    P.MAXIMUM_PACKET_SIZE: (1 << 20, {"CONNECT", "CONNACK"}),
    P.WILDCARD_SUBSCRIPTION_AVAILABLE: (1, {"CONNACK"}),
    P.SUBSCRIPTION_IDENTIFIER_AVAILABLE: (0, {"CONNACK"}),
    P.SHARED_SUBSCRIPTION_AVAILABLE: (1, {"CONNACK"}),
}


def carrier(kind: str, props: dict[int, Any]) -> Packet:
    """A 5.0 packet of ``kind`` carrying ``props``."""
    builders: dict[str, Any] = {
        "CONNECT": lambda: Connect("c", 5, "MQTT", properties=props),
        "WILL": lambda: Connect("c", 5, "MQTT", will=Will("w/t", b"x", 1, True, props)),
        "CONNACK": lambda: ConnAck(False, 0, props),
        "PUBLISH": lambda: Publish("a/b", b"p", 1, False, False, 1, props),
        "PUBACK": lambda: PubAck(1, 0, props),
        "PUBREC": lambda: PubRec(1, 0, props),
        "PUBREL": lambda: PubRel(1, 0, props),
        "PUBCOMP": lambda: PubComp(1, 0, props),
        "SUBSCRIBE": lambda: Subscribe(1, [Subscription("a/#", 1)], props),
        "SUBACK": lambda: SubAck(1, [0], props),
        "UNSUBSCRIBE": lambda: Unsubscribe(1, ["a"], props),
        "UNSUBACK": lambda: UnsubAck(1, [0], props),
        "DISCONNECT": lambda: Disconnect(0, props),
        "AUTH": lambda: Auth(0x18, props),
    }
    packet: Packet = builders[kind]()
    return packet


ALLOWED_CASES = [
    (pid, kind) for pid, (_, kinds) in PROPERTY_TABLE.items() for kind in sorted(kinds)
]


def test_table_covers_every_property() -> None:
    assert set(PROPERTY_TABLE) == set(PropertyId)


@pytest.mark.parametrize(("pid", "kind"), ALLOWED_CASES, ids=lambda x: getattr(x, "name", x))
def test_roundtrip_every_property_in_every_allowed_packet(pid: PropertyId, kind: str) -> None:
    roundtrip(carrier(kind, {pid: PROPERTY_TABLE[pid][0]}), 5)


NOT_ALLOWED_CASES = [
    (pid, kind)
    for pid, (_, kinds) in PROPERTY_TABLE.items()
    for kind in ("PUBLISH", "PUBACK", "CONNACK", "DISCONNECT")
    if kind not in kinds
]


@pytest.mark.parametrize(("pid", "kind"), NOT_ALLOWED_CASES, ids=lambda x: getattr(x, "name", x))
def test_property_not_allowed_is_refused_both_ways(pid: PropertyId, kind: str) -> None:
    props: dict[int, Any] = {pid: PROPERTY_TABLE[pid][0]}
    with pytest.raises(LocalProtocolError):
        encode(carrier(kind, props), 5)
    # Splice the property into an otherwise valid packet: s2.2.2.2 says Malformed Packet.
    blob = encode_properties(props)
    body = (
        {
            "PUBLISH": b"\x00\x03a/b\x00\x01",
            "PUBACK": b"\x00\x01\x00",
            "CONNACK": b"\x00\x00",
            "DISCONNECT": b"\x00",
        }[kind]
        + bytes((len(blob),))
        + blob
    )
    first = {"PUBLISH": 0x32, "PUBACK": 0x40, "CONNACK": 0x20, "DISCONNECT": 0xE0}[kind]
    dec = Decoder(version=5)
    dec.feed(bytes((first, len(body))) + body)
    with pytest.raises(MalformedPacket):
        dec.packets()


def test_publish_with_several_subscription_identifiers() -> None:
    """s3.3.2.3.8: a PUBLISH may carry one Subscription Identifier per matching subscription."""
    props: dict[int, Any] = {P.SUBSCRIPTION_IDENTIFIER: [1, 127, 128, 16383, 16384, 268_435_455]}
    roundtrip(Publish("t", b"", 0, False, False, None, props), 5)


def test_all_publish_properties_together() -> None:
    props: dict[int, Any] = {
        pid: value
        for pid, (value, kinds) in PROPERTY_TABLE.items()
        if "PUBLISH" in kinds and pid != P.SUBSCRIPTION_IDENTIFIER
    }
    props[P.SUBSCRIPTION_IDENTIFIER] = [5, 6]
    roundtrip(Publish("a", b"x" * 300, 2, True, True, 9, props), 5)


def test_all_connack_properties_together() -> None:
    props: dict[int, Any] = {
        pid: value for pid, (value, kinds) in PROPERTY_TABLE.items() if "CONNACK" in kinds
    }
    roundtrip(ConnAck(True, 0, props), 5)


def test_all_connect_and_will_properties_together() -> None:
    props: dict[int, Any] = {
        pid: value for pid, (value, kinds) in PROPERTY_TABLE.items() if "CONNECT" in kinds
    }
    will_props: dict[int, Any] = {
        pid: value for pid, (value, kinds) in PROPERTY_TABLE.items() if "WILL" in kinds
    }
    will = Will("will/topic", b"\x00" * 10, 2, True, will_props)
    roundtrip(Connect("cid", 5, "MQTT", False, 120, will, "u", b"p", props), 5)


def test_property_blob_roundtrip() -> None:
    props: dict[int, Any] = {pid: value for pid, (value, _) in PROPERTY_TABLE.items()}
    blob = encode_properties(props)
    assert decode_properties(blob) == props
    assert decode_properties(memoryview(blob)) == props
    assert encode_properties({}) == b""
    assert decode_properties(b"") == {}


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("size", [0, 1, 127 - 9, 128, 16_383, 16_384, 2_097_152])
def test_remaining_length_boundaries(size: int) -> None:
    """1..4-byte remaining lengths (s2.2.3) use the fewest bytes [MQTT-1.5.5-1] and decode."""
    data = roundtrip(Publish("t", b"z" * size, 0), 4)
    remaining = 2 + 1 + size  # topic length + topic + payload
    length_bytes = next(n for n in (1, 2, 3, 4) if remaining < 128**n)
    assert len(data) == 1 + length_bytes + remaining
    assert data[length_bytes] < 0x80  # last length byte: no continuation bit
    assert all(b >= 0x80 for b in data[1:length_bytes])


# --------------------------------------------------------------------------- encode_publish


@pytest.mark.parametrize("version", [3, 4, 5])
def test_encode_publish_matches_encode(version: int) -> None:
    props: dict[int, Any] = {P.USER_PROPERTY: [("a", "b")]} if version == 5 else {}
    for qos, pid in ((0, None), (1, 1), (2, 65535)):
        packet = Publish("x/y", b"data", qos, True, qos > 0, pid, props)
        assert encode_publish("x/y", b"data", qos, True, qos > 0, pid, props, version) == encode(
            packet, version
        )
    assert encode_publish("t", bytearray(b"ab"), 0, False, False, None, None, 4) == encode(
        Publish("t", b"ab"), 4
    )


@pytest.mark.parametrize(
    ("packet", "version"),
    [
        (Publish("t", b"", 3, False, False, 1), 4),  # QoS 3 [MQTT-3.3.1-4]
        (Publish("t", b"", 1), 4),  # QoS 1 without packet id [MQTT-2.2.1-3]
        (Publish("t", b"", 1, False, False, 0), 4),  # packet id 0
        (Publish("t", b"", 0, False, False, 5), 4),  # packet id on QoS 0 [MQTT-2.2.1-2]
        (Publish("t", b"", 0, False, True), 4),  # DUP on QoS 0 [MQTT-3.3.1-2]
        (Publish("", b""), 4),  # empty topic [MQTT-4.7.3-1]
        (Publish("", b"", 0, False, False, None, {P.USER_PROPERTY: []}), 5),
        (Publish("a\x00b", b""), 4),  # U+0000 [MQTT-1.5.4-2]
        (Publish("\ud800", b""), 4),  # lone surrogate
        (Publish("t" * 65536, b""), 4),  # topic too long
        (Publish("t", b"", 0, False, False, None, {P.SESSION_EXPIRY_INTERVAL: 1}), 5),
        (Publish("t", b"", 0, False, False, None, {P.PAYLOAD_FORMAT_INDICATOR: 2}), 5),
        (Publish("t", b"", 0, False, False, None, {P.TOPIC_ALIAS: 0}), 5),
        (Publish("t", b"", 0, False, False, None, {0x7F: 1}), 5),
        (Publish("t", b""), 6),  # unknown version
        (Auth(), 4),  # AUTH is 5.0 only
        (PubAck(1, 0x10), 4),  # no reason codes in 3.1.1 PUBACK
        (PubAck(0), 5),
        (PubAck(1, 0x02), 5),  # not a PUBACK reason code
        (Disconnect(0x80), 4),
        (ConnAck(False, 6), 4),
        (ConnAck(False, 0x05), 5),
        (SubAck(1, [3]), 4),
        (Subscribe(1, []), 4),  # [MQTT-3.8.3-3]
        (Subscribe(1, [Subscription("a", 0, True)]), 4),  # No Local is 5.0 only
        (Subscribe(1, [Subscription("a", 0, False, False, 3)]), 5),
        (Unsubscribe(1, []), 5),  # [MQTT-3.10.3-2]
        (Connect("c", 5, "MQTT"), 4),  # level / version mismatch
        (Connect("c", 4, "MQIsdp"), 4),  # name / level mismatch
        (Connect("c", 4, "MQTT", password=b"pw"), 4),  # [MQTT-3.1.2-22]
        (Connect("c", 4, "MQTT", keepalive=70000), 4),
        (Connect("c", 4, "MQTT", will=Will("w", b"", 3)), 4),
    ],
)
def test_encode_refuses_what_the_spec_forbids(packet: Packet, version: int) -> None:
    with pytest.raises(LocalProtocolError):
        encode(packet, version)


def test_encode_rejects_non_packets() -> None:
    with pytest.raises(LocalProtocolError):
        encode("not a packet", 4)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- hypothesis

text = st.text(
    alphabet=st.characters(codec="utf-8", blacklist_characters="\x00"),
    max_size=20,
)
topic = text.filter(bool)
u16 = st.integers(1, 65535)
u32 = st.integers(0, 0xFFFF_FFFF)
user_props = st.lists(st.tuples(text, text), min_size=1, max_size=3)

publish_props = st.fixed_dictionaries(
    {},
    optional={
        P.PAYLOAD_FORMAT_INDICATOR: st.integers(0, 1),
        P.MESSAGE_EXPIRY_INTERVAL: u32,
        P.CONTENT_TYPE: text,
        P.RESPONSE_TOPIC: topic,
        P.CORRELATION_DATA: st.binary(max_size=16),
        P.SUBSCRIPTION_IDENTIFIER: st.lists(st.integers(1, 268_435_455), min_size=1, max_size=3),
        P.TOPIC_ALIAS: u16,
        P.USER_PROPERTY: user_props,
    },
)


@st.composite
def publishes(draw: st.DrawFn, version: int) -> Publish:
    qos = draw(st.integers(0, 2))
    return Publish(
        draw(topic),
        draw(st.binary(max_size=300)),
        qos,
        draw(st.booleans()),
        draw(st.booleans()) if qos else False,
        draw(u16) if qos else None,
        cast(dict[int, Any], draw(publish_props)) if version == 5 else {},
    )


@pytest.mark.parametrize("version", [4, 5])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_hypothesis_publish_roundtrip(version: int, data: st.DataObject) -> None:
    packet = data.draw(publishes(version))
    wire = roundtrip(packet, version)
    assert wire == encode_publish(
        packet.topic,
        packet.payload,
        packet.qos,
        packet.retain,
        packet.dup,
        packet.packet_id,
        packet.properties,
        version,
    )


subscriptions_v5 = st.builds(
    Subscription, topic, st.integers(0, 2), st.booleans(), st.booleans(), st.integers(0, 2)
)
subscriptions_v4 = st.builds(Subscription, topic, st.integers(0, 2))


@settings(max_examples=40, deadline=None)
@given(
    pid=u16,
    subs=st.lists(subscriptions_v5, min_size=1, max_size=4),
    sub_id=st.none() | st.integers(1, 268_435_455),
    users=st.none() | user_props,
)
def test_hypothesis_subscribe_v5(
    pid: int, subs: list[Subscription], sub_id: int | None, users: list[tuple[str, str]] | None
) -> None:
    props: dict[int, Any] = {}
    if sub_id is not None:
        props[P.SUBSCRIPTION_IDENTIFIER] = [sub_id]
    if users is not None:
        props[P.USER_PROPERTY] = users
    roundtrip(Subscribe(pid, subs, props), 5)


@settings(max_examples=30, deadline=None)
@given(pid=u16, subs=st.lists(subscriptions_v4, min_size=1, max_size=4))
def test_hypothesis_subscribe_v4(pid: int, subs: list[Subscription]) -> None:
    roundtrip(Subscribe(pid, subs), 4)


@settings(max_examples=40, deadline=None)
@given(
    level=st.sampled_from([3, 4, 5]),
    client_id=text,
    clean=st.booleans(),
    keepalive=st.integers(0, 65535),
    will=st.none()
    | st.builds(Will, topic, st.binary(max_size=50), st.integers(0, 2), st.booleans()),
    username=st.none() | text,
    password=st.none() | st.binary(max_size=20),
    session_expiry=st.none() | u32,
)
def test_hypothesis_connect(
    level: int,
    client_id: str,
    clean: bool,
    keepalive: int,
    will: Will | None,
    username: str | None,
    password: bytes | None,
    session_expiry: int | None,
) -> None:
    if level < 5 and username is None:
        password = None  # [MQTT-3.1.2-22]
    props: dict[int, Any] = {}
    if level == 5 and session_expiry is not None:
        props[P.SESSION_EXPIRY_INTERVAL] = session_expiry
    name = "MQIsdp" if level == 3 else "MQTT"
    packet = Connect(client_id, level, name, clean, keepalive, will, username, password, props)
    roundtrip(packet, level)


ack_types = st.sampled_from([PubAck, PubRec, PubRel, PubComp])


@settings(max_examples=40, deadline=None)
@given(cls=ack_types, pid=u16, reason=st.none() | text, users=st.none() | user_props)
def test_hypothesis_acks_v5(
    cls: type[PubAck], pid: int, reason: str | None, users: list[tuple[str, str]] | None
) -> None:
    props: dict[int, Any] = {}
    if reason is not None:
        props[P.REASON_STRING] = reason
    if users is not None:
        props[P.USER_PROPERTY] = users
    code = 0x92 if cls in (PubRel, PubComp) else 0x10
    roundtrip(cls(pid, code, props), 5)
    roundtrip(cls(pid, 0, props), 5)
