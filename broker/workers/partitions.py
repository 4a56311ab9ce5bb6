"""Partitions across workers: each has one owner, which alone appends to it.

On the owner a partition is an :class:`OwnedPartition`: a router
:class:`~broker.router.partition.Partition` that, after each group commit, announces its new
high-water mark (and earliest offset) to every peer. Elsewhere it is a
:class:`RemotePartition`: publishes gathered during an iteration are forwarded to the owner
in one frame and their acknowledgements wait for the owner's reply, which comes only after
its append (so a PUBACK still follows the append [MQTT-4.3.2-2]); reads are served from
the records the owner announced (a tail in memory, as the owner's own) and otherwise go to
the files the owner wrote, through a :class:`~broker.commitlog.reader.LogReader` that never
reads past the announced mark.

Frames (see :mod:`broker.workers.mesh`), each sent once per event-loop iteration whatever
the number of partitions and records it carries (gathered until the mesh's flush,
:meth:`~broker.workers.mesh.Mesh.before_flush`): a fleet's iteration gathers a record or two
for each of several partitions, and a frame per partition and commit made the second worker
cost per message what the first spent per iteration. ``FORWARD`` is a request to one owner
whose body is, :mod:`marshal`-ed, one ``(stream, partition, batch)`` per partition it owns that
this iteration gathered records for; answered with the first offset given to each batch, in
order (``<q`` each; -1: the append failed). ``batch`` is the records in the log's batch
format (broker.commitlog.batch, base offset 0), encoded once here: the owner checks its CRC
and appends the bytes as they are, given their offsets (``SegmentedLog.append_parts``),
without an object per record (issue 23: the rows forwarded before cost the second worker
40,198 instructions per message over one worker on the fleet, bench/instr_bench.py); the
compiled small-batch codec (broker.commitlog._smallbatch) makes that cheaper than marshalled
rows were, which took 2 + 3 us to send and rebuild against 27 + 30 us for a batch in Python.
Rows (tuples without their offset: timestamp, topic, payload, qos, retain, client id,
properties) are forwarded instead for the internal streams (``$sessions``, ``$retained``:
their owner handles each record), in a cluster (a replicated partition proposes records,
broker.workers.replicated), and where the codec is not built. ``APPENDED`` is a notification, to
every peer, of the commits of the iteration: one ``(stream, partition, earliest offset,
high-water mark, records)`` each, so each worker knows every partition's mark; ``records``
are the commit's (they end at the mark) when at most :data:`ANNOUNCED_RECORDS` and
:data:`ANNOUNCED_BYTES` of payload, else None: as rows, or, for a commit that appended
forwarded batches, as the batches it wrote (bytes); a worker with a subscriber to that
partition feeds it from memory instead of reading each small batch back from the owner's
file (a fleet's commits are one to three records).
``MARKS`` asks a peer for the marks of all it owns (a worker asks each peer
once when it starts, before it serves: a subscription made then starts from the true end,
not from 0).

Called only from the worker's event loop.
"""

from __future__ import annotations

import logging
import marshal
import struct
from collections.abc import Callable
from functools import partial
from itertools import count
from typing import Any

from broker.commitlog import LogConfig, Record, SegmentedLog, small_batch
from broker.commitlog.batch import BATCH_HEADER, CONTROL_FLAG, MAGIC
from broker.commitlog.crc import batch_crc_ok
from broker.commitlog.keys import PartitionKey
from broker.commitlog.reader import LogReader
from broker.commitlog.small_batch import decode_records, encode
from broker.router.commit import OUTCOME_UNKNOWN
from broker.router.partition import READ_BATCH, Columns, Partition, PartitionBase
from broker.workers.mesh import FIRST_USER_KIND, Mesh, PeerDown

log = logging.getLogger("broker.workers")

FORWARD = FIRST_USER_KIND
APPENDED = FIRST_USER_KIND + 1
MARKS = FIRST_USER_KIND + 2
#: Kinds from here on are free for the other worker services.
NEXT_KIND = FIRST_USER_KIND + 3

#: An announcement carries the records of a commit of at most this many records and ...
ANNOUNCED_RECORDS = 64
#: ... this many payload bytes (a bigger batch is read from the files, where the columns
#: path decodes it without a tuple per record).
ANNOUNCED_BYTES = 64 << 10

_KEY = struct.Struct("<HI")  # stream name length, partition; the name follows
_MARKS = struct.Struct("<qq")

Ack = Callable[[int | None], None]


def pack_key(key: PartitionKey) -> bytes:
    name = key[0].encode()
    return _KEY.pack(len(name), key[1]) + name


def unpack_key(body: memoryview | bytes, pos: int = 0) -> tuple[PartitionKey, int]:
    """The key at ``pos`` and the position after it."""
    size, partition = _KEY.unpack_from(body, pos)
    start = pos + _KEY.size
    return (bytes(body[start : start + size]).decode(), partition), start + size


class OwnedPartition(Partition):
    """A partition this worker owns: a router partition that announces each commit, with
    the records it appended (see :data:`ANNOUNCED_RECORDS`)."""

    __slots__ = ("announce",)

    def __init__(
        self,
        key: PartitionKey,
        log: SegmentedLog,
        announce: Callable[[OwnedPartition, list[Record] | list[bytes | bytearray]], None],
    ) -> None:
        super().__init__(key, log)
        self.announce = announce

    def commit(self) -> tuple[int, int]:
        records = self.pending
        forwarded = bool(self.forwarded)
        try:
            first, end = super().commit()
        except Exception:
            # Peers must not wait on a mark that did not move, but one that did (an earlier
            # batch) is worth telling.
            self.announce(self, [])
            raise
        if forwarded:  # its records are in the batches it wrote
            self.announce(self, self.written)
        else:
            self.announce(self, records if end - first == len(records) else [])
        return first, end


class RemotePartition(PartitionBase):
    """A partition another worker owns, as this worker's router sees it: ``commit``
    forwards the gathered batch to the owner; reads are served from the tail of records the
    owner announced (:meth:`PartitionBase.keep_tail`) and otherwise go to the owner's files
    up to its announced mark."""

    __slots__ = ("forward", "owner", "peer_reads_committed")
    appends_here = False

    log: LogReader

    def __init__(
        self,
        key: PartitionKey,
        reader: LogReader,
        owner: int,
        forward: Callable[[RemotePartition, list[Record], list[Ack | None]], None],
        peer_reads_committed: bool = True,
    ) -> None:
        super().__init__(key, reader)
        self.owner = owner
        self.forward = forward
        self.peer_reads_committed = peer_reads_committed

    def committed_through(self, offset: int) -> None:
        """``offset`` is committed (a peer read it): readable here even before the owner's
        announcement of it arrives (it comes on another channel). Not in a cluster, where
        the peer may be another node's worker: this node's replica may not have it yet."""
        if self.peer_reads_committed:
            self.log.advance(offset + 1)

    def commit(self) -> tuple[int, int]:
        """Forward the gathered batch to the owner; acknowledgements follow its reply."""
        records, acks = self.pending, self.acks
        self.pending, self.acks = [], []
        if records:
            self.forward(self, records, acks)
        end = self.log.end_offset
        return end, end

    def read(self, offset: int, max_records: int = READ_BATCH) -> list[Record]:
        """Committed records from ``offset``: from the tail when it holds ``offset``, else
        from the owner's files (below the tail, or past it up to a mark learnt without its
        records: a large batch, a peer's :meth:`committed_through`)."""
        i = offset - self.tail_base
        if 0 <= i < len(self.tail):
            return self.tail[i : i + max_records]
        return super().read(offset, max_records)

    def read_columns(self, offset: int) -> Columns:
        """:meth:`read` from ``offset`` as columns: the tail's records when it holds it."""
        if 0 <= offset - self.tail_base < len(self.tail):
            return self.tail_columns(offset)
        return super().read_columns(offset)


class PartitionService:
    """One worker's side of partition ownership: makes the router's partition objects,
    forwards, answers forwards, announces and follows high-water marks.

    ``enqueue(key, rows, ack)`` appends forwarded rows to an owned partition through the
    router's group commit (``ack`` is called with the first offset, or None); ``wake(partition)``
    tells the router a remote partition moved (``on_moved(key, old_end, partition)`` runs
    first, for the streams whose every change matters to the worker, such as retained
    messages).
    """

    def __init__(
        self,
        worker: int,
        count: int,
        owner_of: Callable[[PartitionKey, int], int],
        directory_of: Callable[[PartitionKey], Any],
        config_of: Callable[[PartitionKey], LogConfig],
    ) -> None:
        self.worker = worker
        self.count = count
        self.owner_of = owner_of
        self.directory_of = directory_of
        self.config_of = config_of
        self.mesh: Mesh | None = None
        self.enqueue: Callable[[PartitionKey, list[tuple[Any, ...]], Ack], None] | None = None
        #: ``enqueue_batch(key, batch, count, ack)``: a forwarded batch's bytes, likewise.
        self.enqueue_batch: Callable[[PartitionKey, bytes, int, Ack], None] | None = None
        #: Forward batches as the log's bytes, where the small-batch codec is compiled (in
        #: Python a batch costs more than rows: the fleet on two workers took 143,370
        #: instructions per message so, 121,562 with rows, 102,707 compiled); else as rows,
        #: and in a cluster (set by the server).
        self.forward_batches = small_batch.IMPLEMENTATION == "compiled"
        self.wake: Callable[[Any], None] | None = None
        self.on_moved: Callable[[PartitionKey, int, RemotePartition], None] | None = None
        #: The partitions this worker owns (opened at start, so MARKS can answer for all):
        #: OwnedPartition, or a replicated one made by the cluster (:meth:`adopt`).
        self.owned: dict[PartitionKey, Partition] = {}
        self.remote: dict[PartitionKey, RemotePartition] = {}
        #: Every other worker's partitions: (earliest offset, high-water mark) as announced.
        self.marks: dict[PartitionKey, tuple[int, int]] = {}
        #: What the publishers of a forward are told when the owner goes away before its
        #: answer: None (not stored, the single node's answer), or, in a cluster, where the
        #: owner may have proposed them already, OUTCOME_UNKNOWN (set by the server).
        self.lost_outcome: int | None = None
        #: Whether a record a peer read is in the owner's files (one node), or only in a
        #: replica somewhere (a cluster: a shared group's home on another node; set by the
        #: server): :meth:`RemotePartition.committed_through`.
        self.peer_reads_committed = True
        self.forwarded = 0  # records sent to their owner
        #: FORWARDs sent (numbered from 0) and those not answered yet: what a hand-off waits
        #: for (broker.workers.handoff, :meth:`answered_before`).
        self.forwards_sent = 0
        self._unanswered: set[int] = set()
        self.received = 0  # records appended for a peer
        #: Batches gathered this iteration, by owner: sent in one FORWARD at its end.
        self._forwards: dict[int, list[tuple[PartitionBase, list[Record], list[Ack | None]]]]
        self._forwards = {}
        #: Commits of this iteration, sent to every peer in one APPENDED at its end.
        self._appended: list[tuple[str, int, int, int, list[tuple[Any, ...]] | bytes | None]]
        self._appended = []

    def handlers(self) -> dict[int, Callable[[int, int, memoryview], None]]:
        return {FORWARD: self._on_forward, APPENDED: self._on_appended, MARKS: self._on_marks}

    def owns(self, key: PartitionKey) -> bool:
        return self.owner_of(key, self.count) == self.worker

    def make(
        self, key: PartitionKey, open_log: Callable[[PartitionKey], SegmentedLog]
    ) -> PartitionBase:
        """The router's partition object for ``key``: owned or remote."""
        owner = self.owner_of(key, self.count)
        if owner == self.worker:
            owned = OwnedPartition(key, open_log(key), self.announce)
            self.owned[key] = owned
            return owned
        start, end = self.marks.get(key, (0, 0))
        reader = LogReader(self.directory_of(key), self.config_of(key), end)
        reader.advance(end, start)
        part = self.remote[key] = RemotePartition(
            key, reader, owner, self._forward, self.peer_reads_committed
        )
        return part

    async def sync_marks(self) -> None:
        """Learn the marks of every peer's partitions (at start, before serving)."""
        assert self.mesh is not None
        for peer in list(self.mesh.peers):
            body = await self.mesh.call(peer, MARKS)
            pos = 0
            while pos < len(body):
                key, pos = unpack_key(body, pos)
                self._moved(key, *_MARKS.unpack_from(body, pos))
                pos += _MARKS.size

    def adopt(self, part: Partition) -> None:
        """``part``, which this worker owns, was made elsewhere (a replicated partition,
        broker.workers.replicated): MARKS answers for it too; it calls :meth:`announce`
        itself when its high-water mark moves."""
        self.owned[part.key] = part

    # ------------------------------------------------------------ owner side

    def announce(self, part: Partition, records: list[Record] | list[bytes | bytearray]) -> None:
        """Tell every peer, at the end of this iteration, ``part``'s new marks and, when few
        and ending at the mark, the ``records`` of the commit (:data:`ANNOUNCED_RECORDS`),
        or the batches it wrote (bytes, :meth:`OwnedPartition.commit`)."""
        if self.mesh is None or not self.mesh.peers:
            return
        if not self._appended:
            self.mesh.before_flush(self._send_appended)
        stream, partition = part.key
        # end_offset: a replicated partition's is its commit index, not its log's end.
        start = part.log.log_start_offset
        self._appended.append((stream, partition, start, part.end_offset, _announced(records)))

    def _send_appended(self) -> None:
        appended, self._appended = self._appended, []
        if self.mesh is not None:
            self.mesh.broadcast(APPENDED, marshal.dumps(appended))

    def _on_marks(self, peer: int, request: int, body: memoryview) -> None:
        assert self.mesh is not None
        self.mesh.reply(peer, request, b"".join(map(_pack_marks, self.owned.values())))

    def _on_forward(self, peer: int, request: int, body: memoryview) -> None:
        mesh = self.mesh
        assert mesh is not None
        batches = marshal.loads(body)
        answer = _Answer(mesh, peer, request, len(batches))
        for i, (stream, partition, rows) in enumerate(batches):
            key = (stream, partition)
            if not self.owns(key):
                log.error(
                    "worker %d: peer %d forwarded to %s/%d, which it does not own",
                    self.worker,
                    peer,
                    *key,
                )
                answer.settle(i, None)
                continue
            if type(rows) is not bytes:
                assert self.enqueue is not None
                self.received += len(rows)
                self.enqueue(key, rows, partial(answer.settle, i))
                continue
            assert self.enqueue_batch is not None
            count = _checked(rows)
            if count is None:
                log.error(
                    "worker %d: peer %d forwarded a damaged batch to %s/%d", self.worker, peer, *key
                )
                answer.settle(i, None)
                continue
            self.received += count
            self.enqueue_batch(key, rows, count, partial(answer.settle, i))

    # ------------------------------------------------------------ elsewhere

    def _forward(
        self, part: RemotePartition, records: list[Record], acks: list[Ack | None]
    ) -> None:
        self.forward_to(part.owner, part, records, acks)

    def forward_to(
        self, owner: int, part: PartitionBase, records: list[Record], acks: list[Ack | None]
    ) -> None:
        """Gather the batch for ``owner``'s FORWARD, sent at the end of this iteration (also
        a cluster's partition that another worker reads remotely, broker.workers.remote_relay)."""
        self.forwarded += len(records)
        batches = self._forwards.get(owner)
        if batches is None:
            batches = self._forwards[owner] = []
            assert self.mesh is not None
            self.mesh.before_flush(partial(self._send_forward, owner))
        batches.append((part, records, acks))

    def _send_forward(self, owner: int) -> None:
        batches = self._forwards.pop(owner, [])
        if not batches:
            return

        number = self.forwards_sent
        self.forwards_sent += 1
        self._unanswered.add(number)

        def done(body: bytes | None) -> None:
            self._unanswered.discard(number)
            if body is None:
                firsts: list[int | None] = [self.lost_outcome] * len(batches)
                for part, records, _ in batches:
                    log.warning(
                        "%s/%d: worker %d went away; %d records %s",
                        *part.key,
                        owner,
                        len(records),
                        "not stored" if self.lost_outcome is None else "of unknown outcome",
                    )
            else:
                firsts = list(struct.unpack(f"<{len(batches)}q", body))
            for (_, _, acks), first in zip(batches, firsts, strict=True):
                _answered(acks, first)

        assert self.mesh is not None
        body = marshal.dumps(
            [(*part.key, self._framed(part.key, records)) for part, records, _ in batches]
        )
        try:
            self.mesh.request(owner, FORWARD, body, done)
        except PeerDown as e:
            self._unanswered.discard(number)
            for part, records, acks in batches:
                log.warning("%s/%d: %s; %d records not stored", *part.key, e, len(records))
                _settle(acks, None)

    def answered_before(self, number: int) -> bool:
        """Whether every FORWARD numbered below ``number`` was answered (its records'
        acknowledgements called)."""
        return not self._unanswered or min(self._unanswered) >= number

    def _framed(
        self, key: PartitionKey, records: list[Record]
    ) -> bytes | bytearray | list[tuple[Any, ...]]:
        """What a FORWARD carries of ``records`` for ``key`` (module doc): their batch, or
        their rows where the owner handles each record."""
        if self.forward_batches and not key[0].startswith("$"):
            return encode(0, records)
        return [r[1:] for r in records]

    def _on_appended(self, peer: int, request: int, body: memoryview) -> None:
        for stream, partition, start, end, rows in marshal.loads(body):
            key = (stream, partition)
            part = self.remote.get(key)
            if part is not None and (part.tail or part.watchers):
                if type(rows) is bytes and part.watchers:
                    # The batches the commit wrote, which end at the mark: their records.
                    records = _batch_records(rows)
                    part.keep_tail(records[0][0], records)
                elif rows is not None and part.watchers:
                    # The records of the commit, which ends at the mark: the tail of a
                    # partition someone here reads (the others would only hold memory).
                    new = tuple.__new__
                    first = end - len(rows)
                    part.keep_tail(
                        first,
                        [new(Record, (offset, *row)) for offset, row in zip(count(first), rows)],
                    )
                else:
                    part.tail = []  # what follows is in the files only
            self._moved(key, start, end)

    def _moved(self, key: PartitionKey, start: int, end: int) -> None:
        announced = self.marks.get(key)
        self.marks[key] = (start, end)
        part = self.remote.get(key)
        if part is None:
            return  # nobody here reads it yet; a reader made later starts from the mark
        old = part.log.end_offset
        if announced is not None and announced[1] < old:
            # committed_through (a shared group's delivery) moved the reader's end first:
            # the other readers here were not woken for what lies between, nor was the
            # retained index told; the announcement is their news.
            old = announced[1]
        part.log.advance(end, start)
        if end > old:
            if self.on_moved is not None:
                self.on_moved(key, old, part)
            if self.wake is not None:
                self.wake(part)

    def close(self) -> None:
        for part in self.remote.values():
            part.log.close()


def _pack_marks(part: Partition) -> bytes:
    # end_offset: a replicated partition's is its commit index, not its log's end.
    return pack_key(part.key) + _MARKS.pack(part.log.log_start_offset, part.end_offset)


class _Answer:
    """The owner's answer to one FORWARD: the first offset given to each of its batches
    (-1: not stored), replied once every batch's append has answered (all in this
    iteration's group commit)."""

    __slots__ = ("firsts", "left", "mesh", "peer", "request")

    def __init__(self, mesh: Mesh, peer: int, request: int, batches: int) -> None:
        self.mesh = mesh
        self.peer = peer
        self.request = request
        self.firsts = [-1] * batches
        self.left = batches

    def settle(self, i: int, first: int | None) -> None:
        self.firsts[i] = -1 if first is None else first
        self.left -= 1
        if not self.left:
            firsts = self.firsts
            self.mesh.reply(self.peer, self.request, struct.pack(f"<{len(firsts)}q", *firsts))


def _answered(acks: list[Ack | None], first: int | None) -> None:
    """Acknowledge a forwarded batch as its owner answered (``first``: its first offset;
    negative: not stored; None or OUTCOME_UNKNOWN: the owner went away)."""
    if first == OUTCOME_UNKNOWN:  # may be committed: no acknowledgement either way
        for ack in acks:
            if ack is not None:
                ack(OUTCOME_UNKNOWN)
        return
    _settle(acks, None if first is None or first < 0 else first)


def _settle(acks: list[Ack | None], first: int | None) -> None:
    """Call each record's acknowledgement: with its offset, or None when not stored."""
    for i, ack in enumerate(acks):
        if ack is not None:
            ack(None if first is None else first + i)


def _announced(
    records: list[Record] | list[bytes | bytearray],
) -> list[tuple[Any, ...]] | bytes | None:
    """What an announcement carries of a commit's ``records`` (module doc): their rows, or
    the batches written (bytes), or None when they are too many or too big."""
    if not records or len(records) > ANNOUNCED_RECORDS:
        return None
    if not isinstance(records[0], tuple):  # the batches written (a Record is a tuple)
        joined = b"".join(records)
        counts = sum([BATCH_HEADER.unpack_from(b)[7] for b in records])
        return joined if len(joined) <= ANNOUNCED_BYTES and counts <= ANNOUNCED_RECORDS else None
    rows = [r[1:] for r in records]
    return rows if sum([len(r[2]) for r in rows]) <= ANNOUNCED_BYTES else None


def _checked(batch: bytes) -> int | None:
    """The record count of ``batch``, a forwarded batch of consecutive records; None when it
    is not one whole, undamaged such batch (the CRC check is compiled, ~0.1 us)."""
    if len(batch) < BATCH_HEADER.size:
        return None
    (_, length, magic, attributes, _, _, last_delta, n, _, _, _) = BATCH_HEADER.unpack_from(batch)
    if (
        length != len(batch)
        or magic != MAGIC
        or attributes & CONTROL_FLAG
        or n < 1
        or last_delta != n - 1
        or not batch_crc_ok(batch, 0, length)
    ):
        return None
    return int(n)


def _batch_records(batches: bytes) -> list[Record]:
    """The records of consecutive batches (an announcement's, written by the owner)."""
    records: list[Record] = []
    pos = 0
    while pos < len(batches):
        records += decode_records(batches, pos)
        pos += BATCH_HEADER.unpack_from(batches, pos)[1]
    return records
