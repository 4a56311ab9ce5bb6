"""What makes a :class:`~broker.server.Server` one worker among several.

One object per worker process, built by the server before its router: the mesh to the
peers, the partition service (ownership, forwarding, high-water marks) and the session
directory. It is the router's :class:`~broker.router.hooks.WorkerHooks` (passed to the
router at construction), and :meth:`WorkerRuntime.attach` gives it the router's side in
turn. With one worker the server has none of this: the router's hooks are
:class:`~broker.router.hooks.SingleWorker` and it reaches every partition directly.

Start-up order matters, and is :meth:`WorkerRuntime.start`'s:

1. open the partitions this worker owns (recovery happens here, by their only writer);
2. join the mesh and wait for every peer (they start together; a restarted worker finds the
   others up);
3. learn every peer's high-water marks, and which sessions homed here the peers hold;
4. only then load retained messages and sessions and open the listeners.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson

from broker.commitlog import LogConfig, Record, SegmentedLog, Streams
from broker.commitlog.keys import PartitionKey
from broker.mqtt.packets import Will
from broker.workers.groups import MeshGroupPeers
from broker.workers.mesh import Mesh, PeerDown, owner_of
from broker.workers.partitions import PartitionService
from broker.workers.sessions import SESSIONS_NEXT_KIND, SessionDirectory, home_of

if TYPE_CHECKING:
    from broker.router.hooks import GroupPeers
    from broker.router.router import Router

log = logging.getLogger("broker.workers")

#: Seconds a starting worker waits for all its peers before it gives up (and exits, so the
#: supervisor reports it).
PEER_WAIT_SECONDS = 30.0
#: Seconds a stopping worker waits for its forwards to be appended and for its peers to
#: finish theirs.
FINISH_SECONDS = 10.0
#: Seconds a session leaving this worker waits at most for its last forwarded records to be
#: answered (:meth:`WorkerRuntime.settled`; an owner paused that long is slow, not dead).
SETTLE_SECONDS = 2.0
#: Notification: "I have sent all I will send and everything I sent was answered".
FINISHED = SESSIONS_NEXT_KIND
#: Request: one of this worker's admin views (its name is the body), for worker 0's HTTP API.
VIEW = SESSIONS_NEXT_KIND + 1
#: Notifications: this worker's count of connected clients (``<I>``); a login refused from
#: the address in the body.
CONNECTIONS = SESSIONS_NEXT_KIND + 2
LOGIN_FAILED = SESSIONS_NEXT_KIND + 3
#: The kinds of the shared groups' frames (broker.workers.groups) start here.
GROUP_KINDS = SESSIONS_NEXT_KIND + 4
#: Request: run one of a worker's admin actions (``name\0`` and its JSON argument), answered
#: with its JSON result (an admin request that only the worker owning a partition can do,
#: such as a cluster's leadership transfer).
CALL = GROUP_KINDS + MeshGroupPeers.KINDS


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process is told: who it is among how many, and how to say it serves."""

    index: int
    count: int
    ready_fd: int

    def ready(self) -> None:
        """Tell the supervisor this worker serves (call once its listeners are open)."""
        os.write(self.ready_fd, b"R")
        os.close(self.ready_fd)


class WorkerRuntime:
    """Worker ``index`` of ``count``: see the module docstring. Implements
    :class:`broker.router.hooks.WorkerHooks`."""

    def __init__(self, index: int, count: int, streams: Streams) -> None:
        self.index = index
        self.count = count
        self.streams = streams
        self.partitions = PartitionService(
            index, count, owner_of, self._directory, self._log_config
        )
        self.sessions = SessionDirectory(index, count)
        self.groups = MeshGroupPeers(index, lambda group: home_of(group, count), GROUP_KINDS)
        self.groups.hold()  # until the router has loaded its groups (the server's start)
        self.mesh = Mesh(
            streams.data_dir,
            index,
            count,
            {
                **self.partitions.handlers(),
                **self.sessions.handlers(),
                **self.groups.handlers(),
                FINISHED: self._on_finished,
                VIEW: self._on_view,
                CALL: self._on_call,
                CONNECTIONS: self._on_connections,
                LOGIN_FAILED: self._on_login_failed,
            },
            on_peer_up=self._peer_up,
            on_peer_down=self._peer_down,
        )
        self._finished: set[int] = set()
        #: Admin views by name: each returns this worker's part as bytes (set by the server).
        self.views: dict[str, Callable[[], bytes]] = {}
        #: Admin actions by name: each takes a JSON value and returns one, or an awaitable of
        #: one (set by the server).
        self.actions: dict[str, Callable[[Any], Any]] = {}
        self._calls: set[asyncio.Future[Any]] = set()  # awaited actions running for peers
        #: Connected clients per peer, as each last said.
        self.peer_connections: dict[int, int] = {}
        #: Connections this worker handed to the worker owning their partition
        #: (broker.workers.handoff counts them).
        self.handed_off = 0
        self._connections: int | None = None  # to announce at the end of this iteration
        #: Set by the server: a login refused by a peer counts here too.
        self.login_failed: Callable[[str], None] = lambda address: None
        self.partitions.mesh = self.mesh
        self.sessions.mesh = self.mesh
        self.groups.mesh = self.mesh
        #: How the router reaches the groups held elsewhere: over the mesh (the groups'
        #: frames), or a cluster's (broker.workers.cluster_groups.share_across_workers).
        self.shared_groups: GroupPeers = self.groups
        #: Whether each group is held by one of this broker's workers (loaded at start by
        #: its home); False in a cluster, where one worker holds it for every node.
        self.groups_here = True
        self.router: Router | None = None

    def attach(self, router: Router) -> None:
        """Give the mesh's handlers the router's side: sessions handed over, restored and
        listed, records forwarded here, partitions announced, retained messages moved,
        shared groups' frames."""
        self.router = router
        self.groups.router = router
        sessions = self.sessions
        sessions.hand_over = router.hand_over
        sessions.restore = router.restore_sessions
        sessions.held_ids = lambda: list(router.sessions)
        sessions.after_written = partial(self._after_written, router)
        sessions.settled = self.settled
        self.partitions.enqueue = router.append_forwarded
        self.partitions.enqueue_batch = router.append_forwarded_batch
        self.partitions.wake = router.wake

        def moved(key: PartitionKey, old_end: int, part: Any) -> None:
            if key == ("$retained", 0):
                router.apply_retained(records_between(part, old_end, part.end_offset))

        self.partitions.on_moved = moved

    # ------------------------------------------------------------ WorkerHooks

    @property
    def group_peers(self) -> GroupPeers:
        return self.shared_groups

    def is_home(self, name: str) -> bool:
        if not self.groups_here and name.startswith("$share/"):
            return False
        return home_of(name, self.count) == self.index

    def _after_written(self, router: Router, client_id: str, then: Callable[[], None]) -> None:
        """``router.after_written``; in a cluster also after this worker's wills of the
        client id are out, at most a takeover's wait (a session released to another node:
        ``ClusterSessions.before_release``)."""
        cluster = self.sessions.cluster
        if cluster is not None:
            then = partial(cluster.before_release, client_id, then)
        router.after_written(client_id, then)

    def session_ended(self, client_id: str) -> None:
        cluster = self.sessions.cluster
        if cluster is None:
            # Told at the end of this iteration, if no session of that client id is here
            # then: one taken over by a new connection on this worker ends inside the new
            # one's CONNECT (a clean session), and its home must keep this worker as the
            # holder (a hand-off's claim, any other claim, must find it here). And not
            # before its tombstone and its connection's last publishes are answered
            # (SessionDirectory.when_written): a claim the home answers "new" must not race
            # them to their partitions.
            self.sessions.when_written(client_id, partial(self._ended, client_id))
            return

        def ended() -> None:
            if self.router is None or client_id not in self.router.sessions:  # (not back)
                self.sessions.ended(client_id)

        # Its home ends the claim once the will is out (broker.workers.will_fence).
        cluster.after_will(client_id, ended)

    async def settled(self) -> None:
        """Until every FORWARD this worker sent up to the end of this iteration is answered
        (their records appended or refused), for at most :data:`SETTLE_SECONDS`
        (broker.workers.sessions: a session leaving this worker)."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0.001)  # this iteration ended: its FORWARDs left
        mark = self.partitions.forwards_sent
        deadline = loop.time() + SETTLE_SECONDS
        while not self.partitions.answered_before(mark) and loop.time() < deadline:
            await asyncio.sleep(0.001)

    def _ended(self, client_id: str) -> None:
        if self.router is None or client_id not in self.router.sessions:
            self.sessions.ended(client_id)

    def will_now(self, client_id: str, will: Will) -> bool:
        cluster = self.sessions.cluster
        return cluster is None or cluster.will_now(client_id, will)

    def connections_changed(self, count: int) -> None:
        """This worker's connected clients changed: tell the peers, once per iteration."""
        if self._connections is None:
            asyncio.get_running_loop().call_soon(self._announce_connections)
        self._connections = count

    def connected_elsewhere(self) -> int:
        return sum(self.peer_connections.values())

    # ------------------------------------------------------------

    def _directory(self, key: PartitionKey) -> Any:
        return self.streams.partition_dir(*key)

    def _log_config(self, key: PartitionKey) -> LogConfig:
        return self.streams.specs[key[0]].log

    def all_keys(self) -> list[PartitionKey]:
        return [
            (spec.name, p) for spec in self.streams.specs.values() for p in range(spec.partitions)
        ]

    def owned_keys(self) -> list[PartitionKey]:
        return [k for k in self.all_keys() if owner_of(k, self.count) == self.index]

    def make_partition(self, key: PartitionKey) -> Any:
        """The router's partition factory."""
        return self.partitions.make(key, self._open_log)

    def _open_log(self, key: PartitionKey) -> SegmentedLog:
        return self.streams.log(*key)

    async def start(self, open_owned: Callable[[], object]) -> None:
        """Steps 1-3 of the module docstring (after :meth:`attach`); the caller then loads
        the router."""
        open_owned()
        await self.mesh.start()
        try:
            await self.mesh.wait_connected(PEER_WAIT_SECONDS)
        except TimeoutError:
            missing = sorted(set(range(self.count)) - {self.index, *self.mesh.peers})
            raise RuntimeError(
                f"worker {self.index}: workers {missing} did not come up "
                f"within {PEER_WAIT_SECONDS:.0f} s"
            ) from None
        await self.partitions.sync_marks()
        await self.sessions.held_elsewhere()

    def _peer_up(self, peer: int) -> None:
        if self.router is not None:
            self.router.rejoin_groups(peer)  # a restarted home learns its members again

    def _peer_down(self, peer: int) -> None:
        self.peer_connections.pop(peer, None)  # its clients were disconnected with it
        if peer in self._finished:
            return  # stopping with the rest of the broker
        log.warning("worker %d: worker %d went away", self.index, peer)
        self.sessions.peer_down(peer)
        if self.router is not None:
            self.router.worker_left(peer)

    def _announce_connections(self) -> None:
        count, self._connections = self._connections, None
        if count is not None:
            self.mesh.broadcast(CONNECTIONS, struct.pack("<I", count))

    def _on_connections(self, peer: int, request: int, body: memoryview) -> None:
        self.peer_connections[peer] = struct.unpack("<I", body)[0]

    def login_refused(self, address: str) -> None:
        self.mesh.broadcast(LOGIN_FAILED, address.encode())

    def _on_login_failed(self, peer: int, request: int, body: memoryview) -> None:
        self.login_failed(bytes(body).decode())

    def _on_view(self, peer: int, request: int, body: memoryview) -> None:
        view = self.views.get(bytes(body).decode())
        self.mesh.reply(peer, request, view() if view is not None else b"")

    def _on_call(self, peer: int, request: int, body: memoryview) -> None:
        name, _, argument = bytes(body).partition(b"\0")
        action = self.actions.get(name.decode())
        result = action(orjson.loads(argument)) if action is not None else None
        if not inspect.isawaitable(result):
            self.mesh.reply(peer, request, orjson.dumps(result))
            return
        # An action that takes a while (a leave's steps): answered when it is done.
        task = asyncio.ensure_future(result)
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        task.add_done_callback(lambda done: self._answer_call(peer, request, done))

    def _answer_call(self, peer: int, request: int, done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            return
        if (error := done.exception()) is not None:
            log.error("worker %d: action for worker %d failed: %r", self.index, peer, error)
            self.mesh.reply(peer, request, b"null")
            return
        self.mesh.reply(peer, request, orjson.dumps(done.result()))

    async def call(self, worker: int, name: str, argument: Any) -> Any:
        """Action ``name`` of ``worker`` (this one included) with ``argument``: its result
        (raises :class:`PeerDown` if that worker is down)."""
        if worker == self.index:
            result = self.actions[name](argument)
            return await result if inspect.isawaitable(result) else result
        body = await self.mesh.call(worker, CALL, name.encode() + b"\0" + orjson.dumps(argument))
        return orjson.loads(body)

    def tell_all(self, name: str, argument: Any) -> None:
        """Run action ``name`` with ``argument`` on every other worker, not waiting for the
        results (a worker that is down misses it)."""
        body = name.encode() + b"\0" + orjson.dumps(argument)
        for peer in list(self.mesh.peers):
            with contextlib.suppress(PeerDown):
                self.mesh.call(peer, CALL, body).add_done_callback(_ignore_answer)

    async def gather(self, name: str) -> list[bytes]:
        """View ``name`` of every worker, this one first (a worker that is down is missing:
        its part reappears once it is restarted)."""
        parts = [self.views[name]()]
        for peer in sorted(self.mesh.peers):
            try:
                parts.append(await self.mesh.call(peer, VIEW, name.encode()))
            except PeerDown:
                continue
        return parts

    def _on_finished(self, peer: int, request: int, body: memoryview) -> None:
        self._finished.add(peer)

    async def finish(self) -> None:
        """At shutdown, after the router persisted its sessions: wait until what this worker
        forwarded is in its owners' logs, say so, and keep serving the peers' forwards until
        each of them has said the same (or gone); then leave the mesh."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FINISH_SECONDS
        mesh = self.mesh
        while mesh.pending_requests and loop.time() < deadline:
            await asyncio.sleep(0.01)
        mesh.broadcast(FINISHED)
        while not set(mesh.peers) <= self._finished and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await self.close()

    def describe(self) -> dict[str, Any]:
        return {
            "worker": self.index,
            "workers": self.count,
            "owned": [f"{s}/{p}" for s, p in self.owned_keys()],
            "peers_up": sorted(self.mesh.peers),
            "forwarded": self.partitions.forwarded,
            "received": self.partitions.received,
            "claims": self.sessions.claims,
            "takeovers": self.sessions.takeovers,
            "handed_off": self.handed_off,
        }

    async def close(self) -> None:
        await self.mesh.close()
        self.partitions.close()


def records_between(part: Any, start: int, end: int) -> list[Record]:
    """Committed records of ``part`` in ``[start, end)`` (for the streams a worker follows
    whole, such as retained messages)."""
    out: list[Record] = []
    while start < end:
        batch = part.read(start, end - start)
        if not batch:
            break
        out.extend(r for r in batch if r.offset < end)
        start = batch[-1].offset + 1
    return out


def _ignore_answer(answer: asyncio.Future[bytes]) -> None:
    if not answer.cancelled():
        answer.exception()  # retrieved: a peer gone meanwhile is no error here
