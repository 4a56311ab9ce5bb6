"""A hand-built MQTT client over a plain socket, written from the spec, not from our codec.

For what paho cannot express: withholding acknowledgements, resending a PUBLISH with DUP after
a reconnect with the same packet id, reading the DUP flag and packet ids of deliveries,
sending DISCONNECT with a chosen reason code, or closing the socket at an exact point.
Nothing here imports ``broker``.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

# Fixed-header packet types (s2.1.2).
CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 2, 3, 4, 5, 6, 7
SUBACK, UNSUBACK, PINGRESP, DISCONNECT = 9, 11, 13, 14


def varint(n: int) -> bytes:
    """Variable Byte Integer (s1.5.5)."""
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def utf8(s: str) -> bytes:
    b = s.encode()
    return struct.pack("!H", len(b)) + b


def packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + varint(len(body)) + body


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
    """CONNECT (s3.1). 5.0 properties: Session Expiry Interval (0x11), Receive Maximum
    (0x21); will property: Will Delay Interval (0x18)."""
    flags = 0x02 if clean else 0
    will_part = b""
    if will is not None:
        topic, payload, qos, retain = will
        flags |= 0x04 | (qos << 3) | (0x20 if retain else 0)
        if version == 5:
            wprops = b"" if will_delay is None else b"\x18" + struct.pack("!I", will_delay)
            will_part += varint(len(wprops)) + wprops
        will_part += utf8(topic) + struct.pack("!H", len(payload)) + payload
    body = utf8("MQTT") + bytes([version, flags]) + struct.pack("!H", keepalive)
    if version == 5:
        props = b"" if session_expiry is None else b"\x11" + struct.pack("!I", session_expiry)
        if receive_maximum is not None:
            props += b"\x21" + struct.pack("!H", receive_maximum)
        body += varint(len(props)) + props
    body += utf8(client_id) + will_part
    return packet(0x10, body)


@dataclass
class Packet:
    type: int
    flags: int
    body: bytes

    @property
    def packet_id(self) -> int:
        return int(struct.unpack("!H", self.body[:2])[0])


@dataclass
class Delivery:
    """A PUBLISH received from the broker."""

    topic: str
    payload: bytes
    qos: int
    dup: bool
    retain: bool
    packet_id: int


class RawClient:
    """One MQTT connection driven byte by byte. Every read has a deadline."""

    def __init__(self, port: int, version: int = 4, timeout: float = 5.0) -> None:
        self.version = version
        self.timeout = timeout
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""
        self._next_pid = 1
        #: Packets read while waiting for another kind (kept in order).
        self.backlog: list[Packet] = []

    # ------------------------------------------------------------------ sending

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def connect(self, client_id: str, **kw: object) -> tuple[bool, int]:
        """CONNECT; returns (session present, reason/return code) from the CONNACK."""
        self.send(connect_bytes(client_id, self.version, **kw))  # type: ignore[arg-type]
        p = self.expect(CONNACK)
        return bool(p.body[0] & 1), p.body[1]

    def subscribe(self, topic_filter: str, qos: int) -> list[int]:
        pid = self._pid()
        body = struct.pack("!H", pid) + (b"\x00" if self.version == 5 else b"")
        body += utf8(topic_filter) + bytes([qos])
        self.send(packet(0x82, body))
        p = self.expect(SUBACK)
        assert p.packet_id == pid
        rest = p.body[2:]
        if self.version == 5:
            plen, n = _read_varint(rest, 0)
            rest = rest[n + plen :]
        return list(rest)

    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        packet_id: int | None = None,
        *,
        dup: bool = False,
        retain: bool = False,
    ) -> None:
        first = 0x30 | (0x08 if dup else 0) | (qos << 1) | (0x01 if retain else 0)
        body = utf8(topic)
        if qos:
            assert packet_id is not None
            body += struct.pack("!H", packet_id)
        if self.version == 5:
            body += b"\x00"
        self.send(packet(first, body + payload))

    def ack(self, kind: int, packet_id: int) -> None:
        """PUBACK / PUBREC / PUBREL / PUBCOMP (PUBREL has flags 0b0010, s3.6.1)."""
        self.send(
            packet((kind << 4) | (0x02 if kind == PUBREL else 0), struct.pack("!H", packet_id))
        )

    def disconnect(self, reason: int | None = None) -> None:
        """DISCONNECT (5.0: with ``reason``), then close."""
        body = b"" if reason is None else bytes([reason, 0])
        self.send(packet(0xE0, body))
        self.sock.close()

    def close(self) -> None:
        """Drop the TCP connection without DISCONNECT."""
        self.sock.close()

    def _pid(self) -> int:
        pid = self._next_pid
        self._next_pid += 1
        return pid

    # ------------------------------------------------------------------ receiving

    def read_packet(self, timeout: float | None = None) -> Packet:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            parsed = self._parse()
            if parsed is not None:
                return parsed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no complete packet")
            self.sock.settimeout(remaining)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the broker")
            self._buf += chunk

    def _parse(self) -> Packet | None:
        buf = self._buf
        if len(buf) < 2:
            return None
        try:
            length, n = _read_varint(buf, 1)
        except IndexError:
            return None
        end = 1 + n + length
        if len(buf) < end:
            return None
        self._buf = buf[end:]
        return Packet(buf[0] >> 4, buf[0] & 0x0F, buf[1 + n : end])

    def expect(self, kind: int, timeout: float | None = None) -> Packet:
        for i, p in enumerate(self.backlog):
            if p.type == kind:
                return self.backlog.pop(i)
        while True:
            p = self.read_packet(timeout)
            if p.type == kind:
                return p
            self.backlog.append(p)

    def deliveries(self, n: int, timeout: float | None = None) -> list[Delivery]:
        return [self.decode_publish(self.expect(PUBLISH, timeout)) for _ in range(n)]

    def decode_publish(self, p: Packet) -> Delivery:
        assert p.type == PUBLISH
        qos = (p.flags >> 1) & 3
        tlen = struct.unpack("!H", p.body[:2])[0]
        topic = p.body[2 : 2 + tlen].decode()
        i = 2 + tlen
        pid = 0
        if qos:
            pid = struct.unpack("!H", p.body[i : i + 2])[0]
            i += 2
        if self.version == 5:
            plen, n = _read_varint(p.body, i)
            i += n + plen
        return Delivery(topic, p.body[i:], qos, bool(p.flags & 0x08), bool(p.flags & 1), pid)

    def expect_nothing(self, kind: int, wait: float = 0.5) -> None:
        """No packet of ``kind`` arrives within ``wait`` seconds."""
        assert not any(p.type == kind for p in self.backlog), self.backlog
        try:
            while True:
                p = self.read_packet(wait)
                assert p.type != kind, f"unexpected packet {p}"
                self.backlog.append(p)
        except TimeoutError:
            return

    def closed_by_broker(self, timeout: float = 5.0) -> Packet | None:
        """Wait for the broker to close; returns the DISCONNECT it sent first, if any."""
        disconnect = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                p = self.read_packet(deadline - time.monotonic())
            except TimeoutError:
                break
            except OSError:  # ConnectionError: closed (or reset) by the broker
                return disconnect
            if p.type == DISCONNECT:
                disconnect = p
        raise AssertionError("the broker did not close the connection")


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    value, mult, n = 0, 1, 0
    while True:
        byte = buf[i + n]
        n += 1
        value += (byte & 0x7F) * mult
        if not byte & 0x80:
            return value, n
        mult *= 128
