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
    ENDED_KEPT_MS,
    FORWARD_TIMEOUT,
    Claim,
    Claims,
    Forward,
    Forwards,
    refuse_held,
    refuse_zombies,
    zombies,
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


def _record(client_id: str, n: int, at: int = 0) -> Record:
    return Record(-1, at, "t", b"%d" % n, 1, False, client_id)


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


def test_a_leader_fences_the_records_a_node_accepted_before_another_nodes_claim() -> None:
    """Node 1 forwards records it accepted at 900 ms for "dev", which node 2 claimed at
    1,000 ms (node 1 paused meanwhile): zombies. Not: what node 1 sent after the claim (the
    will of the connection taken over), records of clients it claimed last, of clients no
    claim names."""
    claims = Claims()
    for client_id, node in (("dev", 2), ("own", 1), ("both", 2)):
        claims.claimed(client_id, node, 1000)
    records = [
        _record("dev", 1, at=900),
        _record("dev", 2, at=1100),  # sent after node 1 applied the claim
        _record("own", 3, at=900),
        _record("free", 4, at=900),
        _record("", 5, at=900),
        _record("both", 6, at=999),
    ]
    assert set(zombies(records, 1, claims).split(b"\0")) == {b"dev", b"both"}
    assert zombies(records, 2, claims) == b"own"  # the claimant's own pass, node 1's do not
    assert zombies(records[1:5], 1, claims) == b""
    assert claims.newest == 1000 and zombies([records[1]], 1, claims) == b""  # all newer


def test_a_fenced_forward_refuses_its_zombies_and_sends_the_rest_again() -> None:
    """The leader's answer names "dev": its records are refused with what their
    acknowledgements answer, the rest of the batch is dispatched again at once."""
    outcomes: list[tuple[str, Any]] = []
    sent: list[list[Record]] = []

    def ack(name: str) -> Any:
        return lambda offset: outcomes.append((name, offset))

    def release(now: float) -> None:
        sent.extend(records for records, _acks, _deadline in part.held)
        part.held.clear()

    records = [_record("dev", 1), _record("x", 2), _record("dev", 3), _record("y", 4)]
    acks = [ack("dev1"), ack("x2"), ack("dev3"), ack("y4")]
    part = SimpleNamespace(group=7, held=[], release=release)
    batch = Forward(100.0, part, records, acks, 105.0, OLD)  # type: ignore[arg-type]
    refuse_zombies(part, batch, b"dev")  # type: ignore[arg-type]
    assert outcomes == [("dev1", None), ("dev3", None)]
    assert sent == [[records[1], records[3]]]


def test_a_zombie_is_fenced_by_any_later_claim_of_another_node_even_of_an_ended_session() -> None:
    """Node 1 accepted dev's record at 900 ms and was paused; dev connected on node 2 (claim
    at 1,000), then back on node 1 (1,100), or its session ended meanwhile (a clean
    session): the record is still a zombie. Before, only the latest claim counted and an
    ended session's none (bench.churn --cluster 3 --kill pause, seed 44: `dev17: got 88,
    acked 91`)."""
    claims = Claims()
    claims.claimed("dev", 1, 500)
    claims.claimed("dev", 2, 1000)
    claims.claimed("dev", 1, 1100)
    assert claims.get("dev") == Claim(1, 1100, 1000)
    old, new = _record("dev", 1, at=900), _record("dev", 2, at=1150)
    assert zombies([old, new], 1, claims) == b"dev"
    assert zombies([new], 1, claims) == b""
    claims.ended("dev")  # its clean session ended
    assert zombies([old], 1, claims) == b"dev" and not claims.live
    claims.claimed("dev", 1, 1200)  # back on node 1: the history goes on
    assert claims.get("dev") == Claim(1, 1200, 1000) and zombies([old], 1, claims) == b"dev"
    # An ended session's claims are kept for ENDED_KEPT_MS of claim time, then forgotten.
    claims.ended("dev")
    claims.claimed("other", 3, 1200 + ENDED_KEPT_MS + 1)
    claims.ended("other")
    assert claims.get("dev") is None and len(claims) == 1
