"""The router's timer (``Lifecycle.tick``) looks only at the sessions that may have work for
it: the ones made dirty since its last pass (``RouterState.timed``) and the offline ones
whose will or expiry is due (``RouterState.offline_due``, a heap). A fleet's connected
sessions with nothing to write, and offline ones days from their expiry, cost a pass
nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from broker.config import RouterConfig
from broker.mqtt.packets import Will
from broker.mqtt.properties import PropertyId
from broker.router.session import Session
from tests.unit.router.conftest import Harness


def timed(h: Harness) -> list[Session]:
    return list(h.router.state.timed.values())


def waiting(h: Harness) -> list[str]:
    """The offline sessions with a live entry in the heap."""
    sessions = h.router.state.sessions
    return sorted(
        cid
        for at, _, cid in h.router.state.offline_due
        if cid in sessions and sessions[cid]._due == at
    )


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


def test_offline_sessions_wait_in_the_heap_until_their_will_and_expiry(tmp_path: Path) -> None:
    h = Harness(tmp_path / "data", RouterConfig(session_expiry_max=0xFFFFFFFF))
    will = Will("wills/a", b"gone", 1, False, {PropertyId.WILL_DELAY_INTERVAL: 5})
    link, a = h.connect("a", expiry=10, will=will)
    link_b, b = h.connect("b", expiry=3600)
    link_c, c = h.connect("c")  # clean: ends with its connection
    link_n, n = h.connect("n", version=4, clean=False)  # 3.1.1: never expires
    h.tick(1)
    assert timed(h) == [] and waiting(h) == []
    for session, lnk in ((a, link), (b, link_b), (c, link_c), (n, link_n)):
        h.drop(session, lnk)
    assert waiting(h) == ["a", "b"]  # n never expires and has no will: nothing to wait for
    h.tick(1)
    assert timed(h) == []  # written
    assert h.router.state.offline_due[0][0] == a._due  # the will, in 5 s, comes first
    h.tick(3)
    assert h.log_payloads("wills/a") == []
    h.tick(2)  # 6 s after the drop: the will is out; the expiry still to come
    assert h.log_payloads("wills/a") == [b"gone"]
    assert waiting(h) == ["a", "b"]
    h.tick(5)
    assert "a" not in h.router.state.sessions and waiting(h) == ["b"]
    _, b2 = h.connect("b", clean=False, expiry=3600)
    assert b2 is b
    h.tick(1)
    assert timed(h) == []  # back: written, nothing to wait for
    h.tick(3600)  # its entry came up: dropped (online)
    assert waiting(h) == [] and h.router.state.offline_due == []
    assert "b" in h.router.state.sessions and "n" in h.router.state.sessions
    h.streams.close()


def test_a_flapping_device_keeps_one_entry(h: Harness) -> None:
    """Each drop of a persistent session wants a look at its expiry, later than the one
    its entry already has: no new entry (the heap does not grow with reconnects)."""
    for _ in range(50):
        link, s = h.connect("flap", clean=False, expiry=600)
        h.drop(s, link)
        h.tick(1)
    assert len(h.router.state.offline_due) == 1
    h.tick(600 - 49)  # 600 s after the first drop: looked at, not expired, waits again
    assert "flap" in h.router.state.sessions and waiting(h) == ["flap"]
    h.tick(60)
    assert "flap" not in h.router.state.sessions and h.router.state.offline_due == []


def test_restored_offline_sessions_are_timed_after_a_restart(tmp_path: Path) -> None:
    h = Harness(tmp_path / "data")
    will = Will("wills/r", b"late", 0, False, {PropertyId.WILL_DELAY_INTERVAL: 30})
    link, r = h.connect("r", expiry=60, will=will)
    h.drop(r, link)
    h.tick(1)
    h.restart()
    assert waiting(h) == ["r"]
    h.tick(31)
    assert h.log_payloads("wills/r") == [b"late"]
    h.tick(31)
    assert "r" not in h.router.state.sessions and waiting(h) == []
    h.streams.close()


def test_an_ended_session_made_dirty_late_does_not_stand_for_its_successor(h: Harness) -> None:
    link, old = h.connect("c", expiry=60)
    h.tick(1)
    _, new = h.connect("c", expiry=60)  # takes over: clean start ends the old session
    assert new is not old
    h.router.mark_dirty(old)  # something of the old session's, late
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
    h.router.mark_dirty(sessions[7])
    assert timed(h) == [sessions[7]]


def test_a_write_that_fails_leaves_the_rest_for_the_next_pass(h: Harness) -> None:
    _, a = h.connect("a", expiry=60)
    _, b = h.connect("b", expiry=60)
    h.tick(1)
    h.router.mark_dirty(a)
    h.router.mark_dirty(b)
    store = h.router.tick.__self__.store  # type: ignore[attr-defined]
    persist = store.persist

    def broken(session: Session, ack: object = None) -> None:
        raise RuntimeError("a bug while writing")

    store.persist = broken
    with pytest.raises(RuntimeError):
        h.router.tick()
    assert a.dirty and b.dirty and ids_timed(h) == ["a", "b"]
    store.persist = persist
    h.tick(1)
    assert not a.dirty and not b.dirty and timed(h) == []


def ids_timed(h: Harness) -> list[str]:
    return sorted(s.client_id for s in timed(h))
