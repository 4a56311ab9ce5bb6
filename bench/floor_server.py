"""The floor: the least a Python + uvloop server must do per message in the bench's scenarios.

Not a broker. It answers CONNECT and SUBSCRIBE, takes PUBLISHes at QoS 0 and 1 (3.1.1, no
validation beyond framing), appends the raw packets of one event-loop iteration to a file
with one ``os.write``, then sends the PUBACKs (after the append, as mqlog acknowledges only
what is in the log) and one write of the iteration's deliveries to the last subscriber, at the
publish's QoS with its own packet ids. No sessions, topic matching, routing, partitions, ACLs
or index: everything mqlog adds to that is what mqlog costs above this floor.

Measured on the fleet scenario (5,000 devices x 1 QoS 1 message/s): this server used 18-24%
of a core against Mosquitto's 18-20% in the same runs, mqlog 63-65% with one worker and
87-105% with two. So Python and uvloop are not what keeps mqlog from 2x Mosquitto's CPU
there; mqlog's per-iteration path is (see README, Performance).

Run: ``python -m bench.floor_server PORT LOGFILE`` (the bench starts it: ``--brokers floor``).
"""

from __future__ import annotations

import asyncio
import os
import sys

import uvloop

from bench.loadgen import varint

CONNACK = b"\x20\x02\x00\x00"
PINGRESP = b"\xd0\x00"
PUBLISH, CONNECT, SUBSCRIBE, PINGREQ, DISCONNECT = 3, 1, 8, 12, 14


class Floor:
    """The server's state: the subscriber and what one iteration gathered."""

    def __init__(self, log_fd: int) -> None:
        self.log_fd = log_fd
        self.subscriber: FloorProtocol | None = None
        self.records: list[bytes] = []
        self.acks: list[tuple[asyncio.Transport, bytes]] = []
        self.deliveries: list[bytes] = []
        self.next_id = 1
        self.scheduled = False

    def flush(self) -> None:
        """End of the iteration: append, acknowledge, deliver."""
        self.scheduled = False
        if self.records:
            os.write(self.log_fd, b"".join(self.records))
            self.records.clear()
        for transport, acks in self.acks:
            transport.write(acks)
        self.acks.clear()
        if self.deliveries and self.subscriber is not None:
            self.subscriber.transport.write(b"".join(self.deliveries))
        self.deliveries.clear()

    def deliver(self, head: int, topic: bytes, payload: bytes) -> None:
        """Queue a PUBLISH of ``topic`` for the subscriber (QoS from ``head``'s flags)."""
        body = len(topic).to_bytes(2, "big") + topic
        if head & 0x06:
            pid = self.next_id
            self.next_id = pid % 65535 + 1
            body += pid.to_bytes(2, "big")
        body += payload
        self.deliveries.append(bytes((head & 0x36,)) + varint(len(body)) + body)


class FloorProtocol(asyncio.Protocol):
    """One connection: frames every complete packet of a read in one pass."""

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.rest = b""
        self.transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        floor = self.floor
        if self.rest:
            data = self.rest + data
        self.rest = b""
        n = len(data)
        i = 0
        acks = []
        while i < n:
            # Remaining length: a variable byte integer after the first byte.
            length, shift, j = 0, 0, i + 1
            while j < n and data[j] & 0x80:
                length |= (data[j] & 0x7F) << shift
                shift += 7
                j += 1
            if j >= n:
                break
            length |= data[j] << shift
            j += 1
            end = j + length
            if end > n:
                break
            kind = data[i] >> 4
            if kind == PUBLISH:
                tl = (data[j] << 8) | data[j + 1]
                topic = data[j + 2 : j + 2 + tl]
                at = j + 2 + tl
                if data[i] & 0x06:
                    acks.append(b"\x40\x02" + data[at : at + 2])
                    at += 2
                floor.records.append(data[i:end])
                floor.deliver(data[i], topic, data[at:end])
            elif kind == CONNECT:
                self.transport.write(CONNACK)
            elif kind == SUBSCRIBE:
                floor.subscriber = self
                self.transport.write(b"\x90\x03" + data[j : j + 2] + bytes((data[end - 1],)))
            elif kind == PINGREQ:
                self.transport.write(PINGRESP)
            elif kind == DISCONNECT:
                self.transport.close()
                return
            i = end  # PUBACKs of the subscriber need nothing
        self.rest = data[i:]
        if acks:
            floor.acks.append((self.transport, b"".join(acks)))
        if not floor.scheduled:
            floor.scheduled = True
            asyncio.get_running_loop().call_soon(floor.flush)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.floor.subscriber is self:
            self.floor.subscriber = None


async def serve(port: int, log_path: str) -> None:
    floor = Floor(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FloorProtocol(floor), "127.0.0.1", port, backlog=4096)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), sys.argv[2]))
