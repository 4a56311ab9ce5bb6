"""Parking: an idle connection taken off the event loop until something happens on it.

An idle MQTT connection cost ~2,200 traced bytes, 1,272 of them uvloop's (its transport and
the transport's entry in the loop's map of file descriptors; issue 23, item 4). A parked
connection keeps its :class:`~broker.net.transport.MQTTProtocol` (the session's link: the
router, the keepalive wheel and the link registry keep seeing the same object) and its
socket, as a duplicate file descriptor watched by one ``epoll`` per worker
(:class:`ParkingLot`, itself one reader of the loop); its uvloop transport is closed.
uvloop closes a transport's descriptor with ``uv_close`` (a plain ``close(2)``, no
``shutdown(2)``), so the TCP connection lives on in the duplicate.

A connection parks when it is idle (:func:`parkable`) for ``[router] park_after``; it
resumes (:func:`unpark`) on a new transport (``loop.connect_accepted_socket`` over the
same socket) when the socket becomes readable (input, or the peer's FIN or reset) or when
the broker writes to it or closes it (a delivery, a takeover, keepalive expiry, shutdown):
the protocol's output and close wait for the new transport (``connection_made``). Its input
stays in the kernel meanwhile and is read by the new transport as if nothing happened.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
from functools import partial
from typing import Any

from broker.net.carrier import Carrier
from broker.net.devicepath import new_lane
from broker.net.keepalive import KeepaliveWheel

#: A :class:`broker.net.transport.MQTTProtocol` (which imports this module: no cycle).
MQTTProtocol = Any

log = logging.getLogger("broker.net.parking")

#: Readable, or the peer closed its side or reset: either way the connection resumes.
WAKE = select.EPOLLIN | select.EPOLLRDHUP


class _Detached(asyncio.Protocol):
    """The protocol of a parked connection's closed transport: its ``connection_lost`` is
    not the connection's end."""


_DETACHED = _Detached()


class ParkingLot:
    """One worker's parked connections: their sockets in one epoll, read by the loop as one
    file descriptor; and the wheel of the live ones, by when each is looked at for parking."""

    __slots__ = ("_by_fd", "_epoll", "_loop", "_resuming", "_wheel", "after")

    def __init__(self, loop: asyncio.AbstractEventLoop | None, after: float, now: float) -> None:
        #: Seconds idle before a connection parks; 0: never (no epoll is made).
        self.after = after if loop is not None else 0.0
        self._loop = loop
        self._wheel: KeepaliveWheel[MQTTProtocol] = KeepaliveWheel(0.5, now)
        self._by_fd: dict[int, MQTTProtocol] = {}
        self._resuming: set[asyncio.Task[Any]] = set()
        self._epoll: select.epoll | None = None
        if self.after > 0 and loop is not None:
            self._epoll = select.epoll()
            loop.add_reader(self._epoll.fileno(), self._wake)

    def __len__(self) -> int:
        """Connections parked now."""
        return len(self._by_fd)

    def watch(self, link: MQTTProtocol, now: float) -> None:
        """Look at ``link`` (a connection with a session) for parking: first half ``after``
        from now (it has just written: its CONNACK, or what waited while it was parked),
        which starts the watch on its output (:func:`parkable`)."""
        if self.after > 0:
            self._wheel.file(link, now + self.after / 2 + self._spread(link))

    def _spread(self, link: MQTTProtocol) -> float:
        """Up to half ``after`` more, the same for a link every time: a fleet that connected
        at once (5,000 looks took 4 ms in one timer run) is looked at over ten runs."""
        return hash(link) % 61 / 122 * self.after

    def forget(self, link: MQTTProtocol) -> None:
        self._wheel.discard(link)

    def check(self, now: float) -> None:
        """Park the connections looked at now that were idle; look at the others again
        ``after`` from their last input, at least half ``after`` from now (and spread)."""
        for link in self._wheel.due(now):
            if link.closing:
                continue
            if parkable(link, now, self.after) and park(link):
                continue
            link._wrote = False  # the next look asks whether anything left since this one
            soonest = max(link.last_received + self.after, now + self.after / 2)
            self._wheel.file(link, soonest + self._spread(link))

    def hold(self, fd: int, link: MQTTProtocol) -> None:
        assert self._epoll is not None
        self._by_fd[fd] = link
        self._epoll.register(fd, WAKE)

    def resume(self, link: MQTTProtocol, fd: int) -> None:
        """A new transport for ``link`` over the parked socket ``fd`` (no longer watched)."""
        assert self._epoll is not None and self._loop is not None
        del self._by_fd[fd]
        self._epoll.unregister(fd)
        sock = socket.socket(fileno=fd)  # uvloop detaches it when that transport closes
        loop = self._loop
        task = loop.create_task(loop.connect_accepted_socket(lambda: link, sock))
        self._resuming.add(task)
        task.add_done_callback(partial(self._resumed, link))

    def _resumed(self, link: MQTTProtocol, task: asyncio.Task[Any]) -> None:
        self._resuming.discard(task)
        error = None if task.cancelled() else task.exception()
        if task.cancelled() or error is not None:
            error = error if isinstance(error, Exception) else None
            log.warning("%s: resuming a parked connection failed: %r", link.client_id, error)
            link.connection_lost(error)  # its will, its session's end: as a lost connection

    def _wake(self) -> None:
        assert self._epoll is not None
        for fd, _ in self._epoll.poll(0):
            link = self._by_fd.get(fd)
            if link is not None:
                unpark(link)

    async def close(self) -> None:
        """After the links were told to close (shutdown): the resumptions end, then the epoll."""
        while self._resuming:
            await asyncio.gather(*self._resuming, return_exceptions=True)
        if self._epoll is not None and self._loop is not None:
            self._loop.remove_reader(self._epoll.fileno())
            for fd in self._by_fd:
                os.close(fd)
            self._by_fd.clear()
            self._epoll.close()
            self._epoll = None


def parkable(link: MQTTProtocol, now: float, after: float) -> bool:
    """Whether ``link`` may park now: a plain TCP connection with a session and nothing in
    flight either way, idle for ``after``. Nothing in flight: no output queued, held or in
    the transport's buffer; no part of a packet in the decoder; no unacknowledged QoS 1/2
    delivery, QoS 2 exchange or 5.0 inbound quota entry; no retained message or shared
    group record still to deliver, no consumer waiting for a PUBACK to go on. Idle: nothing
    received for ``after`` and nothing written since the lot's last look at it, at least
    half ``after`` ago (a subscriber being fed does not park). A TLS or WebSocket
    connection never parks: its carrier holds state."""
    transport = link.transport
    session = link.session
    if (
        link._wrote  # the common answers first: a device or a subscriber in use
        or now - link.last_received < after
        or transport is None
        or session is None
        or link._admission is not None
        or link._out is not None
        or link._held
        or link._paused
        or link._handoff is not None
        or isinstance(transport, Carrier)
        or transport.is_closing()
        or transport.get_write_buffer_size()
        or link.conn.buffered
        or link.conn.inbound_unacked
    ):
        return False
    return not (
        session.inflight
        or session.incoming_qos2
        or session.pending_qos2
        or session.pending_retained
        or session.group_queue
        or session.waiting
    )


def park(link: MQTTProtocol) -> bool:
    """Close ``link``'s transport, keeping its socket (a duplicate descriptor) in the lot;
    False where the transport shows no socket (it stays as it is)."""
    transport = link.transport
    assert transport is not None
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    fd = os.dup(sock.fileno())
    transport.set_protocol(_DETACHED)
    transport.abort()  # uv_close: the descriptor only; the duplicate keeps the connection
    link.transport = None
    link.conn.drop_decoder()  # made again on resuming, with the compiled lane that reads it
    link._lane = None
    link._parked = fd
    link.edge.parking.hold(fd, link)
    return True


def unpark(link: MQTTProtocol) -> None:
    """Resume ``link`` if it is parked: its output and close wait for ``connection_made``."""
    fd = link._parked
    if fd > 0:
        link._parked = -1  # resuming
        link.edge.parking.resume(link, fd)


def resumed(link: MQTTProtocol) -> None:
    """``connection_made`` of a resumed link (its new transport is set): write what waited."""
    link._parked = 0
    rest, link._handoff = link._handoff, None  # a handed link's (broker.net.handoff)
    link.conn.new_decoder(rest or b"")
    if link.conn.plain_topic and link.compiled_device_path:
        link._lane = new_lane(link, link._plain_key)
    edge = link.edge
    edge.parking.watch(link, edge.monotonic())
    if link.closing:
        link._flush_and_close()
    else:
        link.flush_output()
