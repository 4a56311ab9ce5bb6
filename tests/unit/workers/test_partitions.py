"""Partitions across workers: a worker reading a partition another owns gets the committed
records with the owner's announcements and serves its subscribers from that tail; real
meshes (sockets), real logs and a real LogReader on the owner's files."""

from __future__ import annotations

import asyncio
import marshal
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from broker.commitlog import LogConfig, Record, SegmentedLog, small_batch
from broker.commitlog.batch import decode_batch, encode_control
from broker.commitlog.keys import PartitionKey
from broker.commitlog.small_batch import encode
from broker.router.commit import OUTCOME_UNKNOWN
from broker.router.partition import PartitionBase, SessionWatcher
from broker.workers.mesh import Mesh, owner_of
from broker.workers.partitions import (
    ANNOUNCED_BYTES,
    ANNOUNCED_RECORDS,
    APPENDED,
    FORWARD,
    OwnedPartition,
    PartitionService,
    RemotePartition,
    _checked,
)

CONFIG = LogConfig(fsync="never")
#: A partition worker 0 owns (of two).
KEY = next(("default", p) for p in range(8) if owner_of(("default", p), 2) == 0)
WATCHER = SessionWatcher("sub", "main")


def run(coro: Callable[[], Awaitable[Any]]) -> Any:
    return uvloop.run(asyncio.wait_for(coro(), 120))


class Worker:
    """One worker's partition service on its mesh."""

    def __init__(self, tmp: Path, index: int) -> None:
        self.tmp = tmp
        self.service = PartitionService(index, 2, owner_of, self.directory, lambda key: CONFIG)
        # Batches, also where the compiled codec is not built (then they are the Python
        # forms': the same bytes).
        self.service.forward_batches = True
        self.wakes: list[int] = []
        self.service.wake = self._wake
        self.mesh = Mesh(tmp / "mesh", index, 2, self.service.handlers())
        self.service.mesh = self.mesh

    def directory(self, key: PartitionKey) -> Path:
        return self.tmp / "data" / key[0] / str(key[1])

    def open_log(self, key: PartitionKey) -> SegmentedLog:
        return SegmentedLog.open(self.directory(key), CONFIG)

    def _wake(self, part: Any) -> None:
        self.wakes.append(part.end_offset)

    def partition(self, key: PartitionKey) -> PartitionBase:
        return self.service.make(key, self.open_log)


async def connected(*workers: Worker) -> None:
    for w in workers:
        await w.mesh.start()
    for w in workers:
        await w.mesh.wait_connected(5)


async def until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.002)


def records(rng: random.Random, n: int, size: int) -> list[Record]:
    return [
        Record(
            -1,
            1_700_000_000_000 + i,
            f"devices/d{rng.randrange(50)}/telemetry",
            rng.randbytes(size),
            1,
            False,
            f"d{rng.randrange(50)}",
        )
        for i in range(n)
    ]


def check_reads(remote: PartitionBase, log: SegmentedLog) -> None:
    """Every offset the reader may read gives the owner's records, and nothing past the
    announced mark (never a record that is not committed); read one after the other, as a
    subscriber does, so the columns kept from one read serve the next."""
    end = remote.end_offset
    for offset in range(max(0, end - 150), end):
        got = remote.read(offset)
        assert got, offset
        assert got == log.read(offset, max_records=len(got)), offset
        assert got[-1].offset < end
        cols = remote.read_columns(offset).built()
        assert cols and cols.offsets[cols.stop - 1] < end
        # Each read returns what it has at hand (a read-ahead, the tail): compare the prefix.
        n = min(len(cols), len(got))
        assert list(cols.payloads[cols.start : cols.start + n]) == [r.payload for r in got[:n]]
        assert list(cols.offsets[cols.start : cols.start + n]) == [r.offset for r in got[:n]]
    assert remote.read(end) == []


@pytest.mark.slow  # hypothesis over announcements and files: ~5 s
def test_a_reader_is_fed_the_announced_records_and_the_files_behind_them(tmp_path: Path) -> None:
    """Random commits (small ones carry their records, large ones only the mark) and
    marks learnt early through ``committed_through``: the reader's every read equals the
    owner's log, the small commits come from its tail, and offsets stay exact across the
    batches the tail did not get."""
    rng = random.Random(6)

    async def main() -> None:
        owner, reader = Worker(tmp_path, 0), Worker(tmp_path, 1)
        await connected(owner, reader)
        owned = owner.partition(KEY)
        assert isinstance(owned, OwnedPartition)
        remote = reader.partition(KEY)
        assert isinstance(remote, RemotePartition)
        remote.watchers.add(WATCHER)
        from_tail = 0
        for round_ in range(60):
            kind = rng.random()
            if kind < 0.15:
                batch = records(rng, ANNOUNCED_RECORDS + rng.randrange(1, 50), 20)
            elif kind < 0.25:
                batch = records(rng, 2, ANNOUNCED_BYTES // 2 + 1)  # over the byte bound
            else:
                batch = records(rng, rng.randrange(1, 4), rng.randrange(0, 80))
            for rec in batch:
                owned.add(rec, None)
            first, end = owned.commit()
            assert end - first == len(batch)
            if round_ % 7 == 3:
                # A group's worker saw the last record before the announcement came.
                remote.committed_through(end - 1)
                assert remote.read(end - 1)[0] == owned.log.read(end - 1, 1)[0]
            await until(lambda end=end: reader.service.marks.get(KEY, (0, 0))[1] == end)
            assert remote.end_offset == end
            # Every announcement wakes the readers here, also when committed_through had
            # moved the reader's end first (the others watching it learn of it only so).
            assert reader.wakes[-1] == end
            small = (
                len(batch) <= ANNOUNCED_RECORDS
                and sum(len(r.payload) for r in batch) <= ANNOUNCED_BYTES
            )
            if small:
                assert remote.tail and remote.tail[-1].offset == end - 1
                assert remote.tail_base <= first
                from_tail += 1
            else:
                assert not remote.tail  # read from the files
            check_reads(remote, owned.log)
            check_reads(owned, owned.log)  # the owner's own tail
        assert from_tail > 30
        await owner.mesh.close()
        await reader.mesh.close()
        owned.log.close()
        reader.service.close()

    run(main)


def test_a_partition_nobody_reads_keeps_no_tail_and_a_restarted_owner_continues_it(
    tmp_path: Path,
) -> None:
    """Rows for a partition without a reader here are not kept; once someone reads it the
    tail starts at the next announcement, and it goes on across a restart of the owner
    (offsets continue from its log)."""
    rng = random.Random(7)

    async def main() -> None:
        owner, reader = Worker(tmp_path, 0), Worker(tmp_path, 1)
        await connected(owner, reader)
        owned = owner.partition(KEY)
        remote = reader.partition(KEY)
        assert isinstance(remote, RemotePartition)
        for rec in records(rng, 3, 10):
            owned.add(rec, None)
        _, end = owned.commit()
        await until(lambda: remote.end_offset == end)
        assert not remote.tail
        remote.watchers.add(WATCHER)
        for rec in records(rng, 2, 10):
            owned.add(rec, None)
        first, end = owned.commit()
        await until(lambda: remote.end_offset == end)
        assert remote.tail_base == first and len(remote.tail) == 2
        check_reads(remote, owned.log)

        # The owner's process goes away and a new one takes over its files.
        await owner.mesh.close()
        owned.log.close()
        again = Worker(tmp_path, 0)
        await connected(again)
        await until(lambda: 0 in reader.mesh.peers)
        owned = again.partition(KEY)
        assert owned.end_offset == end
        for rec in records(rng, 3, 10):
            owned.add(rec, None)
        first, end = owned.commit()
        await until(lambda: remote.end_offset == end)
        assert remote.tail_base == first - 2 and len(remote.tail) == 5
        check_reads(remote, owned.log)
        await again.mesh.close()
        await reader.mesh.close()
        owned.log.close()
        reader.service.close()

    run(main)


def test_an_unknown_outcome_reaches_every_publisher_of_a_forward(tmp_path: Path) -> None:
    """A replicated partition's owner answers a forward with OUTCOME_UNKNOWN (its group lost
    its leader with the batch in flight): every publisher of the batch gets it, none a
    refusal; and when the owner goes away before answering, the publishers get
    ``lost_outcome``: None (not stored) on a single node, OUTCOME_UNKNOWN in a cluster."""

    async def main() -> None:
        owner, reader = Worker(tmp_path, 0), Worker(tmp_path, 1)
        answers: list[Callable[[int | None], None]] = []
        owner.service.enqueue_batch = lambda key, batch, count, ack: answers.append(ack)
        await connected(owner, reader)
        owner.partition(KEY)
        remote = reader.partition(KEY)
        got: list[int | None] = []

        def publish(n: int) -> None:
            for rec in records(random.Random(n), n, 10):
                remote.add(rec, got.append)
            remote.commit()

        publish(3)
        await until(lambda: len(answers) == 1)
        answers.pop()(OUTCOME_UNKNOWN)
        await until(lambda: len(got) == 3)
        assert got == [OUTCOME_UNKNOWN] * 3

        got.clear()
        reader.service.lost_outcome = OUTCOME_UNKNOWN
        publish(2)
        await until(lambda: len(answers) == 1)
        await owner.mesh.close()  # gone before its answer
        await until(lambda: len(got) == 2)
        assert got == [OUTCOME_UNKNOWN] * 2
        await reader.mesh.close()
        reader.service.close()
        owner.service.owned[KEY].log.close()

    run(main)


def _counting(mesh: Mesh, kind: int) -> list[Any]:
    """The bodies of the frames of ``kind`` ``mesh`` receives, unmarshalled, in order."""
    handler = mesh.handlers[kind]
    bodies: list[Any] = []

    def counted(peer: int, request: int, body: memoryview) -> None:
        bodies.append(marshal.loads(body))
        handler(peer, request, body)

    mesh.handlers[kind] = counted
    return bodies


def test_an_iteration_sends_one_forward_per_owner_and_one_announcement(tmp_path: Path) -> None:
    """The batches one iteration gathers for several partitions of one owner leave in one
    FORWARD, answered once with each batch's first offset (every publisher gets its own
    record's); the owner's commits of one iteration leave in one APPENDED."""
    keys = [key for key in (("default", p) for p in range(16)) if owner_of(key, 2) == 0][:3]

    async def main() -> None:
        owner, reader = Worker(tmp_path, 0), Worker(tmp_path, 1)
        forwards = _counting(owner.mesh, FORWARD)
        appended = _counting(reader.mesh, APPENDED)
        gathered: list[tuple[PartitionKey, int, Callable[[int | None], None]]] = []
        owner.service.enqueue_batch = lambda key, batch, count, ack: gathered.append(
            (key, count, ack)
        )
        await connected(owner, reader)
        remotes = [reader.partition(key) for key in keys]
        got: dict[PartitionKey, list[int | None]] = {key: [] for key in keys}
        for n, (key, remote) in enumerate(zip(keys, remotes, strict=True)):
            for rec in records(random.Random(n), n + 1, 10):
                remote.add(rec, got[key].append)
        for remote in remotes:  # one iteration's group commit
            remote.commit()
        await until(lambda: len(gathered) == 3)
        assert len(forwards) == 1
        # Each batch as the log's bytes, encoded once (base offset 0: the owner places it).
        assert [(stream, p, decode_batch(batch)) for stream, p, batch in forwards[0]] == [
            (
                *key,
                [r._replace(offset=i) for i, r in enumerate(records(random.Random(n), n + 1, 10))],
            )
            for n, key in enumerate(keys)
        ]
        for n, (key, size, ack) in enumerate(gathered):
            assert (key, size) == (keys[n], n + 1)
            ack(100 * n if n != 1 else None)  # the second batch's append failed
        await until(lambda: sum(map(len, got.values())) == 6)
        assert got == {keys[0]: [0], keys[1]: [None, None], keys[2]: [200, 201, 202]}

        owned = [owner.partition(key) for key in keys]
        for part in owned:
            for rec in records(random.Random(9), 2, 10):
                part.add(rec, None)
            part.commit()
        await until(lambda: all(reader.service.marks.get(key) == (0, 2) for key in keys))
        assert len(appended) == 1 and [e[:4] for e in appended[0]] == [(*key, 0, 2) for key in keys]
        await owner.mesh.close()
        await reader.mesh.close()
        reader.service.close()
        for part in owned:
            part.log.close()

    run(main)


@pytest.mark.parametrize("watched", [True, False])
def test_forwarded_batches_are_appended_as_their_bytes(tmp_path: Path, watched: bool) -> None:
    """A forward carries each partition's records as one batch; the owner appends its bytes
    among its own records, in the order gathered, each publisher acknowledged with its
    record's offset; the owner's tail (when someone reads the partition there) and the
    forwarder's, fed by the announcement of the batches written, hold the log's records."""
    rng = random.Random(8)

    async def main() -> None:
        owner, other = Worker(tmp_path, 0), Worker(tmp_path, 1)
        owned = owner.partition(KEY)
        assert isinstance(owned, OwnedPartition)
        if watched:
            owned.watchers.add(WATCHER)
        commits: list[tuple[int, int]] = []

        def enqueue_batch(
            key: PartitionKey, batch: bytes, count: int, ack: Callable[[int | None], None]
        ) -> None:
            # The router's group commit: gathered among the owner's records, then committed.
            assert key == KEY and isinstance(batch, bytes)
            # Runs of up to 12 records: small batches and general ones (over SMALL_BATCH).
            for rec in records(rng, rng.randrange(0, 13), 12):
                owned.add(rec, None)
            owned.add_batch(batch, count, ack)
            for rec in records(rng, rng.randrange(0, 13), 12):
                owned.add(rec, None)
            commits.append(owned.commit())

        owner.service.enqueue_batch = enqueue_batch
        await connected(owner, other)
        remote = other.partition(KEY)
        remote.watchers.add(WATCHER)
        acked: list[tuple[Record, int | None]] = []
        sent = 0
        for round_ in range(20):
            batch = records(rng, rng.randrange(1, 13), rng.randrange(1, 40))
            for rec in batch:
                remote.add(rec, lambda offset, rec=rec: acked.append((rec, offset)))
            remote.commit()
            sent += len(batch)
            await until(lambda n=sent: len(acked) == n)
            await until(lambda n=round_ + 1: remote.end_offset == commits[n - 1][1])
        log = owned.log
        for rec, offset in acked:
            assert offset is not None
            assert log.read(offset, 1)[0][1:] == rec[1:]
        assert remote.tail  # the announcements carried the batches written
        check_reads(remote, log)
        if watched:
            assert owned.tail and owned.tail[-1].offset == log.end_offset - 1
            check_reads(owned, log)
        else:
            assert not owned.tail  # nobody reads it here: no record rebuilt
        assert owner.service.received == len(acked)
        await owner.mesh.close()
        await other.mesh.close()
        other.service.close()
        log.close()

    run(main)


def test_internal_streams_and_a_cluster_forward_rows(tmp_path: Path) -> None:
    """Where the owner handles each record (an internal stream such as ``$sessions``) or
    proposes records (a cluster's replicated partition, ``forward_batches`` off), a forward
    carries rows, as the owner's ``enqueue`` takes them."""
    internal = next(("$sessions", p) for p in range(8) if owner_of(("$sessions", p), 2) == 0)

    async def main() -> None:
        owner, other = Worker(tmp_path, 0), Worker(tmp_path, 1)
        forwards = _counting(owner.mesh, FORWARD)
        rows: list[tuple[PartitionKey, list[Any]]] = []
        owner.service.enqueue = lambda key, got, ack: (rows.append((key, got)), ack(7))
        await connected(owner, other)
        sent = records(random.Random(3), 2, 10)
        for key, batches in ((internal, True), (KEY, False)):
            other.service.forward_batches = batches
            remote = other.partition(key)
            acked: list[int | None] = []
            for rec in sent:
                remote.add(rec, acked.append)
            remote.commit()
            await until(lambda acked=acked: len(acked) == 2)
            assert acked == [7, 8]
        assert rows == [(internal, [r[1:] for r in sent]), (KEY, [r[1:] for r in sent])]
        assert all(isinstance(body[0][2], list) for body in forwards)
        await owner.mesh.close()
        await other.mesh.close()
        other.service.close()

    run(main)


def test_a_damaged_forward_is_refused() -> None:
    """A forwarded batch is appended only when it is one whole batch of consecutive records
    with its CRC intact; else its publishers are refused (the owner's ``_checked``)."""
    batch = encode(0, records(random.Random(4), 3, 10))
    assert _checked(batch) == 3
    flipped = bytearray(batch)
    flipped[-1] ^= 1
    for bad in (
        bytes(flipped),
        batch[:-1],
        batch + batch,
        batch[:40],
        encode_control(0, 1, 1, b"", 5),
    ):
        assert _checked(bad) is None


def test_without_the_compiled_codec_forwards_are_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In Python a batch costs more to encode and decode than rows (the fleet on two workers:
    143,370 instructions per message against 121,562 with rows): forwards stay rows there."""
    assert Worker(tmp_path, 0).service.forward_batches  # the tests' workers: batches
    monkeypatch.setattr(small_batch, "IMPLEMENTATION", "python")
    assert not PartitionService(1, 2, owner_of, Path, lambda key: CONFIG).forward_batches
    monkeypatch.setattr(small_batch, "IMPLEMENTATION", "compiled")
    assert PartitionService(1, 2, owner_of, Path, lambda key: CONFIG).forward_batches
