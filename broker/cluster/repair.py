"""Corrupt batches repaired from a healthy replica (issue 25 item 4).

Every replica of a group holds the same bytes for its committed entries: each wrote the
leader's batch verbatim and encodes its control batches identically
(``broker.cluster.storage``). So a damaged range that one replica finds in its log can be
rewritten with another replica's copy of the same offsets, and nothing committed is lost while
a majority holds it intact.

Where damage is found (every place reports it once, ``broker.commitlog.integrity.report``,
whose listener this is): a reader of the local log (live delivery, ``$replay``, the fetch API),
the scrubber's pass over sealed segments, the recovery of a segment at start, and the leader
reading entries to send to a follower (``GroupStorage.entries`` then hands out nothing from the
damaged batch on: the follower gets heartbeats only until the repair, never the bad bytes).

The repair of a damaged range of group ``g`` (on the event loop, :meth:`Repairs.add`):

1. its offsets: ``first`` is one past the intact batch before the range, ``last`` one before
   the intact batch after it, or the next segment's base for a range that runs to the end of a
   sealed segment (``SegmentedLog.damaged_offsets``). A damaged header hides its own offsets:
   its neighbours bound them. Only committed offsets are repaired (``last`` below this node's
   commit index, and the peer's: :func:`answer`); a range above the commit index waits for it
   (an uncommitted entry is Raft's to keep or overwrite);
2. a peer that replicates the group is asked for the batches of ``first..last`` (the leader
   first, else each other replica in turn): :data:`ASK`, answered by :data:`ANSWER` with the
   status and the batches as that peer stores them;
3. the batches are checked: CRC and structure, exact tiling of ``first..last``, and each
   batch's epoch equal to the term this node's term table holds for its index (Raft's Log
   Matching: an index and a term name one entry, s5.3); then rewritten in place, which also
   requires them to fill the damaged bytes exactly, and fsynced (``SegmentedLog.rewrite``,
   ``broker.commitlog.rewrite``);
4. counted per partition (:attr:`Repairs.repaired`, ``mqlog_repaired_batches_total``), logged
   (WARNING: partition, segment, byte range, offsets, the peer), and the partition's readers
   woken (:attr:`on_repaired`): a reader held at the range (``on_corruption = "stop"``) reads
   the repaired batches; one that skipped it has gone on (the loss was reported).

A peer that does not answer within :data:`ANSWER_TIMEOUT`, has not committed the range, or
holds it damaged too (it then repairs its own copy) leaves the range to the next peer; when none
could help, the attempt is retried after :data:`FIRST_RETRY_SECONDS`, doubling up to
:data:`MAX_RETRY_SECONDS`, for as long as the range exists. Batches that verify but do not fit
the range (the bytes differ in length: ``$retained``, compacted by each node at its own time)
are not written; if every peer that answered sent such batches, the range is left as it is with
an ERROR saying so, and its reads skip or hold per ``on_corruption``, as on a single node.

Called on the node's event loop only, but for the report listener, which may run on the
scrubber's thread and hands the range over to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from broker.cluster.multiraft import MultiRaft
from broker.cluster.storage import GroupStorage
from broker.commitlog import (
    CorruptRecordBatch,
    LogClosed,
    LogIOError,
    OffsetOutOfRange,
    RewriteRefused,
    integrity,
)
from broker.commitlog.batch import BATCH_HEADER, BATCH_HEADER_SIZE, read_header
from broker.commitlog.integrity import DamagedRange
from broker.commitlog.rewrite import check_batches

logger = logging.getLogger("broker.cluster")

#: Transport kinds of the repair (the node's own, below ``node.FIRST_APP_KIND``): a request
#: for a group's batches of an offset range, and its answer.
ASK = 2
ANSWER = 3
_ASK = struct.Struct("<QIqqI")  # request id, group, first offset, last offset, max bytes
_ANSWER = struct.Struct("<QB")  # request id, status; the batches follow when OK

#: Answer statuses.
OK = 0
NOT_COMMITTED = 1
UNAVAILABLE = 2
#: The asker's own outcomes of a request (never on the wire).
UNREACHABLE = 253
TIMEOUT = 254
STATUS = {
    OK: "sent the batches",
    NOT_COMMITTED: "has not committed the range",
    UNAVAILABLE: "does not hold the range intact",
    UNREACHABLE: "is not connected",
    TIMEOUT: "did not answer",
}

#: Most bytes of batches one answer carries (a peer frame is at most 64 MiB): a damaged range
#: longer than this is not repaired in place.
MAX_ANSWER_BYTES = 32 << 20
#: Most batches one answer carries.
MAX_ANSWER_BATCHES = 1 << 20
#: Seconds an asker waits for an answer before it asks the next peer.
ANSWER_TIMEOUT = 5.0
#: Seconds before a range no peer could help with is tried again; doubled each time up to
#: :data:`MAX_RETRY_SECONDS`.
FIRST_RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 30.0


class RepairHost(Protocol):
    """What the repair needs of its node (``broker.cluster.node.ClusterNode``)."""

    id: int
    loop: asyncio.AbstractEventLoop
    host: MultiRaft | None
    storages: dict[int, GroupStorage]
    group_keys: dict[int, tuple[str, int]]
    names: dict[int, str]
    handlers: dict[int, Callable[[int, memoryview], None]]

    def leader(self, group: int) -> int | None: ...

    def send(self, node: int, kind: int, payload: bytes) -> bool: ...


# -- the protocol, without I/O -------------------------------------------------------------


def answer(storage: GroupStorage, first: int, last: int, max_bytes: int) -> tuple[int, list[bytes]]:
    """This replica's answer to a request for the batches of offsets ``first..last``: ``OK``
    and the batches exactly covering them, as stored (read verified: never a damaged one), or
    why not: ``NOT_COMMITTED`` (``last`` at or past this node's commit index; an uncommitted
    entry may differ between replicas), ``UNAVAILABLE`` (not held, damaged here too, other
    batch boundaries, or more than ``max_bytes``)."""
    if last + 1 > storage.commit:
        return NOT_COMMITTED, []
    log = storage.log
    try:
        if first < log.log_start_offset:
            return UNAVAILABLE, []
        batches = log.read_batches(first, last + 1, MAX_ANSWER_BATCHES, max_bytes)
    except (CorruptRecordBatch, OffsetOutOfRange, LogClosed):
        return UNAVAILABLE, []
    if (
        not batches
        or read_header(batches[0]).base_offset != first
        or read_header(batches[-1]).last_offset != last
        or sum(map(len, batches)) > max_bytes
    ):
        return UNAVAILABLE, []
    return OK, batches


def split_batches(data: memoryview | bytes) -> list[bytes] | None:
    """The batches concatenated in an answer, cut at their length fields; None when the
    lengths do not add up (a peer's bug: nothing of it is used)."""
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < BATCH_HEADER_SIZE:
            return None
        length = BATCH_HEADER.unpack_from(data, pos)[1]
        if length < BATCH_HEADER_SIZE or length > len(data) - pos:
            return None
        out.append(bytes(data[pos : pos + length]))
        pos += length
    return out


def check_answer(
    storage: GroupStorage, damage: DamagedRange, first: int, last: int, batches: list[bytes]
) -> None:
    """Raise :class:`RewriteRefused` unless ``batches`` verify, tile ``first..last``, fill the
    damaged bytes, and each carries the epoch this node's term table holds for its index."""
    check_batches(damage, first, last, batches)
    for batch in batches:
        h = read_header(batch)
        term = storage.terms.term_at(h.base_offset + 1)
        if term != h.leader_epoch:
            raise RewriteRefused(
                f"{damage.path}: the batch at offset {h.base_offset} has epoch "
                f"{h.leader_epoch}, this replica's log has term {term} there"
            )


# -- the driver ------------------------------------------------------------------------------


@dataclass(slots=True)
class RepairStats:
    """Counters since the node started."""

    #: Damaged ranges taken on, and those repaired or given up.
    started: int = 0
    repaired: int = 0
    given_up: int = 0
    #: Requests sent to peers, and requests answered for peers.
    asked: int = 0
    answered: int = 0


class Repairs:
    """The repair of every damaged range of the groups ``node`` hosts; see the module doc."""

    def __init__(self, node: RepairHost) -> None:
        self.node = node
        self.loop = node.loop
        self.stats = RepairStats()
        #: Batches rewritten per (stream, partition).
        self.repaired: dict[tuple[str, int], int] = {}
        #: Called with a group after a range of its log was rewritten: its readers go on (the
        #: node's driver sets it to what a commit does, which wakes them).
        self.on_repaired: Callable[[int], None] = lambda g: None
        self._jobs: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._waiting: dict[int, tuple[int, asyncio.Future[tuple[int, list[bytes]]]]] = {}
        self._next_request = 1
        self._closed = False
        node.handlers[ASK] = self._on_ask
        node.handlers[ANSWER] = self._on_answer
        integrity.add_listener(self._on_report)

    # -- damage found ------------------------------------------------------------------------

    def _on_report(self, damage: DamagedRange) -> None:
        """The integrity listener (any thread): hand the range to the loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the node is gone
            self.loop.call_soon_threadsafe(self.add, damage)

    def add(self, damage: DamagedRange) -> None:
        """Repair ``damage`` if it is a range of a group's log here (once per range)."""
        key = (os.fspath(damage.path), damage.position)
        if self._closed or key in self._jobs:
            return
        group = self._group_of(damage)
        if group is None:
            return
        self.stats.started += 1
        task = self.loop.create_task(self._repair(group, damage))
        self._jobs[key] = task
        task.add_done_callback(lambda _t: self._jobs.pop(key, None))

    def _group_of(self, damage: DamagedRange) -> int | None:
        for g, (stream, partition) in self.node.group_keys.items():
            if stream == damage.stream and str(partition) == damage.partition:
                return g
        return None

    async def _repair(self, group: int, damage: DamagedRange) -> None:
        delay = FIRST_RETRY_SECONDS
        try:
            while not await self._attempt(group, damage):
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_RETRY_SECONDS)
        except Exception:  # a bug must not go unnoticed, nor stop the other repairs
            logger.exception("repair of %s failed", _range(damage))

    async def _attempt(self, group: int, damage: DamagedRange) -> bool:
        """One try; True when the range is repaired or cannot be, False to try again later."""
        storage = self.node.storages.get(group)
        host = self.node.host
        if storage is None or host is None:
            return False  # not hosted yet (start-up)
        if storage.log.directory != damage.path.parent:
            return True  # another node's log (nodes sharing a process: tests)
        try:
            bounds = storage.log.damaged_offsets(damage)
        except LogClosed:
            return True
        if bounds is None:
            logger.info("%s: nothing left to repair (segment gone, or no offset)", _range(damage))
            return True
        first, last = bounds
        if last + 1 > storage.commit:
            return False  # above the commit index: Raft's until committed (module doc)
        tried: list[str] = []
        misfits: list[str] = []
        for peer in self._peers(group, host):
            name = self.node.names.get(peer, str(peer))
            status, batches = await self._ask(peer, group, first, last)
            if status != OK:
                tried.append(f"{name} {STATUS.get(status, f'answered {status}')}")
                continue
            try:
                check_answer(storage, damage, first, last, batches)
                written = storage.log.rewrite(damage, batches)
            except RewriteRefused as exc:
                misfits.append(f"{name}: {exc}")
                continue
            except LogClosed:
                return True
            except LogIOError as exc:
                logger.error("%s: repair from %s not written: %s", _range(damage), name, exc)
                return False
            self._repaired(group, damage, first, last, batches, name, written)
            return True
        if misfits and not tried:
            self.stats.given_up += 1
            logger.error(
                "%s: not repaired in place, no replica's batches fit it (%s); its reads skip or "
                "hold per on_corruption",
                _range(damage),
                "; ".join(misfits),
            )
            return True
        logger.info(
            "%s: no replica could repair it yet (%s); trying again",
            _range(damage),
            "; ".join(tried + misfits) or "no other replica",
        )
        return False

    def _peers(self, group: int, host: MultiRaft) -> list[int]:
        """The group's other replicas, its leader first."""
        others = sorted(host.core(group).configuration.members - {self.node.id})
        leader = self.node.leader(group)
        if leader in others:
            others.remove(leader)
            others.insert(0, leader)
        return others

    def _repaired(
        self,
        group: int,
        damage: DamagedRange,
        first: int,
        last: int,
        batches: list[bytes],
        peer: str,
        written: int,
    ) -> None:
        self.stats.repaired += 1
        stream, partition = self.node.group_keys[group]
        key = (stream, partition)
        self.repaired[key] = self.repaired.get(key, 0) + written
        epochs = sorted({read_header(b).leader_epoch for b in batches})
        logger.warning(
            "repaired corrupt record batches from node %s: stream %s partition %d, segment %s, "
            "bytes %d..%d, offsets %d..%d (%d batches, epoch %s)%s",
            peer,
            stream,
            partition,
            damage.path,
            damage.position,
            damage.end,
            first,
            last,
            len(batches),
            ", ".join(map(str, epochs)),
            "" if written else "; already rewritten",
        )
        self.on_repaired(group)

    # -- requests ------------------------------------------------------------------------

    async def _ask(self, peer: int, group: int, first: int, last: int) -> tuple[int, list[bytes]]:
        request = self._next_request
        self._next_request += 1
        body = _ASK.pack(request, group, first, last, MAX_ANSWER_BYTES)
        if not self.node.send(peer, ASK, body):
            return UNREACHABLE, []
        self.stats.asked += 1
        future: asyncio.Future[tuple[int, list[bytes]]] = self.loop.create_future()
        self._waiting[request] = (peer, future)
        try:
            return await asyncio.wait_for(future, ANSWER_TIMEOUT)
        except TimeoutError:
            return TIMEOUT, []
        finally:
            self._waiting.pop(request, None)

    def _on_ask(self, frm: int, body: memoryview) -> None:
        if len(body) != _ASK.size:
            logger.warning("cluster: bad repair request from node %d dropped", frm)
            return
        request, group, first, last, max_bytes = _ASK.unpack_from(body)
        storage = self.node.storages.get(group)
        host = self.node.host
        status, batches = UNAVAILABLE, list[bytes]()
        if (
            storage is not None
            and host is not None
            and frm in host.core(group).configuration.members
        ):
            status, batches = answer(storage, first, last, min(max_bytes, MAX_ANSWER_BYTES))
        self.stats.answered += 1
        self.node.send(frm, ANSWER, _ANSWER.pack(request, status) + b"".join(batches))

    def _on_answer(self, frm: int, body: memoryview) -> None:
        if len(body) < _ANSWER.size:
            return
        request, status = _ANSWER.unpack_from(body)
        waiting = self._waiting.get(request)
        if waiting is None or waiting[0] != frm or waiting[1].done():
            return  # timed out meanwhile, or not from the peer asked
        batches = split_batches(body[_ANSWER.size :]) if status == OK else []
        waiting[1].set_result((UNAVAILABLE, []) if batches is None else (status, batches))

    # -- views and shutdown ------------------------------------------------------------------

    def view(self) -> list[dict[str, object]]:
        """Batches rewritten per partition held here (0 included), for the node's status."""
        keys = sorted(
            self.node.group_keys[g] for g in self.node.storages if g in self.node.group_keys
        )
        return [
            {"stream": s, "partition": p, "batches": self.repaired.get((s, p), 0)} for s, p in keys
        ]

    def close(self) -> None:
        """Stop listening and cancel the repairs in progress (a range left damaged is found
        again by the next reader or scrub after a restart)."""
        self._closed = True
        integrity.remove_listener(self._on_report)
        for task in list(self._jobs.values()):
            task.cancel()
        for _peer, future in self._waiting.values():
            if not future.done():
                future.cancel()


def _range(damage: DamagedRange) -> str:
    return (
        f"corrupt record batch of stream {damage.stream} partition {damage.partition}, segment "
        f"{damage.path}, bytes {damage.position}..{damage.end}, offsets {damage.offsets()}"
    )
