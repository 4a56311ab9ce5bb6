"""The forwards a node awaits answers to (broker.workers.forwards): when the group's leader
changes, a forward to the node that led it waits ANSWER_GRACE for that node's answer (it
refuses what it no longer takes, a planned hand-over commits what it proposed first), unless
the link to it is down; then, or past FORWARD_TIMEOUT, its outcome is unknown."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from broker.commitlog import Record
from broker.router.commit import OUTCOME_UNKNOWN
from broker.workers.forwards import (
    ANSWER_GRACE,
    FORWARD_TIMEOUT,
    Forward,
    Forwards,
    refuse_held,
)

OLD, NEW = 1, 2


def _forward(
    outcomes: list[Any], group: int = 7, leader: int = OLD, sent: float = 100.0
) -> Forward:
    part = SimpleNamespace(group=group)
    return Forward(sent, part, [], [outcomes.append], 5.0, leader)  # type: ignore[arg-type]


def test_a_forward_to_a_deposed_leader_waits_for_its_answer_a_moment() -> None:
    outcomes: list[Any] = []
    waiting = Forwards({1: _forward(outcomes), 2: _forward(outcomes, leader=NEW)})
    assert waiting.deposed(7, NEW, 100.0, linked=lambda node: True)
    assert outcomes == [] and set(waiting) == {1, 2}  # its answer may come still
    waiting.deposed(7, NEW, 100.1, linked=lambda node: True)  # from the first change on
    waiting.overdue(100.0 + ANSWER_GRACE / 2)
    assert outcomes == []
    waiting.overdue(100.0 + ANSWER_GRACE)
    assert outcomes == [OUTCOME_UNKNOWN] and set(waiting) == {2}  # the new leader's waits on


def test_a_forward_to_a_leader_whose_link_is_down_is_unknown_at_once() -> None:
    outcomes: list[Any] = []
    waiting = Forwards({1: _forward(outcomes), 2: _forward(outcomes, group=8)})
    assert not waiting.deposed(7, NEW, 100.0, linked=lambda node: node != OLD)  # link closed
    assert outcomes == [OUTCOME_UNKNOWN] and set(waiting) == {2}  # another group's waits on


def test_an_unanswered_forward_is_unknown_past_the_timeout() -> None:
    outcomes: list[Any] = []
    waiting = Forwards({1: _forward(outcomes, sent=100.0)})
    waiting.overdue(100.0 + FORWARD_TIMEOUT / 2)
    assert outcomes == []
    waiting.overdue(100.0 + FORWARD_TIMEOUT + 0.1)
    assert outcomes == [OUTCOME_UNKNOWN] and not waiting


def _record(client_id: str, n: int) -> Record:
    return Record(-1, 0, "t", b"%d" % n, 1, False, client_id)


def test_a_claimed_clients_held_records_are_refused_with_what_their_acks_answer() -> None:
    """Another node claimed "x": its held records are refused, each with the records its
    acknowledgement answers (another worker's batch is answered by its first record's), so
    that none is dispatched after what its client publishes on the other node; the rest stay
    held, in order."""
    outcomes: list[tuple[str, Any]] = []

    def ack(name: str) -> Any:
        return lambda offset: outcomes.append((name, offset))

    batch1 = [_record("x", 1), _record("y", 2), _record("", 3), _record("z", 4), _record("z", 5)]
    acks1 = [ack("x1"), ack("y2"), None, ack("z4"), None]  # y2 answers 3 too (a worker's batch)
    batch2 = [_record("w", 6), _record("x", 7), _record("v", 8), _record("x", 9)]
    acks2 = [ack("w6"), None, None, None]  # w6 answers all four
    batch3 = [_record("x", 10), _record("u", 11)]
    acks3 = [None, None]  # QoS 0, answered by nobody: one by one
    part = SimpleNamespace(held=[(batch1, acks1, 5.0), (batch2, acks2, 6.0), (batch3, acks3, 7.0)])
    other = SimpleNamespace(held=[([_record("y", 12)], [ack("y12")], 8.0)])
    plain = SimpleNamespace()  # a partition of one node: nothing held

    assert refuse_held([plain, part, other], "x") == 6
    assert outcomes == [("x1", None), ("w6", None)]
    assert part.held == [
        (batch1[1:], acks1[1:], 5.0),
        ([batch3[1]], [None], 7.0),
    ]
    assert len(other.held) == 1
    assert refuse_held([part, other], "nobody") == 0 and len(part.held) == 2
