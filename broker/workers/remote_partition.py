"""Partitions this node holds no replica of: served to its clients through remote reads.

With ``replication_factor`` below the node count a stream partition's Raft group lives on
``replication_factor`` nodes (``broker.cluster.placement``), but a client may connect to any
node (issue 20, item 5). On a node outside the group the router's partition is a
:class:`RemotePartition`:

* publishes gathered in one loop iteration go to the group's leader as one ``FORWARD``
  (``broker.workers.replicated``'s, the one followers use), and are acknowledged only by the
  leader's answer, which comes after the quorum commit [MQTT-4.3.2-2]; a publish whose
  outcome is unknown (the leader changed or died meanwhile) gets no PUBACK and its
  connection is closed, as on a follower;
* readers (subscribers, shared groups, ``$replay``) see only committed records, fetched from
  a replica with the fetch protocol (``broker.cluster.fetch``): whole batches, CRC-checked
  here, never past the high-water mark the replica states.

Design: one long poll per partition (Kafka's follower and consumer fetch, ``fetch.max.wait``),
not a push of each commit. The node keeps one ``FETCH`` outstanding per remote partition, at its
known high-water mark, preferably to the leader (it learns a commit first: a follower learns it
a message later, ``broker.cluster.commits``), which holds it until the next commit (at most a
second, ``broker.workers.remote_fetches.LIVE_WAIT_MS``) and answers with the marks, the leader
and, when the partition has readers here, the new batches. So a commit reaches this node's
subscribers one message after it happened, as it reaches a follower with the leader's next
AppendEntries or commit notice, and the replica keeps no state per reader beyond one held
request: no registration to expire, nothing to redo after a node restarts, and a dead replica
costs one ``ANSWER_TIMEOUT`` (2.5 s) before the poll goes to the next. A push (the leader
sending each commit to the nodes that asked) would save the request per commit but needs a
subscription the leader must keep, hand over at every leadership change and expire when the
asker dies; the long poll gets the same latency with none of that. The answer's leader is what
forwards are sent to (this node hosts no core of the group to know it). Without readers the poll
asks for the marks only (``max bytes = 0``): publishers alone cost no data traffic back.

Records fetched are kept in memory (:class:`Chunks`, bounded by :data:`CACHE_RECORDS` and
:data:`CACHE_BYTES`), not on disk: the point of a replication factor below the node count is
that a node stores and fsyncs only its share. A reader behind what the cache holds (a
``$replay``, a persistent session back after a while) gets nothing at first; the read starts a
fetch from its offset (four at a time per partition) and the partition's readers are woken
when the answer arrives, so history streams at one round trip per 1 MiB. Limits: a
``$replay/time:`` resolves its time from the records fetched here
(:meth:`RemoteLog.offset_for_time`); a ``;merge`` replay may pass a partition whose fetch is
in flight.

``$retained`` and ``$sessions`` are not remote: they are replicated on every node
(``broker.workers.remote_fetches.RemoteFetches.place`` says why).

Called only from the worker's event loop.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from broker.commitlog import LogConfig, Record
from broker.commitlog.errors import CommitLogError, OffsetOutOfRange
from broker.commitlog.keys import PartitionKey
from broker.router.partition import READ_BATCH, Columns, PartitionBase

if TYPE_CHECKING:
    from broker.cluster.node import ClusterNode

Ack = Callable[[int | None], None]

#: Records and payload bytes kept per remote partition.
CACHE_RECORDS = 65536
CACHE_BYTES = 32 << 20


class Chunk(NamedTuple):
    """Committed records fetched from ``first`` (the offset asked) up to ``next`` (the end
    of the last batch; control batches and compaction's gaps hold no record)."""

    first: int
    next: int
    records: list[Record]
    size: int


class Chunks:
    """The records fetched for one remote partition: chunks of disjoint offset ranges,
    oldest dropped first past :data:`CACHE_RECORDS` / :data:`CACHE_BYTES`."""

    __slots__ = ("by_first", "count", "size", "starts")

    def __init__(self) -> None:
        self.by_first: OrderedDict[int, Chunk] = OrderedDict()  # insertion order: eviction
        self.starts: list[int] = []  # sorted
        self.count = 0
        self.size = 0

    def find(self, offset: int) -> Chunk | None:
        i = bisect_right(self.starts, offset) - 1
        if i < 0:
            return None
        chunk = self.by_first[self.starts[i]]
        return chunk if offset < chunk.next else None

    def add(self, chunk: Chunk) -> None:
        if chunk.next <= chunk.first:
            return
        # Drop what the new chunk overlaps: ranges stay disjoint, so a lookup is one bisect.
        for first in self.starts[max(0, bisect_left(self.starts, chunk.first) - 1) :]:
            if first >= chunk.next:
                break
            old = self.by_first[first]
            if old.next > chunk.first:
                self._drop(first)
        self.by_first[chunk.first] = chunk
        self.starts.insert(bisect_left(self.starts, chunk.first), chunk.first)
        self.count += len(chunk.records)
        self.size += chunk.size
        while len(self.by_first) > 1 and (self.count > CACHE_RECORDS or self.size > CACHE_BYTES):
            self._drop(next(iter(self.by_first)))

    def _drop(self, first: int) -> None:
        old = self.by_first.pop(first)
        del self.starts[bisect_left(self.starts, first)]
        self.count -= len(old.records)
        self.size -= old.size

    def read(self, offset: int, max_records: int) -> tuple[list[Record], int]:
        """Records from ``offset`` (through chunks that hold none there), and the offset
        where what the chunks hold ends."""
        while True:
            chunk = self.find(offset)
            if chunk is None:
                return [], offset
            records = chunk.records
            i = bisect_left(records, offset, key=_offset)
            if i < len(records):
                return records[i : i + max_records], offset
            offset = chunk.next


def _offset(record: Record) -> int:
    return record[0]


class NotHeldHere(CommitLogError):
    """A read of the log's files of a partition this node holds no replica of (the HTTP
    fetch API): the client asks a replica, which the message names."""

    def __init__(self, part: RemotePartition) -> None:
        replicas = ", ".join(part.replica_names())
        super().__init__(f"{part.key[0]}/{part.key[1]} is not held on this node: ask {replicas}")


class RemoteLog:
    """What the router's readers see of a remote partition's log: its marks as the replicas
    last stated them, and reads from :class:`Chunks` (a read the chunks cannot serve starts a
    fetch and returns nothing yet)."""

    def __init__(self, part: RemotePartition, config: LogConfig) -> None:
        self.part = part
        self.config = config
        #: Every offset below it is committed (the highest mark a replica stated).
        self.end_offset = 0
        self.log_start_offset = 0

    @property
    def high_watermark(self) -> int:
        return self.end_offset

    def records(self, offset: int, max_records: int) -> list[Record]:
        """Committed records from ``offset`` fetched already (none yet: a fetch started)."""
        if not self.log_start_offset <= offset <= self.end_offset:
            raise OffsetOutOfRange(offset, self.log_start_offset, self.end_offset)
        return self.part.fetched(offset, max_records)

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> Any:
        """The HTTP fetch API's read: served by the replicas (the error names them)."""
        raise NotHeldHere(self.part)

    read_columns = read

    def offset_for_time(self, timestamp_ms: int) -> int:
        """The first offset at or after ``timestamp_ms`` among the records fetched here;
        the log start when they do not reach back that far (README, Cluster: a ``time:``
        replay on a node outside the group may then start earlier)."""
        chunks = self.part.chunks
        best: int | None = None
        for first in chunks.starts:
            chunk = chunks.by_first[first]
            if chunk.records and chunk.records[0].timestamp < timestamp_ms:
                for r in chunk.records:
                    if r.timestamp >= timestamp_ms:
                        best = r.offset if best is None else min(best, r.offset)
                        break
                else:
                    best = chunk.next if best is None else min(best, chunk.next)
        return self.log_start_offset if best is None else best


@dataclass(slots=True)
class Poll:
    """A fetch in flight."""

    request: int
    offset: int
    live: bool
    sent: float  # monotonic
    to: int  # node id


class PartitionHost(Protocol):
    """What a remote partition needs of the worker's cluster side
    (``broker.workers.replicated.ClusterService``)."""

    hold_seconds: float
    node: ClusterNode

    @property
    def remote(self) -> HistoryReads: ...

    def forward(
        self, part: RemotePartition, records: list[Record], acks: list[Ack | None], deadline: float
    ) -> bool: ...

    def remote_leader(self, part: RemotePartition) -> None: ...


class HistoryReads(Protocol):
    def history(self, part: RemotePartition, offset: int) -> None: ...


class RemotePartition(PartitionBase):
    """A partition whose group this node does not host (module docstring)."""

    __slots__ = (
        "chunks",
        "group",
        "held",
        "history",
        "known",
        "leader_hint",
        "leader_term",
        "live",
        "owner",
        "replicas",
        "service",
        "skipped",
    )
    appends_here = False
    fetched_remotely = True

    log: RemoteLog  # type: ignore[assignment]

    def __init__(
        self,
        key: PartitionKey,
        config: LogConfig,
        group: int,
        service: PartitionHost,
        replicas: list[int],
        owner: int | None = None,
    ) -> None:
        self.group = group
        #: The worker of this node that owns the partition when it is not this one (several
        #: workers per node, broker.workers.remote_relay): publishes are forwarded to it and
        #: fetches sent through it. None: this worker owns it.
        self.owner = owner
        self.service = service
        self.chunks = Chunks()
        self.replicas = replicas
        self.leader_hint: int | None = None
        #: The latest term a replica named a leader in (:attr:`leader_hint` leads in it, if
        #: known): a replica behind that names an earlier leader is not believed.
        self.leader_term: int | None = None
        #: A replica answered once (the marks are the cluster's, not 0).
        self.known = False
        self.live: Poll | None = None
        self.history: dict[int, Poll] = {}
        #: Replicas that failed us lately, asked last.
        self.skipped: list[int] = []
        #: Batches waiting for a leader: (records, acks, monotonic deadline), as a
        #: follower's (broker.workers.replicated).
        self.held: list[tuple[list[Record], list[Ack | None], float]] = []
        super().__init__(key, RemoteLog(self, config))  # type: ignore[arg-type]

    @property
    def end_offset(self) -> int:
        return self.log.end_offset

    def leader(self) -> int | None:
        return self.leader_hint

    def replica_names(self) -> list[str]:
        names = self.service.node.names
        return [names.get(n, str(n)) for n in self.replicas]

    # -- publishes ------------------------------------------------------------------------

    def commit(self) -> tuple[int, int]:
        """Forward what this iteration gathered to the leader, in one batch."""
        records, acks = self.pending, self.acks
        self.pending, self.acks = [], []
        if records:
            self.dispatch(records, acks, time.monotonic() + self.service.hold_seconds)
        end = self.log.end_offset
        return end, end

    def dispatch(self, records: list[Record], acks: list[Ack | None], deadline: float) -> None:
        if not self.service.forward(self, records, acks, deadline):
            self.held.append((records, acks, deadline))

    def release(self, now: float) -> None:
        """Forward what is held again (a leader may be known now); refuse what waited past
        its deadline (``None``: a negative acknowledgement or a closed connection)."""
        held, self.held = self.held, []
        for records, acks, deadline in held:
            if now > deadline:
                for ack in acks:
                    if ack is not None:
                        ack(None)
            else:
                self.dispatch(records, acks, deadline)

    # -- fetches --------------------------------------------------------------------------

    def target(self) -> int | None:
        """The replica to ask: the leader if known and not failing lately, else the first
        replica that did not fail lately."""
        skipped = self.skipped
        order = sorted(self.replicas, key=lambda n: (n in skipped, n != self.leader_hint))
        return order[0] if order else None

    def skip(self, node: int) -> None:
        """``node`` failed a fetch or a forward: asked last from now on."""
        if node in self.skipped:
            self.skipped.remove(node)
        self.skipped.append(node)
        if len(self.skipped) >= len(self.replicas):
            del self.skipped[0]
        if self.leader_hint == node:
            self.leader_hint = None

    def forget(self, poll: Poll) -> None:
        if self.live is poll:
            self.live = None
        elif self.history.get(poll.offset) is poll:
            del self.history[poll.offset]

    def marks(self, leader: int | None, start: int, hwm: int, term: int | None = None) -> bool:
        """A replica stated these (``term``: the one ``leader`` leads in); returns True
        when the high-water mark moved."""
        self.known = True
        stale = term is not None and self.leader_term is not None and term < self.leader_term
        if leader is not None and not stale:
            if leader not in self.replicas:  # a replica placed since (broker.cluster.reshape)
                self.replicas.append(leader)
            if leader in self.skipped:
                self.skipped.remove(leader)
            if term is not None:
                self.leader_term = term
            if leader != self.leader_hint:
                self.leader_hint = leader
                self.service.remote_leader(self)
        plog = self.log
        plog.log_start_offset = max(plog.log_start_offset, start)
        if hwm > plog.end_offset:
            plog.end_offset = hwm
            return True
        return False

    # -- reads ----------------------------------------------------------------------------

    def fetched(self, offset: int, max_records: int) -> list[Record]:
        """Records from ``offset`` fetched already; none (and a fetch started) otherwise."""
        records, at = self.chunks.read(offset, max_records)
        if not records and at < self.log.end_offset:
            self.service.remote.history(self, at)
        return records

    def read(self, offset: int, max_records: int = READ_BATCH) -> list[Record]:
        return self.log.records(offset, max_records)

    def read_columns(self, offset: int) -> Columns:
        return Columns.from_records(self.read(offset))
