"""Both ends of the fetch protocol (``broker.cluster.fetch``) for one worker.

The asking side keeps one live poll per :class:`~broker.workers.remote_partition.RemotePartition`
(why a long poll and not a push: that module's docstring) and the history reads its readers
start; the answering side serves the groups this worker hosts: a request is answered at once
from the log (``SegmentedLog.read_batches`` up to the high-water mark: committed batches only,
each CRC-checked on the way out) or, a live poll with nothing new, held until the group's next
commit or its wait. A malformed or oversized request is refused and counted
(:attr:`RemoteFetches.refused`), an answer that fails verification dropped and counted
(:attr:`RemoteFetches.bad_answers`): neither ever raises out of the transport's callback.

It also decides, once the cluster formed, which groups this worker hosts and which it reads
remotely (:meth:`RemoteFetches.place`), and describes the remote ones for the status.

Called only from the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from broker.cluster.fetch import (
    NOT_REPLICA,
    OK,
    OUT_OF_RANGE,
    REFUSED,
    UNAVAILABLE,
    FetchError,
    FetchRequest,
    decode_answer,
    decode_request,
    encode_answer,
    encode_request,
    verified_records,
)
from broker.cluster.membership import Configuration
from broker.cluster.node import FIRST_APP_KIND
from broker.cluster.storage import GroupStorage
from broker.commitlog.errors import CommitLogError, CorruptRecordBatch, OffsetOutOfRange
from broker.router.state import RETAINED, SESSIONS
from broker.workers.remote_partition import Chunk, PartitionHost, Poll, RemotePartition

if TYPE_CHECKING:
    from broker.cluster.node import ClusterNode
    from broker.commitlog import Record, Streams
    from broker.commitlog.keys import PartitionKey
    from broker.router.partition import PartitionBase
    from broker.router.router import Router
    from broker.workers.remote_partition import Ack

log = logging.getLogger("broker.cluster")

#: No configuration: what a log without one names (no one).
_NONE = Configuration.of(())

#: Transport kinds (``FIRST_APP_KIND`` .. + 3 are the forwards and leadership's).
FETCH = FIRST_APP_KIND + 4
FETCHED = FIRST_APP_KIND + 5

#: Milliseconds a replica holds a live poll with nothing new (then it answers the marks).
LIVE_WAIT_MS = 1000
#: Seconds an unanswered fetch waits before it is sent to the next replica: the hold plus
#: a margin for a busy replica.
ANSWER_TIMEOUT = LIVE_WAIT_MS / 1000 + 1.5
#: Bytes of batches one answer may carry.
FETCH_BYTES = 1 << 20
#: History fetches in flight per partition (readers at different offsets).
HISTORY_FETCHES = 4
#: Live polls a replica holds at most (over all asking nodes): beyond, answered at once.
MAX_PARKED = 4096


class FetchHost(PartitionHost, Protocol):
    """What the fetch service needs of the worker's cluster side
    (``broker.workers.replicated.ClusterService``)."""

    node: ClusterNode
    groups: dict[int, PartitionKey]
    storages: dict[int, GroupStorage]
    router: Router | None
    streams: Streams
    remote_parts: dict[PartitionKey, RemotePartition]

    def make_partition(self, key: PartitionKey) -> PartitionBase: ...

    def remote_moved(self, part: RemotePartition) -> None: ...

    def hosting_changed(self, key: PartitionKey) -> None: ...


@runtime_checkable
class Handover(Protocol):
    """What :meth:`RemoteFetches.demote` takes over from the replica it replaces."""

    held: list[tuple[list[Record], list[Ack | None], float]]
    pending: list[Record]
    acks: list[Ack | None]


class RemoteFetches:
    """Both ends of the fetch protocol for one worker: the asking side (its
    :class:`RemotePartition` objects' polls and history reads) and the answering side (the
    groups it hosts: requests answered at once or held until the next commit)."""

    def __init__(self, service: FetchHost) -> None:
        self.service = service
        self.node: ClusterNode = service.node
        #: Remote partitions by group.
        self.parts: dict[int, RemotePartition] = {}
        self._next = 1
        #: Requests in flight by id.
        self.polls: dict[int, tuple[RemotePartition, Poll]] = {}
        #: Live polls held on this replica, by group: (asking node, request, deadline).
        self.parked: dict[int, list[tuple[int, FetchRequest, float]]] = {}
        self.parked_count = 0
        #: Partitions whose history read failed: their readers are woken at the next tick.
        self.retry: set[RemotePartition] = set()
        #: A leader added this node to a group read remotely here (broker.cluster.reshape).
        service.node.reshape.on_join = self.promote
        service.node.reshape.on_removed = self.demote
        #: Sends a fetch of a partition another worker of this node owns through that worker
        #: (``relay(owner, node, request)``; False when it cannot leave): with several workers
        #: per node only the owner has links to the group's hosts (broker.workers.remote_relay).
        self.relay: Callable[[int, int, bytes], bool] = lambda owner, to, body: False
        self.refused = 0  # malformed or oversized requests
        self.bad_answers = 0  # answers that failed verification
        self.served = 0
        self.relayed = 0  # fetches sent on for another worker (broker.workers.remote_relay)
        self.node.handlers[FETCH] = self._on_fetch
        self.node.handlers[FETCHED] = self.on_fetched

    # -- the asking side ------------------------------------------------------------------

    def add(self, part: RemotePartition) -> None:
        self.parts[part.group] = part
        self.poll(part)

    def poll(self, part: RemotePartition, wait_ms: int = 0) -> None:
        """Start the partition's live poll at its known mark."""
        if part.live is not None:
            return
        offset = part.log.end_offset
        max_bytes = FETCH_BYTES if part.watchers else 0
        part.live = self._send(part, offset, max_bytes, wait_ms, live=True)

    def history(self, part: RemotePartition, offset: int) -> None:
        if offset in part.history or len(part.history) >= HISTORY_FETCHES:
            return
        poll = self._send(part, offset, FETCH_BYTES, 0, live=False)
        if poll is not None:
            part.history[offset] = poll
        else:
            self.retry.add(part)  # no replica reachable now: the readers try at the tick

    def _send(
        self, part: RemotePartition, offset: int, max_bytes: int, wait_ms: int, live: bool
    ) -> Poll | None:
        to = part.target()
        if to is None:
            return None
        request = self._next
        self._next += 1
        body = encode_request(FetchRequest(request, part.group, offset, max_bytes, wait_ms))
        owner = part.owner
        if not (self.node.send(to, FETCH, body) if owner is None else self.relay(owner, to, body)):
            part.skip(to)
            return None
        poll = Poll(request, offset, live, time.monotonic(), to)
        self.polls[request] = (part, poll)
        return poll

    def on_fetched(self, frm: int, body: memoryview) -> None:
        """A replica's answer (``FETCHED``), from node ``frm``, directly or relayed by the
        worker owning the partition."""
        try:
            answer = decode_answer(body)
        except FetchError as e:
            self.bad_answers += 1
            log.warning("cluster: bad fetch answer from node %d: %s", frm, e)
            return
        found = self.polls.pop(answer.request, None)
        if found is None or found[1].to != frm or found[0].group != answer.group:
            return  # timed out meanwhile (asked again), or not ours
        part, poll = found
        part.forget(poll)
        if answer.error != OK:
            part.skip(frm)
            if answer.error == OUT_OF_RANGE:
                part.marks(answer.leader, answer.log_start, answer.high_watermark, answer.term)
            self._again(part, poll)
            return
        try:
            records, end = verified_records(answer, poll.offset) if answer.batches else ([], 0)
        except FetchError as e:
            self.bad_answers += 1
            log.warning(
                "cluster: fetch answer of %s/%d from node %d dropped: %s", *part.key, frm, e
            )
            part.skip(frm)
            self._again(part, poll)
            return
        moved = part.marks(answer.leader, answer.log_start, answer.high_watermark, answer.term)
        if end > poll.offset:
            size = sum([len(r[3]) for r in records])
            part.chunks.add(Chunk(poll.offset, end, records, size))
            moved = True
        if moved:
            self.service.remote_moved(part)
        if poll.live:
            self.poll(part, LIVE_WAIT_MS)
        elif end and end < answer.high_watermark and not records:
            self.history(part, end)  # only control batches there: read on

    def _again(self, part: RemotePartition, poll: Poll) -> None:
        """After a failed fetch, at the next :meth:`tick` (to the next replica: one that
        cannot answer, e.g. not hosting yet, is not asked in a loop): a live poll goes again;
        for a history read the partition's readers are woken, and read (so fetch) again."""
        if not poll.live:
            self.retry.add(part)

    def tick(self, now: float) -> None:
        """Fetches unanswered past :data:`ANSWER_TIMEOUT`, or sent to a node whose link is
        down (a dead leader: its successor is learnt from another replica within a tick, not
        a timeout), go to the next replica; held polls past their wait are answered;
        partitions without a poll start one."""
        names, transport = self.node.names, self.node.transport
        late = [
            r
            for r, (_, p) in self.polls.items()
            if now - p.sent > ANSWER_TIMEOUT or not transport.connected(names.get(p.to, ""))
        ]
        for request in late:
            part, poll = self.polls.pop(request)
            part.forget(poll)
            part.skip(poll.to)
            self._again(part, poll)
        for part in self.parts.values():
            if part.live is None:
                self.poll(part, LIVE_WAIT_MS)
        retry, self.retry = self.retry, set()
        for part in retry:
            self.service.remote_moved(part)
        for g, held in list(self.parked.items()):
            due = [h for h in held if h[2] <= now]
            if due:
                self.parked[g] = [h for h in held if h[2] > now]
                for frm, req, _ in due:
                    self.parked_count -= 1
                    self._answer(frm, req)

    def close(self) -> None:
        self.polls.clear()
        for part in self.parts.values():
            part.live = None
            part.history.clear()

    # -- the answering side ---------------------------------------------------------------

    def _on_fetch(self, frm: int, body: memoryview) -> None:
        try:
            req = decode_request(body)
        except FetchError as e:
            self.refused += 1
            log.warning("cluster: fetch request from node %d refused: %s", frm, e)
            if len(body) >= 12:  # the request id and group are readable: say so
                request = int.from_bytes(body[:8], "little")
                group = int.from_bytes(body[8:12], "little")
                self.node.send(frm, FETCHED, encode_answer(request, group, REFUSED, None, 0, 0))
            return
        storage = self.node.storages.get(req.group)
        if storage is None:
            self.node.send(
                frm, FETCHED, encode_answer(req.request, req.group, NOT_REPLICA, None, 0, 0)
            )
            return
        if (
            req.wait_ms
            and req.offset >= storage.log.high_watermark
            and self.parked_count < MAX_PARKED
        ):
            # Nothing new yet, or this replica not as far as the asker (a new leader before its
            # first commit, a follower behind): held until it is, or the wait ends.
            deadline = time.monotonic() + req.wait_ms / 1000
            self.parked.setdefault(req.group, []).append((frm, req, deadline))
            self.parked_count += 1
            return
        self._answer(frm, req)

    def committed(self, group: int) -> None:
        """The group's commit index moved here: the polls held for it that it reached are
        answered."""
        held = self.parked.get(group)
        storage = self.node.storages.get(group)
        if not held or storage is None:
            return
        hwm = storage.log.high_watermark
        due = [h for h in held if h[1].offset < hwm]
        if due:
            self.parked[group] = [h for h in held if h[1].offset >= hwm]
            self.parked_count -= len(due)
            for frm, req, _ in due:
                self._answer(frm, req)

    def _answer(self, frm: int, req: FetchRequest) -> None:
        g = req.group
        storage = self.node.storages.get(g)
        if storage is None:
            self.node.send(frm, FETCHED, encode_answer(req.request, g, NOT_REPLICA, None, 0, 0))
            return
        plog = storage.log
        start, hwm = plog.log_start_offset, plog.high_watermark
        leader = self.node.leader(g)
        term = self.node.core(g).term
        error, batches = OK, []
        if not start <= req.offset <= hwm:
            error = OUT_OF_RANGE
        elif req.offset < hwm and req.max_bytes:
            try:
                batches = plog.read_batches(req.offset, hwm, 1 << 20, req.max_bytes)
            except OffsetOutOfRange:
                error = OUT_OF_RANGE
            except (CorruptRecordBatch, CommitLogError, OSError):
                error = UNAVAILABLE  # a damaged range awaiting repair: another replica
        self.served += 1
        answer = encode_answer(req.request, g, error, leader, start, hwm, batches, term)
        self.node.send(frm, FETCHED, answer)

    def stats(self) -> dict[str, int]:
        return {
            "fetches_served": self.served,
            "fetches_refused": self.refused,
            "fetch_answers_dropped": self.bad_answers,
            "fetches_held": self.parked_count,
            "fetches_waiting": len(self.polls),
            "fetches_relayed": self.relayed,
        }

    # -- placement and views --------------------------------------------------------------

    def place(self, count: int) -> dict[int, GroupStorage]:
        """The cluster formed with ``count`` nodes: the storages of the groups this worker
        hosts (the caller hosts them); every other group of the worker's becomes a
        :class:`RemotePartition` (replacing any partition the router made before, e.g. for
        a session loaded at start) and starts its live poll.

        ``$retained`` and ``$sessions`` are placed on every node: each node applies every
        commit of them (its retained index, its knowledge of the sessions and their owners,
        which a takeover needs at once), so each needs all of them anyway, and a replica
        everywhere is the cheapest way to have them; they are small and compacted. With
        several workers per node the node's other workers read a partition that is remote
        here through this worker (broker.workers.remote_relay)."""
        service, node = self.service, self.node
        for g, key in service.groups.items():
            if key in (RETAINED, SESSIONS):
                node.replication[g] = count
                node.everywhere.add(g)
        # Named by the group's own log (a replica re-created here earlier,
        # broker.cluster.reshape: the log's configuration wins over placement), or placed
        # here when the cluster formed (not on a node that joined it later, nor for a group
        # this node was removed from).
        guess = not node.joined
        removed = node.reshape.removed
        hosted = {
            g: s
            for g, s in service.storages.items()
            if node.id in s.membership(_NONE).current.members
            or (guess and g not in removed and node.id in node.replicas_of(g))
        }
        for g in service.groups:
            if g not in hosted:
                self._serve_remotely(g)
        return hosted

    def _serve_remotely(self, g: int) -> RemotePartition:
        """Serve group ``g``'s partition from a :class:`RemotePartition` (its watchers kept)."""
        service, node = self.service, self.node
        key = service.groups[g]
        part = self.serve(g, key, [n for n in node.replicas_of(g) if n != node.id])
        service.remote_parts[key] = part
        service.hosting_changed(key)
        return part

    def serve(
        self, g: int, key: PartitionKey, replicas: list[int], owner: int | None = None
    ) -> RemotePartition:
        """A :class:`RemotePartition` of group ``g`` (``owner``: the worker of this node that
        owns it, if not this one), in the router's place of the partition it had (its
        watchers kept), polling ``replicas``."""
        service = self.service
        config = service.streams.specs[key[0]].log
        part = RemotePartition(key, config, g, service, replicas, owner)
        router = service.router
        old = router.partitions.get(key) if router is not None else None
        # Another worker's is put in the router's place at once: the router's factory makes
        # only this worker's own (ClusterService.make_partition, from remote_parts).
        if router is not None and (old is not None or owner is not None):
            if old is not None:
                part.watchers = old.watchers
            router.partitions[key] = part
        self.add(part)
        return part

    def drop(self, g: int) -> RemotePartition | None:
        """Stop reading group ``g`` remotely (its node hosts it now): the partition, whose
        polls end with it, or None."""
        part = self.parts.pop(g, None)
        if part is not None:
            self.retry.discard(part)
            for request in [r for r, (p, _) in self.polls.items() if p is part]:
                del self.polls[request]  # its answers are dropped: no poll goes again
        return part

    def demote(self, g: int, leader: int) -> None:
        """This node was removed from group ``g`` (broker.cluster.reshape), as ``leader``
        said: its partition is served remotely from now on, the publishes its replica held
        (waiting for a leader it no longer hears) are forwarded to ``leader``, and its copy is
        moved aside (renamed, kept): a new, empty storage takes its place for a later
        :meth:`promote`."""
        service = self.service
        key = service.groups.get(g)
        if key is None:
            return
        old = service.router.partitions.get(key) if service.router is not None else None
        part = self._serve_remotely(g)
        part.leader_hint = leader
        if isinstance(old, Handover):
            part.held += old.held
            old.held = []
            if old.pending:
                deadline = time.monotonic() + service.hold_seconds
                part.held.append((old.pending, old.acks, deadline))
                old.pending, old.acks = [], []
            part.release(time.monotonic())
        aside = service.streams.set_aside(*key, f"removed-{int(time.time())}")
        service.storages[g] = GroupStorage.over(service.streams.log(*key))
        log.info("cluster: %s/%d: this node's copy moved to %s", *key, aside)

    def promote(self, g: int) -> GroupStorage | None:
        """A leader added this node to group ``g`` (broker.cluster.reshape): its partition is
        served from the group's storage from now on (a replicated partition replaces the
        remote one in the router, with its watchers) and no longer polled; the storage, or
        None for a group this worker does not have."""
        service = self.service
        key, storage = service.groups.get(g), service.storages.get(g)
        if key is None or storage is None:
            return None
        part = service.remote_parts.pop(key, None)
        self.drop(g)
        router = service.router
        if router is not None:
            new = service.make_partition(key)
            if part is not None:
                new.watchers = part.watchers
            router.partitions[key] = new
        service.hosting_changed(key)
        return storage

    async def caught_up(self, timeout: float) -> list[int]:
        """Wait until a replica answered each remote partition once (its marks are the
        cluster's), or ``timeout``; returns the groups still unknown."""
        deadline = time.monotonic() + timeout
        while True:
            behind = [g for g, part in self.parts.items() if not part.known]
            if not behind or time.monotonic() >= deadline:
                return behind
            self.tick(time.monotonic())
            await asyncio.sleep(0.05)

    def status(self) -> list[dict[str, Any]]:
        """The remote partitions, shaped as ``ClusterNode.status``'s partitions, with
        ``replica: false`` and ``role: "remote"``."""
        names = self.node.names
        out = []
        for g, part in sorted(self.parts.items(), key=lambda kv: kv[1].key):
            if part.owner is not None:
                continue  # in its owner's view (the node's is every worker's, merged)
            hint = part.leader_hint
            out.append(
                {
                    "stream": part.key[0],
                    "partition": part.key[1],
                    "group": g,
                    "role": "remote",
                    "replica": False,
                    "term": None,
                    "leader": names.get(hint) if hint is not None else None,
                    "replicas": sorted(part.replica_names()),
                    "preferred_leader": names.get(part.replicas[0]) if part.replicas else None,
                    "commit_index": part.log.end_offset,
                    "earliest_offset": part.log.log_start_offset,
                    "followers": [],
                }
            )
        return out
