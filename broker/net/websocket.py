"""MQTT over WebSocket ([server] ws_port, path ``/mqtt``, subprotocol ``mqtt``), via aiohttp.

Each binary frame's bytes go into the same :class:`~broker.net.transport.MQTTProtocol` a TCP
connection uses; an MQTT packet may span frames and a frame may hold several packets
[MQTT-6.0.0-2]. A text frame is a protocol violation [MQTT-6.0.0-1] and closes the
connection. Browser clients (MQTT.js) and paho's ``websockets`` transport connect here.

Output: the protocol's coalesced writes are queued and sent by one writer task per
connection; past the high-water mark the protocol is paused exactly as a socket would pause
it, so a slow browser costs the router nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

from aiohttp import WSMsgType, web

from broker.net.carrier import Carrier
from broker.net.transport import MQTTProtocol

if TYPE_CHECKING:
    from broker.net.context import EdgeContext

log = logging.getLogger("broker.websocket")

#: Subprotocol a client must offer and the server selects [MQTT-6.0.0-3], [MQTT-6.0.0-4].
SUBPROTOCOL = "mqtt"
PATHS = ("/mqtt", "/")
#: How long a shutdown waits for WebSocket clients to finish the closing handshake.
SHUTDOWN_SECONDS = 5.0


class WebSocketCarrier(Carrier):
    """Transport for one MQTTProtocol over one WebSocket."""

    def __init__(
        self, ws: web.WebSocketResponse, request: web.Request, protocol: MQTTProtocol
    ) -> None:
        super().__init__(request.transport)
        self.ws = ws
        self.request = request
        self.protocol = protocol
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self._paused = False
        self._wakeup = asyncio.Event()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        self._queue.append(bytes(data))
        self._queued += len(data)
        self._wakeup.set()
        if self._queued > self._high_water and not self._paused:
            self._paused = True
            self.protocol.pause_writing()

    async def run_writer(self) -> None:
        """Send queued output; close the WebSocket once closing and drained."""
        ws = self.ws
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while self._queue:
                    data = self._queue.popleft()
                    self._queued -= len(data)
                    await ws.send_bytes(data)
                    if self._paused and self._queued <= self._high_water // 4:
                        self._paused = False
                        self.protocol.resume_writing()
                if self._closing:
                    await ws.close()
                    return
        except (ConnectionError, RuntimeError) as e:  # peer gone while we were sending
            log.debug("websocket %s: %s", self.protocol.peer, e)
            self._closing = True

    def close(self) -> None:
        self._closing = True
        self._wakeup.set()

    def abort(self) -> None:
        self._closing = True
        self._queue.clear()
        transport = self.request.transport
        if transport is not None:
            transport.abort()


class WebSocketListener:
    """The aiohttp site for MQTT over WebSocket; started and stopped by the server."""

    def __init__(
        self, edge: EdgeContext[MQTTProtocol], host: str, port: int, *, reuse_port: bool = False
    ) -> None:
        self.edge = edge
        self.host = host
        self.port = port
        self.reuse_port = reuse_port  # one worker of several: they share the port
        self.app = web.Application()
        self.app.add_routes([web.get(path, self.handle) for path in PATHS])
        self._runner: web.AppRunner | None = None
        self._sockets: set[web.WebSocketResponse] = set()

    async def start(self) -> str:
        self._runner = web.AppRunner(
            self.app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_SECONDS
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.host, self.port, backlog=4096, reuse_port=self.reuse_port or None
        )
        await site.start()
        host, port = self.host, self.port
        if self._runner.addresses:
            host, port = self._runner.addresses[0][:2]
        return f"ws://{host}:{port}/mqtt"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        max_size = self.edge.config.router.max_packet_size + 5  # plus the fixed header
        ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,), max_msg_size=max_size)
        ready = ws.can_prepare(request)
        if not ready.ok:
            return web.Response(status=400, text="MQTT over WebSocket: upgrade required\n")
        if ready.protocol != SUBPROTOCOL:
            log.info(
                "websocket %s: no 'mqtt' subprotocol offered; serving MQTT anyway", request.remote
            )
        await ws.prepare(request)
        protocol = MQTTProtocol(self.edge)
        carrier = WebSocketCarrier(ws, request, protocol)
        protocol.connection_made(carrier)
        writer = asyncio.get_running_loop().create_task(carrier.run_writer())
        error: BaseException | None = None
        try:
            async for msg in ws:
                if msg.type is WSMsgType.BINARY:
                    if msg.data:  # an empty frame carries no MQTT bytes
                        protocol.data_received(msg.data)
                elif msg.type is WSMsgType.TEXT:
                    log.info(
                        "websocket %s: text frame; MQTT uses binary frames [MQTT-6.0.0-1]; closing",
                        protocol.peer,
                    )
                    break
                elif msg.type is WSMsgType.ERROR:
                    error = ws.exception()
                    break
        finally:
            carrier._closing = True
            protocol.connection_lost(error if isinstance(error, Exception) else None)
            carrier._wakeup.set()
            try:
                await asyncio.wait_for(writer, 5)
            except (TimeoutError, asyncio.CancelledError):
                writer.cancel()
            if not ws.closed:
                await ws.close()
        return ws
