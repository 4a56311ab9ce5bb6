"""Batches a node forwarded to their group's leader (broker.workers.replicated), awaiting the
answer: the first offset once committed there, a refusal (that node does not take proposals:
the batch is held for the next leader), or an unknown outcome (it stopped leading with the
entry in flight).

When the group's leader changes, a forward to the node that led it has an answer coming
still, if that node is alive: it refuses what reaches it while it hands over or after it
stopped leading, and a planned hand-over gives the leadership away only once everything it
proposed is committed (broker.cluster.raft), so its answers say stored. A forward waits
:data:`ANSWER_GRACE` for it; then, or at once if the link to that node is down (killed), its
outcome is unknown (its publishers' connections are closed so that they resend), not after
:data:`FORWARD_TIMEOUT`. Called only from the worker's event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from broker.commitlog import Record
from broker.router.commit import OUTCOME_UNKNOWN

Ack = Callable[[int | None], None]

#: Seconds a forwarded batch waits for its answer before its outcome is called unknown.
FORWARD_TIMEOUT = 10.0
#: Seconds a forward to a node that stopped leading waits for that node's answer.
ANSWER_GRACE = 0.25


class Dispatching(Protocol):
    """A partition whose batches are forwarded to its group's leader (broker.workers.replicated's
    ReplicatedPartition, broker.workers.remote_partition's RemotePartition)."""

    group: int
    #: Batches waiting for a leader: (records, acks, monotonic deadline).
    held: list[tuple[list[Record], list[Ack | None], float]]

    def leader(self) -> int | None: ...

    def release(self, now: float) -> None: ...


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
