"""Replicated partitions: the router's partitions as Raft groups across the cluster's nodes.

A :class:`ReplicatedPartition` is a router partition whose log is one Raft group's log
(``broker.cluster.storage``; the group and its node are ``broker.cluster.node``):

* on the group's leader, the batch one iteration gathered becomes ONE entry: encoded once, at
  the offset after the log's last entry, with the leader's term as its epoch
  (``storage.encode_entry``), proposed, and written to the local log at once; its publishers'
  acknowledgements wait in :attr:`ReplicatedPartition.inflight` until the group's commit index
  covers it (with ``fsync = "always"``: until a majority has it on disk), then go out, the
  records join the in-memory tail and readers wake (PUBACK / PUBREC only after the quorum
  commit [MQTT-4.3.2-2]);
* elsewhere (a follower, or no leader known yet) the batch is forwarded to the leader's node
  (:class:`ClusterService`), whose answer carries the first offset once committed there;
* readers, on every replica, see only committed records: :attr:`end_offset` is the log's
  high-water mark, which the storage pins to the commit index, and a commit wakes them;
* on a node outside the group (``replication_factor`` below the node count) the partition is
  a ``broker.workers.remote_partition.RemotePartition``: forwarded like a follower's, read
  through the fetch protocol (``broker.workers.remote_fetches``).

Outcomes. An entry is acknowledged only if the commit index reaches it while the term at its
index is still the one it was proposed in (an index and a term name one entry, Raft's Log
Matching property s5.3), so an entry a newer leader overwrote is never acknowledged. When
this node stops leading the group (or its term changes) with entries in flight, their
outcome is unknown (they may commit under the new leader, or be overwritten): the publishers
get :data:`~broker.router.commit.OUTCOME_UNKNOWN`, no acknowledgement, and their connections
are closed so that they publish again (QoS 1 duplicates are allowed; nothing acknowledged is
lost). A forward whose answer does not come (the link to the leader broke, the leader died,
or it stopped leading and says nothing for a moment: broker.workers.forwards) ends the same
way; a planned transfer leaves none unknown (broker.cluster.raft hands over once all is
committed, and the forwards reaching the old leader meanwhile are refused). A batch that
finds no leader taking proposals (an election or a leadership transfer in progress, a
forward refused by a node that no longer leads) is held and dispatched again when a leader
is known, so a publish in the middle of a failover is delayed, not refused; only after
:data:`HOLD_SECONDS` without one do its publishers get ``None``: a negative acknowledgement
(MQTT 5) or a closed connection (3.1.1). The leader refuses the records of a forward that
another node's claim of their client superseded (accepted on a node before it was paused,
sent as it resumed: broker.workers.forwards.zombies); the rest is forwarded again.

The internal ``$retained`` and ``$sessions`` streams are Raft groups too, compacted with their
batches' boundaries kept (:data:`CLUSTER_SPECS`); every node applies each commit of
``$retained`` to its retained index and of ``$sessions`` to its knowledge of the sessions and
their owners (broker.workers.replicated_sessions). User streams are never compacted (retention
only), so every compacted log of a cluster keeps its entries' boundaries.

Several workers per node. Each worker runs a :class:`ClusterService` of its own, hosting the
groups of the partitions it owns (``broker.workers.mesh.owner_of``, as on one node) with a
:class:`~broker.cluster.node.ClusterNode` of its own on ``raft_port + index``
(``broker.cluster.node``): the other workers reach those partitions as they reach any
partition another worker owns (``broker.workers.partitions``: publishes forwarded to the
owner, reads from its files up to the high-water mark it announces, which here is the
group's commit index: :attr:`ClusterService.on_committed` announces it after every commit,
on leaders and followers alike). So ``$retained`` lives in one worker per node, the one that
owns it on a single node. On a node outside a partition's group, its other workers read it
through the owner (``broker.workers.remote_relay``).

Called only from the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from broker.cluster.leadership import Leadership
from broker.cluster.metadata import LocalStreams
from broker.cluster.node import FIRST_APP_KIND, ClusterNode
from broker.cluster.nodesettings import advertised, node_settings
from broker.cluster.placement import group_ids
from broker.cluster.raft import NotLeader, Role
from broker.cluster.storage import GroupStorage, encode_entry
from broker.commitlog import Record, SegmentedLog, Streams
from broker.commitlog.config import StreamSpec
from broker.commitlog.keys import PartitionKey
from broker.commitlog.small_batch import decode_records, encode
from broker.commitlog.streams import INTERNAL_LOG, RETAINED_STREAM, SESSIONS_STREAM
from broker.config import Config
from broker.router.commit import OUTCOME_UNKNOWN
from broker.router.partition import READ_BATCH, Columns, Partition, PartitionBase
from broker.router.state import RETAINED, SESSIONS
from broker.workers import forwards
from broker.workers.cluster_hooks import ClusterHooks
from broker.workers.forwards import ANSWER_GRACE, Forward, Forwards, answer
from broker.workers.mesh import PeerDown
from broker.workers.remote_fetches import RemoteFetches
from broker.workers.remote_partition import RemotePartition
from broker.workers.replicated_sessions import ClusterSessions

if TYPE_CHECKING:
    from broker.router.router import Router

log = logging.getLogger("broker.cluster")

Ack = Callable[[int | None], None]

#: A forwarded batch for a group whose leader is here, and the answer.
FORWARD = FIRST_APP_KIND
FORWARDED = FIRST_APP_KIND + 1
#: Seconds a starting node waits for its groups to have a leader and to commit as far as it
#: said, before it serves clients (a new subscription's "latest" is then the cluster's, not
#: the stale mark of the restarted node; a node cut off from the majority serves after this).
CATCH_UP_SECONDS = 10.0
#: Seconds a batch may wait for its group to have a leader (an election, a transfer) before
#: its publishers are refused: a failover takes about an election timeout, so a publish in
#: the middle of one is delayed rather than refused.
HOLD_SECONDS = 5.0
#: Seconds a stopping node waits for the session states it persisted last to commit.
DRAIN_SECONDS = 2.0

_BEHIND = "cluster: serving with %d partitions not caught up after %g s (no leader?): %s"
_SERVES = "cluster: node %s%s holds %d partitions, reads %d remotely (%d nodes)"

_FORWARD = struct.Struct("<QI")  # request id, group; the batch follows
_ANSWER = struct.Struct("<Qq")  # request id, first offset (-1 refused, OUTCOME_UNKNOWN)

#: ``$retained`` and ``$sessions`` as Raft groups: compacted with their batches' boundaries
#: kept (an emptied batch stays as a placeholder, so Raft's entries never move).
CLUSTER_SPECS = tuple(
    StreamSpec(name, (), 1, replace(INTERNAL_LOG, keep_empty_batches=True))
    for name in (RETAINED_STREAM, SESSIONS_STREAM)
)


class ReplicatedPartition(Partition):
    """See the module docstring."""

    __slots__ = ("group", "held", "inflight", "service")

    def __init__(
        self, key: PartitionKey, log: SegmentedLog, group: int, service: ClusterService
    ) -> None:
        super().__init__(key, log)
        self.group = group
        self.service = service
        #: Proposed entries awaiting commit: (last index, term, records, acks, proposed at).
        self.inflight: deque[tuple[int, int, list[Record], list[Ack | None], float]] = deque()
        #: Batches waiting for a leader: (records, acks, monotonic deadline).
        self.held: list[tuple[list[Record], list[Ack | None], float]] = []

    @property
    def end_offset(self) -> int:
        return self.log.high_watermark

    # Gathered as they are, unnumbered (numbered when proposed: the leader may change
    # before), not renumbered as Partition.add does; a forwarded batch as its records (a
    # proposal is of records). PartitionBase's own functions, so that the compiled device
    # lane gathers into it as into another worker's partition (broker.net._devicelane).
    next_offset = PartitionBase.next_offset
    add = PartitionBase.add
    add_batch = PartitionBase.add_batch

    def read(self, offset: int, max_records: int = READ_BATCH) -> list[Record]:
        """Committed records from ``offset``: from the tail when it holds ``offset`` (it may
        stop short of the mark: records committed under another leader reach this node's
        log, not its tail), else from the log."""
        i = offset - self.tail_base
        if 0 <= i < len(self.tail):
            return self.tail[i : i + max_records]
        return PartitionBase.read(self, offset, max_records)

    def read_columns(self, offset: int) -> Columns:
        if 0 <= offset - self.tail_base < len(self.tail):
            return self.tail_columns(offset)
        return PartitionBase.read_columns(self, offset)

    def commit(self) -> tuple[int, int]:
        records, acks = self.pending, self.acks
        self.pending, self.acks = [], []
        mark = self.log.high_watermark
        if records:
            self.dispatch(records, acks, time.monotonic() + HOLD_SECONDS)
        return mark, mark

    def dispatch(self, records: list[Record], acks: list[Ack | None], deadline: float) -> None:
        """Propose ``records`` here (the leader), forward them to the leader, or, while the
        group has no leader that takes proposals (an election, a leadership transfer), hold
        them until one does or ``deadline`` passes (then a refusal: ``None``)."""
        node = self.service.node
        if node.host is None:  # not hosting yet (start-up): held until it is
            self.held.append((records, acks, deadline))
            return
        core = node.core(self.group)
        if core.role is Role.LEADER and core.transferee is None:
            term = core.term
            payload, count = encode_entry(records, core.terms.last_index, term)
            try:
                index = node.propose(self.group, payload, count)
            except NotLeader:
                pass
            else:
                self.inflight.append((index, term, records, acks, time.perf_counter()))
                return
        elif self.service.forward(self, records, acks, deadline):
            return
        self.held.append((records, acks, deadline))

    def release(self, now: float) -> None:
        """Dispatch what is held again (a leader may be known now); refuse what waited past
        its deadline."""
        held, self.held = self.held, []
        for records, acks, deadline in held:
            if now > deadline:
                answer(acks, None)
            else:
                self.dispatch(records, acks, deadline)

    def committed(self, commit: int) -> list[Record]:
        """The group's commit index reached ``commit``: acknowledge what it covers; returns
        the records this node proposed that it covers, numbered."""
        inflight = self.inflight
        terms = self.service.node.storages[self.group].terms
        new = tuple.__new__
        observe = self.service.observe_commit
        now = time.perf_counter()
        out: list[Record] = []
        while inflight and inflight[0][0] <= commit:
            index, term, records, acks, proposed = inflight.popleft()
            observe(now - proposed)
            first = index - len(records)
            if terms.term_at(index) != term:
                answer(acks, OUTCOME_UNKNOWN)  # overwritten: never acknowledged
                continue
            stored = [new(Record, (first + i, *r[1:])) for i, r in enumerate(records)]
            self.keep_tail(first, stored)
            out += stored
            for i, ack in enumerate(acks):
                if ack is not None:
                    ack(first + i)
        return out

    def leader(self) -> int | None:
        """The group's leader as this node's core knows it."""
        return self.service.node.leader(self.group)

    def leadership_changed(self) -> None:
        """This node stopped leading the group, or its term changed: whatever is in flight
        has an unknown outcome (module docstring)."""
        core = self.service.node.core(self.group)
        inflight = self.inflight
        while inflight and (
            not self.service.node.is_leader(self.group) or inflight[0][1] != core.term
        ):
            answer(inflight.popleft()[3], OUTCOME_UNKNOWN)


class ClusterService:
    """The cluster side of one broker process: the node, its groups, forwarding to leaders,
    remote reads. :meth:`attach` connects it to the router, :meth:`start` forms the cluster."""

    def __init__(
        self,
        config: Config,
        streams: Streams,
        worker: tuple[int, int] = (0, 1),
        owns: Callable[[PartitionKey], bool] = lambda key: True,
    ) -> None:
        assert config.cluster is not None
        self.streams = streams
        settings = node_settings(config.cluster, worker, *advertised(config))
        self.node = ClusterNode(settings, config.commitlog.data_dir)
        self.node.local_streams = LocalStreams.of(config)
        specs = [
            spec
            for spec in streams.specs.values()
            if (not spec.name.startswith("$") and not spec.log.compacted)
            or spec.name in (RETAINED_STREAM, SESSIONS_STREAM)
        ]
        every = group_ids((spec.name, p) for spec in specs for p in range(spec.partitions))
        #: The groups this worker hosts: those of the partitions it owns (module docstring).
        self.groups = {g: key for g, key in every.items() if owns(key)}
        #: Every replicated partition's group, this worker's or not.
        self.every = every
        rf = {spec.name: config.replication_factor(spec) for spec in specs}
        self.node.replication = {g: rf[key[0]] for g, key in self.groups.items()}
        #: Each group's storage, opened now, before the router loads anything: it pins the
        #: log's high-water mark at the last commit it knows, so no reader (the router's
        #: start-up included) sees a record that may yet be truncated.
        self.storages = {g: GroupStorage.over(streams.log(*key)) for g, key in self.groups.items()}
        #: ``$retained`` offsets below this are in the router's retained index (when hosted).
        self._retained_applied = streams.log(*RETAINED).high_watermark if owns(RETAINED) else 0
        #: Sessions and their owners across the cluster, this node's claims (every worker).
        own = streams.log(*SESSIONS) if owns(SESSIONS) else None
        self.sessions = ClusterSessions(self.node, own, worker)
        #: The router's hooks with one worker per node: it loads the sessions this node owns.
        self.hooks = ClusterHooks(self.sessions) if worker[1] == 1 else None
        self.keys = {key: g for g, key in self.groups.items()}
        #: Every replicated partition, this worker's or not.
        self.replicated = frozenset(every.values())
        #: Called after each commit of a hosted partition with the records this node proposed
        #: that it covers (the other workers of the node learn the new mark; set by the server).
        self.on_committed: Callable[[ReplicatedPartition, list[Record]], None] = (
            lambda part, records: None
        )
        self.node.group_keys = dict(self.groups)
        self.node.on_commit = self._on_commit
        self.node.on_leader = self._on_leader
        self.node.handlers[FORWARD] = self._on_forward
        self.node.handlers[FORWARDED] = self._on_answer
        self.leadership = Leadership(self.node)
        self.router: Router | None = None
        #: Called with each committed entry's propose-to-commit seconds (the metrics').
        self.observe_commit: Callable[[float], None] = lambda seconds: None
        self._next_request = 1
        #: Forwarded batches awaiting their answer, by request id.
        self._waiting = Forwards()
        #: How long a batch may wait for a leader (ReplicatedPartition.dispatch).
        self.hold_seconds = HOLD_SECONDS
        #: Partitions of this worker whose group this node does not host (remote reads).
        self.remote_parts: dict[PartitionKey, RemotePartition] = {}
        self.remote = RemoteFetches(self)
        #: Several workers per node (broker.workers.remote_relay sets them): a partition of
        #: this worker's became remote here or hosted; publishes of another worker's remote
        #: partition to that worker; awaited once placed, before catching up.
        self.hosting_changed: Callable[[PartitionKey], None] = lambda key: None
        self.relay_forward: Callable[[RemotePartition, list[Record], list[Ack | None]], None]
        self.placed: Callable[[], Awaitable[None]] | None = None
        #: Several workers, not hosting ``$sessions``: :meth:`_sessions_caught_up` (server).
        self.sessions_owner: Callable[[], Awaitable[int]] | None = None

    def attach(self, router: Router) -> None:
        self.router = router
        self.sessions.router = router

    def make_partition(self, key: PartitionKey) -> PartitionBase:
        """The router's partition factory: replicated or local (module docstring)."""
        g = self.keys.get(key)
        if g is None:
            return Partition(key, self.streams.log(*key))
        remote = self.remote_parts.get(key)
        if remote is not None:
            return remote
        return ReplicatedPartition(key, self.streams.log(*key), g, self)

    async def start(self) -> None:
        """Form the cluster, then host every group (see :attr:`storages`)."""
        members = await self.node.start()
        index, count = self.node.settings.worker
        self.node.host_groups(self.remote.place(len(members)))
        if self.placed is not None:
            await self.placed()
        behind = await self.node.caught_up(CATCH_UP_SECONDS)
        await self._sessions_caught_up()
        behind += await self.remote.caught_up(CATCH_UP_SECONDS)
        if behind:
            names = ", ".join(f"{s}/{p}" for s, p in (self.groups[g] for g in behind))
            log.warning(_BEHIND, len(behind), CATCH_UP_SECONDS, names)
        worker = f" worker {index} of {count}" if count > 1 else ""
        held, remote = len(self.node.storages), len(self.remote_parts)
        log.info(_SERVES, self.node.name, worker, held, remote, len(members))
        self.sessions.resume()  # its sessions as committed; claims are answered from now on

    async def _sessions_caught_up(self) -> None:
        """A worker not hosting ``$sessions`` resumes once the one hosting it caught up
        (:attr:`sessions_owner`) and its announcements reached this one (at most
        :data:`CATCH_UP_SECONDS`). It resumed on what the files held at its start, applying
        the history while serving: claims at stale epochs, surrenders and wills of records
        superseded (bench.churn --cluster 3, nodes of two workers killed)."""
        owner = self.sessions_owner
        if owner is None or self.sessions.applied is not None or self.router is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CATCH_UP_SECONDS
        try:
            mark = await asyncio.wait_for(owner(), CATCH_UP_SECONDS)
        except (TimeoutError, PeerDown) as e:
            return log.warning("cluster: serving before $sessions' worker caught up (%r)", e)
        part = self.router.partition(SESSIONS)
        while part.end_offset < mark and loop.time() < deadline:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        await self._drain_sessions()
        self.remote.close()
        for waiting in self._waiting.values():
            answer(waiting.acks, OUTCOME_UNKNOWN)
        self._waiting.clear()
        for part in self._replicated():
            answer([ack for _records, acks, _deadline in part.held for ack in acks], None)
            part.held.clear()
        await self.node.close()

    async def _drain_sessions(self) -> None:
        """At shutdown: let the session states the router just persisted commit (at most
        :data:`DRAIN_SECONDS`), so that a restart, or a reconnect on another node, finds
        their last positions."""
        g = self.keys.get(SESSIONS)
        part = self._partition(g) if g is not None else None
        if part is None:
            return
        deadline = time.monotonic() + DRAIN_SECONDS
        while (
            part.inflight
            or part.held
            or part.pending
            or any(w.part is part for w in self._waiting.values())
        ) and time.monotonic() < deadline:
            if self.node.leader(part.group) is None:
                break  # no quorum to commit them
            await asyncio.sleep(self.node.settings.heartbeat_interval / 4)

    def tick(self) -> None:
        """Called by the server's timer: forwards unanswered for too long have an unknown
        outcome; held batches are dispatched again, or refused past their deadline."""
        now = time.monotonic()
        self._waiting.overdue(now)
        self.remote.tick(now)
        for part in self._replicated():
            if part.held:
                part.release(now)
        self.sessions.orphans.tick()

    def _replicated(self) -> list[ReplicatedPartition | RemotePartition]:
        parts = self.router.partitions.values() if self.router is not None else ()
        return [p for p in parts if isinstance(p, (ReplicatedPartition, RemotePartition))]

    # -- commits and leaders -----------------------------------------------------------------

    def _partition(self, g: int) -> ReplicatedPartition | None:
        router = self.router
        key = self.groups.get(g)
        if router is None or key is None:
            return None
        part = router.partitions.get(key)
        return part if isinstance(part, ReplicatedPartition) else None

    def _on_commit(self, g: int, commit: int) -> None:
        self.remote.committed(g)
        key = self.groups.get(g)
        if key == RETAINED and self.router is not None:
            self._apply_retained(commit)
        elif key == SESSIONS and self.router is not None:
            self._apply_sessions(commit)
        part = self._partition(g)
        if part is None:
            return
        records = part.committed(commit)
        if records and (
            records[-1].offset + 1 != part.end_offset
            or records[-1].offset - records[0].offset + 1 != len(records)
        ):
            records = []  # not the whole of what the mark covers: the peers read the files
        self.on_committed(part, records)
        assert self.router is not None
        self.router.wake(part)

    def _apply_retained(self, commit: int) -> None:
        """Committed ``$retained`` records, up to offset ``commit``, to the retained index
        (the router loaded the log up to the last commit known at start)."""
        assert self.router is not None
        start = self._retained_applied
        self._retained_applied = self._apply(RETAINED, start, commit, self.router.apply_retained)

    def _apply_sessions(self, commit: int) -> None:
        """Committed ``$sessions`` records, up to offset ``commit``, to the sessions'
        knowledge (broker.workers.replicated_sessions)."""
        sessions = self.sessions
        assert sessions.applied is not None  # this worker owns $sessions: read at start
        sessions.applied = self._apply(SESSIONS, sessions.applied, commit, sessions.apply)

    def _apply(
        self, key: PartitionKey, offset: int, commit: int, apply: Callable[[list[Record]], Any]
    ) -> int:
        """Records of ``key`` from ``offset`` up to ``commit`` to ``apply`` (control batches
        and compaction placeholders hold no record); returns the offset applied to."""
        assert self.router is not None
        part, start = self.router.partition(key), offset
        while offset < commit:
            records = part.read(offset)
            if not records:
                break
            records = [r for r in records if r.offset < commit]
            apply(records)
            offset = records[-1].offset + 1 if records else commit
        return max(offset, start)

    def _on_leader(self, g: int) -> None:
        self._forwards_lost(g, self.node.leader(g))
        part = self._partition(g)
        if part is not None:
            part.leadership_changed()
            if part.held and self.node.leader(g) is not None:
                part.release(time.monotonic())

    def _forwards_lost(self, g: int, leader: int | None) -> None:
        """Forwards of group ``g`` to a node other than ``leader``: answered by that node in
        a moment, else their outcome is unknown (broker.workers.forwards)."""
        names, connected = self.node.names, self.node.transport.connected
        now = time.monotonic()
        if self._waiting.deposed(g, leader, now, lambda node: connected(names.get(node, ""))):
            self.node.loop.call_later(ANSWER_GRACE, self._waiting.overdue, now + ANSWER_GRACE)

    def remote_leader(self, part: RemotePartition) -> None:
        """A replica named another leader of ``part``'s group (as :meth:`_on_leader`)."""
        self._forwards_lost(part.group, part.leader_hint)
        if part.held and part.leader_hint is not None:
            part.release(time.monotonic())

    def remote_moved(self, part: RemotePartition) -> None:
        """A remote partition's mark moved, or records arrived: its readers take them."""
        if self.router is not None and self.router.partitions.get(part.key) is part:
            self.router.wake(part)

    # -- forwarding --------------------------------------------------------------------------

    def forward(
        self,
        part: ReplicatedPartition | RemotePartition,
        records: list[Record],
        acks: list[Ack | None],
        deadline: float,
    ) -> bool:
        """Send ``records`` to the leader of ``part``'s group; False when no other node is
        known to lead it or the message cannot leave (the caller holds them)."""
        if isinstance(part, RemotePartition) and part.owner is not None:
            self.relay_forward(part, records, acks)  # acknowledged by the owner's answer
            return True
        leader = part.leader()
        if leader is None or leader == self.node.id:
            return False
        request = self._next_request
        self._next_request += 1
        body = _FORWARD.pack(request, part.group) + encode(0, records)
        if not self.node.send(leader, FORWARD, body):
            return False
        self._waiting[request] = Forward(time.monotonic(), part, records, acks, deadline, leader)
        return True

    def _on_forward(self, frm: int, body: memoryview) -> None:
        request, g = _FORWARD.unpack_from(body)
        router = self.router
        key = self.groups.get(g)

        def reply(offset: int | None) -> None:
            self.node.send(frm, FORWARDED, _ANSWER.pack(request, -1 if offset is None else offset))

        if router is None or key is None or not self.node.takes_proposals(g):
            reply(None)  # the asker holds it for the next leader (handing over: the transferee)
            return
        try:
            records = decode_records(bytes(body[_FORWARD.size :]))
        except Exception as e:  # a peer's bug: refuse this batch, keep serving
            log.warning("cluster: bad forwarded batch from node %d: %s", frm, e)
            reply(None)
            return
        if fenced := forwards.zombies(records, frm, self.sessions.claims, self.node.names):
            self.node.send(frm, FORWARDED, _ANSWER.pack(request, forwards.FENCED) + fenced)
            return
        router.append_forwarded(key, [r[1:] for r in records], reply)

    def _on_answer(self, frm: int, body: memoryview) -> None:
        request, first = _ANSWER.unpack_from(body)
        w = self._waiting.pop(request, None)
        if w is None:
            return  # timed out meanwhile: its publishers were told
        part, records, acks, deadline = w.part, w.records, w.acks, w.deadline
        if first == -1:
            # Refused (that node no longer leads, or had no leader): wait for the next one.
            part.held.append((records, acks, deadline))
            if isinstance(part, RemotePartition):
                part.skip(frm)  # its live poll brings the new leader
            if part.leader() not in (None, frm):
                part.release(time.monotonic())
        elif first == OUTCOME_UNKNOWN:
            answer(acks, OUTCOME_UNKNOWN)
        elif first == forwards.FENCED:
            forwards.refuse_zombies(part, w, bytes(body[_ANSWER.size :]))
        else:
            for i, ack in enumerate(acks):
                if ack is not None:
                    ack(first + i)

    # -- operations --------------------------------------------------------------------------

    def transfer_leader(self, key: PartitionKey, name: str) -> str:
        """Start moving ``key``'s leadership to node ``name`` (``mqlog cluster
        transfer-leader``, broker.cluster.leadership)."""
        label = f"{key[0]}/{key[1]}"
        g = self.keys.get(key)
        if g is None:
            raise ValueError(f"{label} is not a replicated partition of this worker")
        remote = self.remote_parts.get(key)
        hint = remote.leader_hint if remote is not None else None
        return self.leadership.transfer(g, label, name, hint)

    def status(self) -> dict[str, Any]:
        view = self.node.status()
        for entry in view["partitions"]:
            entry["replica"] = True
        view["partitions"] += self.remote.status()
        view["remote_reads"] = self.remote.stats()
        view["forwards_waiting"] = len(self._waiting)
        view["session_takeovers"] = self.sessions.takeovers
        return view
