"""The forwards a node awaits answers to (broker.workers.forwards): when the group's leader
changes, a forward to the node that led it waits ANSWER_GRACE for that node's answer (it
refuses what it no longer takes, a planned hand-over commits what it proposed first), unless
the link to it is down; then, or past FORWARD_TIMEOUT, its outcome is unknown."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from broker.router.commit import OUTCOME_UNKNOWN
from broker.workers.forwards import ANSWER_GRACE, FORWARD_TIMEOUT, Forward, Forwards

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
