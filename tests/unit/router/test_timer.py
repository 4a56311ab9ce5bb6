"""The router's timer (``Lifecycle.tick``) looks only at the sessions that may have work for
it (``RouterState.timed``): dirty persistent ones, offline ones waiting for a will or their
expiry. A fleet's connected sessions with nothing to write cost its pass nothing."""

from __future__ import annotations

import sys
from pathlib import Path

from broker.mqtt.packets import Will
from broker.mqtt.properties import PropertyId
from broker.router.session import Session
from tests.unit.router.conftest import Harness


def timed(h: Harness) -> list[Session]:
    return list(h.router.state.timed.values())


def ids(h: Harness) -> list[str]:
    return sorted(s.client_id for s in timed(h))


def test_connected_sessions_with_nothing_to_write_leave_the_timer(h: Harness) -> None:
    clean = [h.connect(f"clean{i}")[1] for i in range(5)]
    link, kept = h.connect("kept", expiry=3600)
    h.tick(1)
    assert timed(h) == []  # written once (connect made it dirty), then nothing to wait for
    h.subscribe(kept, "t/#", 1)
    h.publish(clean[0], "t/1", b"x", 1, 1)
    h.run()
    assert timed(h) == [kept]  # its position moved: to be written
    h.tick(1)
    assert timed(h) == []
    assert h.router.state.sessions["kept"] is kept and kept.dirty is False
    del link


def test_offline_sessions_stay_until_their_will_and_expiry(h: Harness) -> None:
    will = Will("wills/a", b"gone", 1, False, {PropertyId.WILL_DELAY_INTERVAL: 5})
    link, a = h.connect("a", expiry=10, will=will)
    link_b, b = h.connect("b", expiry=3600)
    link_c, c = h.connect("c")  # clean: ends with its connection
    h.tick(1)
    assert timed(h) == []
    h.drop(a, link)
    h.drop(b, link_b)
    h.drop(c, link_c)
    h.tick(1)
    assert ids(h) == ["a", "b"]
    h.tick(3)
    assert h.log_payloads("wills/a") == []
    h.tick(2)  # 6 s after the drop: the will is out; the expiry still to come
    assert h.log_payloads("wills/a") == [b"gone"]
    assert ids(h) == ["a", "b"]
    h.tick(5)
    assert "a" not in h.router.state.sessions and ids(h) == ["b"]
    _, b2 = h.connect("b", clean=False, expiry=3600)
    assert b2 is b
    h.tick(1)
    assert timed(h) == []  # back: nothing to wait for, written


def test_restored_offline_sessions_are_timed_after_a_restart(tmp_path: Path) -> None:
    h = Harness(tmp_path / "data")
    will = Will("wills/r", b"late", 0, False, {PropertyId.WILL_DELAY_INTERVAL: 30})
    link, r = h.connect("r", expiry=60, will=will)
    h.drop(r, link)
    h.tick(1)
    h.restart()
    (restored,) = timed(h)
    assert restored.client_id == "r"
    h.tick(31)
    assert h.log_payloads("wills/r") == [b"late"]
    h.tick(31)
    assert "r" not in h.router.state.sessions and timed(h) == []
    h.streams.close()


def test_an_ended_session_made_dirty_late_does_not_stand_for_its_successor(h: Harness) -> None:
    link, old = h.connect("c", expiry=60)
    h.tick(1)
    _, new = h.connect("c", expiry=60)  # takes over: clean start ends the old session
    assert new is not old
    old.dirty = True  # something of the old session's, late
    h.tick(1)
    assert timed(h) == []  # both passed: the old one dropped, the new one written
    assert new.dirty is False
    del link


def test_a_burst_leaves_the_timer_small(h: Harness) -> None:
    sessions = [h.connect(f"s{i}", expiry=60)[1] for i in range(3000)]
    big = sys.getsizeof(h.router.state.timed)
    h.tick(1)
    assert timed(h) == []
    assert sys.getsizeof(h.router.state.timed) < big // 10
    sessions[7].dirty = True
    assert timed(h) == [sessions[7]]
