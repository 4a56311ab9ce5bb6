"""Replicated sessions: ``$sessions`` as a Raft group, each client id owned by one node at a time.

In a cluster ``$sessions`` is a Raft group like ``$retained`` (broker.workers.replicated's
``CLUSTER_SPECS``): a session's state, written through the group commit as on one node
(broker.router.store), is acknowledged once the quorum committed it, and every node applies
each commit, in log order, to its knowledge of the sessions (:class:`ClusterSessions`):
``states`` (the latest state record per client id) and ``owners`` (the node that holds each
client id's session, and its connection epoch). So a client reconnecting with a clean start
of 0 to ANY node finds its subscriptions, log positions and unacknowledged QoS 1/2 state.

Ownership is decided in the log. Beside a client id's state record (key: the client id), its
*claim* record (key: NUL + the client id: an MQTT string never contains U+0000
[MQTT-1.5.4-2], so no client id or ``$share/...`` filter is one) names the owning node and
an epoch. Every CONNECT with a client id on a node that does not own it:

1. proposes a claim ``(this node, epoch + 1)``, where ``epoch`` is the latest this node applied;
   applied on every node in log order, a claim is valid only if its epoch is greater than the
   current one, so of two connects racing on two nodes exactly one claim of an epoch wins; the
   loser claims again above it (:data:`CLAIM_ATTEMPTS`), and the last connection wins, as on
   one node [MQTT-3.1.4-3];
2. the previous owner, applying the winning claim while it serves, closes the connection it
   holds (5.0: DISCONNECT 0x8E Session taken over [MQTT-3.1.4-3]), takes the session out of
   its router and writes its final state, then a *release* record naming the new owner and
   epoch, in that order, in one batch;
3. the claimant waits for the release (at most :data:`TAKEOVER_TIMEOUT`; not at all when
   the previous owner's node is not connected) and adopts the latest state applied, the
   final one; a previous owner that is dead or cut off is logged, and the session continues
   from its last committed state. A claim overtaken meanwhile by another node's refuses this
   connection, so exactly one stays connected.

A node that owns the client id connects it at once (the previous connection, if any, is
closed by the router as on one node); a claim committed meanwhile elsewhere takes it away
right after. At start a node loads only the sessions it owns (broker.workers.cluster_hooks); claims
applied while it catches up, before it serves, move sessions away without a release (their
claimants did not wait for this dead node), and once caught up it reloads the sessions it
owns from what it applied (:meth:`ClusterSessions.resume`).

With several workers per node, every worker applies ``$sessions`` (the one that owns it at
each commit, the others as it announces its new mark: :meth:`ClusterSessions.follow`), and
acts for the client ids homed at it (``crc32 % workers``, broker.workers.sessions): their
claims (the home's session directory claims for the node before it decides which worker holds
the session), releases (the worker holding the session gives it up), assertions and ends.

The sessions of a node gossip declares dead are claimed by one survivor (an *orphan* claim),
which runs their wills and expiry (broker.workers.orphans); a will goes out only from the node
whose *will record*, on the ownership key, is applied while its epoch is the owner's
(broker.workers.will_fence).

**Ownership records and compaction.** ``$sessions`` is compacted (each node its own copy, at
its own time; a follower may be sent a compacted copy), which keeps only the last record of
each key and drops a key whose last record is a tombstone. So the last ownership record of a
client id alone must say what the whole history says, and a session that ends must end with a
tombstone:

* a session the router ends (clean start, expiry, a clean session's disconnection) ends its
  ownership: the owner writes a tombstone of the claim unless its client is connecting again
  (:meth:`ClusterSessions.session_ended`), and compaction then removes both records;
* a release (or assertion, below) names the owner it follows: applied where nobody holds the
  client id (its claim compacted away, or a tombstone committed out of turn), it makes that
  node the owner again;
* a record that lost (a claim of a stale epoch, a release of an earlier epoch, another node's
  tombstone committed after this node's claim, a will record of a stale epoch) is answered by
  the owner with an *assertion* ``(owner, epoch)``, so the last word is the owner's again;
* a will record that won is followed by its *out* record, an assertion, once the will is
  published (broker.workers.will_fence); until then it is the last word, and says that the
  will is pending, as the history does.

Between a record that lost and the assertion (one commit) a compaction of that very range
could still keep the stale record; a node reading that copy learns the owner from the
assertion that follows it.

Called only from the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import orjson

from broker.cluster.placement import node_id_of
from broker.commitlog import Record, SegmentedLog
from broker.mqtt.packets import Will
from broker.net.context import HERE, NEW, STATE
from broker.router.commit import OUTCOME_UNKNOWN
from broker.router.state import SESSIONS
from broker.router.store import OWNERSHIP
from broker.workers.cluster_groups import ClusterGroupPeers
from broker.workers.forwards import Claims, refuse_held
from broker.workers.orphans import Orphans
from broker.workers.sessions import SessionDirectory, home_of
from broker.workers.will_fence import LEFT, WillFence

if TYPE_CHECKING:
    from broker.cluster.node import ClusterNode
    from broker.router.router import Router

log = logging.getLogger("broker.cluster")
T = TypeVar("T")

#: Key prefix of a claim (and release) record in ``$sessions`` (module docstring); the
#: session store never loads these as sessions.
CLAIM_PREFIX = OWNERSHIP
#: Seconds a claim waits to be committed and applied here.
CLAIM_TIMEOUT = 10.0
#: Seconds a claimant waits for the previous owner's release (then goes on without it).
TAKEOVER_TIMEOUT = 3.0
#: Claims one CONNECT makes before it is refused (each lost to a connect on another node).
CLAIM_ATTEMPTS = 3

#: What a claim that lost (its epoch not above the current one when applied) resolves to.
_LOST = -1


class Owner(NamedTuple):
    """The node holding a client id's session (a Raft node id) and its connection epoch."""

    node: int
    epoch: int


class ClaimError(Exception):
    """A CONNECT's claim failed: no commit in time, or other nodes' connections won."""


class ClusterSessions:
    """This node's knowledge of every session and the claims of its CONNECTs (module
    docstring). ``router`` is set once the router exists; :attr:`serving` once the node
    caught up and serves clients."""

    def __init__(
        self,
        node: ClusterNode,
        sessions_log: SegmentedLog | None,
        worker: tuple[int, int] = (0, 1),
    ) -> None:
        self.node = node
        self.router: Router | None = None
        self.serving = False
        #: This worker's index and the node's worker count: a worker acts for the client
        #: ids whose home it is (``crc32 % workers``, broker.workers.sessions).
        self.worker = worker
        #: With several workers: the node's session directory (who holds each client id
        #: homed here); set by the server.
        self.directory: SessionDirectory | None = None
        #: Client id -> its owner, as of the last ``$sessions`` record applied.
        self.owners: dict[str, Owner] = {}
        #: Client id -> its latest state record's payload (the router's ``to_state`` JSON).
        self.states: dict[str, bytes] = {}
        #: Client id -> its latest claim applied (a leader refuses the records a node
        #: accepted before another's claim: broker.workers.forwards.zombies).
        self.claims = Claims()
        #: Client id -> the epoch of the latest release applied since its last claim.
        self.released: dict[str, int] = {}
        self.takeovers = 0
        #: The sessions of dead members, adopted here while this node leads ``$sessions``.
        self.orphans = Orphans(self)
        #: Wills published once across the nodes.
        self.fence = WillFence(self)
        self._claims: dict[tuple[str, int], asyncio.Future[int | None]] = {}
        #: Client ids this node is claiming now (a CONNECT's or an orphan's claim), each with
        #: what its claim sets once it is over (the next claim of the client id waits for it).
        self._claiming: dict[str, asyncio.Future[None]] = {}
        #: Client id -> the epoch of this node's ownership whose end it wrote.
        self._ending: dict[str, int] = {}
        self._releases: dict[tuple[str, int], asyncio.Future[None]] = {}
        #: Client ids whose CONNECT here waits for this node's end of their ownership.
        self._end_waiters: dict[str, asyncio.Future[bool]] = {}
        #: Shared group (full filter) -> its latest positions record's payload.
        self.groups: dict[str, bytes] = {}
        #: Shared groups across the nodes: held by the ``$sessions`` leader (used by the
        #: worker hosting ``$sessions``).
        self.group_peers = ClusterGroupPeers(node, self.groups)
        #: ``$sessions`` offsets below this are applied (None: not read yet, a worker that
        #: does not own ``$sessions`` reads it once the owner announced its mark).
        self.applied: int | None = None
        self._resumed = asyncio.Event()
        if sessions_log is not None:
            # What this node's log holds (up to its pinned high-water mark) is known at once.
            log_ = sessions_log
            self._read(log_.read, log_.log_start_offset, log_.high_watermark)

    def _read(self, read: Callable[..., list[Record]], offset: int, end: int) -> None:
        while offset < end:
            records = read(offset, max_records=1000)
            if not records:
                break
            self.apply([r for r in records if r.offset < end])
            offset = records[-1].offset + 1
        self.applied = end

    def follow(self, key: object, old_end: int, part: Any) -> None:
        """Another worker of this node owns ``$sessions`` and announced its new mark: apply
        what was committed since (broker.workers.partitions' ``on_moved``)."""
        if key == SESSIONS and self.applied is not None:
            self._read(part.log.read, max(self.applied, old_end), part.end_offset)

    def home(self, client_id: str) -> bool:
        """Whether this worker acts for ``client_id`` on this node."""
        index, count = self.worker
        return count == 1 or home_of(client_id, count) == index

    def holds(self, client_id: str) -> bool:
        """Whether a worker of this node holds ``client_id``'s session."""
        if self.directory is not None:
            return client_id in self.directory.registry
        return self.router is not None and client_id in self.router.sessions

    def held_here(self, client_id: str) -> None:
        """This worker adopted ``client_id``'s session (broker.workers.orphans)."""
        if self.directory is not None:
            self.directory.registry[client_id] = self.worker[0]

    def resume(self) -> None:
        """The node caught up and is about to serve: the router holds exactly the sessions
        this node owns (of those homed at this worker), each in its latest committed state
        (the log the router loaded at start ended at the commit known then; what committed
        since was applied here only). Sessions no claim names (written before the cluster)
        stay as loaded."""
        router = self.router
        assert router is not None
        if self.applied is None:
            part = router.partition(SESSIONS)
            self._read(part.log.read, part.log.log_start_offset, part.end_offset)
        me = self.node.id
        registry = self.directory.registry if self.directory is not None else None
        for client_id in list(router.sessions):
            owner = self.owners.get(client_id)
            if owner is not None and owner.node != me:
                router.hand_over(client_id)  # offline: it only leaves this router
                if registry is not None and registry.get(client_id) == self.worker[0]:
                    del registry[client_id]
        for client_id, owner in self.owners.items():
            if owner.node != me or not self.home(client_id):
                continue
            if registry is not None and registry.get(client_id, self.worker[0]) != self.worker[0]:
                continue  # another worker of this node holds it (it restarted; not this one)
            if client_id in router.sessions:
                router.hand_over(client_id)
            state = self.states.get(client_id)
            if state:
                router.adopt(client_id, state)
                if registry is not None:
                    registry[client_id] = self.worker[0]
        self.serving = True
        self._resumed.set()
        self.fence.resume()
        if SESSIONS in self.node.group_keys.values():
            # The worker hosting $sessions speaks for its node's shared groups (with
            # several workers, for the others too: broker.workers.cluster_group_frames).
            self.group_peers.start(router)

    async def resumed(self, _: object = None) -> int:
        """Once this worker has caught up and serves (:meth:`resume`): the ``$sessions``
        offset it applied up to (the other workers of the node wait for it at start)."""
        await self._resumed.wait()
        return self.applied or 0

    # -- applying commits (every node) ----------------------------------------------------

    def apply(self, records: Iterable[Record]) -> None:
        """Committed ``$sessions`` records, in log order (module docstring)."""
        for rec in records:
            key = rec.topic
            if key.startswith(CLAIM_PREFIX):
                self._apply_claim(key[len(CLAIM_PREFIX) :], rec.payload, rec.timestamp)
            elif key.startswith("$share/"):
                if rec.payload:  # a shared group's positions (broker.workers.cluster_groups)
                    self.groups[key] = rec.payload
                else:
                    self.groups.pop(key, None)
            elif rec.payload:
                self.states[key] = rec.payload
            else:
                self.states.pop(key, None)  # the session ended [MQTT-3.1.2-4]

    def _apply_claim(self, client_id: str, payload: bytes, at: int) -> None:
        """A claim, release, assertion or end of ``client_id``'s ownership (module
        docstring, "Ownership records and compaction")."""
        me = self.node.id
        current = self.owners.get(client_id)
        if not payload:  # the session ended: nobody holds it
            self.owners.pop(client_id, None)
            self.claims.ended(client_id)
            self.released.pop(client_id, None)
            self.fence.ended(client_id)
            ended = self._ending.pop(client_id, None)
            waiting = self._end_waiters.pop(client_id, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(True)
            if current is None or current.node != me:
                return
            if waiting is not None and not self.holds(client_id):
                return  # its client's CONNECT here waited for this end: it claims anew
            if ended != current.epoch or self._holds(client_id):
                # An earlier owner's end committed after this node's claim, or this node's
                # own while its client came back: it still holds the session.
                self._assert(client_id, current.epoch)
            return
        body = orjson.loads(payload)
        node, epoch = node_id_of(body["node"]), body["epoch"]
        if self.fence.applied(client_id, node, epoch, body):
            if current is not None and current.node == me and current != (node, epoch):
                self._assert(client_id, current.epoch)  # a stale will: not left the last word
            return
        if "released_by" in body or "asserted" in body:
            if "released_by" in body and node == me:  # a will it hands over (will_fence)
                self.fence.released(client_id, epoch, body.get(LEFT), client_id in self._claiming)
            if current is None or current.epoch <= epoch:
                # The record names the owner its claim of this epoch made: that is the
                # owner, also alone in a compacted log, or after a stale claim of the same
                # epoch that compaction kept, or after an end committed out of turn.
                self.owners[client_id] = current = Owner(node, epoch)
                if node == me and not self._holds(client_id):
                    self.session_ended(client_id)  # an old release after the end: end again
            if current == (node, epoch):
                if "released_by" in body:
                    self._released(client_id, epoch)
            elif current.node == me:
                self._assert(client_id, current.epoch)  # not left the last word
            return
        if current is not None and epoch <= current.epoch:
            # Another connection's claim of this epoch came first: this one lost the race.
            if node == me:
                self._resolve(client_id, epoch, _LOST)
            if current.node == me:
                self._assert(client_id, current.epoch)  # not left the last word
            return
        self.owners[client_id] = Owner(node, epoch)
        self.claims.claimed(client_id, node, at)
        self.released.pop(client_id, None)
        self._ending.pop(client_id, None)
        previous = current.node if current is not None else None
        self.fence.claimed(client_id, node, previous, "orphan" in body, epoch)
        if node == me:
            self._resolve(client_id, epoch, previous)
        else:
            refuse_held(self.router.partitions.values() if self.router else (), client_id)
            self._release(client_id, previous, node, epoch)

    def _holds(self, client_id: str) -> bool:
        return client_id in self._claiming or self.holds(client_id)

    def _released(self, client_id: str, epoch: int) -> None:
        self.released[client_id] = epoch
        waiter = self._releases.pop((client_id, epoch), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _assert(self, client_id: str, epoch: int) -> None:
        """Write that this node holds ``client_id`` at ``epoch`` again: the last ownership
        record of a client id must name its owner (a stale one would, once compaction kept
        only it, name another)."""
        router = self.router
        if not self.serving or router is None or not self.home(client_id):
            return  # catching up (its own record follows), or another worker's client id
        body = orjson.dumps({"node": self.node.name, "epoch": epoch, "asserted": True})
        row = (router.state.now_ms(), CLAIM_PREFIX + client_id, body, 0, False, "", b"")
        router.append_forwarded(SESSIONS, [row], _ignore)

    def will_now(self, client_id: str, will: Will) -> bool:
        """The router's will of ``client_id`` is due (broker.workers.will_fence)."""
        return self.fence.will_now(client_id, will)

    def after_will(self, client_id: str, then: Callable[[], None]) -> None:
        """``then()`` once this worker's will of ``client_id`` is out (will_fence)."""
        self.fence.after_will(client_id, then)

    def before_release(self, client_id: str, then: Callable[[], None]) -> None:
        """:meth:`after_will`, at most :data:`TAKEOVER_TIMEOUT` (:meth:`_release`)."""
        self.fence.after_will(client_id, then, TAKEOVER_TIMEOUT)

    def session_ended(self, client_id: str) -> None:
        """The router ended ``client_id``'s session (clean start, expiry, a clean session's
        disconnection): unless its client is connecting here again, the ownership ends too,
        so that compaction removes the claim (a tombstone)."""
        owner = self.owners.get(client_id)
        mine = owner is not None and owner.node == self.node.id
        if owner is not None and mine and self.serving and self.home(client_id):
            self.node.loop.call_soon(self._end, client_id, owner.epoch)

    def _end(self, client_id: str, epoch: int) -> None:
        router = self.router
        if router is None or self._holds(client_id) or self.fence.busy(client_id):
            return  # connected again (a clean start), being claimed here, or its will going out
        if self.owners.get(client_id) != (self.node.id, epoch):
            return  # claimed by another node meanwhile
        self._ending[client_id] = epoch
        row = (router.state.now_ms(), CLAIM_PREFIX + client_id, b"", 0, False, "", b"")

        def answered(offset: int | None) -> None:
            if offset is None and self._ending.get(client_id) == epoch:  # refused: not ending
                del self._ending[client_id]
                if (waiting := self._end_waiters.pop(client_id, None)) and not waiting.done():
                    waiting.set_result(False)
            _ignore(offset)

        router.append_forwarded(SESSIONS, [row], answered)

    def _resolve(self, client_id: str, epoch: int, outcome: int | None) -> None:
        waiter = self._claims.pop((client_id, epoch), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)

    def _release(self, client_id: str, previous: int | None, to: int, epoch: int) -> None:
        """Node ``to`` owns ``client_id`` from ``epoch`` on: if the session was this node's,
        its connection here is closed as taken over [MQTT-3.1.4-3] and, while serving, its
        final state and the release go in the log for the claimant, after this node's wills
        of it are out (at most :data:`TAKEOVER_TIMEOUT`): released, the claimant publishes
        none of them (a node killed before leaves no release, and the claimant does)."""
        if not self.home(client_id):
            return  # the worker this client id is homed at acts
        if self.directory is not None:
            if previous == self.node.id or self.holds(client_id):
                self.node.loop.create_task(self._surrender(client_id, to, epoch))
            return
        router = self.router
        held = router is not None and client_id in router.sessions
        if previous != self.node.id and not held:
            return
        state = router.hand_over(client_id) if router is not None and held else None
        release = partial(self._write_release, client_id, state, held, to, epoch)
        self.before_release(client_id, release)

    async def _surrender(self, client_id: str, to: int, epoch: int) -> None:
        """:meth:`_release` with several workers: the worker holding the session gives it up
        (broker.workers.sessions; its wills out first), then the release is written; only
        while that claim is the owner's: a node catching up applies superseded claims, whose
        surrenders took the session from the connection holding it at a later epoch."""
        assert self.directory is not None
        if self.owners.get(client_id) != (to, epoch):
            return
        held = self.holds(client_id)
        state = await self.directory.surrender(client_id)
        self._write_release(client_id, state, held, to, epoch)

    def _write_release(
        self, client_id: str, state: bytes | None, held: bool, to: int, epoch: int
    ) -> None:
        router = self.router
        if not self.serving or router is None:
            return  # catching up at start: that claimant did not wait for this node
        now = router.state.now_ms()
        state, will = self.fence.take_left(client_id, state)
        release = {"node": self.node.names.get(to, str(to)), "epoch": epoch}
        release["released_by"] = self.node.name
        if will is not None:
            release[LEFT] = will
        rows = [(now, CLAIM_PREFIX + client_id, orjson.dumps(release), 0, False, "", b"")]
        if state is not None:
            rows.insert(0, (now, client_id, state, 0, False, "", b""))
        router.append_forwarded(SESSIONS, rows, _ignore)
        self.takeovers += 1
        log.info(
            "cluster: %s: session taken over by node %s (epoch %d)%s",
            client_id,
            release["node"],
            epoch,
            "" if held else "; it was not held here",
        )

    # -- claiming (the node a client connects to) -------------------------------------------

    async def claim(
        self, client_id: str, adopt: Callable[[bytes], T], only_from: int | None = None
    ) -> T:
        """Make this node the owner of ``client_id``'s session and return what
        ``adopt(answer)`` returns (``answer``: :data:`HERE`, :data:`NEW`, or :data:`STATE`
        + the state to adopt; see broker.net.admission). With ``only_from``, only while
        that node holds it (broker.workers.orphans). Raises :class:`ClaimError`."""
        # One claim of a client id at a time on this node: two at once (an orphan's and its
        # client's CONNECT) would propose the same epoch, indistinguishable when applied.
        while (ahead := self._claiming.get(client_id)) is not None:
            await asyncio.wait((ahead,))  # never cancels the claim ahead
        over: asyncio.Future[None] = self.node.loop.create_future()
        self._claiming[client_id] = over
        try:
            return await self._claim(client_id, adopt, only_from)
        finally:
            del self._claiming[client_id]
            over.set_result(None)

    async def _claim(self, client_id: str, adopt: Callable[[bytes], T], only_from: int | None) -> T:
        me = self.node.id
        for _ in range(CLAIM_ATTEMPTS):
            current = self.owners.get(client_id)
            if only_from is not None and (current is None or current.node != only_from):
                raise ClaimError(f"{client_id}: claimed by another node meanwhile")
            if current is not None and current.node == me:
                if client_id in self._ending and await self._end_applied(client_id):
                    continue
                return adopt(HERE)
            epoch = (current.epoch if current is not None else 0) + 1
            previous = await self._propose(client_id, epoch, orphan=only_from is not None)
            if previous == _LOST:
                continue
            if previous is not None and previous != me:
                await self._wait_release(client_id, epoch, previous)
            if self.owners.get(client_id) != (me, epoch):
                self.fence.claim_failed(client_id)
                raise ClaimError(f"{client_id}: a connection on another node took the session")
            if self.holds(client_id):
                return adopt(HERE)
            released = self.released.get(client_id) == epoch
            state = self.fence.claimed_here(client_id, epoch, self.states.get(client_id), released)
            return adopt(STATE + state if state else NEW)
        raise ClaimError(f"{client_id}: {CLAIM_ATTEMPTS} claims lost to connections elsewhere")

    async def _end_applied(self, client_id: str) -> bool:
        """This node's end of ``client_id`` 's ownership is in flight as its client connects
        here again: whether it applied within :data:`TAKEOVER_TIMEOUT` (then the claim is
        made anew). Taken as held here, the ownership was asserted once the end applied, at
        the epoch another node's claim had just taken after the end, and taken back from it:
        a will lost (bench.churn --cluster 3, a clean session back on two nodes at once)."""
        waiting = self._end_waiters.setdefault(client_id, self.node.loop.create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(waiting), TAKEOVER_TIMEOUT)
        except TimeoutError:  # (no leader): taken as held here, as before; not waited for again
            self._ending.pop(client_id, None)
            self._end_waiters.pop(client_id, None)
            return False

    async def _propose(self, client_id: str, epoch: int, orphan: bool) -> int | None:
        """Propose the claim (``orphan``: of a dead node's session) and wait until it is
        applied here: the previous owner, None, or :data:`_LOST`."""
        router = self.router
        assert router is not None
        waiter: asyncio.Future[int | None] = self.node.loop.create_future()
        self._claims[(client_id, epoch)] = waiter

        body = {"node": self.node.name, "epoch": epoch, **({"orphan": True} if orphan else {})}
        payload = orjson.dumps(body)
        row = (router.state.now_ms(), CLAIM_PREFIX + client_id, payload, 0, False, "", b"")

        def committed(offset: int | None) -> None:
            if waiter.done():
                return
            if offset is None:  # refused: no leader for too long
                waiter.set_exception(ClaimError(f"{client_id}: $sessions has no leader"))
            elif offset == OUTCOME_UNKNOWN:
                # Its leader lost office with it in flight: proposed again. If the first
                # did commit, it resolves the claim and the second, of the same epoch, is
                # stale wherever it is applied.
                router.append_forwarded(SESSIONS, [row], committed)

        router.append_forwarded(SESSIONS, [row], committed)
        try:
            return await asyncio.wait_for(waiter, CLAIM_TIMEOUT)
        except TimeoutError:
            raise ClaimError(f"{client_id}: claim not committed within {CLAIM_TIMEOUT} s") from None
        finally:
            self._claims.pop((client_id, epoch), None)

    async def _wait_release(self, client_id: str, epoch: int, previous: int) -> None:
        """Until node ``previous`` released the session (its final state is then applied),
        at most :data:`TAKEOVER_TIMEOUT`; not at all if that node is not connected."""
        name = self.node.names.get(previous, str(previous))
        if self.released.get(client_id) == epoch:
            return
        if not self.node.transport.connected(name):
            why = "is unreachable"
            return log.warning("cluster: %s: node %s %s: %s", client_id, name, why, _GOES_ON)
        waiter: asyncio.Future[None] = self.node.loop.create_future()
        self._releases[(client_id, epoch)] = waiter
        try:
            await asyncio.wait_for(waiter, TAKEOVER_TIMEOUT)
        except TimeoutError:
            why = f"did not release the session within {TAKEOVER_TIMEOUT:g} s"
            log.warning("cluster: %s: node %s %s: %s", client_id, name, why, _GOES_ON)
        finally:
            self._releases.pop((client_id, epoch), None)


#: What a claimant does when the session's previous owner does not release it.
_GOES_ON = "the session continues here from its last committed state"


def _ignore(offset: int | None) -> None:
    if offset is None or offset == OUTCOME_UNKNOWN:
        log.warning("cluster: a session release was not committed (no leader for $sessions)")
