"""MQTT 5.0 properties (s2.2.2) and the wire data representations they use (s1.5).

A decoded property set is a ``dict[int, Any]`` keyed by :class:`PropertyId`:

* Byte, Two Byte, Four Byte and Variable Byte Integer properties -> ``int``
* UTF-8 Encoded String properties -> ``str``; Binary Data properties -> ``bytes``
* ``USER_PROPERTY`` -> ``list[tuple[str, str]]`` in wire order, repeats allowed (s3.1.2.11.8)
* ``SUBSCRIPTION_IDENTIFIER`` -> ``list[int]`` everywhere; only PUBLISH may carry several
  (s3.3.2.3.8), SUBSCRIBE exactly one (s3.8.2.1.2).

Decoding checks, in this order for each property: the identifier is known (else Malformed
Packet: its length cannot be known), it is allowed in this packet type (Table 2-4; else
Malformed Packet, as s2.2.2.2 says), its value fits inside the property block (else Malformed
Packet), it is not a forbidden repeat (else Protocol Error), and its value is one the spec
allows (e.g. Receive Maximum 0, Payload Format Indicator 2: Protocol Error).

Two forms exist: the *property block* of a packet (Variable Byte Integer length first,
:func:`read_property_block` / :func:`encode_property_block`, checked against the packet
type) and the *blob* stored in commit-log records (no length prefix, no packet-type check,
:func:`decode_properties` / :func:`encode_properties`).

Encoding applies the same rules and raises :class:`LocalProtocolError`, because sending such a
packet would be our bug.

Buffers passed to the readers here are ``bytes`` or ``bytearray`` with explicit ``end``
bounds: every read is checked against ``end`` (the end of the packet or of the property
block), never against the end of the buffer, so a short field is always a
:class:`MalformedPacket` and never reads into the next packet.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from broker.mqtt.errors import LocalProtocolError, MalformedPacket, ProtocolError
from broker.mqtt.reason_codes import ReasonCode

__all__ = [
    "MAX_VBI",
    "WILL_PROPERTIES",
    "PropertyId",
    "decode_properties",
    "encode_binary",
    "encode_properties",
    "encode_property_block",
    "encode_utf8",
    "encode_vbi",
    "read_binary",
    "read_property_block",
    "read_utf8",
    "read_vbi",
]

#: Largest value a Variable Byte Integer can hold (four bytes, s1.5.5).
MAX_VBI = 268_435_455

#: Pseudo packet type used as the context for the Will Properties of a CONNECT (s3.1.3.2).
WILL_PROPERTIES = 16

# Packet type numbers (s2.1.2), repeated here so this module does not import packets.py.
_CONNECT, _CONNACK, _PUBLISH, _PUBACK, _PUBREC, _PUBREL, _PUBCOMP = 1, 2, 3, 4, 5, 6, 7
_SUBSCRIBE, _SUBACK, _UNSUBSCRIBE, _UNSUBACK, _DISCONNECT, _AUTH = 8, 9, 10, 11, 14, 15


class PropertyId(IntEnum):
    """Property identifiers of MQTT 5.0 (s2.2.2.2, Table 2-4)."""

    PAYLOAD_FORMAT_INDICATOR = 0x01
    MESSAGE_EXPIRY_INTERVAL = 0x02
    CONTENT_TYPE = 0x03
    RESPONSE_TOPIC = 0x08
    CORRELATION_DATA = 0x09
    SUBSCRIPTION_IDENTIFIER = 0x0B
    SESSION_EXPIRY_INTERVAL = 0x11
    ASSIGNED_CLIENT_IDENTIFIER = 0x12
    SERVER_KEEP_ALIVE = 0x13
    AUTHENTICATION_METHOD = 0x15
    AUTHENTICATION_DATA = 0x16
    REQUEST_PROBLEM_INFORMATION = 0x17
    WILL_DELAY_INTERVAL = 0x18
    REQUEST_RESPONSE_INFORMATION = 0x19
    RESPONSE_INFORMATION = 0x1A
    SERVER_REFERENCE = 0x1C
    REASON_STRING = 0x1F
    RECEIVE_MAXIMUM = 0x21
    TOPIC_ALIAS_MAXIMUM = 0x22
    TOPIC_ALIAS = 0x23
    MAXIMUM_QOS = 0x24
    RETAIN_AVAILABLE = 0x25
    USER_PROPERTY = 0x26
    MAXIMUM_PACKET_SIZE = 0x27
    WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
    SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
    SHARED_SUBSCRIPTION_AVAILABLE = 0x2A


# Value kinds (s1.5).
_BYTE, _U16, _U32, _VBI, _UTF8, _BIN, _PAIR = range(7)

_P = PropertyId
_PUB_WILL = frozenset({_PUBLISH, WILL_PROPERTIES})
_ALL = frozenset(
    {
        _CONNECT,
        _CONNACK,
        _PUBLISH,
        WILL_PROPERTIES,
        _PUBACK,
        _PUBREC,
        _PUBREL,
        _PUBCOMP,
        _SUBSCRIBE,
        _SUBACK,
        _UNSUBSCRIBE,
        _UNSUBACK,
        _DISCONNECT,
        _AUTH,
    }
)

#: identifier -> (member, value kind, packet types that may carry it): Table 2-4.
_SPEC: dict[int, tuple[PropertyId, int, frozenset[int]]] = {
    _P.PAYLOAD_FORMAT_INDICATOR: (_P.PAYLOAD_FORMAT_INDICATOR, _BYTE, _PUB_WILL),
    _P.MESSAGE_EXPIRY_INTERVAL: (_P.MESSAGE_EXPIRY_INTERVAL, _U32, _PUB_WILL),
    _P.CONTENT_TYPE: (_P.CONTENT_TYPE, _UTF8, _PUB_WILL),
    _P.RESPONSE_TOPIC: (_P.RESPONSE_TOPIC, _UTF8, _PUB_WILL),
    _P.CORRELATION_DATA: (_P.CORRELATION_DATA, _BIN, _PUB_WILL),
    _P.SUBSCRIPTION_IDENTIFIER: (
        _P.SUBSCRIPTION_IDENTIFIER,
        _VBI,
        frozenset({_PUBLISH, _SUBSCRIBE}),
    ),
    _P.SESSION_EXPIRY_INTERVAL: (
        _P.SESSION_EXPIRY_INTERVAL,
        _U32,
        frozenset({_CONNECT, _CONNACK, _DISCONNECT}),
    ),
    _P.ASSIGNED_CLIENT_IDENTIFIER: (_P.ASSIGNED_CLIENT_IDENTIFIER, _UTF8, frozenset({_CONNACK})),
    _P.SERVER_KEEP_ALIVE: (_P.SERVER_KEEP_ALIVE, _U16, frozenset({_CONNACK})),
    _P.AUTHENTICATION_METHOD: (
        _P.AUTHENTICATION_METHOD,
        _UTF8,
        frozenset({_CONNECT, _CONNACK, _AUTH}),
    ),
    _P.AUTHENTICATION_DATA: (
        _P.AUTHENTICATION_DATA,
        _BIN,
        frozenset({_CONNECT, _CONNACK, _AUTH}),
    ),
    _P.REQUEST_PROBLEM_INFORMATION: (
        _P.REQUEST_PROBLEM_INFORMATION,
        _BYTE,
        frozenset({_CONNECT}),
    ),
    _P.WILL_DELAY_INTERVAL: (_P.WILL_DELAY_INTERVAL, _U32, frozenset({WILL_PROPERTIES})),
    _P.REQUEST_RESPONSE_INFORMATION: (
        _P.REQUEST_RESPONSE_INFORMATION,
        _BYTE,
        frozenset({_CONNECT}),
    ),
    _P.RESPONSE_INFORMATION: (_P.RESPONSE_INFORMATION, _UTF8, frozenset({_CONNACK})),
    _P.SERVER_REFERENCE: (_P.SERVER_REFERENCE, _UTF8, frozenset({_CONNACK, _DISCONNECT})),
    _P.REASON_STRING: (
        _P.REASON_STRING,
        _UTF8,
        frozenset(
            {_CONNACK, _PUBACK, _PUBREC, _PUBREL, _PUBCOMP, _SUBACK, _UNSUBACK, _DISCONNECT, _AUTH}
        ),
    ),
    _P.RECEIVE_MAXIMUM: (_P.RECEIVE_MAXIMUM, _U16, frozenset({_CONNECT, _CONNACK})),
    _P.TOPIC_ALIAS_MAXIMUM: (_P.TOPIC_ALIAS_MAXIMUM, _U16, frozenset({_CONNECT, _CONNACK})),
    _P.TOPIC_ALIAS: (_P.TOPIC_ALIAS, _U16, frozenset({_PUBLISH})),
    _P.MAXIMUM_QOS: (_P.MAXIMUM_QOS, _BYTE, frozenset({_CONNACK})),
    _P.RETAIN_AVAILABLE: (_P.RETAIN_AVAILABLE, _BYTE, frozenset({_CONNACK})),
    _P.USER_PROPERTY: (_P.USER_PROPERTY, _PAIR, _ALL),
    _P.MAXIMUM_PACKET_SIZE: (_P.MAXIMUM_PACKET_SIZE, _U32, frozenset({_CONNECT, _CONNACK})),
    _P.WILDCARD_SUBSCRIPTION_AVAILABLE: (
        _P.WILDCARD_SUBSCRIPTION_AVAILABLE,
        _BYTE,
        frozenset({_CONNACK}),
    ),
    _P.SUBSCRIPTION_IDENTIFIER_AVAILABLE: (
        _P.SUBSCRIPTION_IDENTIFIER_AVAILABLE,
        _BYTE,
        frozenset({_CONNACK}),
    ),
    _P.SHARED_SUBSCRIPTION_AVAILABLE: (
        _P.SHARED_SUBSCRIPTION_AVAILABLE,
        _BYTE,
        frozenset({_CONNACK}),
    ),
}

#: Byte properties whose only legal values are 0 and 1 (s3.3.2.3.2, s3.1.2.11.6-7,
#: s3.2.2.3.4-5, s3.2.2.3.11-13): any other value is a Protocol Error.
_ZERO_OR_ONE = frozenset(
    {
        _P.PAYLOAD_FORMAT_INDICATOR,
        _P.REQUEST_PROBLEM_INFORMATION,
        _P.REQUEST_RESPONSE_INFORMATION,
        _P.MAXIMUM_QOS,
        _P.RETAIN_AVAILABLE,
        _P.WILDCARD_SUBSCRIPTION_AVAILABLE,
        _P.SUBSCRIPTION_IDENTIFIER_AVAILABLE,
        _P.SHARED_SUBSCRIPTION_AVAILABLE,
    }
)

#: Properties for which 0 is a Protocol Error: Receive Maximum (s3.1.2.11.3), Maximum Packet
#: Size (s3.1.2.11.4), Topic Alias (s3.3.2.3.4), Subscription Identifier (s3.3.2.3.8).
_NONZERO = frozenset(
    {_P.RECEIVE_MAXIMUM, _P.MAXIMUM_PACKET_SIZE, _P.TOPIC_ALIAS, _P.SUBSCRIPTION_IDENTIFIER}
)

_MAX_FOR_KIND = {_BYTE: 0xFF, _U16: 0xFFFF, _U32: 0xFFFF_FFFF, _VBI: MAX_VBI}


# --------------------------------------------------------------------------- readers


def read_vbi(buf: bytes | bytearray, pos: int, end: int) -> tuple[int, int]:
    """Decode a Variable Byte Integer at ``pos``; return ``(value, position after it)``.

    At most four bytes [MQTT-1.5.5-1]; a fifth continuation byte or running past ``end`` is a
    Malformed Packet.
    """
    value = 0
    shift = 0
    limit = min(pos + 4, end)
    while pos < limit:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    if pos >= end and shift < 28:
        raise MalformedPacket("variable byte integer runs past the end of the packet")
    raise MalformedPacket("variable byte integer longer than four bytes")


def read_utf8(buf: bytes | bytearray, pos: int, end: int) -> tuple[str, int]:
    """Decode a UTF-8 Encoded String (s1.5.4) at ``pos``; return ``(text, next position)``.

    Ill-formed UTF-8, including encoded UTF-16 surrogates, is a Malformed Packet
    [MQTT-1.5.4-1]; so is U+0000 [MQTT-1.5.4-2]. Python's strict UTF-8 codec rejects
    surrogates and overlong forms, which is exactly the spec's well-formedness rule.
    """
    if pos + 2 > end:
        raise MalformedPacket("string length runs past the end of the packet")
    start = pos + 2
    stop = start + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise MalformedPacket("string runs past the end of the packet")
    try:
        text = buf[start:stop].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedPacket(f"string is not well-formed UTF-8: {exc.reason}") from None
    if "\x00" in text:
        raise MalformedPacket("string contains U+0000 [MQTT-1.5.4-2]")
    return text, stop


def read_binary(buf: bytes | bytearray, pos: int, end: int) -> tuple[bytes, int]:
    """Decode Binary Data (s1.5.6): a two-byte length and that many bytes."""
    if pos + 2 > end:
        raise MalformedPacket("binary length runs past the end of the packet")
    start = pos + 2
    stop = start + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise MalformedPacket("binary data runs past the end of the packet")
    return bytes(buf[start:stop]), stop


def read_property_block(
    buf: bytes | bytearray, pos: int, end: int, context: int
) -> tuple[dict[int, Any], int]:
    """Decode a packet's property block (length + properties) at ``pos`` for ``context``.

    ``context`` is the packet type number, or :data:`WILL_PROPERTIES`. Returns the property
    dict and the position just after the block. The block must fit in ``end``.
    """
    if pos >= end:
        raise MalformedPacket("property length missing")
    length = buf[pos]
    if length < 0x80:
        pos += 1
    else:
        length, pos = read_vbi(buf, pos, end)
    block_end = pos + length
    if block_end > end:
        raise MalformedPacket("property block runs past the end of the packet")
    return _read_properties(buf, pos, block_end, context), block_end


def decode_properties(data: bytes | bytearray | memoryview) -> dict[int, Any]:
    """Decode a property list stored without its length prefix (a commit-log record's blob).

    The inverse of :func:`encode_properties`. No packet-type check (the properties were
    validated when the packet was received); repeats follow PUBLISH rules. Raises
    :class:`MalformedPacket` on bad input.
    """
    if isinstance(data, memoryview):
        data = data.tobytes()
    return _read_properties(data, 0, len(data), None)


def _read_properties(
    buf: bytes | bytearray, pos: int, block_end: int, context: int | None
) -> dict[int, Any]:
    """The properties in ``buf[pos:block_end]``; ``context`` None skips the Table 2-4 check."""
    props: dict[int, Any] = {}
    while pos < block_end:
        spec = _SPEC.get(buf[pos])
        if spec is None:
            raise MalformedPacket(f"unknown property identifier 0x{buf[pos]:02X}")
        pid, kind, allowed = spec
        pos += 1
        if context is not None and context not in allowed:
            # s2.2.2.2: "A Control Packet which contains an Identifier which is not valid
            # for its packet type ... is a Malformed Packet."
            raise MalformedPacket(f"property {pid.name} is not allowed in this packet")
        value: Any
        if kind == _BYTE:
            if pos >= block_end:
                raise MalformedPacket(f"property {pid.name} runs past its block")
            value = buf[pos]
            pos += 1
        elif kind == _U16:
            if pos + 2 > block_end:
                raise MalformedPacket(f"property {pid.name} runs past its block")
            value = (buf[pos] << 8) | buf[pos + 1]
            pos += 2
        elif kind == _U32:
            if pos + 4 > block_end:
                raise MalformedPacket(f"property {pid.name} runs past its block")
            value = int.from_bytes(buf[pos : pos + 4], "big")
            pos += 4
        elif kind == _VBI:
            value, pos = read_vbi(buf, pos, block_end)
        elif kind == _UTF8:
            value, pos = read_utf8(buf, pos, block_end)
        elif kind == _BIN:
            value, pos = read_binary(buf, pos, block_end)
        else:
            name, pos = read_utf8(buf, pos, block_end)
            text, pos = read_utf8(buf, pos, block_end)
            pairs = props.get(pid)
            if pairs is None:
                props[pid] = [(name, text)]
            else:
                pairs.append((name, text))
            continue
        if pid in _ZERO_OR_ONE:
            if value > 1:
                raise ProtocolError(f"property {pid.name} must be 0 or 1, got {value}")
        elif value == 0 and pid in _NONZERO:
            if pid == _P.TOPIC_ALIAS:
                # s3.3.4: "A Topic Alias value of 0 ... is a Protocol Error, the receiver uses
                # DISCONNECT with Reason Code of 0x94 (Topic Alias invalid)".
                raise ProtocolError("TOPIC_ALIAS 0 [MQTT-3.3.2-8]", ReasonCode.TOPIC_ALIAS_INVALID)
            raise ProtocolError(f"property {pid.name} must not be 0")
        if pid == _P.SUBSCRIPTION_IDENTIFIER:
            ids = props.get(pid)
            if ids is None:
                props[pid] = [value]
            elif context is None or context == _PUBLISH:
                ids.append(value)
            else:
                raise ProtocolError("SUBSCRIPTION_IDENTIFIER included more than once")
        elif pid in props:
            raise ProtocolError(f"property {pid.name} included more than once")
        else:
            props[pid] = value
    return props


# --------------------------------------------------------------------------- writers


def encode_vbi(value: int) -> bytes:
    """Encode a Variable Byte Integer (s1.5.5) in the fewest bytes [MQTT-1.5.5-1]."""
    if value < 0x80:
        if value < 0:
            raise LocalProtocolError(f"variable byte integer must be >= 0, got {value}")
        return bytes((value,))
    if value > MAX_VBI:
        raise LocalProtocolError(f"variable byte integer {value} exceeds {MAX_VBI}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_utf8(text: str) -> bytes:
    """Encode a UTF-8 Encoded String with its two-byte length (s1.5.4).

    Refuses what a receiver must treat as malformed: U+0000, lone surrogates, > 65,535 bytes.
    """
    if not isinstance(text, str):
        raise LocalProtocolError(f"expected str, got {type(text).__name__}")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise LocalProtocolError(f"string {text!r} is not encodable as UTF-8") from None
    if "\x00" in text:
        raise LocalProtocolError("strings must not contain U+0000 [MQTT-1.5.4-2]")
    if len(data) > 0xFFFF:
        raise LocalProtocolError("string longer than 65,535 bytes")
    return len(data).to_bytes(2, "big") + data


def encode_binary(data: bytes) -> bytes:
    """Encode Binary Data with its two-byte length (s1.5.6)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise LocalProtocolError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > 0xFFFF:
        raise LocalProtocolError("binary data longer than 65,535 bytes")
    return len(data).to_bytes(2, "big") + data


def _encode_int(pid: PropertyId, kind: int, value: Any) -> bytes:
    if not isinstance(value, int) or (isinstance(value, bool) and kind != _BYTE):
        raise LocalProtocolError(f"property {pid.name} needs an int, got {value!r}")
    if not 0 <= value <= _MAX_FOR_KIND[kind]:
        raise LocalProtocolError(f"property {pid.name} value {value} out of range")
    if pid in _ZERO_OR_ONE and value > 1:
        raise LocalProtocolError(f"property {pid.name} must be 0 or 1")
    if value == 0 and pid in _NONZERO:
        raise LocalProtocolError(f"property {pid.name} must not be 0")
    if kind == _VBI:
        return encode_vbi(value)
    return int(value).to_bytes({_BYTE: 1, _U16: 2, _U32: 4}[kind], "big")


def encode_property_block(props: dict[int, Any], context: int) -> bytes:
    """Encode a packet's property block (Variable Byte Integer length + properties).

    ``context`` is the packet type number or :data:`WILL_PROPERTIES`. An empty dict encodes
    as the single byte ``0x00``.
    """
    if not props:
        return b"\x00"
    out = _write_properties(props, context)
    return encode_vbi(len(out)) + out


def encode_properties(props: dict[int, Any]) -> bytes:
    """Encode a property list WITHOUT its length prefix (a commit-log record's blob).

    The inverse of :func:`decode_properties`; ``b""`` for an empty dict. Values are checked
    as for a packet, but not which packet type may carry them.
    """
    return bytes(_write_properties(props, None)) if props else b""


def _write_properties(props: dict[int, Any], context: int | None) -> bytearray:
    out = bytearray()
    for key, value in props.items():
        spec = _SPEC.get(key)
        if spec is None:
            raise LocalProtocolError(f"unknown property identifier {key!r}")
        pid, kind, allowed = spec
        if context is not None and context not in allowed:
            raise LocalProtocolError(f"property {pid.name} is not allowed in this packet")
        head = bytes((pid,))
        if kind == _PAIR:
            if not isinstance(value, list | tuple):
                raise LocalProtocolError("USER_PROPERTY needs a list of (name, value) pairs")
            for pair in value:
                if not isinstance(pair, tuple | list) or len(pair) != 2:
                    raise LocalProtocolError(f"USER_PROPERTY item {pair!r} is not a pair")
                out += head + encode_utf8(pair[0]) + encode_utf8(pair[1])
        elif kind == _UTF8:
            out += head + encode_utf8(value)
        elif kind == _BIN:
            out += head + encode_binary(value)
        elif pid == _P.SUBSCRIPTION_IDENTIFIER:
            ids = [value] if isinstance(value, int) else value
            if not isinstance(ids, list | tuple) or not ids:
                raise LocalProtocolError("SUBSCRIPTION_IDENTIFIER needs a non-empty list of ints")
            if len(ids) > 1 and context not in (None, _PUBLISH):
                raise LocalProtocolError("only PUBLISH may carry several subscription ids")
            for one in ids:
                out += head + _encode_int(pid, kind, one)
        else:
            out += head + _encode_int(pid, kind, value)
    return out
