"""Where each session lives: a client id is served by one worker at a time.

Connections land on any worker (SO_REUSEPORT picks), so a client that reconnects may land
on another worker than the one holding its session. Each client id has a *home* worker
(``crc32(client id) % workers``) that keeps the registry entry saying which worker holds the
session, and decides every claim on it, one claim per client id at a time:

1. a worker that gets a CONNECT asks the home (``CLAIM``) before it answers the client;
2. if another worker holds the session, the home asks that worker to give it up
   (``RELEASE``): it closes the old connection with 0x8E "session taken over"
   [MQTT-3.1.4-3], takes the session out of its router and answers with the session's
   state (subscriptions, offsets, in-flight messages, QoS 2 packet ids);
3. the home records the new holder and answers the claim with that state, which the new
   worker's router adopts, so nothing is lost and no QoS 2 message is delivered twice.

A session that ends (expiry, clean session) is dropped from the registry (``ENDED``).

Order in ``$sessions``: each worker's records of a client id (its state, a clean session's
tombstone) reach the stream's owner on that worker's own socket, in no order with another
worker's. So a worker answers a release, and tells the home a session ended, only once its
own records of that client id are answered (the router's ``after_written``): the next
holder's records are then appended after them, never before (an older state appended
last undid the newer, and a will was lost when its holder died; 2-7 of ~4,100 per churn run
with three workers).

A connection handed from worker A to worker B (broker.workers.handoff: its socket moved)
takes its session the same way, with a claim that holds only if A still holds it
(``HANDED``): the home asks A to give up the session of that connection (``RELEASE_HANDED``,
naming the hand-off's token), which A does without closing anything, or refuses when the
session was taken over meanwhile (the claim fails and B closes the handed connection as
taken over [MQTT-3.1.4-3]). One claim per client id at a time: exactly one holder.

On a cluster node the home first claims the client id for the node (``cluster``:
broker.workers.replicated_sessions): a session another node held comes with its final state
(the claimant adopts it), and when another node claims one held here the home takes it from
the worker holding it (:meth:`SessionDirectory.surrender`).

When a worker dies, each home takes back the sessions that worker held (their last state is
in the ``$sessions`` stream) and holds them itself, offline, until their clients reconnect
(so their wills and expiry still run). A worker that starts asks its peers which of its home
sessions they hold (``HELD``) and loads the others from ``$sessions``; it decides no claim
before that (:meth:`SessionDirectory.loaded`): its registry is empty until then, and a claim
decided on it would be answered "new" for a session whose state is in the log, which the
claimant would then start afresh (a peer's clients reconnect to it while it restarts).

Called only from the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import zlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from broker.mqtt.packets import Will
from broker.net.context import HERE, NEW, STATE
from broker.workers.mesh import Mesh, PeerDown
from broker.workers.partitions import NEXT_KIND

if TYPE_CHECKING:
    from broker.workers.will_fence import WillFence

log = logging.getLogger("broker.workers")
T = TypeVar("T")

CLAIM = NEXT_KIND
RELEASE = NEXT_KIND + 1
#: Before the client id of a ``RELEASE``: to another node (:meth:`SessionDirectory.surrender`).
_SURRENDER = b"\0"
ENDED = NEXT_KIND + 2
HELD = NEXT_KIND + 3
HANDED = NEXT_KIND + 4
RELEASE_HANDED = NEXT_KIND + 5
#: Kinds from here on are free for the other worker services.
SESSIONS_NEXT_KIND = NEXT_KIND + 6
_HANDED = struct.Struct("<IQ")  # the worker handing the connection, the hand-off's token

#: Seconds a claim keeps retrying while the home worker is down (being restarted).
CLAIM_PATIENCE = 10.0
#: The home's answer to a claim it could not decide (in a cluster: the node's claim failed).
REFUSED = b"X"


class ClaimRefused(Exception):
    """The home worker could not decide a claim (its error is in its log)."""


def _now(client_id: str, then: Callable[[], None]) -> None:
    then()


def home_of(client_id: str, count: int) -> int:
    return zlib.crc32(client_id.encode()) % count


class NodeClaims(Protocol):
    """In a cluster, the node's claims of client ids (broker.workers.replicated_sessions'
    ``ClusterSessions`` of the home worker)."""

    def claim(self, client_id: str, adopt: Callable[[bytes], bytes]) -> Awaitable[bytes]: ...

    def session_ended(self, client_id: str) -> None: ...

    def will_now(self, client_id: str, will: Will) -> bool: ...

    def after_will(self, client_id: str, then: Callable[[], None]) -> None: ...

    def before_release(self, client_id: str, then: Callable[[], None]) -> None: ...

    @property
    def fence(self) -> WillFence: ...


class SessionDirectory:
    """This worker's part of the session registry (see the module docstring).

    The worker connects it to its router through three callables:

    - ``hand_over(client_id) -> bytes | None``: take the session out of this worker (closing
      its connection as taken over) and return its state, None if it has none to give;
    - ``restore(client_ids) -> list[str]``: load these sessions from ``$sessions`` as offline
      sessions held here; returns the ids found;
    - ``held_ids() -> list[str]``: the client ids of the sessions this worker holds.
    """

    def __init__(self, worker: int, count: int) -> None:
        self.worker = worker
        self.count = count
        self.mesh: Mesh | None = None
        #: For client ids whose home is this worker: the worker that holds the session.
        self.registry: dict[str, int] = {}
        self._busy: dict[str, asyncio.Future[None]] = {}
        #: Claims of this worker answered by a home on another worker and not adopted yet
        #: (the answer read, the claimant's turn to run not come), and the releases of the
        #: same client ids waiting for them (see :meth:`claim`).
        self._answered: dict[str, set[object]] = {}
        self._deferred: dict[str, list[Callable[[], None]]] = {}
        #: What waits for this worker's records to be answered (:meth:`when_written`; kept:
        #: a task nothing references may be collected).
        self._waiting: set[asyncio.Task[None]] = set()
        #: Claims of this worker under way, per client id (see :meth:`ended`).
        self._claiming: dict[str, int] = {}
        #: How many times each peer was seen to die (:meth:`peer_down`): a claim decided
        #: for a worker that died since its claim was read is taken back (see _decide).
        self._deaths: dict[int, int] = {}
        self.hand_over: Callable[[str], bytes | None] = lambda client_id: None
        self.restore: Callable[[list[str]], list[str]] = lambda client_ids: []
        self.held_ids: Callable[[], list[str]] = list
        #: ``release_handed(client_id, token) -> bytes | None``: the hand-off ``token`` of
        #: ``client_id`` is over: its session leaves this worker (its state; None: not held
        #: by that connection any more).
        self.release_handed: Callable[[str, int], bytes | None] = lambda client_id, token: None
        #: ``after_written(client_id, then)``: ``then()`` once the ``$sessions`` records of
        #: ``client_id`` this worker wrote are answered (broker.router.store): a session
        #: that leaves here is answered for, and its end told to its home, only then, so
        #: that no record of it from here is appended after its next holder's.
        self.after_written: Callable[[str, Callable[[], None]], None] = _now
        #: ``settled()``: until the records this worker forwarded so far (a connection's
        #: publishes, a retained copy among them) are answered by their owners, bounded
        #: (broker.workers.runtime). A session taken over from here is answered for only
        #: then: its next connection's records, forwarded by another worker on another
        #: socket, must not overtake its last ones (a retained message acknowledged on the
        #: new connection was replaced by an older one of the old).
        self.settled: Callable[[], Awaitable[None]] | None = None
        self.claims = 0
        self.takeovers = 0  # sessions handed from one worker to another
        #: In a cluster: a claim is the node's first (the client id may be held by another
        #: node: it must release it), then this worker's (set by the server).
        self.cluster: NodeClaims | None = None
        #: Set once the registry holds every session homed here (:meth:`loaded`): claims
        #: wait for it.
        self._ready = asyncio.Event()

    def handlers(self) -> dict[int, Callable[[int, int, memoryview], None]]:
        return {
            CLAIM: self._on_claim,
            RELEASE: self._on_release,
            ENDED: self._on_ended,
            HELD: self._on_held,
            HANDED: self._on_handed,
            RELEASE_HANDED: self._on_release_handed,
        }

    def home(self, client_id: str) -> int:
        return home_of(client_id, self.count)

    # ------------------------------------------------------------ the claimant

    async def claim(self, client_id: str, adopt: Callable[[bytes], T]) -> T:
        """Make this worker the holder of ``client_id``'s session and return what
        ``adopt(answer)`` returns; ``answer`` is :data:`NEW`, :data:`HERE` or :data:`STATE`
        + the state, and ``adopt`` creates or takes over the session in the router.

        A release asked of this worker between the answer and ``adopt`` waits until
        ``adopt`` ran: the home may send it right behind its answer (deciding another
        worker's claim, or a hand-off's), and it must find the session adopted, or the
        session would end up on two workers. A release asked before the answer is not
        kept waiting: this claim is then queued at the home behind the decision that asks
        it, which would wait for the release forever. Raises :class:`PeerDown` if the
        home stays unreachable for :data:`CLAIM_PATIENCE` seconds.
        """
        return await self._claim(client_id, adopt, None)

    async def claim_handed(
        self, client_id: str, sender: int, token: int, adopt: Callable[[bytes], T]
    ) -> T:
        """:meth:`claim` for a connection ``sender`` handed here (hand-off ``token``): it
        holds only if ``sender`` still holds the session for that connection; else
        ``adopt(REFUSED)``."""
        return await self._claim(client_id, adopt, (sender, token))

    async def _claim(
        self, client_id: str, adopt: Callable[[bytes], T], handed: tuple[int, int] | None
    ) -> T:
        self.claims += 1
        claim = object()
        self._claiming[client_id] = self._claiming.get(client_id, 0) + 1
        try:
            return adopt(await self._ask_home(client_id, claim, handed))
        finally:
            if self._claiming[client_id] == 1:
                del self._claiming[client_id]
            else:
                self._claiming[client_id] -= 1
            answered = self._answered.get(client_id)
            if answered is not None:
                answered.discard(claim)
                if not answered:
                    del self._answered[client_id]
                    for release in self._deferred.pop(client_id, ()):
                        release()

    async def _ask_home(
        self, client_id: str, claim: object, handed: tuple[int, int] | None = None
    ) -> bytes:
        home = self.home(client_id)
        if home == self.worker:
            # Decided and adopted in one turn of this task: no release comes between.
            return await self._decide(client_id, self.worker, handed)
        if handed is not None:  # no retry: the sender waits for this claim's end
            body = _HANDED.pack(*handed) + client_id.encode()
            return await self._call(home, HANDED, body, client_id, claim)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLAIM_PATIENCE
        while True:
            try:
                answer = await self._call(home, CLAIM, client_id.encode(), client_id, claim)
            except PeerDown:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.1)  # the supervisor is restarting it
                continue
            if answer == REFUSED:
                raise ClaimRefused(f"worker {home} could not decide the claim of {client_id!r}")
            return answer

    def _call(
        self, home: int, kind: int, body: bytes, client_id: str, claim: object
    ) -> asyncio.Future[bytes]:
        """Ask ``home``; the answer marks ``claim`` answered as it is read (before any
        message behind it: a future's callbacks would run after those)."""
        assert self.mesh is not None
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        def on_reply(answer: bytes | None) -> None:
            if future.done():
                return  # the claimant went away
            if answer is None:
                future.set_exception(PeerDown(f"worker {home} went away"))
                return
            self._answered.setdefault(client_id, set()).add(claim)
            future.set_result(answer)

        self.mesh.request(home, kind, body, on_reply)
        return future

    def when_written(self, client_id: str, then: Callable[[], None]) -> None:
        """Call ``then`` once this worker's records of ``client_id`` are answered
        (:meth:`_written`)."""

        async def wait() -> None:
            await self._written(client_id)
            then()

        task = asyncio.get_running_loop().create_task(wait())
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)

    async def _written(self, client_id: str) -> None:
        """Until this worker's records of ``client_id`` are answered: those it forwarded
        (:attr:`settled`) and its ``$sessions`` records (:attr:`after_written`)."""
        if self.settled is not None:
            await self.settled()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def answered() -> None:
            if not done.done():
                done.set_result(None)

        self.after_written(client_id, answered)
        await done

    def ended(self, client_id: str) -> None:
        """The session of ``client_id`` held here ended (and its tombstone is answered,
        :attr:`after_written`): tell its home. Not while a claim of the client id from here
        is under way: its answer makes this worker the holder anew ("here", as the home
        still has it), and an end told behind it would take that entry away, leaving the
        next claim to start a second session while this one's connection goes on."""
        if client_id in self._claiming:
            return
        home = self.home(client_id)
        if home == self.worker:
            self._forget(client_id, self.worker)
        elif self.mesh is not None and home in self.mesh.peers:
            self.mesh.send(home, ENDED, client_id.encode())

    # ------------------------------------------------------------ the home

    async def _decide(
        self,
        client_id: str,
        claimant: int,
        handed: tuple[int, int] | None = None,
        reply: Callable[[bytes], None] | None = None,
        deaths: int = 0,
    ) -> bytes:
        """Decide a claim of ``client_id`` by ``claimant`` and return the answer; for
        another worker's claim, ``reply`` sends it (:data:`REFUSED` if deciding failed)
        before the next claim of the client id is decided: a release that decision asks
        of the claimant then follows this answer on the mesh (see :meth:`claim`). Not
        before the sessions homed here are known (:meth:`loaded`). ``deaths``: the
        claimant's count in :attr:`_deaths` when its claim was read."""
        if not self._ready.is_set():
            await self._ready.wait()
        while (busy := self._busy.get(client_id)) is not None:
            await asyncio.shield(busy)  # one claim per client id at a time
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._busy[client_id] = done
        try:
            try:
                answer = await self._decide_turn(client_id, claimant, handed)
                if self.registry.get(client_id) == claimant and (
                    self._gone(claimant) or self._deaths.get(claimant, 0) != deaths
                ):
                    # The claimant died after its claim was read (after peer_down() took back
                    # what it held; it may be back already, restarted, holding nothing): the
                    # session it was given comes back here the same way (its last holder's
                    # records are in the log, :attr:`after_written`). Left to it, the entry
                    # would send every later claim of the client id to the dead worker, or to
                    # its replacement, which would answer "new": the session lost.
                    self._take_back(claimant, [client_id])
            except Exception as e:
                if reply is None:
                    raise
                log.error(
                    "worker %d: claim of %r for worker %d failed: %r",
                    self.worker,
                    client_id,
                    claimant,
                    e,
                )
                answer = REFUSED
            if reply is not None:
                reply(answer)
            return answer
        finally:
            del self._busy[client_id]
            done.set_result(None)

    async def _decide_turn(
        self, client_id: str, claimant: int, handed: tuple[int, int] | None
    ) -> bytes:
        """:meth:`_decide`, in the claim's turn."""
        if self.cluster is not None:
            answer = await self.cluster.claim(client_id, _same)
            if answer != HERE:  # new, or another node's final state: not held here
                self.registry[client_id] = claimant
                return answer
        if handed is not None:
            return await self._decide_handed(client_id, claimant, *handed)
        while True:
            holder = self.registry.get(client_id)
            if holder is None:
                self.registry[client_id] = claimant
                return NEW
            if holder == claimant:
                return HERE
            if self._gone(holder):
                # Dead before this entry named it (see _decide): asking it would fail at once,
                # and again, without this loop ever yielding.
                self._take_back(holder, [client_id])
                continue
            try:
                state = await self._release_at(holder, client_id)
            except PeerDown:
                # The holder died: peer_down() took its sessions back here; ask again.
                continue
            self.registry[client_id] = claimant
            if not state:
                return NEW
            self.takeovers += 1
            return STATE + state

    async def _decide_handed(self, client_id: str, claimant: int, sender: int, token: int) -> bytes:
        """A handed connection's claim (module docstring), in the claim's turn."""
        if self.registry.get(client_id, sender) != sender:
            return REFUSED  # taken over meanwhile
        # (None: unregistered, as a client id the broker assigned, which is never claimed:
        # the sender's answer decides, naming the connection in flight.)
        if sender == self.worker:
            state = self.release_handed(client_id, token)
            if state is not None:
                await self._written(client_id)
        else:
            assert self.mesh is not None
            try:
                body = token.to_bytes(8, "little") + client_id.encode()
                state = await self.mesh.call(sender, RELEASE_HANDED, body) or None
            except PeerDown:
                return REFUSED
        if state is None:
            return REFUSED
        self.registry[client_id] = claimant
        return STATE + state

    async def _release_at(self, holder: int, client_id: str, surrender: bool = False) -> bytes:
        if holder == self.worker:
            state = self.hand_over(client_id) or b""
            await self._written(client_id)
            return state
        assert self.mesh is not None
        body = (_SURRENDER if surrender else b"") + client_id.encode()
        return await self.mesh.call(holder, RELEASE, body)

    async def surrender(self, client_id: str) -> bytes | None:
        """Another node took ``client_id`` over: the worker holding its session here gives
        it up (its connection closed as taken over [MQTT-3.1.4-3]); returns its state."""
        while (busy := self._busy.get(client_id)) is not None:
            await asyncio.shield(busy)  # a claim here in progress: it ends first
        holder = self.registry.pop(client_id, None)
        if holder is None:
            return None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._busy[client_id] = done  # and a claim here waits for this one
        try:
            return await self._release_at(holder, client_id, surrender=True) or None
        except PeerDown:
            return None  # that worker died: its last state is what the log holds
        finally:
            del self._busy[client_id]
            done.set_result(None)

    def _on_claim(self, peer: int, request: int, body: memoryview) -> None:
        client_id = bytes(body).decode()
        mesh = self.mesh
        assert mesh is not None

        def reply(answer: bytes) -> None:
            mesh.reply(peer, request, answer)

        deaths = self._deaths.get(peer, 0)
        asyncio.get_running_loop().create_task(
            self._decide(client_id, peer, reply=reply, deaths=deaths)
        )

    def _on_release(self, peer: int, request: int, body: memoryview) -> None:
        surrender = body[:1] == _SURRENDER
        client_id = bytes(body[1:] if surrender else body).decode()
        mesh = self.mesh
        assert mesh is not None

        def release() -> None:
            state = self.hand_over(client_id) or b""
            self.when_written(client_id, lambda: mesh.reply(peer, request, handed(state)))

        def handed(state: bytes) -> bytes:  # to another node: with a will left to an adopter
            cluster = self.cluster
            if cluster is None or not surrender:
                return state
            return cluster.fence.hand_left(client_id, state) or b""

        if client_id in self._answered:
            self._deferred.setdefault(client_id, []).append(release)  # see claim()
        else:
            release()

    def _on_handed(self, peer: int, request: int, body: memoryview) -> None:
        sender, token = _HANDED.unpack_from(body)
        client_id = bytes(body[_HANDED.size :]).decode()
        mesh = self.mesh
        assert mesh is not None

        def reply(answer: bytes) -> None:
            mesh.reply(peer, request, answer)

        deaths = self._deaths.get(peer, 0)
        asyncio.get_running_loop().create_task(
            self._decide(client_id, peer, (sender, token), reply, deaths)
        )

    def _on_release_handed(self, peer: int, request: int, body: memoryview) -> None:
        token = int.from_bytes(body[:8], "little")
        client_id = bytes(body[8:]).decode()
        mesh = self.mesh
        assert mesh is not None

        def release() -> None:
            state = self.release_handed(client_id, token) or b""
            self.when_written(client_id, lambda: mesh.reply(peer, request, state))

        if client_id in self._answered:
            # A new connection of this client here claimed it: the home answered that claim
            # and asks this release right behind. The new connection takes the session
            # first; the hand-off then finds it taken over and is refused (see claim()).
            self._deferred.setdefault(client_id, []).append(release)
        else:
            release()

    def _on_ended(self, peer: int, request: int, body: memoryview) -> None:
        self._forget(bytes(body).decode(), peer)

    def _forget(self, client_id: str, holder: int) -> None:
        # Only if that worker still holds it: a claim may have moved it since.
        if self.registry.get(client_id) == holder and client_id not in self._busy:
            del self.registry[client_id]
            if self.cluster is not None:
                self.cluster.session_ended(client_id)  # the node's claim ends too

    # ------------------------------------------------------------ restarts

    def peer_down(self, peer: int) -> None:
        """``peer`` died: the sessions homed here that it held are restored here."""
        self._deaths[peer] = self._deaths.get(peer, 0) + 1
        self._take_back(peer, [cid for cid, holder in self.registry.items() if holder == peer])

    def _take_back(self, peer: int, lost: list[str]) -> None:
        """Restore here the sessions of ``lost``, which dead ``peer`` held."""
        if not lost:
            return
        found = set(self.restore(lost))
        for cid in lost:
            if cid in found:
                self.registry[cid] = self.worker
            else:
                del self.registry[cid]
        missing = [cid for cid in lost if cid not in found]
        log.warning(
            "worker %d: worker %d died holding %d sessions homed here; %d restored from the log%s",
            self.worker,
            peer,
            len(lost),
            len(found),
            f" (not in it: {', '.join(missing[:10])})" if missing else "",
        )

    def _gone(self, worker: int) -> bool:
        """Whether ``worker`` is another worker this one has seen die (not back yet)."""
        return worker != self.worker and self.mesh is not None and worker not in self.mesh.peers

    async def held_elsewhere(self) -> dict[str, int]:
        """At start: which sessions homed here the peers hold (they stay there)."""
        assert self.mesh is not None
        held: dict[str, int] = {}
        for peer in list(self.mesh.peers):
            body = await self.mesh.call(peer, HELD, self.worker.to_bytes(4, "little"))
            for cid in body.decode().split("\0") if body else ():
                held[cid] = peer
        self.registry.update(held)
        return held

    def _on_held(self, peer: int, request: int, body: memoryview) -> None:
        home = int.from_bytes(body, "little")
        assert self.mesh is not None
        ids = [cid for cid in self.held_ids() if self.home(cid) == home]
        # NUL separates: an MQTT string never contains U+0000 [MQTT-1.5.4-2].
        self.mesh.reply(peer, request, "\0".join(ids).encode())

    def loaded(self, client_ids: list[str]) -> None:
        """At start, after :meth:`held_elsewhere`: these sessions homed here were loaded
        from the log and are held here; the registry is complete, claims are decided from
        now on."""
        for cid in client_ids:
            self.registry.setdefault(cid, self.worker)
        self._ready.set()


def _same(answer: bytes) -> bytes:
    return answer
