"""A hand-built MQTT client over a plain socket, and the raw-socket helpers of the tests.

For what paho cannot express: withholding acknowledgements, resending a PUBLISH with DUP after
a reconnect with the same packet id, reading the DUP flag and packet ids of deliveries,
sending DISCONNECT with a chosen reason code, sending malformed bytes, or closing the socket
at an exact point. The bytes come from ``tests/mqttbytes.py`` (written from the spec); nothing
here imports ``broker``.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

from tests.mqttbytes import (
    CONNACK,
    DISCONNECT,
    PUBLISH,
    PUBREL,
    SUBACK,
    connect_bytes,
    packet,
    read_varint,
    split_packet,
    utf8,
)
from tests.mqttbytes import varint as varint  # re-exported for tests/unit/net/test_device_path.py

# ------------------------------------------------------------------ plain sockets


def raw_connect(port: int, timeout: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    """``n`` bytes, or fewer if the peer closed first."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def read_packet(s: socket.socket, timeout: float = 5.0) -> tuple[int, bytes]:
    """One packet as (first byte, body); raises AssertionError if the peer closed first."""
    s.settimeout(timeout)
    head = recv_exactly(s, 1)
    assert head, "connection closed while a packet was expected"
    while len(head) == 1 or head[-1] & 0x80:  # Remaining Length: up to a byte < 0x80
        b = recv_exactly(s, 1)
        assert b, "connection closed inside a fixed header"
        head += b
    length, _ = read_varint(head, 1)
    body = recv_exactly(s, length)
    assert len(body) == length, f"short body: {body.hex()}"
    return head[0], body


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


# ------------------------------------------------------------------ a whole client


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

    def __init__(
        self, port: int, version: int = 4, timeout: float = 5.0, host: str = "127.0.0.1"
    ) -> None:
        self.version = version
        self.timeout = timeout
        self.sock = socket.create_connection((host, port), timeout=timeout)
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
            plen, pos = read_varint(rest, 0)
            rest = rest[pos + plen :]
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
        parsed = split_packet(self._buf)
        if parsed is None:
            return None
        first, body, end = parsed
        self._buf = self._buf[end:]
        return Packet(first >> 4, first & 0x0F, body)

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
            plen, i = read_varint(p.body, i)
            i += plen
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
