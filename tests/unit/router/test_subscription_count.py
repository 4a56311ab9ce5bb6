"""The router's subscription count (``mqlog_subscriptions``, ``$SYS/broker/subscriptions/
count``) is kept as subscriptions change, not counted session by session at each scrape:
after every kind of change it equals a count over every session held."""

from __future__ import annotations

from pathlib import Path

from broker.mqtt.packets import Unsubscribe
from broker.router.session import Session
from tests.unit.router.conftest import FakeLink, Harness


def recount(h: Harness) -> int:
    return sum(s.subscription_count() for s in h.router.sessions.values())


def unsubscribe(h: Harness, session: Session, *filters: str) -> None:
    h.router.unsubscribe(session, Unsubscribe(9, list(filters)))
    h.run()


def test_the_count_follows_every_change(tmp_path: Path) -> None:
    h = Harness(tmp_path / "data")
    links: dict[str, FakeLink] = {}

    def check(expected: int) -> None:
        assert h.router.subscriptions == recount(h) == expected

    links["a"], a = h.connect("a", expiry=600)
    h.subscribe(a, "t/#", 1)
    h.subscribe(a, "t/#", 0)  # the same filter again: replaced, not added
    h.subscribe(a, "u/+", 1)
    h.subscribe(a, "$replay/earliest/t/#", 1)  # a consumer of its own
    h.subscribe(a, "$share/g/t/#", 1)
    check(4)
    links["b"], b = h.connect("b")
    h.subscribe(b, "t/1", 0)
    h.subscribe(b, "$share/g/t/#", 1)
    check(6)
    unsubscribe(h, a, "u/+", "$replay/earliest/t/#", "nothing/here")
    check(4)
    unsubscribe(h, a, "$share/g/t/#")
    check(3)
    h.drop(b, links["b"])  # a clean session ends with its connection
    check(1)
    links["a2"], a2 = h.connect("a", clean=False, expiry=600)  # resumed: the same session
    assert a2 is a
    check(1)
    state = h.router.hand_over("a")  # moves to another worker
    assert state is not None
    check(0)
    h.router.adopt("a", state)  # and back
    check(1)
    h.restart()
    check(1)  # restored from $sessions
    links["c"], c = h.connect("a")  # clean start: the old session ends
    check(0)
    assert c is not a
    h.streams.close()
