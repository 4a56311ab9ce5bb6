"""The queue checker (tests/checker.py) on hand-built histories, and its one-pass order and
unavailability scans against brute-force references on random histories."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.checker import (
    Fault,
    Publish,
    Read,
    check,
    dumps,
    order_violations,
    unavailability,
)


def pub(
    uid: str, start: float, end: float | None, topic: str = "t", sent: float | None = None
) -> Publish:
    return Publish(uid, "c0", topic, 1, start, start if sent is None else sent, end)


def test_clean_history_is_ok() -> None:
    ps = [pub("a", 0, 1), pub("b", 1, 2), pub("c", 2, None)]
    r = check(ps, [Read("a", "t"), Read("b", "t")])
    assert r.ok
    assert (r.acked, r.lost, r.unacked_seen, r.unacked_lost, r.duplicates) == (2, 0, 0, 1, 0)


def test_acknowledged_but_not_read_back_is_lost() -> None:
    ps = [pub("a", 0, 1), pub("b", 1, 2)]
    r = check(ps, [Read("b", "t")])
    assert not r.ok
    assert r.lost == 1
    assert r.lost_ids == ["a"]


def test_unacknowledged_read_back_is_allowed_and_counted() -> None:
    r = check([pub("a", 0, None)], [Read("a", "t")])
    assert r.ok
    assert (r.unacked_seen, r.unacked_lost) == (1, 0)


def test_duplicates_counted_and_unexpected_flagged() -> None:
    ps = [pub("a", 0, 1)]
    r = check(ps, [Read("a", "t"), Read("a", "t"), Read("a", "t"), Read("zz", "t")])
    assert r.duplicates == 2  # the second and third "a"; nothing for the lone "zz"
    assert r.unexpected == 1
    assert not r.ok


def test_real_time_order_on_a_topic() -> None:
    # b was acknowledged (t=2) before c was first sent (t=3): c read before b is a violation.
    ps = [pub("a", 0, 1), pub("b", 1, 2), pub("c", 3, 4)]
    bad = [Read("a", "t"), Read("c", "t"), Read("b", "t")]
    assert order_violations(ps, bad) == [("t", "c", "b")]
    assert check(ps, bad).order_violations == 1


def test_concurrent_publishes_may_land_either_way() -> None:
    ps = [pub("a", 0, 5), pub("b", 1, 3)]  # overlapping: no order between them
    assert order_violations(ps, [Read("b", "t"), Read("a", "t")]) == []
    assert order_violations(ps, [Read("a", "t"), Read("b", "t")]) == []


def test_order_is_per_topic_and_on_first_copies() -> None:
    ps = [pub("a", 0, 1, "x"), pub("b", 2, 3, "y"), pub("c", 4, 5, "x")]
    # a y-message read first is no violation for x; a late duplicate of a is ignored
    reads = [Read("b", "y"), Read("a", "x"), Read("c", "x"), Read("a", "x")]
    assert order_violations(ps, reads) == []


def test_unavailability_from_fault_to_next_ack_of_a_later_send() -> None:
    ps = [
        pub("a", 0.0, 0.5),
        pub("b", 9.0, 13.0, sent=12.5),  # first sent before the fault, resent after it
        pub("c", 13.0, 13.2),
    ]
    faults = [Fault("kill", "n0", 10.0, 11.0), Fault("pause", "n1", 20.0, 21.0)]
    ws = unavailability(ps, faults)
    assert ws[0].unavailable == pytest.approx(3.0)  # b's resend at 12.5 acked at 13.0
    assert ws[0].duration == pytest.approx(1.0)
    assert ws[1].unavailable is None
    r = check(ps, [Read(u, "t") for u in "abc"], faults)
    assert r.never_available == 1
    assert r.unavailable_max == pytest.approx(3.0)


def test_repeated_publish_id_is_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        check([pub("a", 0, 1), pub("a", 1, 2)], [])


def test_table_and_json() -> None:
    r = check([pub("a", 0, 1)], [Read("a", "t")], [Fault("kill", "n0", 0.5, 0.6)])
    assert "acknowledged lost" in r.table()
    assert "kill" in r.table()
    doc = json.loads(dumps(r))
    assert doc["lost"] == 0
    assert doc["windows"][0]["target"] == "n0"


# ------------------------------------------------------------------ against references

times = st.integers(min_value=0, max_value=20).map(float)


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[Publish], list[Read]]:
    n = draw(st.integers(min_value=0, max_value=8))
    ps: list[Publish] = []
    for i in range(n):
        start = draw(times)
        sent = start + draw(times)
        delay = draw(st.none() | times)
        end = None if delay is None else sent + delay
        ps.append(Publish(f"m{i}", "c", draw(st.sampled_from("xy")), 1, start, sent, end))
    picks = draw(st.lists(st.sampled_from(ps), max_size=12)) if ps else []
    return ps, [Read(p.uid, p.topic) for p in picks]


@given(histories())
def test_order_scan_matches_all_pairs(h: tuple[list[Publish], list[Read]]) -> None:
    ps, reads = h
    firsts: list[Read] = []
    for r in reads:
        if r.uid not in {f.uid for f in firsts}:
            firsts.append(r)
    by = {p.uid: p for p in ps}
    bad_b = set()
    for i, ra in enumerate(firsts):
        for rb in firsts[i + 1 :]:
            a, b = by[ra.uid], by[rb.uid]
            if ra.topic == rb.topic and b.end is not None and b.end < a.start:
                bad_b.add(b.uid)
    assert {b for _, _, b in order_violations(ps, reads)} == bad_b


@given(histories(), times)
def test_unavailability_matches_a_scan(h: tuple[list[Publish], list[Read]], t: float) -> None:
    ps, _ = h
    ends = [p.end for p in ps if p.end is not None and p.sent >= t]
    want = min(ends) - t if ends else None
    assert unavailability(ps, [Fault("f", "n", t, t)])[0].unavailable == want
