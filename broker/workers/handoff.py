"""Hand-off: a device connection moves to the worker owning the partition it publishes to.

With several workers, a device publishing to a partition another worker owns has every
publish forwarded over the mesh and its PUBACK wait for the owner's answer (issue 23,
item 2). When such a connection takes that partition as its plain topic's (the device
path's, ``edge.handoff`` is told: :meth:`HandOff.consider`), and moving it costs little (a
plain TCP connection whose session has nothing in flight either way, no QoS 2 exchange open
and no shared subscription: :func:`movable`; its subscriptions move with it), worker A
hands it to the owner B, whose publishes are then appended locally, with no forward:

1. A stops reading the socket and waits until every publish of it A accepted is answered:
   each FORWARD sent up to then answered (:meth:`PartitionService.answered_before`), this
   iteration's group commit run, the PUBACKs written and the socket's output drained.
2. A takes the socket off uvloop and sends its descriptor to B (:mod:`broker.net.handoff`:
   SCM_RIGHTS, the sender checked by its credentials), then ``HANDOFF`` over the mesh: the
   connection's protocol state and the bytes of a packet A had only begun to read. The
   session stays on A meanwhile, held by the connection in flight.
3. B claims the session at its home worker, on the condition that A still holds it for
   this hand-off (broker.workers.sessions, ``HANDED``): A gives it up (the router's
   ``release_link``: no will, no close; its login's ACL state dropped here) and the home
   records B; B adopts it (``attach_handed``: the will stays pending, the ACL restored)
   and resumes the connection on its loop, the carried bytes first.
4. A claim that fails (the session was taken over meanwhile by a new connection) makes B
   close the handed connection as taken over [MQTT-3.1.4-3]; one that never happens (B
   died) makes A count the connection lost (its will goes out).

Stopping (:meth:`HandOff.settle`): a worker that has begun to stop starts no hand-off and
takes none (A keeps the session and counts the connection lost, as its stop does with every
other connection), and it waits for the hand-offs under way before it persists its
sessions: each one's session is then in A's router or in B's when that worker writes them
(B, taking one while it stops, closes the connection as its stop closes the others). A
session that left A after A wrote its sessions and reached B after B wrote its own was lost
on SIGTERM.

Order: a QoS 0/1 publish of the connection accepted by A was appended before the hand-off
(step 1), and the FORWARDs precede ``HANDOFF`` on the mesh; B reads the socket only after.
A connection handed to a worker stays there for :data:`COOLDOWN` seconds at least.

Off with one worker, in a cluster, and with ``[router] handoff = false``. Called only from
the worker's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import marshal
import os
from typing import TYPE_CHECKING, Any

from broker.mqtt.reason_codes import ReasonCode
from broker.net.connlog import PEER_CLOSED
from broker.net.context import STATE
from broker.net.handoff import WAIT_SECONDS, FdChannel, detach, refuse, resume
from broker.net.keepalive import keepalive_deadline
from broker.net.transport import MQTTProtocol
from broker.workers.mesh import PeerDown
from broker.workers.runtime import CALL

if TYPE_CHECKING:
    from broker.commitlog.keys import PartitionKey
    from broker.net.context import EdgeContext
    from broker.router.session import Session
    from broker.workers.runtime import WorkerRuntime

log = logging.getLogger("broker.workers.handoff")

#: Request A -> B: take this connection (its state; the descriptor follows on the channel).
HANDOFF = CALL + 8
#: Seconds a connection's publishes may take to be answered before a hand-off gives up.
QUIESCE_SECONDS = 2.0
#: Seconds a descriptor may wait for room in the receiving worker's channel.
SEND_SECONDS = 1.0
#: Times a hand-off that could not be done is tried again, and the seconds between tries.
RETRIES = 3
RETRY_SECONDS = 1.0
#: Seconds a connection handed to a worker stays there before it may move again.
COOLDOWN = 10.0
#: Seconds a stopping worker waits for the hand-offs under way (each is bounded by its own
#: limits: the quiesce, the send, the descriptor's wait on the channel).
SETTLE_SECONDS = QUIESCE_SECONDS + SEND_SECONDS + WAIT_SECONDS


class HandOff:
    """One worker's side of hand-offs, both ways (see the module docstring)."""

    def __init__(self, server: EdgeContext[MQTTProtocol], runtime: WorkerRuntime) -> None:
        self.server = server
        self.runtime = runtime
        self.router = server.router
        self.channel = FdChannel(server.loop, os.getppid(), runtime.index)
        self._tokens = itertools.count((runtime.index << 48) + 1)
        #: Connections in flight from here, by token (step 2 to step 3).
        self._inflight: dict[int, MQTTProtocol] = {}
        #: Client ids handed here, when (monotonic): not moved again before COOLDOWN.
        self._recent: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.handed_in = 0
        #: This worker stops: no hand-off starts or is taken (module docstring, "Stopping").
        self.stopping = False
        runtime.mesh.handlers[HANDOFF] = self._on_handoff
        runtime.sessions.release_handed = self._release_handed

    @property
    def rejected(self) -> int:
        """Channel messages from anyone but a sibling worker, dropped."""
        return self.channel.rejected

    # ------------------------------------------------------------ the worker handing

    def consider(self, link: MQTTProtocol, key: PartitionKey, attempt: int = 0) -> None:
        """``link`` publishes to ``key`` now: hand it to the owner if that is another
        worker and the link is cheap to move (module docstring). A hand-off that could
        not be done (its publishes slow to be answered, the owner's channel full) is tried
        again :data:`RETRY_SECONDS` later, :data:`RETRIES` times."""
        owner = getattr(self.router.partitions.get(key), "owner", None)
        session = link.session
        if (
            self.stopping
            or owner is None
            or owner == self.runtime.index
            or owner not in self.runtime.mesh.peers
            or session is None
            or link._handoff is not None
            or link.tls
            or link._admission is not None
            or link.transport is None
            or link.transport.get_extra_info("socket") is None  # a carrier: TLS, WebSocket
            or link.conn.outbound_aliases
        ):
            return
        if not movable(session):
            self._again(link, key, attempt)  # a delivery in flight to it, say: later
            return
        now = self.server.monotonic()
        if self._recent.get(link.client_id, -COOLDOWN) > now - COOLDOWN:
            return
        token = next(self._tokens)
        link._handoff = token
        task = self.server.loop.create_task(self._hand(link, owner, token, key, attempt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _hand(
        self, link: MQTTProtocol, owner: int, token: int, key: PartitionKey, attempt: int
    ) -> None:
        transport = link.transport
        assert transport is not None
        transport.pause_reading()  # step 1
        log.debug("%s: handing to worker %d (%x)", link.client_id, owner, token)
        try:
            quiet = await self._quiesce(link)
        except Exception:
            log.exception("bug while handing %s to worker %d", link.client_id, owner)
            quiet = False
        session = link.session
        if (
            not quiet
            or session is None
            or session.link is not link
            or not movable(session)
            or owner not in self.runtime.mesh.peers
        ):
            log.debug("%s: stays (its publishes answered in time: %s)", link.client_id, quiet)
            link._handoff = None  # stays here
            if link.transport is not None and not link.transport.is_closing():
                link.transport.resume_reading()
                self._again(link, key, attempt)
            return
        conn = link.conn
        rest = conn.take_buffered()
        fd = detach(link)  # step 2
        # Nothing more is written here from now on: a delivery to its subscriptions waits
        # at its cursor (can_write), which goes with the session; a close waits too.
        link._closing = True
        try:
            await self._send(owner, token, fd)
        except OSError as e:
            # Expected now and then, and harmless (the connection stays here, tried again
            # later): the owner's channel full for a second (a busy owner), the owner dead.
            expected = isinstance(e, (BlockingIOError, ConnectionRefusedError))
            log.log(
                logging.DEBUG if expected else logging.WARNING,
                "%s: hand-off to worker %d failed: %s",
                link.client_id,
                owner,
                e,
            )
            if session.link is not link or self.router.sessions.get(link.client_id) is not session:
                # Taken over while its descriptor waited [MQTT-3.1.4-3]: not resumed here.
                refuse(fd, link.version, ReasonCode.SESSION_TAKEN_OVER)
                return
            link._closing = False
            link._handoff = rest  # it stays here, on a new transport, the bytes first
            link._parked = -1
            resume(self.server.loop, link, fd).add_done_callback(lambda t: _resumed(link, t))
            self._again(link, key, attempt)
            return
        os.close(fd)
        edge = self.server
        edge.keepalive.discard(link)
        edge.parking.forget(link)
        edge.links.discard(link)
        link._lane = None
        link._ending = None
        self._inflight[token] = link
        state = (
            token,
            link.client_id,
            link.version,
            link.keepalive,
            conn.client_topic_alias_maximum,
            conn.client_receive_maximum,
            conn.client_max_packet_size,
            conn.inbound_aliases,
            conn.plain_topic,
            rest,
            session.receive_maximum,
            session.request_problem_information,
            session.stored,
        )
        try:
            answer = await self.runtime.mesh.call(owner, HANDOFF, marshal.dumps(state))
        except PeerDown:
            answer = b""
        finally:
            self._inflight.pop(token, None)
        log.debug("%s: handed to worker %d: %r", link.client_id, owner, answer)
        if answer == b"1":
            self.runtime.handed_off += 1
        else:
            self._lost(link, session)

    def _again(self, link: MQTTProtocol, key: PartitionKey, attempt: int) -> None:
        if attempt < RETRIES:
            self.server.loop.call_later(RETRY_SECONDS, self._retry, link, key, attempt + 1)

    def _retry(self, link: MQTTProtocol, key: PartitionKey, attempt: int) -> None:
        if not link.closing and link.conn.plain_topic and link._plain_key == key:
            self.consider(link, key, attempt)  # still publishing there

    async def _send(self, owner: int, token: int, fd: int) -> None:
        """Send ``fd`` to ``owner``; its channel holds few messages at once (the kernel's
        ``net.unix.max_dgram_qlen``, 10 by default): a full one is tried again for up to
        :data:`SEND_SECONDS` (a fleet's devices arrive together)."""
        loop = self.server.loop
        deadline = loop.time() + SEND_SECONDS
        while True:
            try:
                self.channel.send(owner, token, fd)
                return
            except BlockingIOError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.001)

    async def _quiesce(self, link: MQTTProtocol) -> bool:
        """Step 1: wait until every publish of ``link`` accepted so far is answered and its
        output is written; False if that takes over :data:`QUIESCE_SECONDS` or the link
        closes."""
        loop = self.server.loop
        deadline = loop.time() + QUIESCE_SECONDS
        forwards = self.runtime.partitions
        await asyncio.sleep(0.001)  # this iteration ended: its FORWARDs left, its commit ran
        mark = forwards.forwards_sent
        while True:
            transport = link.transport
            if link.closing or transport is None or transport.is_closing():
                return False
            if (
                forwards.answered_before(mark)
                and link._out is None
                and not link._held
                and not transport.get_write_buffer_size()
                and not link.conn.inbound_unacked
            ):
                return True
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.001)

    def _release_handed(self, client_id: str, token: int) -> bytes | None:
        """Step 3 on A (the home asks): the session leaves with the connection in flight."""
        link = self._inflight.get(token)
        session = self.router.sessions.get(client_id)

        if link is None or session is None:
            return None
        link.session = None
        return self.router.release_link(session, link)

    def _lost(self, link: MQTTProtocol, session: Session) -> None:
        """The hand-off failed after the socket left: the connection is lost here."""
        link._closing = True
        link.session = None
        if session.link is link and self.router.sessions.get(session.client_id) is session:
            self.router.connection_lost(session, link, graceful=False)

    # ------------------------------------------------------------ the worker taking

    def _on_handoff(self, peer: int, request: int, body: memoryview) -> None:
        if self.stopping:
            # Not taken: its session stays with the sender (the descriptor, when it comes,
            # is closed with the channel).
            self.runtime.mesh.reply(peer, request, b"0")
            return
        state = marshal.loads(body)
        task = self.server.loop.create_task(self._take(peer, state))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

        def answer(done: asyncio.Task[bool]) -> None:
            ok = not done.cancelled() and done.exception() is None and done.result()
            if not done.cancelled() and done.exception() is not None:
                log.error("hand-off from worker %d failed: %r", peer, done.exception())
            self.runtime.mesh.reply(peer, request, b"1" if ok else b"0")

        task.add_done_callback(answer)

    async def _take(self, sender: int, state: tuple[Any, ...]) -> bool:
        (
            token,
            client_id,
            version,
            keepalive,
            alias_maximum,
            client_receive_maximum,
            client_max_packet_size,
            inbound_aliases,
            plain_topic,
            rest,
            receive_maximum,
            problem_info,
            stored,
        ) = state
        fd = await self.channel.take(token)
        if fd is None:
            log.warning("%s: handed by worker %d, its socket never came", client_id, sender)
            return False
        if self.stopping:
            # Its session stays with the sender.
            refuse(fd, version, ReasonCode.SERVER_SHUTTING_DOWN)
            return False
        server = self.server
        link = MQTTProtocol(server)
        link.client_id = client_id
        link.version = version
        link.keepalive = keepalive
        conn = link.conn
        conn.connected = True
        conn.version = version
        if version == 5:
            conn.inbound_unacked = set()
        conn.client_topic_alias_maximum = alias_maximum
        conn.client_receive_maximum = client_receive_maximum
        conn.client_max_packet_size = client_max_packet_size
        conn.inbound_aliases = inbound_aliases

        def adopt(answer: bytes) -> Session | None:
            if answer[:1] != STATE:
                return None
            self.router.adopt(client_id, answer[1:])
            return self.router.attach_handed(link, client_id, receive_maximum, problem_info, stored)

        try:
            session = await self.runtime.sessions.claim_handed(client_id, sender, token, adopt)
        except Exception as e:
            log.warning("%s: the claim of a handed connection failed: %r", client_id, e)
            session = None
        log.debug("%s: from worker %d (%x): %s", client_id, sender, token, session is not None)
        if session is None:
            # Taken over meanwhile [MQTT-3.1.4-3].
            refuse(fd, version, ReasonCode.SESSION_TAKEN_OVER)
            return False
        if link.closing:
            # Taken over right after it came (a release the home asked behind its answer
            # ran as the claim ended, broker.workers.sessions): closed, never resumed.
            refuse(fd, version, ReasonCode.SESSION_TAKEN_OVER)
            return True
        if self.stopping:
            # Taken while this worker stops: closed as its stop closes every connection (the
            # will, the session written before the router closes).
            refuse(fd, version, ReasonCode.SERVER_SHUTTING_DOWN)
            self.router.connection_lost(session, link, graceful=False)
            return True
        link.session = session
        if plain_topic:
            key = self.router.plain_route(client_id, plain_topic)
            if key is not None:
                conn.expect_plain(plain_topic)
                link._plain_key = key
        if server.config.server.connection_messages:
            link._ending = PEER_CLOSED
        link._handoff = rest  # fed to its decoder first (broker.net.parking.resumed)
        link._parked = -1  # connection_made resumes it, as an unparked link
        link.last_received = link.connected_at = server.monotonic()
        server.links.add(link)
        deadline = keepalive_deadline(link)
        if deadline is not None:
            server.keepalive.file(link, deadline)
        self._recent[client_id] = link.last_received
        if len(self._recent) > 100_000:
            self._prune(link.last_received)
        self.handed_in += 1
        resume(server.loop, link, fd).add_done_callback(lambda task: _resumed(link, task))
        return True

    def _prune(self, now: float) -> None:
        self._recent = {c: t for c, t in self._recent.items() if t > now - COOLDOWN}

    async def settle(self) -> None:
        """The worker stops: no hand-off starts or is taken from now on, and the ones under
        way end (each within its own time limits) before the worker writes its sessions
        (module docstring, "Stopping")."""
        self.stopping = True
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=SETTLE_SECONDS)

    def close(self) -> None:
        self.channel.close()


def movable(session: Session) -> bool:
    """Whether ``session`` is cheap to move with its connection: nothing in flight either
    way, no QoS 2 exchange, nothing queued for it, no shared subscription (its group's
    members are counted where they are). Its subscriptions move (a device listening on its
    command topic): each consumer's cursor is the next record not sent, which the taking
    worker sends from (``Session.to_state``, ``SessionStore.adopt``)."""
    return not (
        session.shared
        or session.inflight
        or session.incoming_qos2
        or session.pending_qos2
        or session.pending_retained
        or session.group_queue
        or session.waiting
    )


def _resumed(link: MQTTProtocol, task: asyncio.Task[Any]) -> None:
    error = None if task.cancelled() else task.exception()
    if task.cancelled() or error is not None:
        log.warning("%s: resuming a handed connection failed: %r", link.client_id, error)
        link.connection_lost(error if isinstance(error, Exception) else None)
