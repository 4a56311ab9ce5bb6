"""Hand-built MQTT bytes for the CONNECT / malformed / MQTT 5 / limits tests, from the spec.

Tests spell packet bodies as hex literals with comments; these helpers only add the fixed
header's remaining length (s2.1.4) and read packets back into (first byte, body) pairs, with a
property-list reader written from the table in MQTT 5.0 s2.2.2.2. Nothing here imports
``broker``: a bug in the codec cannot hide a bug in the broker.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from tests.integration.conftest import raw_connect, recv_exactly
from tests.integration.rawclient import packet as pkt
from tests.integration.rawclient import varint


def mqtt_str(s: str | bytes) -> bytes:
    """UTF-8 Encoded String (s1.5.4): two-byte length then bytes."""
    b = s.encode() if isinstance(s, str) else s
    return len(b).to_bytes(2, "big") + b


# CONNECT bodies (s3.1.2): protocol name "MQTT", level, flags, keepalive.
def connect311(client_id: str = "", *, flags: int = 0x02, keepalive: int = 60) -> bytes:
    # 00 04 'MQTT' | 04 level 3.1.1 | flags (0x02 clean session) | keepalive
    return pkt(
        0x10,
        bytes.fromhex("00044d51545404")
        + bytes([flags])
        + keepalive.to_bytes(2, "big")
        + mqtt_str(client_id),
    )


def connect5(
    client_id: str = "", *, flags: int = 0x02, keepalive: int = 60, props: bytes = b""
) -> bytes:
    # 00 04 'MQTT' | 05 level 5.0 | flags (0x02 clean start) | keepalive | properties
    return pkt(
        0x10,
        bytes.fromhex("00044d51545405")
        + bytes([flags])
        + keepalive.to_bytes(2, "big")
        + varint(len(props))
        + props
        + mqtt_str(client_id),
    )


def read_packet(s: socket.socket, timeout: float = 5.0) -> tuple[int, bytes]:
    """One packet as (first byte, body); raises AssertionError if the peer closed first."""
    s.settimeout(timeout)
    first = recv_exactly(s, 1)
    assert first, "connection closed while a packet was expected"
    length, shift = 0, 0
    while True:
        b = recv_exactly(s, 1)
        assert b, "connection closed inside a fixed header"
        length |= (b[0] & 0x7F) << shift
        shift += 7
        if b[0] < 0x80:
            break
    body = recv_exactly(s, length)
    assert len(body) == length, f"short body: {body.hex()}"
    return first[0], body


def open_session(port: int, connect: bytes) -> tuple[socket.socket, bytes]:
    """Connect, send ``connect``, return the socket and the CONNACK body (checked 0x20)."""
    s = raw_connect(port)
    s.sendall(connect)
    first, body = read_packet(s)
    assert first == 0x20, f"expected CONNACK, got {first:#x} {body.hex()}"
    return s, body


def wait_closed(s: socket.socket, timeout: float = 5.0) -> tuple[bytes, float]:
    """Read until the broker closes: (bytes received, seconds it took)."""
    start = time.monotonic()
    s.settimeout(timeout)
    buf = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    except TimeoutError:
        raise AssertionError(f"not closed within {timeout}s; got {buf.hex()}") from None
    except ConnectionResetError:
        pass
    return buf, time.monotonic() - start


# --------------------------------------------------------------------------- properties
# Data type of each property identifier (MQTT 5.0 s2.2.2.2, Table 2-4).
_BYTE = {0x01, 0x17, 0x19, 0x24, 0x25, 0x28, 0x29, 0x2A}
_TWO = {0x13, 0x21, 0x22, 0x23}
_FOUR = {0x02, 0x11, 0x18, 0x27}
_VARINT = {0x0B}
_STRING = {0x03, 0x08, 0x12, 0x15, 0x1A, 0x1C, 0x1F}
_BINARY = {0x09, 0x16}
_PAIR = {0x26}


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    n, shift = 0, 0
    while True:
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return n, pos


def read_props(buf: bytes, pos: int) -> tuple[dict[int, Any], int]:
    """A property list with its length prefix at ``pos``: ({id: value or [values]}, end)."""
    length, pos = _read_varint(buf, pos)
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
            value, pos = _read_varint(buf, pos)
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
    assert first >> 4 == 3, f"expected PUBLISH, got {first:#x} {body.hex()}"
    n = int.from_bytes(body[:2], "big")
    topic = body[2 : 2 + n].decode()
    pos = 2 + n
    pid = None
    if (first >> 1) & 3:
        pid = int.from_bytes(body[pos : pos + 2], "big")
        pos += 2
    props, pos = read_props(body, pos)
    return topic, pid, props, body[pos:]
