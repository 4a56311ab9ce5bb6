"""One connection between two nodes (``broker.cluster.peers`` holds them all): its handshake,
then the frames it carries.

Handshake (version 2), both sides proving that they hold the shared secret::

    connector -> acceptor   HELLO  = "MQLR" | version u8 | nonce[16] | id_len u8 | node id
                                     | host_len u8 | host | port u16   (the advertised address)
                                     | worker u16 | workers u16
    acceptor -> connector   REPLY  = the same fields for the acceptor | proof_a[32]
    connector -> acceptor   proof_c[32]

``proof_a = HMAC-SHA256(secret, b"acceptor" + HELLO + REPLY without its proof)`` and
``proof_c`` likewise with ``b"connector"``: the MAC covers both nonces and both ids (so a
recorded handshake cannot be replayed) and both advertised addresses (so none can be altered on
the way), and the role label keeps a peer from answering a proof with the proof it was sent.
Proofs are compared with ``hmac.compare_digest``.

``worker`` / ``workers``: which worker process of its node the sender is, among how many
(``router.workers``). Each worker of a node hosts the Raft groups of the partitions it owns
and has a transport of its own (worker ``i`` on ``raft_port + i``), so worker ``i`` of one node
talks to worker ``i`` of every other; that needs every node to run the same count. Once the
peer's proof checked out (so a stranger cannot provoke it), each side compares the peer's
pair with its own and refuses a link whose count or index differs (:class:`Incompatible`:
an ERROR naming both counts and the key, counted in ``incompatible``; the connector sends its
proof first, so the acceptor sees the proof and says the same in its own log).

A wrong magic, version or proof, a peer
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
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast


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
    #: Authenticated peers refused for another worker count or index (module docstring).
    incompatible: int = 0
    bad_frames: int = 0
    #: Outgoing links that completed a handshake.
    connects: int = 0


class PeerTransport(Protocol):
    """What a link reads and updates of the transport that owns it
    (``broker.cluster.peers.PeerTransport``; named here so the two modules do not import
    each other)."""

    node_id: str
    #: (this worker's index, the node's worker count): see the module docstring.
    worker: tuple[int, int]
    stats: PeerStats
    _loop: asyncio.AbstractEventLoop
    _closing: bool
    _handshake_timeout: float
    _secret: bytes
    _links: set[Link]
    _out: dict[str, Link]
    _nonces: dict[bytes, Dialer]
    _on_message: Callable[[str, int, memoryview], None]

    def _hello(self, nonce: bytes) -> bytes: ...
    def _authenticated(self, link: Link) -> None: ...
    def _announced(self, payload: memoryview) -> None: ...
    def _refuse(self, link: Link, reason: str) -> None: ...

    def _link_lost(self, node: str) -> None: ...
    def _incompatible(self, link: Link, reason: str) -> None: ...
    def _warn(self, key: str, message: str, level: int = ...) -> None: ...


log = logging.getLogger("broker.cluster.peers")

MAGIC = b"MQLR"
VERSION = 2
MAX_FRAME = 64 << 20
#: The transport's own frame kind (member announcements); ``send`` refuses it.
KIND_MEMBERS = 0
NONCE_SIZE = 16
PROOF_SIZE = 32

HEADER = struct.Struct(">IB")
_PORT = struct.Struct(">H")
_WORKER = struct.Struct(">HH")  # worker index, worker count
#: A connection's buffer until it is an authenticated incoming link: larger than a HELLO or
#: REPLY and its proof (at most 567 bytes), so a stranger costs little memory.
_HANDSHAKE_SIZE = 1024
_READ_SIZE = 256 << 10  # an incoming link's usual buffer (grown for a larger frame)
_MIN_READ = 16 << 10  # make room when less than this is free at the buffer's end
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})
#: An outgoing link whose sent data stays unacknowledged this long is closed (TCP_USER_TIMEOUT,
#: Linux) and redialled: after a partition heals, TCP's own retransmission backoff could
#: otherwise keep the link silent for about as long again as the partition lasted.
USER_TIMEOUT_MS = 5000

Address = tuple[str, int]


class Refused(Exception):
    """A handshake refused: the message says why (logged, counted in auth_failures)."""


class Incompatible(Refused):
    """An authenticated peer runs another worker count, or answered as another worker."""


class BadFrame(Exception):
    """A malformed frame from an authenticated peer (counted in bad_frames)."""


def encode_member(node: bytes, address: Address) -> bytes:
    host = address[0].encode()
    return bytes([len(node)]) + node + bytes([len(host)]) + host + _PORT.pack(address[1])


def hello(nonce: bytes, node: bytes, address: Address, worker: tuple[int, int] = (0, 1)) -> bytes:
    """A HELLO, or a REPLY without its proof (``worker``: index, count)."""
    return MAGIC + bytes([VERSION]) + nonce + encode_member(node, address) + _WORKER.pack(*worker)


def parse_member(view: memoryview, o: int) -> tuple[str, Address, int] | None:
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
        raise Refused("a node id or host that is not UTF-8") from None
    if not node:
        raise Refused("an empty node id")
    return node, (host, _PORT.unpack_from(view, host_end)[0]), host_end + 2


def parse_hello(view: memoryview) -> tuple[bytes, str, Address, tuple[int, int], int] | None:
    """``(nonce, node id, advertised address, (worker, workers), length)`` of the HELLO (or
    REPLY, without its proof) at the start of ``view``; None if more bytes are needed."""
    head = len(MAGIC) + 1 + NONCE_SIZE
    if bytes(view[: len(MAGIC)]) != MAGIC[: len(view)]:
        raise Refused(f"not a peer (magic {bytes(view[: len(MAGIC)])!r})")
    if len(view) < head:
        return None
    if view[len(MAGIC)] != VERSION:
        raise Refused(f"handshake version {view[len(MAGIC)]}, expected {VERSION}")
    member = parse_member(view, head)
    if member is None or len(view) < member[2] + _WORKER.size:
        return None
    index, count = _WORKER.unpack_from(view, member[2])
    nonce = bytes(view[len(MAGIC) + 1 : head])
    return nonce, member[0], member[1], (index, count), member[2] + _WORKER.size


def check_worker(node: str, ours: tuple[int, int], theirs: tuple[int, int]) -> None:
    """Raise :class:`Incompatible` unless ``theirs`` (index, count) matches ``ours``."""
    if theirs[1] != ours[1]:
        raise Incompatible(
            f"node {node!r} runs {theirs[1]} worker(s) per node and this node {ours[1]}: every "
            f"node of a cluster must run the same count (router.workers / --workers)"
        )
    if theirs[0] != ours[0]:
        raise Incompatible(
            f"node {node!r} answered as its worker {theirs[0]}, expected worker {ours[0]}: "
            f"seeds must name each node's [cluster] raft_port (worker i uses raft_port + i)"
        )


class Link(asyncio.BufferedProtocol):
    """One TCP connection: its handshake, then the frames it carries (incoming) or the frames
    written to it (outgoing). ``closed`` resolves when the connection is lost.

    The transport's own half (a split for size, not a separate abstraction): a link reads and
    updates its ``PeerTransport``'s link tables (``_out``, ``_links``, ``_nonces``) and calls
    back into it when it authenticates or is refused."""

    def __init__(self, owner: PeerTransport, dialer: Dialer | None) -> None:
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
        self._buf = bytearray(_HANDSHAKE_SIZE)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._want = 0  # bytes of the frame being read, header included
        self._hello = b""
        self._reply = b""
        self._nonce = b""
        self._worker = (0, 1)  # the acceptor's peer's, from its HELLO
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
            if self.dialer is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
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
        free = len(self._buf) - self._end
        if not free or (free < _MIN_READ and self.ready and self.dialer is None):
            self._make_room()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        try:
            if not self.ready:
                self._handshake()
            if self.ready and self._end > self._start:
                self._frames()
        except Incompatible as e:
            self.owner._incompatible(self, str(e))
        except Refused as e:
            self.owner._refuse(self, str(e))
        except BadFrame as e:
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
            if not owner._closing:
                owner._link_lost(self.node)
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
            parsed = parse_hello(view)
            if parsed is None:
                return
            nonce, node, address, self._worker, n = parsed
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
                raise Refused(f"node {self.node!r} failed to prove the shared secret")
            self._start += PROOF_SIZE
            check_worker(self.node, self.owner.worker, self._worker)
        else:
            parsed = parse_hello(view)
            if parsed is None or len(view) < parsed[4] + PROOF_SIZE:
                return
            _, node, address, worker, n = parsed
            self._reply = bytes(view[:n])
            self._peer(node, address)
            proof = bytes(view[n : n + PROOF_SIZE])
            if not hmac.compare_digest(proof, self._proof(b"acceptor")):
                raise Refused(f"node {node!r} failed to prove the shared secret")
            self._start += n + PROOF_SIZE
            assert self.transport is not None
            self.transport.write(self._proof(b"connector"))
            check_worker(node, self.owner.worker, worker)  # after the proof: see the docstring
        self.ready = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.owner._authenticated(self)

    def _peer(self, node: str, address: Address) -> None:
        if node == self.owner.node_id:
            raise Refused(f"the peer claims our own node id {node!r}")
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
            raise BadFrame("data on a connection we only send on")
        view, start, end = self._view, self._start, self._end
        owner = self.owner
        deliver, node, stats = owner._on_message, self.node, owner.stats
        self._want = 0
        try:
            while end - start >= 5:
                length, kind = HEADER.unpack_from(view, start)
                if length > MAX_FRAME:
                    raise BadFrame(f"a frame of {length} bytes (at most {MAX_FRAME})")
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
        size = max(self._want, pending + _MIN_READ, _READ_SIZE)
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


class Dialer:
    """Keeps one outgoing link to ``address`` up: connect, handshake, wait for it to close,
    back off (exponential, jittered, capped), again; until retired."""

    def __init__(self, address: Address, seed: bool, node: str | None) -> None:
        self.address = address
        self.seed = seed
        self.node = node
        self.retired = False
        self.link: Link | None = None
        self.task: asyncio.Task[None] | None = None

    def retire(self) -> None:
        self.retired = True
        if self.link is not None:
            self.link.close()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
