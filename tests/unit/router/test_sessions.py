"""Session lifetime on a fake clock: expiry, clean start, resume, restart (s4.1)."""

from __future__ import annotations

import pytest

from broker.mqtt.packets import ConnAck, Disconnect, Will
from broker.router.session import NO_ENTRIES, Inflight, Session, Subscription
from tests.unit.router.conftest import Harness, fail_appends


def test_session_expires_after_its_interval(h: Harness) -> None:
    link, s = h.connect("a", 5, expiry=10)
    h.subscribe(s, "t/#", 1)
    h.drop(s, link)
    h.tick(9.5)
    assert "a" in h.router.sessions
    h.tick(1)
    assert "a" not in h.router.sessions
    link, s = h.connect("a", 5, clean=False, expiry=10)
    assert link.of(ConnAck)[0].session_present is False  # [MQTT-3.2.2-3]


def test_expiry_zero_ends_with_the_connection(h: Harness) -> None:
    link, s = h.connect("a", 5)
    h.drop(s, link)
    assert "a" not in h.router.sessions


def test_expired_session_is_gone_after_restart_too(h: Harness) -> None:
    link, s = h.connect("a", 5, expiry=10)
    h.subscribe(s, "t/#", 1)
    h.drop(s, link)
    h.restart()
    assert "a" in h.router.sessions  # loaded from $sessions
    h.tick(11)  # the interval counts from the disconnect, across the restart
    assert "a" not in h.router.sessions
    h.restart()
    assert "a" not in h.router.sessions  # the tombstone was written


def test_resume_delivers_what_was_published_while_away(h: Harness) -> None:
    link, s = h.connect("sub", 4, clean=False)
    h.subscribe(s, "t/#", 1)
    h.drop(s, link)
    _, p = h.connect("pub", 4)
    for i in range(5):
        h.publish(p, "t/1", f"m{i}".encode(), 1, i + 1)
    h.run()
    h.restart()
    link, s = h.connect("sub", 4, clean=False)
    assert link.of(ConnAck)[0].session_present is True
    assert [x.payload for x in link.take()] == [f"m{i}".encode() for i in range(5)]


def test_clean_start_discards_state(h: Harness) -> None:
    link, s = h.connect("a", 5, expiry=100)
    h.subscribe(s, "t/#", 1)
    h.drop(s, link)
    link, s = h.connect("a", 5, clean=True, expiry=100)
    assert link.of(ConnAck)[0].session_present is False  # [MQTT-3.1.2-4]
    assert not s.main.subscriptions


def test_an_idle_session_shares_its_empty_tables_until_one_gets_an_entry() -> None:
    a, b = Session("a"), Session("b")
    assert a.consumers is b.consumers is a.shared is a.inflight is NO_ENTRIES
    with pytest.raises(TypeError):
        a.inflight[1] = Inflight(("default", 0), 0, 1, False, False, None, "")
    assert a.main is a.consumers[""]  # made on first use: a's own table, not b's
    a.own_shared()["$share/g/t"] = Subscription("t", 1)
    a.own_inflight()[1] = Inflight(("default", 0), 0, 1, False, False, None, "")
    assert a.consumers is not NO_ENTRIES and a.shared is not NO_ENTRIES
    assert list(a.inflight) == [1] and len(NO_ENTRIES) == 0
    assert b.consumers is b.shared is b.inflight is NO_ENTRIES


def test_a_session_state_not_stored_is_written_again_at_the_next_tick(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A persistent session's state whose append failed (with several workers: the worker
    owning ``$sessions`` dead, the forward refused) is written again by the timer: nothing
    else would write it before the session changes again, and a restart (or the death of
    the worker holding it) meanwhile restored it without the subscription."""
    _link, s = h.connect("a", 5, expiry=600)
    calls = fail_appends(h, monkeypatch, ("$sessions", 0), 1)
    h.subscribe(s, "t/#", 1)  # its state's append fails
    assert calls == [1]
    h.tick(0.5)
    assert calls == [2]  # written again
    h.streams.close()  # a crash: no router.close()
    h.open()
    assert "t/#" in h.router.sessions["a"].main.subscriptions


def test_after_written_waits_for_every_sessions_record_of_the_client_id(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What waits on ``after_written`` runs once every ``$sessions`` record of that client
    id written here has answered, stored or not (with several workers a session leaves
    this worker only then: broker.workers.sessions)."""
    called: list[str] = []
    h.router.after_written("a", lambda: called.append("idle"))
    assert called == ["idle"]  # nothing in flight: at once
    link, s = h.connect("a", 5, expiry=600)
    h.subscribe(s, "t/#", 1)
    h.router.connection_lost(s, link, graceful=False)  # its state written: in flight
    h.router.after_written("a", lambda: called.append("state"))
    h.router.after_written("b", lambda: called.append("b"))  # another client id: at once
    assert called == ["idle", "b"]
    h.run()  # the group commit appends it
    assert called == ["idle", "b", "state"]

    # A clean session with a will: its state is written at CONNECT, a tombstone at its end.
    link, s = h.connect("a", 5, clean=True, will=Will("w/a", b"gone", 1, False))
    h.router.disconnect(s, Disconnect(0))
    h.router.connection_lost(s, link, graceful=True)
    h.router.after_written("a", lambda: called.append("tombstone"))
    calls = fail_appends(h, monkeypatch, ("$sessions", 0), 1)
    assert called[-1] == "state"
    h.run()  # the append fails: the tombstone is written again at the timer's next pass
    assert calls == [1] and called[-1] == "state"
    h.tick(1)
    assert calls == [2] and called[-1] == "tombstone"


def test_a_tombstone_not_stored_is_written_again_until_it_is(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session that ended keeps its state in the log if its tombstone's append fails
    (with several workers: ``$sessions`` ' owner worker dead, the forward refused); a
    restart would bring the session back (after a clean start [MQTT-3.1.2-4]). The
    tombstone is written again at each pass of the timer until stored, unless a newer
    record of the client id was written here since."""

    def stored(client_id: str) -> list[bytes]:
        log = h.streams.log("$sessions", 0)
        return [r.payload for r in log.read(0, 10_000) if r.topic == client_id]

    link, s = h.connect("a", 5, expiry=600)
    h.subscribe(s, "t/#", 1)
    h.disconnect(s, link)
    assert stored("a") and stored("a")[-1]  # its state is in the log
    calls = fail_appends(h, monkeypatch, ("$sessions", 0), 3)
    link, s = h.connect("a", 5, clean=True)  # a clean start ends the stored session
    h.run()
    assert calls == [1] and stored("a")[-1] != b""
    h.tick(1)
    h.tick(1)
    assert calls == [3] and stored("a")[-1] != b""
    h.tick(1)
    assert calls == [4] and stored("a")[-1] == b""
    h.tick(1)
    assert calls == [4]  # stored: not again

    # Not stored, then replaced by a newer record of the client id: not written again.
    h.disconnect(s, link)
    link, s = h.connect("b", 5, expiry=600)
    h.subscribe(s, "t/#", 1)
    h.disconnect(s, link)
    calls = fail_appends(h, monkeypatch, ("$sessions", 0), 1)
    link, s = h.connect("b", 5, clean=True)
    h.run()  # the tombstone failed
    assert calls == [1] and stored("b")[-1] != b""
    h.disconnect(s, link)
    link, s = h.connect("b", 5, expiry=600)  # back, persistent: its state is written
    h.subscribe(s, "u/#", 1)
    assert calls == [2] and b"u/#" in stored("b")[-1]
    h.tick(1)
    assert b"u/#" in stored("b")[-1]  # no tombstone after it
    h.tick(1)
    assert b"u/#" in stored("b")[-1]  # no tombstone after it


def test_a_persistent_sessions_suback_waits_for_its_state_in_the_log(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SUBACK of a persistent session leaves once the state with the subscription is
    stored (with several workers another one appends it: every worker killed between the
    two lost a subscription already acknowledged); not stored, the connection closes with
    the SUBACK unsent and the client subscribes again."""
    link, s = h.connect("a", 5, expiry=600)
    h.subscribe(s, "t/#", 1)
    assert (link.holds, link.releases, link.closed) == (1, 1, False)
    fail_appends(h, monkeypatch, ("$sessions", 0), 1)
    h.subscribe(s, "u/#", 1)
    assert (link.holds, link.releases) == (2, 1) and link.closed is not False
    clean, c = h.connect("c", 5)  # a clean session's state is not written: nothing held
    h.subscribe(c, "t/#", 1)
    assert clean.holds == 0
