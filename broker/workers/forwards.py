"""Batches a node forwarded to their group's leader (broker.workers.replicated), awaiting the
answer: the first offset once committed there, a refusal (that node does not take proposals:
the batch is held for the next leader), an unknown outcome (it stopped leading with the
entry in flight), or a fence (records of clients another node claimed since: :func:`zombies`).

When the group's leader changes, a forward to the node that led it has an answer coming
still, if that node is alive: it refuses what reaches it while it hands over or after it
stopped leading, and a planned hand-over gives the leadership away only once everything it
proposed is committed (broker.cluster.raft), so its answers say stored. A forward waits
:data:`ANSWER_GRACE` for it; then, or at once if the link to that node is down (killed), its
outcome is unknown (its publishers' connections are closed so that they resend), not after
:data:`FORWARD_TIMEOUT`. Called only from the worker's event loop.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import NamedTuple, Protocol

from broker.commitlog import Record
from broker.router.commit import OUTCOME_UNKNOWN

Ack = Callable[[int | None], None]

log = logging.getLogger("broker.cluster")

_TIMESTAMP = itemgetter(1)  # a Record's timestamp

#: Seconds a forwarded batch waits for its answer before its outcome is called unknown.
FORWARD_TIMEOUT = 10.0
#: Seconds a forward to a node that stopped leading waits for that node's answer.
ANSWER_GRACE = 0.25
#: Milliseconds (of claim time) the claims of a session that ended are kept (:class:`Claims`).
ENDED_KEPT_MS = 600_000
#: A forward's answer: refused for records of clients another node claimed since
#: (:func:`zombies`; their client ids follow).
FENCED = -3


class Dispatching(Protocol):
    """A partition whose batches are forwarded to its group's leader (broker.workers.replicated's
    ReplicatedPartition, broker.workers.remote_partition's RemotePartition)."""

    group: int
    #: Batches waiting for a leader: (records, acks, monotonic deadline).
    held: list[tuple[list[Record], list[Ack | None], float]]

    def leader(self) -> int | None: ...

    def release(self, now: float) -> None: ...


class Claim(NamedTuple):
    """The latest claim of a client id applied (broker.workers.replicated_sessions): the
    claimant (a Raft node id), the claim record's timestamp (ms), and the timestamp of the
    latest claim by any other node before it (0: none)."""

    node: int
    at: int
    other: int = 0

    def since(self, sender: int) -> int:
        """The time of the latest claim by a node other than ``sender``: a record that node
        accepted before it is a zombie."""
        return self.at if self.node != sender else self.other


class Claims:
    """The claims of each client id applied, for :func:`zombies`; those of sessions that
    ended are kept for :data:`ENDED_KEPT_MS` of claim time (a zombie of a session that
    ended since, its client back elsewhere meanwhile, landed after that client's newer
    retained message: bench.churn --cluster 3 --kill pause, seed 44)."""

    def __init__(self) -> None:
        self.live: dict[str, Claim] = {}
        self.over: OrderedDict[str, Claim] = OrderedDict()
        #: The latest claim time of all: records all accepted after it are no zombies.
        self.newest = 0

    def get(self, client_id: str) -> Claim | None:
        return self.live.get(client_id) or self.over.get(client_id)

    def claimed(self, client_id: str, node: int, at: int) -> None:
        self.newest = max(self.newest, at)
        last = self.live.get(client_id) or self.over.pop(client_id, None)
        if last is None:
            self.live[client_id] = Claim(node, at)
        else:
            other = last.other if last.node == node else last.at
            self.live[client_id] = Claim(node, at, other)

    def ended(self, client_id: str) -> None:
        claim = self.live.pop(client_id, None)
        if claim is None:
            return
        over = self.over
        over[client_id] = claim
        over.move_to_end(client_id)
        while over:
            first = next(iter(over.values()))
            if first.at >= claim.at - ENDED_KEPT_MS:
                break
            over.popitem(last=False)

    def __len__(self) -> int:
        return len(self.live) + len(self.over)


class Forward(NamedTuple):
    """A batch forwarded to a leader, awaiting its answer."""

    sent: float  # monotonic
    part: Dispatching
    records: list[Record]
    acks: list[Ack | None]
    deadline: float  # of holding it again if refused (ReplicatedPartition.dispatch)
    leader: int  # the node it went to
    #: When the answer of that node, which stopped leading the group, is given up on
    #: (monotonic: :data:`ANSWER_GRACE` after this node learnt it).
    answer_by: float | None = None


def answer(acks: list[Ack | None], outcome: int | None) -> None:
    for ack in acks:
        if ack is not None:
            ack(outcome)


class Forwards(dict[int, Forward]):
    """The forwards awaiting an answer, by request id (module docstring)."""

    def deposed(
        self, g: int, leader: int | None, now: float, linked: Callable[[int], bool]
    ) -> bool:
        """Group ``g`` is led by ``leader`` (None: not known) from now on: forwards to any
        other node wait :data:`ANSWER_GRACE` for its answer, unless the link to it is down.
        Whether any waits."""
        waits = False
        for request, w in list(self.items()):
            if w.part.group != g or w.leader == leader or w.answer_by is not None:
                continue
            if linked(w.leader):
                self[request] = w._replace(answer_by=now + ANSWER_GRACE)
                waits = True
            else:
                answer(self.pop(request).acks, OUTCOME_UNKNOWN)
        return waits

    def overdue(self, now: float) -> None:
        """Forwards unanswered past :data:`FORWARD_TIMEOUT`, or past :data:`ANSWER_GRACE`
        since their leader was deposed: outcome unknown."""
        late = [
            r
            for r, w in self.items()
            if now - w.sent > FORWARD_TIMEOUT or (w.answer_by is not None and now >= w.answer_by)
        ]
        for request in late:
            answer(self.pop(request).acks, OUTCOME_UNKNOWN)


def refuse_held(parts: Iterable[object], client_id: str) -> int:
    """Another node claimed ``client_id``'s session: refuse (``None``) its records that
    ``parts`` hold for a leader, so that none of them is dispatched after what its client
    publishes there (MQTT's order per topic [MQTT-4.6.0-5]); returns how many were refused.
    A held record of the connection taken over was not acknowledged, so a QoS 1 one is the
    client's to send again; a will among them is sent again by its sender, after the claim.
    Otherwise one failed over after the client's newer retained message on another node
    (bench.churn --cluster 3, node kills: an older retained message in the end).

    An acknowledgement may answer several records (another worker's batch: it numbers them
    from the first offset, broker.workers.partitions), so each is refused with the records it
    answers: from it to the next acknowledgement. Called when such a claim is applied."""
    refused = 0
    for part in parts:
        held = getattr(part, "held", None)  # a Dispatching partition's batches
        if not held or not any(r.client_id == client_id for b in held for r in b[0]):
            continue
        kept: list[tuple[list[Record], list[Ack | None], float]] = []
        lost: list[Ack | None] = []
        for records, acks, deadline in held:
            records_kept: list[Record] = []
            acks_kept: list[Ack | None] = []
            for start, end in _answered_together(acks):
                if any(r.client_id == client_id for r in records[start:end]):
                    refused += end - start
                    lost.append(acks[start])
                else:
                    records_kept += records[start:end]
                    acks_kept += acks[start:end]
            if records_kept:
                kept.append((records_kept, acks_kept, deadline))
        held[:] = kept
        answer(lost, None)
    if refused:
        log.info(
            "cluster: %s: %d held records refused: another node holds its session",
            client_id,
            refused,
        )
    return refused


def zombies(
    records: Sequence[Record],
    sender: int,
    claims: Claims,
    names: Mapping[int, str] | None = None,
) -> bytes:
    """At a group's leader: the clients of ``records`` (forwarded by node ``sender``) whose
    session another node claimed after the record was accepted (:meth:`Claim.since`; the
    claims of a session that ended since count too), as the claims applied here say:
    *zombie* records, of a connection taken over, that reach the leader late (their node
    paused: accepted before, sent as it resumed, before it applied the claim). They are
    refused, as Kafka fences a producer of an older epoch: let through, one landed after
    what the client published since on the other node (bench.churn --cluster 3 --kill
    pause, seed 41: a retained message replaced by an older one). Their client ids,
    NUL-separated (an MQTT string has no U+0000 [MQTT-1.5.4-2]); empty: none.

    Compared by time: the record's (its node's clock, when accepted) against the claim
    record's (the claimant's, when proposed). What its node sends once it applied the claim
    (the will of the connection taken over) is newer than the claim, unless the clocks
    differ by more than the time between them: such a will is refused and sent again (a
    second later, until it passes). A record accepted on a node cut off, after a claim it did
    not know of, passes; it is held there and refused as the claim is applied (refuse_held),
    unless it leaves before, as the node heals."""
    if not records or min(map(_TIMESTAMP, records)) >= claims.newest:
        return b""  # (the fleet's case: no claim since the oldest record)
    ids = {
        r.client_id
        for r in records
        if (claim := claims.get(r.client_id)) is not None and r.timestamp < claim.since(sender)
    }
    if ids:
        node = (names or {}).get(sender, sender)
        log.info("cluster: records of %s from node %s refused: claimed since", sorted(ids), node)
    return b"\0".join(client_id.encode() for client_id in ids)


def refuse_zombies(part: Dispatching, batch: Forward, client_ids: bytes) -> None:
    """The leader refused ``batch`` for the records of ``client_ids`` (:func:`zombies`):
    they are refused (with the records their acknowledgements answer), the rest is sent
    again."""
    part.held.append((batch.records, batch.acks, batch.deadline))
    for client_id in client_ids.decode().split("\0"):
        refuse_held([part], client_id)
    part.release(time.monotonic())


def _answered_together(acks: list[Ack | None]) -> Iterator[tuple[int, int]]:
    """The runs of a held batch answered together: an acknowledgement and the records with
    none after it; a record with none before any (QoS 0) alone."""
    start = 0
    for i in range(1, len(acks) + 1):
        if i == len(acks) or acks[i] is not None or acks[start] is None:
            yield start, i
            start = i
