"""Remote reads: the fetch protocol a node without a replica of a partition reads it with.

Sans-IO, like the codec and the Raft core: this module encodes and decodes the two messages
and verifies what an answer carries; ``broker.workers.remote_partition`` sends, parks and
answers them over the node transport (``broker.cluster.peers``, one authenticated TCP link
per node pair).

* ``FETCH`` (request): ``request id (u64), group (u32), offset (i64), max bytes (u32), wait
  (u32, ms)``; nothing follows. The replica answers with the committed batches from the one
  holding ``offset``, at most ``max bytes`` of them (at least one whole batch when any is
  committed past ``offset``, as Kafka's ``fetch.max.bytes``); ``max bytes = 0`` asks for the
  marks only. With nothing committed at or past ``offset`` the replica holds the request up
  to ``wait`` ms and answers at the first commit (Kafka's ``fetch.max.wait.ms``): the long
  poll by which a non-replica node learns each commit one message after it happened, as a
  follower learns it from the leader's next AppendEntries or commit notice.
* ``FETCHED`` (answer): ``request id (u64), group (u32), error (u8), 3 pad, leader (i64, -1
  unknown), term (i64, -1 unknown), log start (i64), high-water mark (i64)``, then the
  batches, byte for byte as the replica stores them (``SegmentedLog.read_batches``: control
  batches included, every one CRC-checked on the way out, never a damaged one). The leader
  lets the asker forward its publishes to the right node without hosting the group, and the
  term it leads in tells a new office of the same leader from the old (a node reading
  ``$sessions`` remotely follows the shared groups' home by both,
  broker.workers.cluster_groups); the marks let it answer ``earliest`` / ``latest`` and
  wake its subscribers.

Bounds. A request of another size, an offset below 0, ``max bytes`` above
:data:`MAX_FETCH_BYTES` or a wait above :data:`MAX_WAIT_MS` is refused (:class:`FetchError`,
the caller counts it and answers :data:`REFUSED`), never served: a peer's bug must not make a
node read or hold more than it chose to. The reader trusts nothing either
(:func:`verified_records`): every batch's CRC and structure are checked
(``broker.commitlog.batch.validate_batch``, as every read path of the log does, issue 25),
batches must follow each other, and none may reach past the high-water mark the same answer
states: a remote reader never sees an uncommitted record.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from broker.commitlog import Record
from broker.commitlog.batch import decode_into, validate_batch
from broker.commitlog.errors import CommitLogError

#: Most bytes of batches one answer may carry (a request asking more is refused).
MAX_FETCH_BYTES = 4 << 20
#: Longest a replica holds a request with nothing new to answer (a request asking longer
#: is refused).
MAX_WAIT_MS = 5000

REQUEST = struct.Struct("<QIqII")
ANSWER = struct.Struct("<QIB3xqqqq")

#: Error codes of an answer.
OK = 0
#: The node holds no replica of the group (the asker's placement is stale, or a bug).
NOT_REPLICA = 1
#: ``offset`` is below the log start (retention) or past the high-water mark.
OUT_OF_RANGE = 2
#: The replica cannot read there now (a damaged range awaiting repair, not hosting yet).
UNAVAILABLE = 3
#: A malformed or oversized request.
REFUSED = 4
ERRORS = {OK: "ok", NOT_REPLICA: "not a replica", OUT_OF_RANGE: "out of range"}
ERRORS |= {UNAVAILABLE: "unavailable", REFUSED: "refused"}


class FetchError(ValueError):
    """A message that breaks the protocol (the peer's fault): refused and counted."""


class FetchRequest(NamedTuple):
    request: int
    group: int
    offset: int
    max_bytes: int
    wait_ms: int


class FetchAnswer(NamedTuple):
    request: int
    group: int
    error: int
    #: The group's leader as the replica knows it (a node id), or None.
    leader: int | None
    #: The term the replica knows that leader in (None with no leader).
    term: int | None
    log_start: int
    high_watermark: int
    #: The batches, as stored (:func:`verified_records` decodes them).
    batches: memoryview


def encode_request(req: FetchRequest) -> bytes:
    return REQUEST.pack(*req)


def decode_request(body: bytes | memoryview) -> FetchRequest:
    """The request in ``body``; raises :class:`FetchError` if malformed or over the bounds."""
    if len(body) != REQUEST.size:
        raise FetchError(f"fetch request of {len(body)} bytes, not {REQUEST.size}")
    req = FetchRequest._make(REQUEST.unpack(body))
    if req.offset < 0:
        raise FetchError(f"fetch at offset {req.offset}")
    if req.max_bytes > MAX_FETCH_BYTES:
        raise FetchError(f"fetch of {req.max_bytes} bytes (at most {MAX_FETCH_BYTES})")
    if req.wait_ms > MAX_WAIT_MS:
        raise FetchError(f"fetch waiting {req.wait_ms} ms (at most {MAX_WAIT_MS})")
    return req


def encode_answer(
    request: int,
    group: int,
    error: int,
    leader: int | None,
    log_start: int,
    high_watermark: int,
    batches: list[bytes] | tuple[bytes, ...] = (),
    term: int | None = None,
) -> bytes:
    known = leader is not None and term is not None
    head = ANSWER.pack(
        request,
        group,
        error,
        -1 if leader is None else leader,
        term if known else -1,
        log_start,
        high_watermark,
    )
    return head + b"".join(batches) if batches else head


def decode_answer(body: bytes | memoryview) -> FetchAnswer:
    """The answer in ``body`` (its batches unverified); raises :class:`FetchError`."""
    if len(body) < ANSWER.size:
        raise FetchError(f"fetch answer of {len(body)} bytes")
    request, group, error, leader, term, start, hwm = ANSWER.unpack_from(body)
    if error not in ERRORS:
        raise FetchError(f"fetch answer with error code {error}")
    if not 0 <= start <= hwm:
        raise FetchError(f"fetch answer with log start {start} and high-water mark {hwm}")
    view = memoryview(body)[ANSWER.size :]
    if error != OK and len(view):
        raise FetchError("a refused fetch carries batches")
    if leader < 0:
        leader = term = None
    elif term < 0:
        term = None
    return FetchAnswer(request, group, error, leader, term, start, hwm, view)


def verified_records(answer: FetchAnswer, offset: int) -> tuple[list[Record], int]:
    """The records of ``answer`` from ``offset`` on, and the offset after its last batch
    (where the next fetch starts: past control batches and compaction's gaps, which hold no
    record). Every batch is validated (CRC, structure), the first must hold ``offset``, each
    must start where the previous ended and none may end past the answer's high-water mark;
    raises :class:`FetchError` otherwise (the whole answer is then dropped)."""
    buf = bytes(answer.batches)
    records: list[Record] = []
    pos = 0
    expected = -1
    end = offset
    hwm = answer.high_watermark
    while pos < len(buf):
        try:
            h = validate_batch(buf, pos, max(expected, 0), position=pos)
        except CommitLogError as e:
            raise FetchError(f"fetched batch at byte {pos}: {e}") from None
        if expected < 0 and not h.base_offset <= offset < h.next_offset:
            raise FetchError(f"first fetched batch {h.base_offset}..{h.last_offset} not {offset}")
        if expected >= 0 and h.base_offset != expected:
            raise FetchError(f"fetched batch at {h.base_offset}, expected {expected}")
        if h.next_offset > hwm:
            raise FetchError(f"fetched batch ends at {h.next_offset}, past the mark {hwm}")
        decode_into(buf, pos, records, offset, 1 << 62, 1 << 62)
        pos += h.batch_length
        expected = end = h.next_offset
    return records, end
