"""Hand-off, the socket's part: a device connection's descriptor moved to another worker.

With several workers, a device whose publishes go to a partition another worker owns costs
a forward per publish (issue 23, item 2). Its connection can move to the owner instead
(:mod:`broker.workers.handoff` decides when, and moves the session); this module moves the
socket. The sending worker takes it off uvloop as :mod:`broker.net.parking` does (a
duplicate descriptor; uvloop closes its transport with a plain ``close(2)``, no
``shutdown(2)``, so the TCP connection lives on in the duplicate) and sends it with
``SCM_RIGHTS`` over the receiving worker's Unix datagram socket (:class:`FdChannel`), in
the abstract namespace, named after the supervisor's pid: two brokers on one host never
share one. The receiver checks each message's sender with ``SCM_CREDENTIALS`` (the
datagram counterpart of ``SO_PEERCRED``, given by the kernel, not by the sender): the same
uid, and a process whose parent is our supervisor (a sibling worker); anything else is
closed and counted (:attr:`FdChannel.rejected`).

Called only from the worker's event loop.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
import struct
from typing import Any

from broker.net.parking import _DETACHED

log = logging.getLogger("broker.net.handoff")

#: ``struct ucred`` (pid, uid, gid), as SCM_CREDENTIALS carries it.
_UCRED = struct.Struct("3i")
#: A message's body: the hand-off's token, which the mesh message names too.
_TOKEN = struct.Struct("<Q")
#: Seconds a received descriptor waits for its mesh message (and the reverse) before it is
#: closed: the two travel on different sockets, in either order.
WAIT_SECONDS = 5.0


def _power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1


def channel_name(supervisor_pid: int, worker: int) -> bytes:
    """The abstract socket of ``worker`` of the broker whose supervisor is ``supervisor_pid``."""
    return f"\0mqlog-handoff-{supervisor_pid}-{worker}".encode()


def _parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (0 when it cannot be read: the process ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # "pid (comm) state ppid ...": comm may hold spaces or parentheses; it ends at the last ')'.
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


class FdChannel:
    """One worker's datagram socket for descriptors handed to it, and sends to its peers'."""

    def __init__(self, loop: asyncio.AbstractEventLoop, supervisor_pid: int, worker: int) -> None:
        self._loop = loop
        self._supervisor = supervisor_pid
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(channel_name(supervisor_pid, worker))
        self._sock.setblocking(False)
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # our pid is sent
        #: Descriptors received, by token, until their mesh message takes them.
        self._fds: dict[int, int] = {}
        self._waiting: dict[int, asyncio.Future[int]] = {}
        self.rejected = 0  # messages from anyone but a sibling worker: dropped
        loop.add_reader(self._sock.fileno(), self._readable)

    def send(self, worker: int, token: int, fd: int) -> None:
        """Send ``fd`` (the caller closes its copy afterwards) to ``worker`` as ``token``.
        Raises OSError if it cannot leave now (the peer's socket is gone, or full)."""
        name = channel_name(self._supervisor, worker)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        # (socket.send_fds drops its address argument: sendmsg itself.)
        self._out.sendmsg([_TOKEN.pack(token)], rights, socket.MSG_DONTWAIT, name)

    async def take(self, token: int) -> int | None:
        """The descriptor sent as ``token`` (now, or once it arrives); None after
        :data:`WAIT_SECONDS`. The caller owns it."""
        fd = self._fds.pop(token, None)
        if fd is not None:
            return fd
        waiter = self._waiting[token] = self._loop.create_future()
        try:
            return await asyncio.wait_for(waiter, WAIT_SECONDS)
        except TimeoutError:
            return None
        finally:
            self._waiting.pop(token, None)

    def _readable(self) -> None:
        space = socket.CMSG_SPACE(4) + socket.CMSG_SPACE(_UCRED.size)
        while True:
            try:
                data, ancdata, _, _ = self._sock.recvmsg(_TOKEN.size, space)
            except (BlockingIOError, InterruptedError):
                return
            fds: list[int] = []
            cred: tuple[int, int, int] | None = None
            for level, kind, body in ancdata:
                if level != socket.SOL_SOCKET:
                    continue
                if kind == socket.SCM_RIGHTS:
                    arr = array.array("i")
                    arr.frombytes(body[: len(body) - len(body) % arr.itemsize])
                    fds.extend(arr)
                elif kind == socket.SCM_CREDENTIALS and len(body) >= _UCRED.size:
                    cred = _UCRED.unpack_from(body)
            if not self._sibling(cred) or len(fds) != 1 or len(data) != _TOKEN.size:
                self.rejected += 1
                if _power_of_ten(self.rejected):  # a flood costs no line per message
                    log.warning(
                        "hand-off channel: a message from %r dropped (not a worker; %d so far)",
                        cred,
                        self.rejected,
                    )
                for fd in fds:
                    os.close(fd)
                continue
            token = _TOKEN.unpack(data)[0]
            waiter = self._waiting.pop(token, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(fds[0])
            else:
                self._fds[token] = fds[0]
                self._loop.call_later(WAIT_SECONDS, self._expire, token)

    def _sibling(self, cred: tuple[int, int, int] | None) -> bool:
        if cred is None:
            return False
        pid, uid, _ = cred
        return uid == os.getuid() and pid != os.getpid() and _parent_of(pid) == self._supervisor

    def _expire(self, token: int) -> None:
        fd = self._fds.pop(token, None)
        if fd is not None:
            os.close(fd)  # its mesh message never came: the sender gave the connection up

    def close(self) -> None:
        self._loop.remove_reader(self._sock.fileno())
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._sock.close()
        self._out.close()


def detach(link: Any) -> int:
    """Take ``link`` 's socket off uvloop: a duplicate descriptor, returned (the caller
    sends and closes it); its transport is closed without touching the TCP connection, and
    without ``connection_lost`` reaching the link (:mod:`broker.net.parking`'s way)."""
    transport = link.transport
    fd = os.dup(transport.get_extra_info("socket").fileno())
    transport.set_protocol(_DETACHED)
    transport.abort()  # uv_close: the descriptor only; the duplicate keeps the connection
    link.transport = None
    return fd


def resume(loop: asyncio.AbstractEventLoop, link: Any, fd: int) -> asyncio.Task[Any]:
    """A transport for a handed ``link`` over ``fd``: ``connection_made`` runs as for an
    unparked link (``link._parked`` is -1: :func:`broker.net.parking.resumed`)."""
    sock = socket.socket(fileno=fd)
    return loop.create_task(loop.connect_accepted_socket(lambda: link, sock))


def refuse(fd: int, version: int, reason: int) -> None:
    """Close a handed connection that is not resumed: its session was taken over meanwhile
    [MQTT-3.1.4-3], or the worker stops. 5.0 is told why first (DISCONNECT with ``reason``:
    0x8E "session taken over", 0x8B "server shutting down")."""
    try:
        if version == 5:
            os.write(fd, bytes((0xE0, 1, reason)))
    except OSError:
        pass
    finally:
        os.close(fd)
