"""A partition as the router sees it: its log, the batch being gathered, a tail in memory.

Publishes that arrive during one event-loop iteration are gathered in :attr:`pending` and
appended as one batch (one ``write``) by :meth:`commit`; their acknowledgements wait for it.
The last records appended are kept in :attr:`tail` so caught-up subscribers are fed from
memory; a subscriber behind the tail reads the log.

Owned by one router; called only from its event loop thread.
"""

from __future__ import annotations

import struct
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from functools import cache, lru_cache
from itertools import accumulate, count, pairwise, repeat
from typing import Any, NamedTuple

from broker.commitlog import Record, SegmentedLog
from broker.commitlog.columns import ColumnRead
from broker.commitlog.keys import PartitionKey
from broker.commitlog.reader import LogReader
from broker.commitlog.small_batch import decode_records

#: Records kept in memory per partition for caught-up subscribers (one iteration of a busy
#: fan-in appends tens of thousands: a smaller tail sends its subscriber to the log) ...
TAIL_RECORDS = 16384
#: ... and at most about this many payload bytes (large messages keep fewer records).
TAIL_BYTES = 16 << 20
#: Records read from the log per call for a lagging subscriber: enough to decode whole log
#: batches (a busy iteration appends thousands; reading 1,000,000 records back ran at 497k
#: records/s with 512 per read and 710k with 4096, measured here).
READ_BATCH = 4096
#: A read-ahead with fewer records left than this is read again from there, with what follows
#: (a handful of records is below the run path's minimum, Delivery.send_run: a QoS 1 replay's
#: windows of 100 left one read in ~25 with 1-7 records, each then read again as 4,096
#: Record tuples and sent one by one, ~4% of the replay's time, measured).
READ_AHEAD_REST = 64


class SessionWatcher(NamedTuple):
    """A session's consumer reading a partition (see :attr:`PartitionBase.watchers`)."""

    client_id: str
    #: The consumer's name (broker.router.session.MAIN or a ``$replay/...`` filter).
    consumer: str


class GroupWatcher(NamedTuple):
    """A shared group held by this worker reading a partition."""

    #: The group's full ``$share/<name>/<filter>``.
    group: str


class QueueWatcher(NamedTuple):
    """A session whose next record from a group held elsewhere (its ``group_queue``), or an
    in-flight delivery to resend (its ``resend_due``), is not readable here yet: the
    group's home saw the commit first (a cluster's follower learns it a round later), or
    the session resumed on a replica behind the commit."""

    client_id: str
    #: Told apart from a :class:`GroupWatcher` of the same string by its length.
    waiting: bool = True


#: Who is woken when a partition has new records. They are told apart by type, never equal
#: to each other (a different length, or a bool against a string).
Watcher = SessionWatcher | GroupWatcher | QueueWatcher


#: Stored flags byte -> retain (bit 0; the other bits are not ours to read).
_RETAIN_BIT = bytes(i & 1 for i in range(256))


@lru_cache(maxsize=32)
def _equal_parts(size: int, count: int) -> struct.Struct:
    """``count`` consecutive payloads of ``size`` bytes each: one ``unpack_from`` makes
    them all (35 ns per 64-byte payload against 290 ns slicing them one by one, measured)."""
    return struct.Struct(f"{size}s" * count)


class Columns:
    """Committed records of one read as per-record columns, for the run path
    (:meth:`broker.router.delivery.Delivery.send_run`), which needs no ``Record`` per record.

    Records ``start .. stop - 1`` of the columns are the read (a read-ahead is shared by the
    reads that fall inside it, each with its own ``start``). ``offsets`` (ints, increasing)
    and ``strings`` (every topic of the read is among them) are there at once; :meth:`built`
    adds ``topics``, ``payloads`` (``bytes``), ``qos`` (``bytes``, one per record),
    ``retains`` (true where retained), ``properties`` (true where a record has properties:
    its length or its bytes) and ``publishers()`` (the client ids, made on first use:
    no-local only). So a read of topics the consumer does not want is passed over from its
    string table alone. Built from the log's :class:`ColumnRead` with C loops over the
    stored columns (a string-table lookup per record, the payloads split by one struct
    call per batch), or from records in memory (the caught-up tail). Immutable once built.
    """

    __slots__ = (
        "_read",
        "offsets",
        "payloads",
        "properties",
        "publishers",
        "qos",
        "retains",
        "start",
        "stop",
        "strings",
        "topics",
    )

    topics: Sequence[str]
    payloads: Sequence[bytes]
    qos: bytes
    retains: Sequence[int]
    publishers: Callable[[], Sequence[str]]
    properties: Sequence[int | bytes]

    def __init__(
        self, offsets: Sequence[int], strings: Sequence[str], read: ColumnRead | None
    ) -> None:
        self.offsets = offsets
        self.strings = strings
        self._read = read
        self.start = 0
        self.stop = len(offsets)

    def __len__(self) -> int:
        return self.stop - self.start

    def from_index(self, i: int) -> Columns:
        """The same columns from record ``i`` on (built; shares the lists)."""
        self.built()
        cols = Columns(self.offsets, self.strings, None)
        cols.topics, cols.payloads, cols.qos = self.topics, self.payloads, self.qos
        cols.retains, cols.publishers = self.retains, self.publishers
        cols.properties = self.properties
        cols.start = i
        return cols

    def topic_at(self, i: int) -> str:
        """Record ``i`` 's topic, built or not."""
        read = self._read
        if read is None:
            return self.topics[i]
        k = bisect_right(read.run_ends, i)
        index = read.topic_indexes[k].cast("I")[i - (read.run_ends[k - 1] if k else 0)]
        return read.strings[read.table_starts[k] + index]

    @classmethod
    def from_records(cls, records: Sequence[Record]) -> Columns:
        """The tail's records, transposed (a caught-up read is short)."""
        if not records:
            return cls((), (), None).built()
        offsets, _stamps, topics, payloads, qos, retains, client_ids, props = zip(
            *records, strict=True
        )
        cols = cls(offsets, topics, None)
        cols.topics, cols.payloads, cols.qos = topics, payloads, bytes(qos)
        cols.retains, cols.publishers, cols.properties = retains, lambda: client_ids, props
        return cols

    @classmethod
    def from_read(cls, read: ColumnRead) -> Columns:
        """The records of a log read, from its stored column slices (built on demand)."""
        n = read.count
        if not n:
            return cls((), (), None).built()
        first = read.bases[0] + read.deltas[0].cast("I")[0]
        offsets: Sequence[int]
        if read.next_offset - first == n:
            offsets = range(first, read.next_offset)  # no gaps (no compaction): the common case
        else:
            offsets = []
            for base, deltas in zip(read.bases, read.deltas, strict=True):
                offsets += [base + d for d in deltas.cast("I")]
        return cls(offsets, read.strings, read)

    def built(self) -> Columns:
        """Self, with every column (see the class docstring)."""
        read = self._read
        if read is None:
            if not self.stop:
                self.topics = self.payloads = self.retains = self.properties = ()
                self.qos = b""
                self.publishers = tuple
            return self
        topics: list[str] = []
        payloads: list[bytes] = []
        strings = read.strings
        starts = [*read.table_starts, len(strings)]
        tables = [strings[a:b] for a, b in pairwise(starts)]
        for i, data in enumerate(read.payloads):
            topics += map(tables[i].__getitem__, read.topic_indexes[i].cast("I"))
            lengths = read.payload_lengths[i]
            count = len(lengths) // 4
            size = bytes(lengths[:4])
            if count and size * count == lengths:
                # Payloads of one size (telemetry): split by one struct call.
                payloads += _equal_parts(int.from_bytes(size, "little"), count).unpack_from(data)
            else:
                ends = list(accumulate(lengths.cast("I"), initial=0))
                payloads += map(bytes(data).__getitem__, map(slice, ends, ends[1:]))

        @cache
        def publishers() -> list[str]:
            out: list[str] = []
            for table, indexes in zip(tables, read.client_id_indexes, strict=True):
                out += map(table.__getitem__, indexes.cast("I"))
            return out

        self.topics, self.payloads, self.publishers = topics, payloads, publishers
        self.qos = b"".join(read.qos)
        self.retains = b"".join(read.flags).translate(_RETAIN_BIT)
        self.properties = (
            memoryview(b"".join(read.property_lengths)).cast("I")
            if any(read.properties)
            else bytes(read.count)
        )
        self._read = None
        return self


class PartitionBase:
    """What the router needs of any partition: the batch gathered this iteration, who
    watches it, the last committed records in memory (its tail), and reads of its log.
    :class:`Partition` appends to its log; a partition another worker owns
    (broker.workers.partitions) forwards instead, and reads the owner's log and the records
    the owner announced."""

    __slots__ = (
        "acks",
        "columns_ahead",
        "key",
        "log",
        "pending",
        "read_ahead",
        "read_base",
        "tail",
        "tail_base",
        "tail_bytes",
        "watchers",
    )

    #: This worker appends to it.
    appends_here = True
    #: Its records are fetched from another node (a cluster's partition this node holds no
    #: replica of): a read finding none may find them a round trip later.
    fetched_remotely = False

    def __init__(self, key: PartitionKey, log: SegmentedLog | LogReader) -> None:
        self.key = key
        self.log = log
        self.pending: list[Record] = []
        #: One callback per pending record, called with its offset (or None on failure).
        self.acks: list[Callable[[int | None], None] | None] = []
        #: Who reads this partition, woken when it has new records.
        self.watchers: set[Watcher] = set()
        #: The last batch read from the log (for a subscriber behind the tail), so a reader
        #: that takes a few records per call (its send quota) decodes each batch once.
        self.read_ahead: list[Record] = []
        self.read_base = 0
        #: The same for :meth:`read_columns`.
        self.columns_ahead: Columns | None = None
        #: The last records committed, in memory for caught-up subscribers (see
        #: :meth:`keep_tail`): offsets ``tail_base ..`` without gaps.
        self.tail: list[Record] = []
        self.tail_base = log.end_offset
        self.tail_bytes = 0  # payload bytes in tail

    @property
    def end_offset(self) -> int:
        """Next offset to be assigned; every offset below it is committed."""
        return self.log.end_offset

    def committed_through(self, offset: int) -> None:
        """Another worker saw ``offset`` committed (here: every offset below the end is)."""

    def next_offset(self) -> int:
        """The offset the next record gathered here will get: -1 where the owner assigns
        it (another worker's partition; a forwarded batch carries no offsets)."""
        return -1

    def add(self, record: Record, ack: Callable[[int | None], None] | None) -> None:
        """Gather ``record`` (its offset is assigned here, see :meth:`next_offset`)."""
        self.pending.append(record)
        self.acks.append(ack)

    def add_run(
        self,
        timestamp: int,
        topic: str,
        client_id: str,
        payloads: list[bytes],
        qos: list[int],
        acks: Sequence[Callable[[int | None], None] | None],
    ) -> None:
        """Gather consecutive PUBLISHes of one client to one topic, without properties or
        retain flag, in one step (the router's :meth:`~broker.router.router.Router.publish_run`):
        one record per payload, numbered from :meth:`next_offset`."""
        new = tuple.__new__  # Record(...) without the NamedTuple constructor's call
        offsets = zip(self._offsets(), payloads, qos, strict=False)  # offsets never end
        self.pending += [
            new(Record, (offset, timestamp, topic, payload, q, False, client_id, b""))
            for offset, payload, q in offsets
        ]
        self.acks += acks

    def add_rows(
        self, rows: list[tuple[Any, ...]], ack: Callable[[int | None], None] | None
    ) -> None:
        """Gather records given as rows without their offset (a batch another worker
        forwarded, see broker.workers.partitions), consecutively and in one step; ``ack``
        gets the first record's offset."""
        new = tuple.__new__
        self.pending += [
            new(Record, (offset, *row)) for offset, row in zip(self._offsets(), rows, strict=False)
        ]
        self.acks.append(ack)
        self.acks += [None] * (len(rows) - 1)

    def add_batch(self, batch: bytes, count: int, ack: Callable[[int | None], None] | None) -> None:
        """Gather ``batch``, the checked bytes of ``count`` consecutive records another
        worker encoded (broker.workers.partitions), after what is gathered; ``ack`` gets its
        first record's offset. Here: as its records (a partition that appends the bytes as
        they are, :class:`Partition`, overrides this)."""
        self.add_rows([r[1:] for r in decode_records(batch)], ack)

    def _offsets(self) -> Iterator[int]:
        """The offsets of the records gathered next, one per record (see next_offset)."""
        base = self.next_offset()
        return repeat(-1) if base < 0 else count(base)

    def commit(self) -> tuple[int, int]:
        raise NotImplementedError

    def keep_tail(self, first: int, records: list[Record]) -> None:
        """Committed ``records`` from offset ``first`` go to the tail: after it when they
        continue it, else in its place (what lies between is read from the log)."""
        added = sum([len(r[3]) for r in records])
        if self.tail and self.tail_base + len(self.tail) == first:
            self.tail.extend(records)
            self.tail_bytes += added
        else:
            self.tail = records
            self.tail_base = first
            self.tail_bytes = added
        self._trim_tail()

    def tail_columns(self, offset: int) -> Columns:
        """The tail's records from ``offset`` (up to READ_BATCH) as columns, kept in
        ``columns_ahead`` for the next reads: a QoS 1 subscriber whose quota takes a record
        or two per call (each PUBACK frees one) transposed the tail from its cursor on every
        call (13% of a fleet's broker time, measured)."""
        ahead = self._columns_ahead(offset)
        if ahead is not None:
            return ahead
        i = offset - self.tail_base
        cols = self.columns_ahead = Columns.from_records(self.tail[i : i + READ_BATCH])
        return cols

    def _columns_ahead(self, offset: int) -> Columns | None:
        """The columns kept from an earlier read, from ``offset`` on, if they hold it and
        at least READ_AHEAD_REST records from it (else a new read gets what follows too)."""
        ahead = self.columns_ahead
        if ahead is not None:
            offsets = ahead.offsets
            i = bisect_left(offsets, offset)
            if len(offsets) - i >= READ_AHEAD_REST and offsets[i] == offset:
                return ahead.from_index(i)
        return None

    def _trim_tail(self) -> None:
        """Keep at most TAIL_RECORDS records and about TAIL_BYTES of payload in memory."""
        tail = self.tail
        drop = max(0, len(tail) - TAIL_RECORDS)
        if not drop and self.tail_bytes <= TAIL_BYTES:
            return
        left = self.tail_bytes - sum([len(r[3]) for r in tail[:drop]])
        while left > TAIL_BYTES and drop < len(tail) - 1:
            left -= len(tail[drop][3])
            drop += 1
        del tail[:drop]
        self.tail_base += drop
        self.tail_bytes = left

    def read(self, offset: int, max_records: int = READ_BATCH) -> list[Record]:
        """Committed records from ``offset``, read from the log.

        Raises the log's OffsetOutOfRange when ``offset`` fell below the retained start.
        """
        ahead = self.read_ahead
        i = offset - self.read_base
        if ahead and 0 <= i < len(ahead) and ahead[i].offset == offset:
            return ahead[i : i + max_records]
        records = self.log.read(offset, max_records=max_records)
        if max_records >= READ_BATCH and records and records[0].offset == offset:
            self.read_ahead = records
            self.read_base = offset
        return records

    def read_columns(self, offset: int) -> Columns:
        """The records :meth:`read` returns from ``offset`` (up to READ_BATCH), as columns.

        Raises the log's OffsetOutOfRange when ``offset`` fell below the retained start.
        """
        ahead = self._columns_ahead(offset)
        if ahead is not None:
            return ahead
        cols = Columns.from_read(self.log.read_columns(offset, max_records=READ_BATCH))
        # A mark learnt from a peer may fall inside a batch (a remote partition's reader);
        # what lies past it is not committed yet.
        end = self.log.end_offset
        if cols.stop and cols.offsets[-1] >= end:
            cols.stop = bisect_left(cols.offsets, end)
        else:
            self.columns_ahead = cols
        return cols


class Partition(PartitionBase):
    """Single-writer view of one partition log, with group commit.

    Records are numbered as they are gathered: this router is the log's only writer, so the
    next offset is the log's end plus what is pending. The gathered records then go to the
    tail as they are, instead of being rebuilt with their offsets after the append (that
    rebuild was 7% of a fan-in's broker time). Batches another worker forwarded are
    gathered as their bytes (:meth:`add_batch`) and appended as they are: the owner builds
    no object per forwarded record, unless a reader here wants them in the tail.
    """

    __slots__ = ("end", "forwarded", "written")

    log: SegmentedLog

    def __init__(self, key: PartitionKey, log: SegmentedLog) -> None:
        super().__init__(key, log)
        #: The log's end offset as of the last commit, plus the records of the forwarded
        #: batches gathered since (only :meth:`commit` and :meth:`add_batch` move it): the
        #: records in ``pending`` are numbered from it (the compiled device path too).
        self.end = log.end_offset
        #: Forwarded batches gathered: (records of ``pending`` before it, bytes, record
        #: count, acknowledgement).
        self.forwarded: list[tuple[int, bytes, int, Callable[[int | None], None] | None]] = []
        #: The batches the last commit with forwarded batches wrote (for its announcement,
        #: broker.workers.partitions).
        self.written: list[bytes | bytearray] = []

    def next_offset(self) -> int:
        return self.end + len(self.pending)

    def add(self, record: Record, ack: Callable[[int | None], None] | None) -> None:
        pending = self.pending
        offset = self.end + len(pending)
        if record[0] != offset:
            record = tuple.__new__(Record, (offset, *record[1:]))
        pending.append(record)
        self.acks.append(ack)

    def add_batch(self, batch: bytes, count: int, ack: Callable[[int | None], None] | None) -> None:
        self.forwarded.append((len(self.pending), batch, count, ack))
        self.end += count  # the records gathered after it are numbered after it

    def commit(self) -> tuple[int, int]:
        """Append the gathered batch as one write; returns ``(first offset, end offset)``.

        On a storage error the batch is dropped (the log rolled itself back) and every ack
        is called with ``None``; the error propagates to the router, which logs it.
        """
        if self.forwarded:
            return self._commit_forwarded()
        records, acks = self.pending, self.acks
        self.pending, self.acks = [], []
        try:
            first = self.log.append(records)
        except Exception:
            self.end = self.log.end_offset  # rolled back: the numbers given are free again
            _fail(acks)
            raise
        end = self.end = self.log.end_offset
        stored = records
        if records and records[0][0] != first:
            # Only if the log moved other than through this object (it is the single
            # writer): renumber rather than keep records whose offsets are wrong.
            new = tuple.__new__
            stored = [new(Record, (first + i, *r[1:])) for i, r in enumerate(records)]
        self.keep_tail(first, stored)
        if acks.count(None) != len(acks):  # a QoS 0 fan-in's batch has none: no loop
            for i, ack in enumerate(acks):
                if ack is not None:
                    ack(first + i)
        return first, end

    def _commit_forwarded(self) -> tuple[int, int]:
        """:meth:`commit` with forwarded batches among the gathered: in the order gathered,
        each run of this worker's records one batch, each forwarded batch as it came, all
        in one write (:meth:`~broker.commitlog.log.SegmentedLog.append_parts`); one
        acknowledgement per forwarded batch. The forwarded records join the tail only when
        a reader here is watching (decoded in one C call per batch, compiled); else the tail
        starts after the commit and a later reader reads the log."""
        records, acks, forwarded = self.pending, self.acks, self.forwarded
        self.pending, self.acks, self.forwarded = [], [], []
        parts: list[Sequence[Record] | bytes] = []
        runs: list[tuple[list[Callable[[int | None], None] | None], int]] = []
        start = 0
        for before, batch, size, ack in forwarded:
            if before > start:
                parts.append(records[start:before])
                runs.append((acks[start:before], before - start))
            parts.append(batch)
            runs.append(([ack], size))
            start = before
        if start < len(records):
            parts.append(records[start:])
            runs.append((acks[start:], len(records) - start))
        try:
            first, written = self.log.append_parts(parts)
        except Exception:
            self.end = self.log.end_offset
            for run_acks, _ in runs:
                _fail(run_acks)
            raise
        end = self.end = self.log.end_offset
        self.written = written
        if self.watchers:
            stored: list[Record] = []
            offset = first
            for part, wrote in zip(parts, written, strict=True):
                # This worker's records as they are (numbered as gathered), unless the log
                # moved other than through this object.
                mine = not isinstance(part, bytes) and part[0][0] == offset
                stored += part if mine else decode_records(wrote)  # type: ignore[arg-type]
                offset = stored[-1][0] + 1
            self.keep_tail(first, stored)
        else:
            self.tail, self.tail_base, self.tail_bytes = [], end, 0
        offset = first
        for run_acks, size in runs:
            for i, ack in enumerate(run_acks):
                if ack is not None:
                    ack(offset + i)
            offset += size
        return first, end

    def read(self, offset: int, max_records: int = READ_BATCH) -> list[Record]:
        """Committed records from ``offset``: from memory when caught up, else from the log.

        Raises the log's OffsetOutOfRange when ``offset`` fell below the retained start.
        """
        base = self.tail_base
        if self.tail and offset >= base:
            i = offset - base
            return self.tail[i : i + max_records]
        return super().read(offset, max_records)

    def read_columns(self, offset: int) -> Columns:
        """:meth:`read` from ``offset`` as columns: the tail's records when caught up."""
        if self.tail and offset >= self.tail_base:
            return self.tail_columns(offset)
        return super().read_columns(offset)


def _fail(acks: list[Callable[[int | None], None] | None]) -> None:
    """Not stored: every acknowledgement gets None."""
    for ack in acks:
        if ack is not None:
            ack(None)
