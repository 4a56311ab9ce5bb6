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
damaged batch on: the follower gets heartbeats only until the repair, never the bad bytes; a
leader that meets an uncommitted damaged entry of its own steps down instead, as no one
repairs an uncommitted range: ``broker.cluster.election``).

The repair of a damaged range of group ``g`` (``repairer.Repairer.add``):

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
4. counted per partition (``Repairer.repaired``, ``mqlog_repaired_batches_total``), logged
   (WARNING: partition, segment, byte range, offsets, the peer), and the partition's readers
   woken (``Repairer.on_repaired``): a reader held at the range (``on_corruption = "stop"``) reads
   the repaired batches; one that skipped it has gone on (the loss was reported).

A peer that does not answer within ``repairer.ANSWER_TIMEOUT``, has not committed the range, or
holds it damaged too (it then repairs its own copy) leaves the range to the next peer; when none
could help, the attempt is retried after ``repairer.FIRST_RETRY_SECONDS``, doubling up to
``MAX_RETRY_SECONDS``, for as long as the range exists. In a compacted log (``$retained``,
``$sessions``, compacted by each node at its own time) the copies may differ in length: the
sealed segment is then rewritten whole with the peer's batches for the range and swapped in
(``ReplicaOps.rewrite``). Batches that verify but do not fit the range are not written; if
every peer that answered sent such batches, the range is left as it is with an ERROR saying
so, and its reads skip or hold per ``on_corruption``, as on a single node.

This module is the protocol, sans-IO: the messages, what a replica answers (:func:`answer`),
what an asker accepts (:func:`check_answer`). The driver on the node's event loop is
:mod:`broker.cluster.repairer`.
"""

from __future__ import annotations

import struct

from broker.cluster.storage import GroupStorage
from broker.commitlog import (
    CorruptRecordBatch,
    LogClosed,
    OffsetOutOfRange,
    RewriteRefused,
)
from broker.commitlog.batch import BATCH_HEADER, BATCH_HEADER_SIZE, read_header
from broker.commitlog.integrity import DamagedRange
from broker.commitlog.rewrite import check_batches

#: Transport kinds of the repair (the node's own, below ``node.FIRST_APP_KIND``): a request
#: for a group's batches of an offset range, and its answer.
ASK = 2
ANSWER = 3
#: An ASK: request id, group, first offset, last offset, most bytes of batches wanted.
ASK_BODY = struct.Struct("<QIqqI")
#: An ANSWER: request id, status; the batches follow, concatenated, when OK.
ANSWER_HEAD = struct.Struct("<QB")

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


# -- answers and their checks -------------------------------------------------------------


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
    damaged bytes (unless the log is compacted), and each carries the epoch this node's term
    table holds for its index."""
    # A compacted log's copies may differ in length (each replica compacts at its own time):
    # its sealed segment is then rewritten whole (``ReplicaOps.rewrite``).
    check_batches(damage, first, last, batches, exact_size=not storage.log.config.compacted)
    for batch in batches:
        h = read_header(batch)
        term = storage.terms.term_at(h.base_offset + 1)
        if term != h.leader_epoch:
            raise RewriteRefused(
                f"{damage.path}: the batch at offset {h.base_offset} has epoch "
                f"{h.leader_epoch}, this replica's log has term {term} there"
            )


def describe(damage: DamagedRange) -> str:
    """The range as log lines name it: partition, segment, byte range, offsets."""
    return (
        f"corrupt record batch of stream {damage.stream} partition {damage.partition}, segment "
        f"{damage.path}, bytes {damage.position}..{damage.end}, offsets {damage.offsets()}"
    )
