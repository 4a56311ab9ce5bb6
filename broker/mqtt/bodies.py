"""Packet bodies: the variable header and payload of every packet type, parsed in place.

Each ``decode_<type>(buf, pos, end, version)`` reads one packet's body from ``buf[pos:end]``
(the fixed header already checked by :class:`broker.mqtt.decode.Decoder`, which owns the
framing, the buffering and the PUBLISH fast path) and returns the packet, or raises an
:class:`~broker.mqtt.errors.MQTTError` carrying the reason code to answer with.
:data:`BODY_DECODERS` maps a packet type to its decoder.
"""

from __future__ import annotations

from typing import Any

from broker.mqtt.errors import (
    MalformedPacket,
    ProtocolError,
    UnsupportedProtocolVersion,
)
from broker.mqtt.packets import (
    REASON_CODES_V5,
    REASON_CODES_V311,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)
from broker.mqtt.properties import (
    WILL_PROPERTIES,
    read_binary,
    read_property_block,
    read_utf8,
)

_PROTOCOLS = frozenset({("MQTT", 4), ("MQTT", 5), ("MQIsdp", 3)})


def short(what: str) -> MalformedPacket:
    return MalformedPacket(f"{what}: packet body too short")


def _trailing(what: str) -> MalformedPacket:
    return MalformedPacket(f"{what}: bytes left over after the last field")


def _packet_id(buf: bytes, pos: int, end: int, what: str) -> int:
    """A non-zero two-byte packet identifier [MQTT-2.2.1-3] (0 is a Protocol Error)."""
    if pos + 2 > end:
        raise short(what)
    pid = (buf[pos] << 8) | buf[pos + 1]
    if pid == 0:
        raise ProtocolError(f"{what}: packet identifier 0")
    return pid


def _check_reason(ptype: int, code: int, version: int, what: str) -> int:
    table = REASON_CODES_V5 if version == 5 else REASON_CODES_V311
    if code not in table[ptype]:
        raise ProtocolError(f"{what}: reason code 0x{code:02X} is not allowed")
    return code


# --------------------------------------------------------------------------- body decoders
# Each takes (buffer, body start, body end, version) and returns a packet; the fixed header
# (type, flags, size) has been checked already. ``version`` is 3, 4 or 5.


def _decode_connect(buf: bytes, pos: int, end: int, version: int) -> Connect:
    name, pos = read_utf8(buf, pos, end)
    if pos >= end:
        raise short("CONNECT")
    level = buf[pos]
    if (name, level) not in _PROTOCOLS:
        # [MQTT-3.1.2-1] [MQTT-3.1.2-2]: answer 0x84 / return code 1, then close.
        raise UnsupportedProtocolVersion(f"CONNECT protocol {name!r} level {level}")
    if pos + 4 > end:
        raise short("CONNECT")
    flags = buf[pos + 1]
    keepalive = (buf[pos + 2] << 8) | buf[pos + 3]
    pos += 4
    if flags & 0x01:
        raise MalformedPacket("CONNECT reserved flag is set [MQTT-3.1.2-3]")
    will_flag = flags & 0x04
    will_qos = (flags >> 3) & 0x03
    will_retain = bool(flags & 0x20)
    if not will_flag and (will_qos or will_retain):
        raise MalformedPacket("CONNECT will QoS/retain set without will flag (s3.1.2.6-7)")
    if will_qos == 3:
        raise MalformedPacket("CONNECT will QoS 3 [MQTT-3.1.2-14]")
    has_password = flags & 0x40
    has_username = flags & 0x80
    if has_password and not has_username and level < 5:
        raise MalformedPacket("CONNECT password without username [MQTT-3.1.2-22]")
    props: dict[int, Any] = {}
    if level == 5:
        props, pos = read_property_block(buf, pos, end, 1)
    client_id, pos = read_utf8(buf, pos, end)
    will = None
    if will_flag:
        will_props: dict[int, Any] = {}
        if level == 5:
            will_props, pos = read_property_block(buf, pos, end, WILL_PROPERTIES)
        will_topic, pos = read_utf8(buf, pos, end)
        will_payload, pos = read_binary(buf, pos, end)
        will = Will(will_topic, will_payload, will_qos, will_retain, will_props)
    username = password = None
    if has_username:
        username, pos = read_utf8(buf, pos, end)
    if has_password:
        password, pos = read_binary(buf, pos, end)
    if pos != end:
        raise _trailing("CONNECT")
    return Connect(
        client_id, level, name, bool(flags & 0x02), keepalive, will, username, password, props
    )


def _decode_connack(buf: bytes, pos: int, end: int, version: int) -> ConnAck:
    if pos + 2 > end:
        raise short("CONNACK")
    ack_flags = buf[pos]
    if ack_flags & 0xFE:
        raise MalformedPacket("CONNACK reserved acknowledge flags set [MQTT-3.2.2-1]")
    code = _check_reason(2, buf[pos + 1], version, "CONNACK")
    pos += 2
    props: dict[int, Any] = {}
    if version == 5:
        props, pos = read_property_block(buf, pos, end, 2)
    if pos != end:
        raise _trailing("CONNACK")
    return ConnAck(bool(ack_flags), code, props)


def _ack_fields(
    buf: bytes, pos: int, end: int, version: int, ptype: int, what: str
) -> tuple[int, int, dict[int, Any]]:
    """PUBACK/PUBREC/PUBREL/PUBCOMP: packet id, then in 5.0 an optional reason code and an
    optional property block (s3.4.2.1: both may be omitted, the code meaning 0x00)."""
    pid = _packet_id(buf, pos, end, what)
    pos += 2
    if version != 5:
        if pos != end:
            raise _trailing(what)
        return pid, 0, {}
    if pos == end:
        return pid, 0, {}
    code = _check_reason(ptype, buf[pos], 5, what)
    pos += 1
    if pos == end:
        return pid, code, {}
    props, pos = read_property_block(buf, pos, end, ptype)
    if pos != end:
        raise _trailing(what)
    return pid, code, props


def _decode_puback(buf: bytes, pos: int, end: int, version: int) -> PubAck:
    return PubAck(*_ack_fields(buf, pos, end, version, 4, "PUBACK"))


def _decode_pubrec(buf: bytes, pos: int, end: int, version: int) -> PubRec:
    return PubRec(*_ack_fields(buf, pos, end, version, 5, "PUBREC"))


def _decode_pubrel(buf: bytes, pos: int, end: int, version: int) -> PubRel:
    return PubRel(*_ack_fields(buf, pos, end, version, 6, "PUBREL"))


def _decode_pubcomp(buf: bytes, pos: int, end: int, version: int) -> PubComp:
    return PubComp(*_ack_fields(buf, pos, end, version, 7, "PUBCOMP"))


def _decode_subscribe(buf: bytes, pos: int, end: int, version: int) -> Subscribe:
    pid = _packet_id(buf, pos, end, "SUBSCRIBE")
    pos += 2
    props: dict[int, Any] = {}
    if version == 5:
        props, pos = read_property_block(buf, pos, end, 8)
    subs: list[Subscription] = []
    while pos < end:
        topic_filter, pos = read_utf8(buf, pos, end)
        if pos >= end:
            raise short("SUBSCRIBE subscription options")
        opts = buf[pos]
        pos += 1
        qos = opts & 0x03
        if qos == 3:
            raise MalformedPacket("SUBSCRIBE with QoS 3 [MQTT-3.8.3-4]")
        if version != 5:
            if opts & 0xFC:
                raise MalformedPacket("SUBSCRIBE reserved option bits set [MQTT-3.8.3-4]")
            subs.append(Subscription(topic_filter, qos))
            continue
        if opts & 0xC0:
            raise MalformedPacket("SUBSCRIBE reserved option bits set [MQTT-3.8.3-5]")
        retain_handling = (opts >> 4) & 0x03
        if retain_handling == 3:
            raise ProtocolError("SUBSCRIBE retain handling 3 (s3.8.3.1)")
        subs.append(
            Subscription(topic_filter, qos, bool(opts & 0x04), bool(opts & 0x08), retain_handling)
        )
    if not subs:
        raise ProtocolError("SUBSCRIBE without topic filters [MQTT-3.8.3-3]")
    return Subscribe(pid, subs, props)


def _decode_suback(buf: bytes, pos: int, end: int, version: int) -> SubAck:
    pid = _packet_id(buf, pos, end, "SUBACK")
    pos += 2
    props: dict[int, Any] = {}
    if version == 5:
        props, pos = read_property_block(buf, pos, end, 9)
    codes = [_check_reason(9, code, version, "SUBACK") for code in buf[pos:end]]
    return SubAck(pid, codes, props)


def _decode_unsubscribe(buf: bytes, pos: int, end: int, version: int) -> Unsubscribe:
    pid = _packet_id(buf, pos, end, "UNSUBSCRIBE")
    pos += 2
    props: dict[int, Any] = {}
    if version == 5:
        props, pos = read_property_block(buf, pos, end, 10)
    filters: list[str] = []
    while pos < end:
        topic_filter, pos = read_utf8(buf, pos, end)
        filters.append(topic_filter)
    if not filters:
        raise ProtocolError("UNSUBSCRIBE without topic filters [MQTT-3.10.3-2]")
    return Unsubscribe(pid, filters, props)


def _decode_unsuback(buf: bytes, pos: int, end: int, version: int) -> UnsubAck:
    pid = _packet_id(buf, pos, end, "UNSUBACK")
    pos += 2
    if version != 5:
        if pos != end:
            raise _trailing("UNSUBACK")
        return UnsubAck(pid, [], {})
    props, pos = read_property_block(buf, pos, end, 11)
    codes = [_check_reason(11, code, 5, "UNSUBACK") for code in buf[pos:end]]
    return UnsubAck(pid, codes, props)


_PINGREQ = PingReq()
_PINGRESP = PingResp()


def _decode_pingreq(buf: bytes, pos: int, end: int, version: int) -> PingReq:
    if pos != end:
        raise _trailing("PINGREQ")
    return _PINGREQ


def _decode_pingresp(buf: bytes, pos: int, end: int, version: int) -> PingResp:
    if pos != end:
        raise _trailing("PINGRESP")
    return _PINGRESP


def _reason_and_props(
    buf: bytes, pos: int, end: int, ptype: int, what: str
) -> tuple[int, dict[int, Any]]:
    """5.0 DISCONNECT / AUTH body: an optional reason code then an optional property block
    (s3.14.2.1, s3.15.2.1: remaining length 0 means reason 0x00 and no properties)."""
    if pos == end:
        return 0, {}
    code = _check_reason(ptype, buf[pos], 5, what)
    pos += 1
    if pos == end:
        return code, {}
    props, pos = read_property_block(buf, pos, end, ptype)
    if pos != end:
        raise _trailing(what)
    return code, props


def _decode_disconnect(buf: bytes, pos: int, end: int, version: int) -> Disconnect:
    if version != 5:
        if pos != end:
            raise _trailing("DISCONNECT")
        return Disconnect(0, {})
    return Disconnect(*_reason_and_props(buf, pos, end, 14, "DISCONNECT"))


def _decode_auth(buf: bytes, pos: int, end: int, version: int) -> Auth:
    return Auth(*_reason_and_props(buf, pos, end, 15, "AUTH"))


def decode_publish_props(buf: bytes, pos: int, end: int) -> tuple[dict[int, Any], int]:
    return read_property_block(buf, pos, end, 3)


BODY_DECODERS: dict[int, Any] = {
    1: _decode_connect,
    2: _decode_connack,
    4: _decode_puback,
    5: _decode_pubrec,
    6: _decode_pubrel,
    7: _decode_pubcomp,
    8: _decode_subscribe,
    9: _decode_suback,
    10: _decode_unsubscribe,
    11: _decode_unsuback,
    12: _decode_pingreq,
    13: _decode_pingresp,
    14: _decode_disconnect,
    15: _decode_auth,
}
