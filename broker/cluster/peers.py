"""The node-to-node transport: authenticated TCP links carrying framed payloads between nodes.

Two unidirectional connections per pair of nodes. A node SENDS only on the connection it
opened to a peer (its outgoing link) and RECEIVES only on the connections peers opened to it
(incoming links); after the handshake nothing travels the other way on either. So there is no
tie-breaking when two nodes dial each other at once, a slow reader of one direction never
holds up the other, and each side reconnects its own sending half on its own schedule.

Discovery. A node dials every seed, and every peer it learns of: a peer that connects to us is
dialled back at the address it advertises, and after a handshake the connector sends the
acceptor the members it knows (a ``KIND_MEMBERS`` frame, the transport's own; the callbacks
never see it), and every newly learned member is announced to every peer we can send to. So
a node that knows one seed reaches every node that seed reaches. ``members`` holds only peers
that authenticated to or from this node.

The handshake (HMAC-SHA256 over both nonces, ids and addresses with the shared secret, both
ways), the framing after it and what closes a connection are in ``broker.cluster.peerlink``.

Flow control: ``send`` queues the frame unless the link's unsent bytes (queued and in the
transport's buffer) plus the frame would exceed ``max_buffer``, in which case it drops the
frame and returns False (Raft resends what matters); a frame larger than ``max_buffer`` still
goes out when nothing is waiting. What one loop iteration queued for a peer leaves in one
``transport.writelines`` at the start of the next (one system call where there were one per
frame: a round's Raft frame and the forwarded publishes and their answers travel together;
measured with ``bench.cluster_bench --profile``, the leader spent a quarter of its time in
these writes). Everything runs on one event loop; no method is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import struct
from collections.abc import Callable

from broker.cluster.peerlink import (
    HEADER,
    KIND_MEMBERS,
    MAX_FRAME,
    Address,
    BadFrame,
    Dialer,
    Link,
    PeerStats,
    Refused,
    encode_member,
    hello,
    parse_member,
)

log = logging.getLogger("broker.cluster.peers")

HANDSHAKE_TIMEOUT = 2.0
#: One WARNING per remote address per this many seconds.
WARN_INTERVAL = 60.0

_COUNT = struct.Struct(">H")


class PeerTransport:
    """This node's links to its peers (see the module docstring). ``node_id``: this node's
    stable id (1 to 255 UTF-8 bytes); ``bind``: where to listen, also the address advertised to
    peers (port 0: an ephemeral port, ``address`` then tells which); ``seeds``: peers to dial
    first; ``secret``: the shared secret. ``on_message(peer, kind, payload)`` gets every frame
    (``payload`` valid only during the call); ``on_peer(peer, address)`` is called when a peer
    authenticates with an address not known before (its first time, or it moved).
    ``worker``: this transport's worker index and the node's worker count, which every peer
    must share (``broker.cluster.peerlink``)."""

    def __init__(
        self,
        node_id: str,
        bind: Address,
        seeds: list[Address],
        secret: bytes,
        *,
        on_message: Callable[[str, int, memoryview], None],
        on_peer: Callable[[str, Address], None] | None = None,
        max_buffer: int = 8 << 20,
        reconnect: tuple[float, float] = (0.05, 2.0),
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        worker: tuple[int, int] = (0, 1),
    ) -> None:
        if not 0 < len(node_id.encode()) < 256:
            raise ValueError(f"node_id {node_id!r}: 1 to 255 bytes of UTF-8")
        if not secret:
            raise ValueError("secret: empty (peers authenticate with it)")
        if not 0 < reconnect[0] <= reconnect[1]:
            raise ValueError(f"reconnect {reconnect}: expected 0 < first delay <= cap")
        if max_buffer <= 0 or handshake_timeout <= 0:
            raise ValueError("max_buffer and handshake_timeout must be positive")
        if not 0 <= worker[0] < worker[1] < 65536:
            raise ValueError(f"worker {worker}: expected (index, count), 0 <= index < count")
        self.node_id = node_id
        self.worker = worker
        self._node = node_id.encode()
        self.bind = bind
        self.address: Address = bind
        self.seeds = list(seeds)
        self._secret = secret
        self._on_message = on_message
        self._on_peer = on_peer
        self._max_buffer = max_buffer
        self._reconnect = reconnect
        self._handshake_timeout = handshake_timeout
        self.members: dict[str, Address] = {}
        self.stats = PeerStats()
        self._out: dict[str, Link] = {}
        #: Frames queued this iteration per link, and their bytes (module docstring).
        self._queued: dict[Link, list[bytes]] = {}
        self._queued_bytes: dict[Link, int] = {}
        self._links: set[Link] = set()
        self._dialers: dict[Address, Dialer] = {}
        self._nonces: dict[bytes, Dialer] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._warned: dict[str, float] = {}
        self._server: asyncio.Server | None = None
        self._closing = False
        self._loop: asyncio.AbstractEventLoop  # set by start()
        #: Called with a peer's id when an authenticated link to or from it closes (the
        #: gossip membership probes it at once: ``Swim.probe_soon``).
        self.on_link_lost: Callable[[str], None] = lambda node: None

    async def start(self) -> None:
        """Listen on ``bind`` and dial every seed and every member learned (so far, and
        later)."""
        self._loop = asyncio.get_running_loop()
        host, port = self.bind
        self._server = await self._loop.create_server(lambda: Link(self, None), host or None, port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = (host, port)
        for seed in self.seeds:
            if seed != self.address:
                self._dial(seed, seed=True, node=None)
        for node, address in self.members.items():  # learned before we listened
            self._dial(address, seed=False, node=node)

    async def close(self) -> None:
        """Close the listener and every link and stop dialling; idempotent. When it returns
        no task of this transport is left and every connection is closed."""
        if self._closing:
            return
        self._closing = True
        dialers = list(self._dialers.values())
        for d in dialers:
            d.retire()
        if self._server is not None:
            self._server.close()
        await asyncio.gather(*(d.task for d in dialers if d.task), return_exceptions=True)
        while self._links:
            links = list(self._links)
            for link in links:
                link.close()
            await asyncio.gather(*(link.closed for link in links))
        if self._server is not None:
            await self._server.wait_closed()
        self._out.clear()
        self._queued.clear()
        self._queued_bytes.clear()
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.cancel()

    def send(self, node: str, kind: int, payload: bytes | memoryview) -> bool:
        """Queue one frame to ``node``; False (counted) if no link to it is up or its unsent
        bytes would exceed ``max_buffer``. ``kind``: 1 to 255 (0 is the transport's own)."""
        n = len(payload)
        if not 0 < kind < 256 or n > MAX_FRAME:
            raise ValueError(f"send: kind {kind} (1 to 255), {n} bytes (at most {MAX_FRAME})")
        link = self._out.get(node)
        if link is None or not link._open:
            self.stats.dropped_unconnected += 1
            return False
        transport = link.transport
        assert transport is not None  # an authenticated link is connected
        waiting = transport.get_write_buffer_size() + self._queued_bytes.get(link, 0)
        if waiting and waiting + n > self._max_buffer:
            self.stats.dropped_full += 1
            return False
        queued = self._queued.get(link)
        if queued is None:
            if not self._queued:
                self._loop.call_soon(self._write_queued)
            queued = self._queued[link] = []
        if isinstance(payload, memoryview):
            payload = bytes(payload)  # the caller's buffer may change before the write
        queued += (HEADER.pack(n, kind), payload)
        self._queued_bytes[link] = self._queued_bytes.get(link, 0) + 5 + n
        self.stats.frames_sent += 1
        self.stats.bytes_sent += 5 + n
        return True

    def _write_queued(self) -> None:
        """Write what the last iteration queued, one ``writelines`` per link; a link that
        closed meanwhile loses its frames, as if it had closed just after the write."""
        queued, self._queued = self._queued, {}
        self._queued_bytes.clear()
        for link, parts in queued.items():
            transport = link.transport
            if link._open and transport is not None and not transport.is_closing():
                transport.writelines(parts)

    def learn(self, node: str, address: Address) -> None:
        """``node``'s address as learned elsewhere (gossip metadata, the persisted member
        list, worker 0's view): dial it there, unless linked to it at that address already.
        Before :meth:`start` the address is only noted and dialled once listening (a worker
        restarting beside a running worker 0 hears its view before its transport starts:
        ``broker.cluster.worker_view``)."""
        if node != self.node_id and not self._closing:
            self._learn(node, address)

    @property
    def closed(self) -> bool:
        """:meth:`close` was called: nothing is sent or received any more."""
        return self._closing

    def connected(self, node: str) -> bool:
        """True if an authenticated outgoing link to ``node`` is up (``send`` can write)."""
        return node in self._out

    async def wait_connected(self, node: str) -> None:
        """Return once an outgoing link to ``node`` is up (at once if one is)."""
        if node not in self._out:
            waiter = self._loop.create_future()
            self._waiters.setdefault(node, []).append(waiter)
            await waiter

    # -- the links' callbacks

    def _hello(self, nonce: bytes) -> bytes:
        return hello(nonce, self._node, self.address, self.worker)

    def _authenticated(self, link: Link) -> None:
        node, dialer = link.node, link.dialer
        if dialer is not None:
            current = self._out.get(node)
            if current is not None and current is not link:  # another name for a linked node
                dialer.retire()
                return
            self._out[node] = link
            dialer.node = node
            self.stats.connects += 1
            for waiter in self._waiters.pop(node, ()):
                if not waiter.done():
                    waiter.set_result(None)
            known = [encode_member(self._node, self.address)]
            known += [encode_member(n.encode(), a) for n, a in self.members.items() if n != node]
            self._write_members(link, known)
        self._learn(node, link.advertised)

    def _learn(self, node: str, address: Address) -> None:
        if self.members.get(node) != address:
            self.members[node] = address
            announce = [encode_member(node.encode(), address)]
            for n, link in self._out.items():
                if n != node:
                    self._write_members(link, announce)
            if self._on_peer is not None:
                try:
                    self._on_peer(node, address)
                except Exception:
                    log.exception("on_peer(%r, %r) failed", node, address)
        if node not in self._out:
            self._dial(address, seed=False, node=node)

    def _announced(self, payload: memoryview) -> None:
        """A KIND_MEMBERS frame: dial every member not known at that address."""
        if len(payload) < _COUNT.size:
            raise BadFrame("a member announcement without its count")
        (count,) = _COUNT.unpack_from(payload)
        o = _COUNT.size
        for _ in range(count):
            try:
                member = parse_member(payload, o)
            except Refused as e:
                raise BadFrame(f"a member announcement with {e}") from None
            if member is None:
                raise BadFrame("a truncated member announcement")
            node, address, o = member
            if node != self.node_id and self.members.get(node) != address:
                self._dial(address, seed=False, node=node)
        if o != len(payload):
            raise BadFrame("bytes after a member announcement")

    def _write_members(self, link: Link, members: list[bytes]) -> None:
        payload = _COUNT.pack(len(members)) + b"".join(members)
        if link.transport is not None and not link.transport.is_closing():
            link.transport.write(HEADER.pack(len(payload), KIND_MEMBERS) + payload)

    def _link_lost(self, node: str) -> None:
        try:
            self.on_link_lost(node)
        except Exception:
            log.exception("on_link_lost(%r) failed", node)

    def _refuse(self, link: Link, reason: str) -> None:
        self.stats.auth_failures += 1
        side = "to" if link.dialer else "from"
        self._warn(link.remote, f"peer connection {side} {link.remote} refused: {reason}")
        link.close()

    def _incompatible(self, link: Link, reason: str) -> None:
        """An authenticated peer runs another worker count (or is another worker): an error
        in the configuration of one of the two nodes, logged as such (once a minute)."""
        self.stats.incompatible += 1
        self._warn(
            link.remote, f"peer connection with {link.remote} refused: {reason}", logging.ERROR
        )
        link.close()

    def _warn(self, key: str, message: str, level: int = logging.WARNING) -> None:
        now = self._loop.time()
        if now - self._warned.get(key, -WARN_INTERVAL) >= WARN_INTERVAL:
            if len(self._warned) > 1024:
                self._warned.clear()
            self._warned[key] = now
            log.log(level, "%s", message)

    # -- dialling

    def _dial(self, address: Address, *, seed: bool, node: str | None) -> None:
        if self._closing or self._server is None or address == self.address:
            return  # closed, not listening yet (start dials what was learned), or ourselves
        existing = self._dialers.get(address)
        if existing is not None and not existing.retired:
            return
        d = self._dialers[address] = Dialer(address, seed, node)
        d.task = self._loop.create_task(self._keep_dialling(d), name=f"peer dial {address}")

    async def _keep_dialling(self, d: Dialer) -> None:
        first, cap = self._reconnect
        delay = first
        try:
            while not d.retired and not self._closing:
                moved = self.members.get(d.node or "", d.address)
                if not d.seed and moved != d.address:  # the node now advertises another
                    d.retired = True
                    self._dialers.pop(d.address, None)
                    self._dial(moved, seed=False, node=d.node)
                    break
                link = d.link = Link(self, d)
                with contextlib.suppress(OSError, TimeoutError):
                    await asyncio.wait_for(
                        self._loop.create_connection(lambda: link, *d.address),  # noqa: B023 (awaited here)
                        self._handshake_timeout,
                    )
                    await link.closed
                    if link.ready:
                        delay = first
                d.link = None
                if d.retired or self._closing:
                    break
                await asyncio.sleep(random.uniform(delay / 2, delay))
                delay = min(delay * 2, cap)
        finally:
            d.retired = True
            if self._dialers.get(d.address) is d:
                del self._dialers[d.address]
