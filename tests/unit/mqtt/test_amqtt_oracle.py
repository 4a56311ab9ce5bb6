"""Differential tests against amqtt 0.12.1 as an MQTT 3.1 / 3.1.1 oracle.

amqtt is an independent implementation (asyncio-based: its packets are read from a
``StreamReader``). For each packet type it supports, hypothesis generates field values; then

* amqtt builds and encodes the packet, our ``Decoder`` decodes it, and the fields must agree;
* we encode the packet, amqtt decodes it (through a real ``asyncio.StreamReader``), and the
  fields must agree;
* both encoders must produce the same bytes (3.1.1 encodings are unique for given fields).

amqtt quirks handled here, not hidden: its CONNECT password is a ``str`` (ours is binary data
per 3.1.1 s3.1.3.5, so passwords are drawn as valid UTF-8), and it replaces an empty client id
with a random one on decode (flagged by ``client_id_is_random``).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from amqtt.adapters import StreamReaderAdapter
from amqtt.mqtt import packet_class
from amqtt.mqtt.connack import ConnackPacket
from amqtt.mqtt.connect import ConnectPacket, ConnectPayload, ConnectVariableHeader
from amqtt.mqtt.disconnect import DisconnectPacket
from amqtt.mqtt.packet import MQTTFixedHeader, MQTTPacket
from amqtt.mqtt.pingreq import PingReqPacket
from amqtt.mqtt.pingresp import PingRespPacket
from amqtt.mqtt.puback import PubackPacket
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.publish import PublishPacket
from amqtt.mqtt.pubrec import PubrecPacket
from amqtt.mqtt.pubrel import PubrelPacket
from amqtt.mqtt.suback import SubackPacket
from amqtt.mqtt.subscribe import SubscribePacket
from amqtt.mqtt.unsuback import UnsubackPacket
from amqtt.mqtt.unsubscribe import UnsubscribePacket
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.mqtt.decode import Decoder
from broker.mqtt.encode import encode
from broker.mqtt.packets import (
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PingReq,
    PingResp,
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
)
from tests.unit.mqtt.test_golden import CONNECT_HEX

AmqttPacket = MQTTPacket[Any, Any, Any]

#: Raise for a deeper local run: MQLOG_ORACLE_EXAMPLES=5000 pytest <this file>
ORACLE = settings(
    max_examples=int(os.environ.get("MQLOG_ORACLE_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# --------------------------------------------------------------------------- amqtt plumbing


def amqtt_decode(data: bytes) -> AmqttPacket:
    """Decode one packet with amqtt, the way its broker does: from an asyncio StreamReader."""

    async def run() -> tuple[AmqttPacket, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        adapter = StreamReaderAdapter(reader)
        fixed = await MQTTFixedHeader.from_stream(adapter)
        assert fixed is not None
        cls = packet_class(fixed)
        packet = await cls.from_stream(adapter, fixed_header=fixed)
        return packet, await reader.read()

    packet, rest = asyncio.run(run())
    assert rest == b"", "amqtt left bytes unread: the lengths disagree"
    return packet


def to_amqtt(p: Packet, version: int = 4) -> AmqttPacket:
    """Build the equivalent packet with amqtt's own classes and builders."""
    if isinstance(p, Connect):
        vh = ConnectVariableHeader(0, p.keepalive, p.protocol_name, p.protocol_level)
        vh.clean_session_flag = p.clean_start
        vh.username_flag = p.username is not None
        vh.password_flag = p.password is not None
        payload = ConnectPayload(
            client_id=p.client_id,
            username=p.username,
            password=p.password.decode() if p.password is not None else None,
        )
        if p.will is not None:
            vh.will_flag = True
            vh.will_qos = p.will.qos
            vh.will_retain_flag = p.will.retain
            payload.will_topic = p.will.topic
            payload.will_message = p.will.payload
        return ConnectPacket(variable_header=vh, payload=payload)
    if isinstance(p, ConnAck):
        return ConnackPacket.build(1 if p.session_present else 0, p.reason_code)
    if isinstance(p, Publish):
        return PublishPacket.build(p.topic, p.payload, p.packet_id, p.dup, p.qos, p.retain)
    simple: dict[type, Any] = {
        PubAck: PubackPacket,
        PubRec: PubrecPacket,
        PubRel: PubrelPacket,
        PubComp: PubcompPacket,
    }
    if type(p) in simple:
        return simple[type(p)].build(p.packet_id)  # type: ignore[attr-defined]
    if isinstance(p, Subscribe):
        return SubscribePacket.build(
            [(s.topic_filter, s.qos) for s in p.subscriptions], p.packet_id
        )
    if isinstance(p, SubAck):
        return SubackPacket.build(p.packet_id, list(p.reason_codes))
    if isinstance(p, Unsubscribe):
        return UnsubscribePacket.build(list(p.topic_filters), p.packet_id)
    if isinstance(p, UnsubAck):
        return UnsubackPacket.build(p.packet_id)
    if isinstance(p, PingReq):
        return PingReqPacket()
    if isinstance(p, PingResp):
        return PingRespPacket()
    if isinstance(p, Disconnect):
        return DisconnectPacket()
    raise AssertionError(f"amqtt has no {type(p).__name__}")


def from_amqtt(a: AmqttPacket) -> Packet:
    """Read amqtt's decoded fields into our packet type, for a field-by-field comparison."""
    if isinstance(a, ConnectPacket):
        vh, pl = a.variable_header, a.payload
        assert vh is not None and pl is not None
        will = None
        if vh.will_flag:
            assert pl.will_topic is not None and pl.will_message is not None
            will = Will(pl.will_topic, bytes(pl.will_message), vh.will_qos, vh.will_retain_flag)
        return Connect(
            client_id="" if pl.client_id_is_random else (pl.client_id or ""),
            protocol_level=vh.proto_level,
            protocol_name=vh.proto_name,
            clean_start=vh.clean_session_flag,
            keepalive=vh.keep_alive,
            will=will,
            username=pl.username if vh.username_flag else None,
            password=pl.password.encode() if vh.password_flag and pl.password is not None else None,
        )
    if isinstance(a, ConnackPacket):
        vh = a.variable_header
        return ConnAck(bool(vh.session_parent), vh.return_code)
    if isinstance(a, PublishPacket):
        qos = a.qos or 0
        return Publish(
            a.topic_name or "",
            bytes(a.data or b""),
            qos,
            a.retain_flag,
            a.dup_flag,
            a.packet_id if qos else None,
        )
    simple: dict[type, Any] = {
        PubackPacket: PubAck,
        PubrecPacket: PubRec,
        PubrelPacket: PubRel,
        PubcompPacket: PubComp,
    }
    if type(a) in simple:
        return simple[type(a)](a.variable_header.packet_id)  # type: ignore[no-any-return]
    if isinstance(a, SubscribePacket):
        return Subscribe(
            a.variable_header.packet_id, [Subscription(t, q) for t, q in a.payload.topics]
        )
    if isinstance(a, SubackPacket):
        return SubAck(a.variable_header.packet_id, list(a.payload.return_codes))
    if isinstance(a, UnsubscribePacket):
        return Unsubscribe(a.variable_header.packet_id, list(a.payload.topics))
    if isinstance(a, UnsubackPacket):
        return UnsubAck(a.variable_header.packet_id, [])
    if isinstance(a, PingReqPacket):
        return PingReq()
    if isinstance(a, PingRespPacket):
        return PingResp()
    if isinstance(a, DisconnectPacket):
        return Disconnect()
    raise AssertionError(f"unexpected amqtt packet {a!r}")


# Packets a server receives are decoded by a server-side decoder (after a CONNECT); the
# others by a client-side one.
_TO_CLIENT = (ConnAck, SubAck, UnsubAck, PingResp)


def ours_decode(data: bytes, p: Packet) -> Packet:
    if isinstance(p, Connect):
        dec = Decoder()
    elif isinstance(p, _TO_CLIENT):
        dec = Decoder(version=4)
    else:
        dec = Decoder()
        dec.feed(bytes.fromhex(CONNECT_HEX[4]))
        assert isinstance(dec.next_packet(), Connect)
    dec.feed(data)
    packets = dec.packets()
    assert len(packets) == 1, packets
    return packets[0]


# --------------------------------------------------------------------------- strategies

_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
_TEXT = st.text(_CHARS, max_size=20)
_NAME = st.text(_CHARS, min_size=1, max_size=20)
_PID = st.integers(1, 0xFFFF)
# amqtt rejects wildcards in PUBLISH topic names [MQTT-3.3.2-2] (ours leaves that to topics.py).
_TOPIC = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00+#"),
    min_size=1,
    max_size=20,
)


@st.composite
def _connect(draw: st.DrawFn) -> Connect:
    level = draw(st.sampled_from([3, 4]))
    will = None
    if draw(st.booleans()):
        will = Will(
            draw(_NAME), draw(st.binary(max_size=30)), draw(st.integers(0, 2)), draw(st.booleans())
        )
    username = draw(st.none() | _TEXT)
    # 3.1.1 [MQTT-3.1.2-22]: no password without a user name.
    password = draw(st.none() | _TEXT.map(str.encode)) if username is not None else None
    return Connect(
        client_id=draw(_TEXT if level == 4 else _NAME),
        protocol_level=level,
        protocol_name="MQTT" if level == 4 else "MQIsdp",
        clean_start=draw(st.booleans()),
        keepalive=draw(st.integers(0, 0xFFFF)),
        will=will,
        username=username,
        password=password,
    )


@st.composite
def _publish(draw: st.DrawFn) -> Publish:
    qos = draw(st.integers(0, 2))
    return Publish(
        draw(_TOPIC),
        draw(st.binary(max_size=200)),
        qos,
        draw(st.booleans()),
        draw(st.booleans()) if qos else False,
        draw(_PID) if qos else None,
    )


STRATEGIES_311: dict[type, st.SearchStrategy[Packet]] = {
    Connect: _connect(),
    ConnAck: st.builds(ConnAck, st.booleans(), st.integers(0, 5)),
    Publish: _publish(),
    PubAck: st.builds(PubAck, _PID),
    PubRec: st.builds(PubRec, _PID),
    PubRel: st.builds(PubRel, _PID),
    PubComp: st.builds(PubComp, _PID),
    Subscribe: st.builds(
        Subscribe,
        _PID,
        st.lists(st.builds(Subscription, _NAME, st.integers(0, 2)), min_size=1, max_size=4),
    ),
    SubAck: st.builds(
        SubAck, _PID, st.lists(st.sampled_from([0x00, 0x01, 0x02, 0x80]), min_size=1, max_size=4)
    ),
    Unsubscribe: st.builds(Unsubscribe, _PID, st.lists(_NAME, min_size=1, max_size=4)),
    UnsubAck: st.builds(UnsubAck, _PID),
    PingReq: st.just(PingReq()),
    PingResp: st.just(PingResp()),
    Disconnect: st.just(Disconnect()),
}
PACKETS_311: st.SearchStrategy[Packet] = st.one_of(*STRATEGIES_311.values())


def _version(p: Packet) -> int:
    return p.protocol_level if isinstance(p, Connect) else 4


# --------------------------------------------------------------------------- the differential tests


@ORACLE
@given(PACKETS_311)
def test_amqtt_encodes_we_decode(p: Packet) -> None:
    data = bytes(to_amqtt(p).to_bytes())
    assert ours_decode(data, p) == p


@ORACLE
@given(PACKETS_311)
def test_we_encode_amqtt_decodes(p: Packet) -> None:
    data = encode(p, _version(p))
    assert from_amqtt(amqtt_decode(data)) == p


@ORACLE
@given(PACKETS_311)
def test_same_bytes_as_amqtt(p: Packet) -> None:
    assert encode(p, _version(p)) == bytes(to_amqtt(p).to_bytes())


AMQTT_CLASS: dict[type, type] = {
    Connect: ConnectPacket,
    ConnAck: ConnackPacket,
    Publish: PublishPacket,
    PubAck: PubackPacket,
    PubRec: PubrecPacket,
    PubRel: PubrelPacket,
    PubComp: PubcompPacket,
    Subscribe: SubscribePacket,
    SubAck: SubackPacket,
    Unsubscribe: UnsubscribePacket,
    UnsubAck: UnsubackPacket,
    PingReq: PingReqPacket,
    PingResp: PingRespPacket,
    Disconnect: DisconnectPacket,
}


def test_every_amqtt_packet_type_is_covered() -> None:
    """Every packet class amqtt implements (its packet_dict) has a strategy and a builder."""
    from amqtt.mqtt import packet_dict

    assert set(AMQTT_CLASS.values()) == set(packet_dict.values())
    assert set(STRATEGIES_311) == set(AMQTT_CLASS)


@pytest.mark.parametrize("ours_cls", list(STRATEGIES_311), ids=lambda c: c.__name__)
def test_each_type_round_trips_through_amqtt(ours_cls: type) -> None:
    """A per-type run, so no packet type depends on one_of's luck."""

    @settings(max_examples=25, deadline=None)
    @given(STRATEGIES_311[ours_cls])
    def run(p: Packet) -> None:
        a = to_amqtt(p)
        assert isinstance(a, AMQTT_CLASS[ours_cls])
        data = encode(p, _version(p))
        assert data == bytes(a.to_bytes())
        assert ours_decode(data, p) == p
        assert from_amqtt(amqtt_decode(data)) == p

    run()


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 70_000])
def test_large_payload_lengths_agree_with_amqtt(size: int) -> None:
    """Remaining Length boundaries (one, two, three bytes) both ways."""
    p = Publish("t/x", bytes(range(256)) * (size // 256) + bytes(size % 256), qos=1, packet_id=9)
    ours = encode(p, 4)
    theirs = bytes(to_amqtt(p).to_bytes())
    assert ours == theirs
    assert ours_decode(theirs, p) == p
    assert from_amqtt(amqtt_decode(ours)) == p


def test_empty_client_id_is_random_in_amqtt() -> None:
    """amqtt replaces an empty ClientId with a random one [MQTT-3.1.3-6]; ours keeps ""."""
    p = Connect("", 4)
    a = amqtt_decode(encode(p, 4))
    assert isinstance(a, ConnectPacket) and a.client_id_is_random
    assert ours_decode(bytes(to_amqtt(p).to_bytes()), p) == p
