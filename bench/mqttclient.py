"""A minimal asyncio MQTT 3.1.1 client for the lab's workloads (bench/chaos.py,
bench/cluster_bench.py): QoS 1 publishes whose futures resolve at their PUBACK, QoS 1
subscriptions acknowledged at once. Packets are built with bench/loadgen.py's helpers and
parsed here, independently of the broker's codec."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Callable
from typing import Any

from bench.loadgen import DISCONNECT, connect_packet, subscribe_packet, varint


class MqttClient(asyncio.Protocol):
    """MQTT 3.1.1 client for the chaos workload and the cluster benchmark: QoS 1 publishes
    whose futures resolve to the monotonic time of their PUBACK, and QoS 1 deliveries passed
    to ``on_message(topic, payload)`` and acknowledged at once. A lost connection fails every
    pending future with ConnectionError. Runs on the loop that created it."""

    def __init__(self, on_message: Callable[[str, bytes], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.on_message = on_message
        self.connack: asyncio.Future[int] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.pending: dict[int, asyncio.Future[float]] = {}
        self.subacks: dict[int, asyncio.Future[int]] = {}
        self.next_pid = 0
        self.hello = b""
        #: The CONNACK's session present flag (s3.2.2.2), once it came.
        self.session_present: bool | None = None

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        client_id: str,
        *,
        clean: bool = True,
        timeout: float = 2.0,
        on_message: Callable[[str, bytes], None] | None = None,
        will: tuple[str, bytes] | None = None,
    ) -> MqttClient:
        """Connected up to a successful CONNACK, or ConnectionError/OSError/TimeoutError;
        ``will``: the connection's will (topic, message), QoS 1."""
        loop = asyncio.get_running_loop()
        client = cls(on_message)
        client.hello = connect_packet(client_id, clean, keepalive=0, username="chaos", will=will)
        try:
            await asyncio.wait_for(loop.create_connection(lambda: client, host, port), timeout)
            code = await asyncio.wait_for(asyncio.shield(client.connack), timeout)
        except BaseException:
            client.close()
            raise
        if code != 0:
            client.close()
            raise ConnectionError(f"CONNACK return code {code}")
        return client

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.hello)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        err = ConnectionError(f"connection lost: {exc}")
        futs: list[asyncio.Future[Any]] = [self.connack, *self.pending.values()]
        for fut in [*futs, *self.subacks.values()]:
            if not fut.done():
                fut.set_exception(err)
                fut.exception()  # mark retrieved: a dropped publish is not an error here
        self.pending.clear()
        self.subacks.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while True:
            i, rl, mult = pos + 1, 0, 1
            while i < len(buf) and buf[i] & 0x80:
                rl += (buf[i] & 0x7F) * mult
                mult <<= 7
                i += 1
            if i >= len(buf):
                break
            rl += buf[i] * mult
            i += 1
            if i + rl > len(buf):
                break
            self._packet(buf[pos] >> 4, buf[pos] & 0x0F, bytes(buf[i : i + rl]))
            pos = i + rl
        del buf[:pos]

    def _packet(self, kind: int, flags: int, body: bytes) -> None:
        if kind == 2:  # CONNACK
            if not self.connack.done():
                self.session_present = bool(body[0] & 1)
                self.connack.set_result(body[1])
        elif kind == 4:  # PUBACK
            fut = self.pending.pop(struct.unpack_from(">H", body)[0], None)
            if fut is not None and not fut.done():
                fut.set_result(time.monotonic())
        elif kind == 9:  # SUBACK
            sub = self.subacks.pop(struct.unpack_from(">H", body)[0], None)
            if sub is not None and not sub.done():
                sub.set_result(body[2])
        elif kind == 3:  # PUBLISH
            tl = struct.unpack_from(">H", body)[0]
            topic = body[2 : 2 + tl].decode()
            j = 2 + tl
            if (flags >> 1) & 3:
                assert self.transport is not None
                self.transport.write(b"\x40\x02" + body[j : j + 2])
                j += 2
            if self.on_message is not None:
                self.on_message(topic, body[j:])

    # -- requests
    def _pid(self) -> int:
        for _ in range(65535):
            self.next_pid = self.next_pid % 65535 + 1
            if self.next_pid not in self.pending and self.next_pid not in self.subacks:
                return self.next_pid
        raise RuntimeError("65535 packet ids in flight")

    def publish(
        self, topic: str, payload: bytes, *, dup: bool = False, retain: bool = False
    ) -> asyncio.Future[float]:
        """Send one QoS 1 PUBLISH; the future resolves to the PUBACK's monotonic time."""
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        if self.transport is None or self.transport.is_closing() or self.closed.done():
            fut.set_exception(ConnectionError("not connected"))
            return fut
        pid = self._pid()
        t = topic.encode()
        body = struct.pack(">H", len(t)) + t + struct.pack(">H", pid) + payload
        self.pending[pid] = fut
        first = 0x32 | (0x08 if dup else 0) | (0x01 if retain else 0)
        self.transport.write(bytes([first]) + varint(len(body)) + body)
        return fut

    async def subscribe(self, topic_filter: str, timeout: float = 10.0) -> int:
        """SUBSCRIBE at QoS 1; the granted QoS (0x80: refused)."""
        assert self.transport is not None
        pid = self._pid()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.subacks[pid] = fut
        self.transport.write(subscribe_packet(topic_filter, 1, pid))
        return await asyncio.wait_for(fut, timeout)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            with contextlib.suppress(Exception):
                self.transport.write(DISCONNECT)
            self.transport.close()

    @property
    def is_closed(self) -> bool:
        return self.transport is None or self.transport.is_closing() or self.closed.done()
