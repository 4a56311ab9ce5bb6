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

Handshake (version 1), both sides proving that they hold the shared secret::

    connector -> acceptor   HELLO  = "MQLR" | version u8 | nonce[16] | id_len u8 | node id
                                     | host_len u8 | host | port u16   (the advertised address)
    acceptor -> connector   REPLY  = the same fields for the acceptor | proof_a[32]
    connector -> acceptor   proof_c[32]

``proof_a = HMAC-SHA256(secret, b"acceptor" + HELLO + REPLY without its proof)`` and
``proof_c`` likewise with ``b"connector"``: the MAC covers both nonces and both ids (so a
recorded handshake cannot be replayed) and both advertised addresses (so none can be altered on
the way), and the role label keeps a peer from answering a proof with the proof it was sent.
Proofs are compared with ``hmac.compare_digest``. A wrong magic, version or proof, a peer
claiming our node id, a connection closed during the handshake, or one not finished within
``handshake_timeout`` (2 s): that connection is closed and counted in ``auth_failures``, with
one WARNING per remote address per minute; nothing else is affected. A node that dials itself
(a seed naming its own address under another name) recognises its own nonce and stops dialling
that address. Authentication only: after the handshake frames are neither signed nor
encrypted (a network that can inject into a TCP stream needs TLS or a VPN).

Framing after the handshake: ``length u32 | kind u8 | payload`` (``length`` counts the payload
alone), ``length <= MAX_FRAME`` (64 MiB). A longer one, or data arriving on an outgoing link,
closes that connection (``bad_frames``). Payloads are handed to ``on_message`` as memoryviews
of the connection's receive buffer (read into it with ``BufferedProtocol``, no copy), VALID
ONLY UNTIL ``on_message`` RETURNS: the buffer is reused for the next read. An exception from a
callback is a bug: it is logged with its traceback and closes that connection only.

Flow control: ``send`` writes at once (``transport.writelines``) unless the link's unsent
bytes plus the frame would exceed ``max_buffer``, in which case it drops the frame and returns
False (Raft resends what matters); a frame larger than ``max_buffer`` still goes out when
nothing is waiting. Everything runs on one event loop; no method is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

log = logging.getLogger("broker.cluster.peers")

MAGIC = b"MQLR"
VERSION = 1
HANDSHAKE_TIMEOUT = 2.0
MAX_FRAME = 64 << 20
#: The transport's own frame kind (member announcements); ``send`` refuses it.
KIND_MEMBERS = 0
NONCE_SIZE = 16
PROOF_SIZE = 32
#: One WARNING per remote address per this many seconds.
WARN_INTERVAL = 60.0

_HEADER = struct.Struct(">IB")
_PORT = struct.Struct(">H")
_COUNT = struct.Struct(">H")
_READ_SIZE = 256 << 10  # the receive buffer's usual size (grown for a larger frame)
_MIN_READ = 16 << 10  # make room when less than this is free at the buffer's end
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})

Address = tuple[str, int]


@dataclass(slots=True)
class PeerStats:
    """Counters since start. Frames and bytes are those of ``send`` and ``on_message`` (the
    header included in bytes), not the handshake or member announcements."""

    frames_sent: int = 0
    frames_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    dropped_full: int = 0
    dropped_unconnected: int = 0
    auth_failures: int = 0
    bad_frames: int = 0
    #: Outgoing links that completed a handshake.
    connects: int = 0


class _Refused(Exception):
    """A handshake refused: the message says why (logged, counted in auth_failures)."""


class _BadFrame(Exception):
    """A malformed frame from an authenticated peer (counted in bad_frames)."""


def _encode_member(node: bytes, address: Address) -> bytes:
    host = address[0].encode()
    return bytes([len(node)]) + node + bytes([len(host)]) + host + _PORT.pack(address[1])


def _parse_member(view: memoryview, o: int) -> tuple[str, Address, int] | None:
    """``(node id, address, offset after)`` of the member at ``o``, None if incomplete."""
    end = len(view)
    if o >= end:
        return None
    id_end = o + 1 + view[o]
    if id_end >= end:
        return None
    host_end = id_end + 1 + view[id_end]
    if host_end + 2 > end:
        return None
    try:
        node = bytes(view[o + 1 : id_end]).decode()
        host = bytes(view[id_end + 1 : host_end]).decode()
    except UnicodeDecodeError:
        raise _Refused("a node id or host that is not UTF-8") from None
    if not node:
        raise _Refused("an empty node id")
    return node, (host, _PORT.unpack_from(view, host_end)[0]), host_end + 2


def _parse_hello(view: memoryview) -> tuple[bytes, str, Address, int] | None:
    """``(nonce, node id, advertised address, length)`` of the HELLO (or REPLY, without its
    proof) at the start of ``view``; None if more bytes are needed."""
    head = len(MAGIC) + 1 + NONCE_SIZE
    if bytes(view[: len(MAGIC)]) != MAGIC[: len(view)]:
        raise _Refused(f"not a peer (magic {bytes(view[: len(MAGIC)])!r})")
    if len(view) < head:
        return None
    if view[len(MAGIC)] != VERSION:
        raise _Refused(f"handshake version {view[len(MAGIC)]}, expected {VERSION}")
    member = _parse_member(view, head)
    if member is None:
        return None
    return bytes(view[len(MAGIC) + 1 : head]), member[0], member[1], member[2]


class _Link(asyncio.BufferedProtocol):
    """One TCP connection: its handshake, then the frames it carries (incoming) or the frames
    written to it (outgoing). ``closed`` resolves when the connection is lost."""

    def __init__(self, owner: PeerTransport, dialer: _Dialer | None) -> None:
        self.owner = owner
        self.dialer = dialer
        self.node = ""
        self.advertised: Address = ("", 0)
        self.ready = False
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = owner._loop.create_future()
        self.remote = "?"
        self._quiet = False  # closed by us for a reason already counted, or no fault
        self._open = True
        self._buf = bytearray(_READ_SIZE)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._want = 0  # bytes of the frame being read, header included
        self._hello = b""
        self._reply = b""
        self._nonce = b""
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        owner = self.owner
        self.transport = transport = cast(asyncio.Transport, transport)
        if owner._closing:
            self.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.remote = f"{peer[0]}:{peer[1]}" if self.dialer else str(peer[0])
        owner._links.add(self)
        self._timer = owner._loop.call_later(owner._handshake_timeout, self._timed_out)
        if self.dialer is not None:
            self._nonce = secrets.token_bytes(NONCE_SIZE)
            owner._nonces[self._nonce] = self.dialer
            self._hello = owner._hello(self._nonce)
            transport.write(self._hello)

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._buf) - self._end < _MIN_READ:
            self._make_room()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        try:
            if not self.ready:
                self._handshake()
            if self.ready and self._end > self._start:
                self._frames()
        except _Refused as e:
            self.owner._refuse(self, str(e))
        except _BadFrame as e:
            self.owner.stats.bad_frames += 1
            self.owner._warn(self.remote, f"peer {self.node} at {self.remote}: {e}; disconnected")
            self.close()
        except Exception:
            log.exception("peer %s at %s: closing the connection", self.node, self.remote)
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        owner = self.owner
        if self._timer is not None:
            self._timer.cancel()
        owner._links.discard(self)
        owner._nonces.pop(self._nonce, None)
        if self.ready:
            if owner._out.get(self.node) is self:
                del owner._out[self.node]
        elif not self._quiet and not owner._closing:
            owner._refuse(self, "closed during the handshake")
        if not self.closed.done():
            self.closed.set_result(None)

    # -- the handshake

    def _timed_out(self) -> None:
        self._timer = None
        if not self.ready:
            self.owner._refuse(self, f"no handshake within {self.owner._handshake_timeout} s")

    def _handshake(self) -> None:
        view = self._view[self._start : self._end]
        if self.dialer is None and not self._hello:
            parsed = _parse_hello(view)
            if parsed is None:
                return
            nonce, node, address, n = parsed
            self._hello = bytes(view[:n])
            self._start += n
            dialer = self.owner._nonces.get(nonce)
            if dialer is not None:  # we dialled ourselves: no fault, stop dialling there
                dialer.retire()
                self.close()
                return
            self._peer(node, address)
            self._reply = self.owner._hello(secrets.token_bytes(NONCE_SIZE))
            assert self.transport is not None
            self.transport.write(self._reply + self._proof(b"acceptor"))
            view = self._view[self._start : self._end]
        if self.dialer is None:
            if len(view) < PROOF_SIZE:
                return
            if not hmac.compare_digest(bytes(view[:PROOF_SIZE]), self._proof(b"connector")):
                raise _Refused(f"node {self.node!r} failed to prove the shared secret")
            self._start += PROOF_SIZE
        else:
            parsed = _parse_hello(view)
            if parsed is None or len(view) < parsed[3] + PROOF_SIZE:
                return
            _, node, address, n = parsed
            self._reply = bytes(view[:n])
            self._peer(node, address)
            proof = bytes(view[n : n + PROOF_SIZE])
            if not hmac.compare_digest(proof, self._proof(b"acceptor")):
                raise _Refused(f"node {node!r} failed to prove the shared secret")
            self._start += n + PROOF_SIZE
            assert self.transport is not None
            self.transport.write(self._proof(b"connector"))
        self.ready = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.owner._authenticated(self)

    def _peer(self, node: str, address: Address) -> None:
        if node == self.owner.node_id:
            raise _Refused(f"the peer claims our own node id {node!r}")
        host, port = address
        if host in _WILDCARDS:  # it listens everywhere: reach it where we see (or saw) it
            assert self.transport is not None
            host = (
                self.dialer.address[0]
                if self.dialer
                else self.transport.get_extra_info("peername")[0]
            )
        self.node, self.advertised = node, (host, port)

    def _proof(self, role: bytes) -> bytes:
        return hmac.digest(self.owner._secret, role + self._hello + self._reply, "sha256")

    # -- frames

    def _frames(self) -> None:
        """Deliver every whole frame in the buffer (an incoming link's only work)."""
        if self.dialer is not None:
            raise _BadFrame("data on a connection we only send on")
        view, start, end = self._view, self._start, self._end
        owner = self.owner
        deliver, node, stats = owner._on_message, self.node, owner.stats
        self._want = 0
        try:
            while end - start >= 5:
                length, kind = _HEADER.unpack_from(view, start)
                if length > MAX_FRAME:
                    raise _BadFrame(f"a frame of {length} bytes (at most {MAX_FRAME})")
                total = 5 + length
                if end - start < total:
                    self._want = total
                    break
                payload = view[start + 5 : start + total]
                start += total
                if kind == KIND_MEMBERS:
                    owner._announced(payload)
                else:
                    stats.frames_received += 1
                    stats.bytes_received += total
                    deliver(node, kind, payload)
                if not self._open:  # a callback closed it
                    return
        finally:
            self._start = start
        if start == end:
            self._start = self._end = 0
            if len(self._buf) > _READ_SIZE:  # a large frame has passed: give its memory back
                self._buf = bytearray(_READ_SIZE)
                self._view = memoryview(self._buf)

    def _make_room(self) -> None:
        """Move the unread bytes to the front, growing the buffer if the frame being read (or
        the next read) would not fit."""
        pending = self._end - self._start
        size = max(self._want, pending + _MIN_READ, len(self._buf))
        if size > len(self._buf):
            buf = bytearray(size)
            buf[:pending] = self._view[self._start : self._end]
            self._buf, self._view = buf, memoryview(buf)
        else:  # same length: allowed while a view of the buffer is alive
            self._buf[:pending] = self._buf[self._start : self._end]
        self._start, self._end = 0, pending

    def close(self) -> None:
        """Close at once (quietly: whoever closes has counted the reason, if any)."""
        self._quiet = True
        self._open = False
        if self.transport is not None:
            self.transport.abort()  # nothing unsent is worth waiting for


class _Dialer:
    """Keeps one outgoing link to ``address`` up: connect, handshake, wait for it to close,
    back off (exponential, jittered, capped), again; until retired."""

    def __init__(self, address: Address, seed: bool, node: str | None) -> None:
        self.address = address
        self.seed = seed
        self.node = node
        self.retired = False
        self.link: _Link | None = None
        self.task: asyncio.Task[None] | None = None

    def retire(self) -> None:
        self.retired = True
        if self.link is not None:
            self.link.close()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()


class PeerTransport:
    """This node's links to its peers (see the module docstring). ``node_id``: this node's
    stable id (1 to 255 UTF-8 bytes); ``bind``: where to listen, also the address advertised to
    peers (port 0: an ephemeral port, ``address`` then tells which); ``seeds``: peers to dial
    first; ``secret``: the shared secret. ``on_message(peer, kind, payload)`` gets every frame
    (``payload`` valid only during the call); ``on_peer(peer, address)`` is called when a peer
    authenticates with an address not known before (its first time, or it moved)."""

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
    ) -> None:
        if not 0 < len(node_id.encode()) < 256:
            raise ValueError(f"node_id {node_id!r}: 1 to 255 bytes of UTF-8")
        if not secret:
            raise ValueError("secret: empty (peers authenticate with it)")
        if not 0 < reconnect[0] <= reconnect[1]:
            raise ValueError(f"reconnect {reconnect}: expected 0 < first delay <= cap")
        if max_buffer <= 0 or handshake_timeout <= 0:
            raise ValueError("max_buffer and handshake_timeout must be positive")
        self.node_id = node_id
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
        self._out: dict[str, _Link] = {}
        self._links: set[_Link] = set()
        self._dialers: dict[Address, _Dialer] = {}
        self._nonces: dict[bytes, _Dialer] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._warned: dict[str, float] = {}
        self._server: asyncio.Server | None = None
        self._closing = False
        self._loop: asyncio.AbstractEventLoop  # set by start()

    async def start(self) -> None:
        """Listen on ``bind`` and dial every seed (and, later, every member learned)."""
        self._loop = asyncio.get_running_loop()
        host, port = self.bind
        self._server = await self._loop.create_server(lambda: _Link(self, None), host or None, port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = (host, port)
        for seed in self.seeds:
            if seed != self.address:
                self._dial(seed, seed=True, node=None)

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
        waiting = transport.get_write_buffer_size()
        if waiting and waiting + n > self._max_buffer:
            self.stats.dropped_full += 1
            return False
        transport.writelines((_HEADER.pack(n, kind), payload))
        self.stats.frames_sent += 1
        self.stats.bytes_sent += 5 + n
        return True

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
        return MAGIC + bytes([VERSION]) + nonce + _encode_member(self._node, self.address)

    def _authenticated(self, link: _Link) -> None:
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
            known = [_encode_member(self._node, self.address)]
            known += [_encode_member(n.encode(), a) for n, a in self.members.items() if n != node]
            self._write_members(link, known)
        self._learn(node, link.advertised)

    def _learn(self, node: str, address: Address) -> None:
        if self.members.get(node) != address:
            self.members[node] = address
            announce = [_encode_member(node.encode(), address)]
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
            raise _BadFrame("a member announcement without its count")
        (count,) = _COUNT.unpack_from(payload)
        o = _COUNT.size
        for _ in range(count):
            try:
                member = _parse_member(payload, o)
            except _Refused as e:
                raise _BadFrame(f"a member announcement with {e}") from None
            if member is None:
                raise _BadFrame("a truncated member announcement")
            node, address, o = member
            if node != self.node_id and self.members.get(node) != address:
                self._dial(address, seed=False, node=node)
        if o != len(payload):
            raise _BadFrame("bytes after a member announcement")

    def _write_members(self, link: _Link, members: list[bytes]) -> None:
        payload = _COUNT.pack(len(members)) + b"".join(members)
        if link.transport is not None and not link.transport.is_closing():
            link.transport.write(_HEADER.pack(len(payload), KIND_MEMBERS) + payload)

    def _refuse(self, link: _Link, reason: str) -> None:
        self.stats.auth_failures += 1
        side = "to" if link.dialer else "from"
        self._warn(link.remote, f"peer connection {side} {link.remote} refused: {reason}")
        link.close()

    def _warn(self, key: str, message: str) -> None:
        now = self._loop.time()
        if now - self._warned.get(key, -WARN_INTERVAL) >= WARN_INTERVAL:
            if len(self._warned) > 1024:
                self._warned.clear()
            self._warned[key] = now
            log.warning("%s", message)

    # -- dialling

    def _dial(self, address: Address, *, seed: bool, node: str | None) -> None:
        if self._closing or address == self.address:
            return
        existing = self._dialers.get(address)
        if existing is not None and not existing.retired:
            return
        d = self._dialers[address] = _Dialer(address, seed, node)
        d.task = self._loop.create_task(self._keep_dialling(d), name=f"peer dial {address}")

    async def _keep_dialling(self, d: _Dialer) -> None:
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
                link = d.link = _Link(self, d)
                with contextlib.suppress(OSError, TimeoutError):
                    await asyncio.wait_for(
                        self._loop.create_connection(lambda link=link: link, *d.address),
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
