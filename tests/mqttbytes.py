"""MQTT bytes built and read by hand, from the spec: the one byte helper of the tests.

Every test that writes or reads raw MQTT (the hand-built socket client in
``tests/integration/rawclient.py``, the CONNECT / malformed / MQTT 5 / limits / backpressure
tests, the decoder's unit and fuzz tests) takes its bytes from here. Nothing here imports
``broker``: the bytes are written from the specification (section numbers below are MQTT 5.0
unless said otherwise), so a bug in our codec cannot hide the same bug in what it is tested
against. No sockets either: ``rawclient.py`` carries these bytes over TCP.

Tests spell unusual packet bodies as hex literals with comments; these helpers add the fixed
header (s2.1), encode the common CONNECT forms and read packets and property lists back.
"""

from __future__ import annotations

import struct
from typing import Any

# Fixed-header packet types (s2.1.2).
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK = 8, 9, 10, 11
PINGREQ, PINGRESP, DISCONNECT, AUTH = 12, 13, 14, 15


# --------------------------------------------------------------------------- data types


def varint(n: int) -> bytes:
    """Variable Byte Integer (s1.5.5): seven bits a byte, least significant first."""
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The Variable Byte Integer at ``buf[pos]``: (value, position after it). Raises
    IndexError when ``buf`` ends inside it (a caller reading a stream waits for more)."""
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def utf8(s: str | bytes) -> bytes:
    """UTF-8 Encoded String (s1.5.4), or Binary Data (s1.5.6) for bytes: two-byte length,
    then the bytes."""
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("!H", len(b)) + b


# --------------------------------------------------------------------------- writing


def packet(first: int, body: bytes) -> bytes:
    """A whole packet: first byte (type and flags, s2.1.2), Remaining Length, body."""
    return bytes([first]) + varint(len(body)) + body


def connect311(client_id: str = "", *, flags: int = 0x02, keepalive: int = 60) -> bytes:
    """A 3.1.1 CONNECT with the given flags byte (0x02: clean session) and no payload
    beyond the client id (s3.1.2, 3.1.1)."""
    # 00 04 'MQTT' | 04 level 3.1.1 | flags | keepalive
    return packet(
        0x10,
        bytes.fromhex("00044d51545404")
        + bytes([flags])
        + keepalive.to_bytes(2, "big")
        + utf8(client_id),
    )


def connect5(
    client_id: str = "", *, flags: int = 0x02, keepalive: int = 60, props: bytes = b""
) -> bytes:
    """A 5.0 CONNECT with the given flags byte (0x02: clean start) and property bytes."""
    # 00 04 'MQTT' | 05 level 5.0 | flags | keepalive | properties
    return packet(
        0x10,
        bytes.fromhex("00044d51545405")
        + bytes([flags])
        + keepalive.to_bytes(2, "big")
        + varint(len(props))
        + props
        + utf8(client_id),
    )


def connect_bytes(
    client_id: str,
    version: int = 4,
    *,
    clean: bool = True,
    keepalive: int = 60,
    session_expiry: int | None = None,
    receive_maximum: int | None = None,
    will: tuple[str, bytes, int, bool] | None = None,
    will_delay: int | None = None,
) -> bytes:
    """CONNECT (s3.1) from named options. 5.0 properties: Session Expiry Interval (0x11),
    Receive Maximum (0x21); will property: Will Delay Interval (0x18)."""
    flags = 0x02 if clean else 0
    will_part = b""
    if will is not None:
        topic, payload, qos, retain = will
        flags |= 0x04 | (qos << 3) | (0x20 if retain else 0)
        if version == 5:
            wprops = b"" if will_delay is None else b"\x18" + struct.pack("!I", will_delay)
            will_part += varint(len(wprops)) + wprops
        will_part += utf8(topic) + utf8(payload)
    body = utf8("MQTT") + bytes([version, flags]) + struct.pack("!H", keepalive)
    if version == 5:
        props = b"" if session_expiry is None else b"\x11" + struct.pack("!I", session_expiry)
        if receive_maximum is not None:
            props += b"\x21" + struct.pack("!H", receive_maximum)
        body += varint(len(props)) + props
    body += utf8(client_id) + will_part
    return packet(0x10, body)


# --------------------------------------------------------------------------- reading


def split_packet(buf: bytes) -> tuple[int, bytes, int] | None:
    """The first whole packet in ``buf``: (first byte, body, bytes it took), or None when
    ``buf`` holds only part of one."""
    try:
        length, pos = read_varint(buf, 1)
    except IndexError:
        return None
    end = pos + length
    if len(buf) < end:
        return None
    return buf[0], buf[pos:end], end


# Data type of each property identifier (s2.2.2.2, Table 2-4).
_BYTE = {0x01, 0x17, 0x19, 0x24, 0x25, 0x28, 0x29, 0x2A}
_TWO = {0x13, 0x21, 0x22, 0x23}
_FOUR = {0x02, 0x11, 0x18, 0x27}
_VARINT = {0x0B}
_STRING = {0x03, 0x08, 0x12, 0x15, 0x1A, 0x1C, 0x1F}
_BINARY = {0x09, 0x16}
_PAIR = {0x26}


def read_props(buf: bytes, pos: int) -> tuple[dict[int, Any], int]:
    """A property list with its length prefix at ``pos``: ({id: value or [values]}, end).
    User Property and Subscription Identifier may repeat: their values are lists."""
    length, pos = read_varint(buf, pos)
    end = pos + length
    props: dict[int, Any] = {}
    while pos < end:
        pid = buf[pos]
        pos += 1
        value: Any
        if pid in _BYTE:
            value, pos = buf[pos], pos + 1
        elif pid in _TWO:
            value, pos = int.from_bytes(buf[pos : pos + 2], "big"), pos + 2
        elif pid in _FOUR:
            value, pos = int.from_bytes(buf[pos : pos + 4], "big"), pos + 4
        elif pid in _VARINT:
            value, pos = read_varint(buf, pos)
        elif pid in _STRING or pid in _BINARY:
            n = int.from_bytes(buf[pos : pos + 2], "big")
            raw = buf[pos + 2 : pos + 2 + n]
            value, pos = (raw.decode() if pid in _STRING else raw), pos + 2 + n
        elif pid in _PAIR:
            k = int.from_bytes(buf[pos : pos + 2], "big")
            key = buf[pos + 2 : pos + 2 + k].decode()
            pos += 2 + k
            v = int.from_bytes(buf[pos : pos + 2], "big")
            value = (key, buf[pos + 2 : pos + 2 + v].decode())
            pos += 2 + v
        else:
            raise AssertionError(f"unknown property id {pid:#x} in {buf.hex()}")
        if pid in _PAIR or pid in _VARINT:
            props.setdefault(pid, []).append(value)
        else:
            assert pid not in props, f"property {pid:#x} twice"
            props[pid] = value
    assert pos == end
    return props, end


def connack5(body: bytes) -> tuple[int, int, dict[int, Any]]:
    """A 5.0 CONNACK body: (flags, reason code, properties)."""
    props, end = read_props(body, 2)
    assert end == len(body)
    return body[0], body[1], props


def disconnect5(first: int, body: bytes) -> tuple[int, dict[int, Any]]:
    """A 5.0 DISCONNECT: (reason code, properties); an empty body means 0x00 (s3.14.2.1)."""
    assert first == 0xE0, f"expected DISCONNECT, got {first:#x} {body.hex()}"
    if not body:
        return 0, {}
    if len(body) == 1:
        return body[0], {}
    props, _ = read_props(body, 1)
    return body[0], props


def publish5(first: int, body: bytes) -> tuple[str, int | None, dict[int, Any], bytes]:
    """A 5.0 PUBLISH: (topic, packet id or None, properties, payload)."""
    assert first >> 4 == PUBLISH, f"expected PUBLISH, got {first:#x} {body.hex()}"
    n = int.from_bytes(body[:2], "big")
    topic = body[2 : 2 + n].decode()
    pos = 2 + n
    pid = None
    if (first >> 1) & 3:
        pid = int.from_bytes(body[pos : pos + 2], "big")
        pos += 2
    props, pos = read_props(body, pos)
    return topic, pid, props, body[pos:]
