"""The local channel between the worker processes of one broker.

Every pair of workers shares one Unix stream socket in the Linux abstract namespace (no file
to clean up, no path length limit), named after the data directory, which the supervisor has
locked: two brokers never share a mesh. The higher worker id dials the lower one and says
who it is; when a peer dies, the dialer dials again until the supervisor's replacement
listens, so a restarted worker rejoins without anyone passing descriptors around.

Frames: ``<u32 length><u8 kind><u64 request id>`` and a body; ``length`` counts kind, id and
body. Request id 0 is a notification; a request's reply carries its id with :data:`REPLY`.
Frames sent to one peer during an event-loop iteration leave in one ``write`` at its end
(microbatching: one system call for everything an iteration sent a peer), in the order they
were sent.

The mesh knows nothing about what the frames mean: the worker registers one handler per
kind. Called only from the worker's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.commitlog.keys import PartitionKey

log = logging.getLogger("broker.workers.mesh")

HEADER = struct.Struct("<IBQ")
#: The reply to a request (its id names the request).
REPLY = 0
#: The first frame on a dialed connection: the dialer's worker id (``<I>``).
HELLO = 1
#: Kinds below this are the mesh's own; the worker's handlers take the rest.
FIRST_USER_KIND = 8
#: Largest frame body accepted from a peer (a forwarded batch is far below this): a bigger
#: length means a corrupt stream, and the connection is dropped rather than buffered.
MAX_FRAME = 256 << 20
#: Seconds between dial attempts while a peer is down (a restart takes about a second).
REDIAL_SECONDS = 0.05

Handler = Callable[[int, int, memoryview], None]
"""``handler(peer, request_id, body)``: ``body`` is only valid during the call."""


class PeerDown(Exception):
    """The peer's process is gone (or not up yet); what was asked of it was not done."""


def socket_name(data_dir: Path, worker: int) -> bytes:
    """The abstract socket a worker listens on: one namespace per locked data directory."""
    digest = hashlib.sha1(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]
    return f"\0mqlog-{digest}-{worker}".encode()


class _PeerProtocol(asyncio.Protocol):
    """One connection to one peer: frame decoding in, coalesced frames out."""

    def __init__(self, mesh: Mesh, peer: int | None) -> None:
        self.mesh = mesh
        self.peer = peer  # None until an accepted connection said HELLO
        self.transport: Any = None  # uvloop's transports are not asyncio.Transport
        self._buf = bytearray()
        self._out: list[bytes | bytearray | memoryview] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        size = len(buf)
        while size - pos >= HEADER.size:
            length, kind, request = HEADER.unpack_from(buf, pos)
            if length > MAX_FRAME or length < HEADER.size - 4:
                log.error(
                    "peer %s sent a frame of %d bytes; dropping the connection", self.peer, length
                )
                self.close()
                return
            end = pos + 4 + length
            if end > size:
                break
            with memoryview(buf)[pos + HEADER.size : end] as body:
                if kind == HELLO:
                    self.peer = struct.unpack_from("<I", body)[0]
                    self.mesh._attach(self)
                elif self.peer is not None:
                    self.mesh._dispatch(self.peer, kind, request, body)
            pos = end
        del buf[:pos]

    def queue(self, kind: int, request: int, body: bytes | bytearray | memoryview) -> None:
        if not self._out:
            self.mesh._want_flush(self)
        self._out.append(HEADER.pack(HEADER.size - 4 + len(body), kind, request))
        if body:
            self._out.append(body)

    def flush(self) -> None:
        out, self._out = self._out, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.mesh._detach(self)


class Mesh:
    """This worker's channels to its peers: ``send`` notifications, ``call`` requests.

    ``on_peer_up(peer)`` / ``on_peer_down(peer)`` tell the worker when a peer joins or
    leaves (a restarted peer is "up" again once its channel is open).
    """

    def __init__(
        self,
        data_dir: Path,
        worker: int,
        count: int,
        handlers: dict[int, Handler],
        *,
        on_peer_up: Callable[[int], None] | None = None,
        on_peer_down: Callable[[int], None] | None = None,
    ) -> None:
        if any(kind < FIRST_USER_KIND for kind in handlers):
            raise ValueError(f"frame kinds below {FIRST_USER_KIND} are the mesh's own")
        self.data_dir = Path(data_dir)
        self.worker = worker
        self.count = count
        self.handlers = handlers
        self.on_peer_up = on_peer_up
        self.on_peer_down = on_peer_down
        self.peers: dict[int, _PeerProtocol] = {}
        self._server: asyncio.AbstractServer | None = None
        self._dialers: list[asyncio.Task[None]] = []
        #: Set when the channel to a (lower) peer this worker dials is lost.
        self._lost: dict[int, asyncio.Event] = {}
        #: Requests sent and not answered: the peer asked and who waits (a future of
        #: :meth:`call`, or the callback of :meth:`request`).
        self._pending: dict[
            int, tuple[int, asyncio.Future[bytes] | Callable[[bytes | None], None]]
        ] = {}
        self._next_request = 1
        self._flush_due: list[_PeerProtocol] = []
        #: Called at this iteration's flush, before the frames are written (before_flush).
        self._builders: list[Callable[[], None]] = []
        self._flush_scheduled = False
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Schedules the frames' write at the end of the iteration (the server's
        #: broker.net.iteration.IterationEnd); None: the loop's call_soon.
        self.schedule: Callable[[Callable[[], None]], None] | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Listen for higher workers; keep dialing the lower ones in the background."""
        loop = self._loop = asyncio.get_running_loop()
        if self.worker < self.count - 1:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(socket_name(self.data_dir, self.worker))
            except OSError:
                sock.close()
                raise
            self._server = await loop.create_unix_server(
                lambda: _PeerProtocol(self, None), sock=sock
            )
        for peer in range(self.worker):
            self._dialers.append(loop.create_task(self._dial(peer)))

    async def wait_connected(self, timeout: float) -> None:
        """Until every peer is up (startup: a worker serves once it can reach the others)."""
        async with asyncio.timeout(timeout):
            while len(self.peers) < self.count - 1:
                await asyncio.sleep(REDIAL_SECONDS)

    async def _dial(self, peer: int) -> None:
        """Keep a channel to lower worker ``peer`` open for as long as the mesh runs."""
        loop = asyncio.get_running_loop()
        name = socket_name(self.data_dir, peer)
        lost = self._lost[peer] = asyncio.Event()
        while not self._closing:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, name)
            except OSError:
                sock.close()
                await asyncio.sleep(REDIAL_SECONDS)
                continue
            lost.clear()
            _, proto = await loop.create_unix_connection(
                lambda: _PeerProtocol(self, peer), sock=sock
            )
            proto.queue(HELLO, 0, struct.pack("<I", self.worker))
            self._attach(proto)
            await lost.wait()

    async def close(self) -> None:
        self._closing = True
        for task in self._dialers:
            task.cancel()
        for task in self._dialers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._flush()
        for proto in list(self.peers.values()):
            proto.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._fail_pending(None)

    @property
    def pending_requests(self) -> int:
        """Requests sent and not answered yet (or gathered, to be sent at this iteration's
        flush)."""
        return len(self._pending) + len(self._builders)

    # ------------------------------------------------------------ sending

    def send(self, peer: int, kind: int, body: bytes | bytearray | memoryview = b"") -> None:
        """Notify ``peer``; raises :class:`PeerDown` if its channel is not open."""
        self._peer(peer).queue(kind, 0, body)

    def broadcast(self, kind: int, body: bytes | bytearray | memoryview = b"") -> None:
        """Notify every peer that is up (one that is down learns the state when it is back)."""
        for proto in self.peers.values():
            proto.queue(kind, 0, body)

    def call(
        self, peer: int, kind: int, body: bytes | bytearray | memoryview = b""
    ) -> asyncio.Future[bytes]:
        """Ask ``peer``; the future has the reply's body, or :class:`PeerDown` if the peer
        goes away first."""
        proto = self._peer(peer)
        assert self._loop is not None, "the mesh is not started"
        request = self._next_request
        self._next_request += 1
        future: asyncio.Future[bytes] = self._loop.create_future()
        self._pending[request] = (peer, future)
        proto.queue(kind, request, body)
        return future

    def request(
        self,
        peer: int,
        kind: int,
        body: bytes | bytearray | memoryview,
        on_reply: Callable[[bytes | None], None],
    ) -> None:
        """Ask ``peer``; ``on_reply`` is called with the reply's body, or with None if the
        peer goes away first. Raises :class:`PeerDown` if its channel is not open now.

        The per-message path's form of :meth:`call`: the reply runs the callback as it is
        read, without a future and the loop callback that resolving one schedules."""
        proto = self._peer(peer)
        request = self._next_request
        self._next_request += 1
        self._pending[request] = (peer, on_reply)
        proto.queue(kind, request, body)

    def reply(self, peer: int, request: int, body: bytes | bytearray | memoryview = b"") -> None:
        """Answer request ``request`` of ``peer`` (dropped if the peer has gone since)."""
        proto = self.peers.get(peer)
        if proto is not None:
            proto.queue(REPLY, request, body)

    def _peer(self, peer: int) -> _PeerProtocol:
        proto = self.peers.get(peer)
        if proto is None:
            raise PeerDown(f"worker {peer} is not reachable")
        return proto

    def before_flush(self, build: Callable[[], None]) -> None:
        """Call ``build`` once at the end of this iteration, before its frames are written:
        a service that sends one frame per iteration for many events gathers them until
        then, and ``build`` queues that frame (one FORWARD for every batch of the iteration,
        broker.workers.partitions)."""
        self._builders.append(build)
        self._schedule_flush()

    def _want_flush(self, proto: _PeerProtocol) -> None:
        self._flush_due.append(proto)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            if self.schedule is not None:
                self.schedule(self._flush)
            else:
                self._loop.call_soon(self._flush)

    def flush_now(self) -> None:
        """Write this iteration's frames now, not at their turn at the end of the iteration:
        what the caller writes next (a client's acknowledgement) then follows them."""
        if self._flush_scheduled:
            self._flush()

    def _flush(self) -> None:
        builders, self._builders = self._builders, []
        for build in builders:  # their frames leave in this same flush
            try:
                build()
            except Exception:
                log.exception("worker %d: bug building a frame", self.worker)
        self._flush_scheduled = False
        due, self._flush_due = self._flush_due, []
        for proto in due:
            proto.flush()

    # ------------------------------------------------------------ receiving

    def _attach(self, proto: _PeerProtocol) -> None:
        assert proto.peer is not None
        old = self.peers.get(proto.peer)
        if old is not None and old is not proto:
            # A replacement of that worker (the old one died, its end not read yet: a paused
            # worker reads both in one pass). Its death is handled first, as if read before:
            # what it held is taken back and its requests fail, before the new one counts.
            old.close()
            self._detach(old)
        self.peers[proto.peer] = proto
        log.debug("worker %d: peer %d up", self.worker, proto.peer)
        if self.on_peer_up is not None:
            self.on_peer_up(proto.peer)

    def _detach(self, proto: _PeerProtocol) -> None:
        peer = proto.peer
        if peer is None or self.peers.get(peer) is not proto:
            return
        del self.peers[peer]
        if peer in self._lost:
            self._lost[peer].set()
        self._fail_pending(peer)
        log.debug("worker %d: peer %d down", self.worker, peer)
        if self.on_peer_down is not None and not self._closing:
            self.on_peer_down(peer)

    def _fail_pending(self, peer: int | None) -> None:
        """Fail the requests waiting on ``peer`` (None: on every peer)."""
        for request, (to, waiter) in list(self._pending.items()):
            if peer is None or to == peer:
                del self._pending[request]
                if not isinstance(waiter, asyncio.Future):
                    self._answer(waiter, None)
                elif not waiter.done():
                    waiter.set_exception(PeerDown(f"worker {to} went away"))

    def _answer(self, on_reply: Callable[[bytes | None], None], body: bytes | None) -> None:
        try:
            on_reply(body)
        except Exception:
            log.exception("worker %d: bug handling a reply", self.worker)

    def _dispatch(self, peer: int, kind: int, request: int, body: memoryview) -> None:
        if kind == REPLY:
            entry = self._pending.pop(request, None)
            if entry is None:
                return
            waiter = entry[1]
            if not isinstance(waiter, asyncio.Future):
                self._answer(waiter, bytes(body))
            elif not waiter.done():
                waiter.set_result(bytes(body))
            return
        handler = self.handlers.get(kind)
        if handler is None:
            log.error("worker %d: frame of unknown kind %d from peer %d", self.worker, kind, peer)
            return
        try:
            handler(peer, request, body)
        except Exception:
            log.exception(
                "worker %d: bug handling frame kind %d from peer %d", self.worker, kind, peer
            )


def owner_of(key: PartitionKey, count: int) -> int:
    """The worker that owns partition ``key`` of a broker with ``count`` workers.

    A stream's partitions go round robin from a worker picked by the stream's name, so each
    worker owns a share of every multi-partition stream and the internal one-partition
    streams do not all land on worker 0. Stable for a given ``count`` (restarts keep it).
    """
    stream, partition = key
    return (zlib.crc32(stream.encode()) + partition) % count
