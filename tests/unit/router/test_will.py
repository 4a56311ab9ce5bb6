"""Will messages and will delay, on a fake clock (s3.1.2.5, s3.1.3.2.2)."""

from __future__ import annotations

import orjson
import pytest

from broker.mqtt.packets import Will
from broker.mqtt.properties import PropertyId, decode_properties
from broker.router.lifecycle import WILL_RETRY_SECONDS
from broker.router.session import Session
from tests.unit.router.conftest import Harness, fail_appends


def delayed_will(delay: int, payload: bytes = b"gone") -> Will:
    return Will("will/x", payload, 1, False, {PropertyId.WILL_DELAY_INTERVAL: delay})


def test_will_published_on_abnormal_close_not_on_disconnect(h: Harness) -> None:
    link, s = h.connect("a", 4, will=Will("will/x", b"a gone", 1))
    h.drop(s, link)
    assert h.log_payloads("will/x") == [b"a gone"]
    link, s = h.connect("b", 4, will=Will("will/x", b"b gone", 1))
    h.disconnect(s, link)  # [MQTT-3.1.2-10]
    assert h.log_payloads("will/x") == [b"a gone"]
    link, s = h.connect("c", 5, will=Will("will/x", b"c gone", 1))
    h.disconnect(s, link, 0x04)  # Disconnect with Will Message
    assert h.log_payloads("will/x") == [b"a gone", b"c gone"]


def test_will_delay_property_is_not_forwarded(h: Harness) -> None:
    link, s = h.connect("a", 5, expiry=60, will=delayed_will(1))
    h.drop(s, link)
    h.tick(1.0)
    key = h.streams.partition_for("will/x")
    (rec,) = h.streams.log(*key).read(0)
    assert b"\x18" not in rec.properties  # Will Delay Interval belongs to the will only


def test_will_delay_waits_then_publishes(h: Harness) -> None:
    link, s = h.connect("a", 5, expiry=60, will=delayed_will(5))
    h.drop(s, link)
    h.tick(4.9)
    assert h.log_payloads("will/x") == []
    h.tick(0.2)
    assert h.log_payloads("will/x") == [b"gone"]
    h.tick(10)
    assert h.log_payloads("will/x") == [b"gone"]  # once
    assert "a" in h.router.sessions  # the session lives on until its own expiry


def test_reconnect_within_delay_cancels_the_will(h: Harness) -> None:
    link, s = h.connect("a", 5, expiry=60, will=delayed_will(5))
    h.drop(s, link)
    h.tick(3)
    link, s = h.connect("a", 5, clean=False, expiry=60)  # [MQTT-3.1.3-9]
    h.tick(10)
    h.drop(s, link)  # the new connection has no will
    h.tick(10)
    assert h.log_payloads("will/x") == []


def test_session_end_before_delay_publishes_the_will(h: Harness) -> None:
    link, s = h.connect("a", 5, expiry=2, will=delayed_will(100))
    h.drop(s, link)
    h.tick(1)
    assert h.log_payloads("will/x") == []
    h.tick(1.5)
    assert h.log_payloads("will/x") == [b"gone"]
    assert "a" not in h.router.sessions


def test_zero_expiry_publishes_a_delayed_will_at_once(h: Harness) -> None:
    link, s = h.connect("a", 5, will=delayed_will(100))  # session ends with the connection
    h.drop(s, link)
    assert h.log_payloads("will/x") == [b"gone"]


def test_retained_will_is_stored_as_retained(h: Harness) -> None:
    link, s = h.connect("a", 4, will=Will("status/a", b"offline", 1, True))
    h.drop(s, link)
    assert h.router.retained["status/a"].payload == b"offline"
    sub_link, sub = h.connect("late", 4)
    h.subscribe(sub, "status/#", 1)
    (p,) = sub_link.take()
    assert (p.topic, p.payload, p.retain) == ("status/a", b"offline", True)


def test_takeover_publishes_the_old_will_and_keeps_the_new(h: Harness) -> None:
    old, _ = h.connect("a", 5, expiry=60, will=Will("will/x", b"first", 1))
    new, s = h.connect("a", 5, clean=False, expiry=60, will=Will("will/x", b"second", 1))
    assert old.closed == 0x8E  # Session taken over
    assert h.log_payloads("will/x") == [b"first"]
    h.drop(s, new)
    assert h.log_payloads("will/x") == [b"first", b"second"]


def test_delayed_will_survives_a_restart_with_its_remaining_delay(h: Harness) -> None:
    link, s = h.connect("a", 5, expiry=60, will=delayed_will(10, b"after restart"))
    h.drop(s, link)
    h.tick(4)
    h.restart()
    h.tick(5)
    assert h.log_payloads("will/x") == []
    h.tick(1.5)
    assert h.log_payloads("will/x") == [b"after restart"]


def test_will_of_a_client_connected_at_a_crash_is_published_after_restart(h: Harness) -> None:
    """The session was written while connected (as the tick does); then the broker died."""
    will = Will("will/x", b"crashed", 1, False, {PropertyId.USER_PROPERTY: [("k", "v")]})
    h.connect("a", 5, expiry=60, will=will)
    h.tick(0.5)  # the periodic persist of the connected session
    h.streams.close()  # no router.close(): nothing else is written
    h.open()
    h.tick(0.5)
    key = h.streams.partition_for("will/x")
    (rec,) = h.streams.log(*key).read(0)
    assert rec.payload == b"crashed"
    assert decode_properties(rec.properties)[PropertyId.USER_PROPERTY] == [("k", "v")]
    assert h.log_payloads("will/x") == [b"crashed"]


def test_reconnect_after_restart_cancels_a_pending_delayed_will(h: Harness) -> None:
    link, s = h.connect("a", 5, expiry=60, will=delayed_will(10))
    h.drop(s, link)
    h.restart()
    h.connect("a", 5, clean=False, expiry=60)
    h.tick(20)
    assert h.log_payloads("will/x") == []


def test_no_will_after_restart_when_it_was_disconnected_normally(h: Harness) -> None:
    link, s = h.connect("a", 5, expiry=60, will=delayed_will(0))
    h.disconnect(s, link)
    h.restart()
    h.tick(1)
    assert h.log_payloads("will/x") == []


def test_a_clean_sessions_will_is_written_and_published_after_a_crash(h: Harness) -> None:
    """A clean session with a will is in ``$sessions`` from its CONNECT on, so that the will
    survives the node (a cluster publishes it from another, broker.workers.orphans)."""
    h.connect("a", 4, will=Will("will/x", b"clean gone", 1))
    h.streams.close()  # the broker dies: no tick, no router.close()
    h.open()
    h.tick(0.5)
    assert h.log_payloads("will/x") == [b"clean gone"]  # s3.1.2.5: deferred to this start
    assert "a" not in h.router.sessions  # and its session ended (expiry 0)
    h.restart()
    h.tick(1)
    assert h.log_payloads("will/x") == [b"clean gone"]  # once: the end left a tombstone


def test_a_clean_session_disconnected_normally_leaves_no_will_behind(h: Harness) -> None:
    link, s = h.connect("a", 4, will=Will("will/x", b"never", 1))
    h.disconnect(s, link)
    h.streams.close()
    h.open()
    h.tick(1)
    assert h.log_payloads("will/x") == []
    assert "a" not in h.router.sessions


def test_an_adopted_session_counts_its_will_delay_and_expiry_from_the_loss(h: Harness) -> None:
    """``adopt(..., lost_at)``: the state a node wrote of its connected client, adopted by
    another after that node died at ``lost_at``: the will delay and the expiry run from then."""
    _link, s = h.connect("a", 5, expiry=8, will=delayed_will(5, b"late"))
    state = orjson.dumps(s.to_state(h.router.state.monotonic()))  # written while connected
    assert orjson.loads(state)["will_left"] is None
    lost_at = h.router.state.clock() - 3  # its node died 3 s ago
    h.router.adopt("b", state, lost_at)
    h.tick(1.9)
    assert h.log_payloads("will/x") == []
    h.tick(0.2)
    assert h.log_payloads("will/x") == [b"late"]  # 5 s after the loss
    assert "b" in h.router.sessions
    h.tick(3)
    assert "b" not in h.router.sessions  # expired 8 s after the loss


def test_an_adopted_wills_delay_counts_from_when_the_connection_was_lost(h: Harness) -> None:
    """The dead node wrote down that the connection dropped 4 s before its death: a will
    delay of 10 s has 6 s left at the adoption (it had 10 before)."""
    now = h.clock.now
    session = Session("dev", persistent=True, expiry_interval=300)
    session.will = delayed_will(10, b"gone")
    session.disconnected_at = now - 4
    session.will_due = 6.0  # as written then: will_left 10 at monotonic -4
    state = orjson.dumps(session.to_state(-4.0))
    h.router.adopt("dev", state, now)
    h.tick(5.5)
    assert h.log_payloads("will/x") == []
    h.tick(1)
    assert h.log_payloads("will/x") == [b"gone"]


def test_a_delayed_will_published_is_not_published_again_after_a_crash(h: Harness) -> None:
    """The timer that publishes a delayed will writes the session's state without it."""
    link, s = h.connect("a", 5, expiry=60, will=delayed_will(2, b"once"))
    h.drop(s, link)
    h.tick(2.5)
    assert h.log_payloads("will/x") == [b"once"]
    h.streams.close()  # a crash: no router.close()
    h.open()
    h.tick(5)
    assert h.log_payloads("will/x") == [b"once"]


def test_a_persistent_sessions_will_is_written_at_connect_and_survives_a_crash(
    h: Harness,
) -> None:
    """The state with the will is in ``$sessions`` from the CONNECT on, as a clean
    session's is: left to the next tick's persist, a worker killed before it left whoever
    restored the session (its home worker, or itself restarted) without this will."""
    h.connect("a", 4, clean=False, will=Will("will/x", b"persistent gone", 1))
    h.streams.close()  # the broker dies before any tick: no persist, no router.close()
    h.open()
    h.tick(0.5)
    assert h.log_payloads("will/x") == [b"persistent gone"]  # s3.1.2.5: deferred to here
    assert "a" in h.router.sessions  # the session lives on


def test_a_due_will_goes_out_when_its_client_is_back_before_the_timer(h: Harness) -> None:
    """Restored after a crash, the will of a client that was connected is due at once, and
    the timer publishes it; a client back before that tick must not cancel it: only a will
    whose delay still runs is cancelled by a new connection [MQTT-3.1.3-9], a due one is
    published [MQTT-3.1.2-8]. (With several workers, a device whose worker was killed
    reconnects to another one within milliseconds, before its home worker's next tick.)"""
    h.connect("a", 4, clean=False, will=Will("will/x", b"first", 1))
    h.tick(0.5)  # (the state is written at the CONNECT, and by the tick's persist)
    h.streams.close()
    h.open()  # restored, offline, its will due now
    link, s = h.connect("a", 4, clean=False, will=Will("will/x", b"second", 1))
    assert h.log_payloads("will/x") == [b"first"]
    h.tick(1)
    assert h.log_payloads("will/x") == [b"first"]  # once
    h.drop(s, link)
    assert h.log_payloads("will/x") == [b"first", b"second"]


def test_a_will_whose_append_fails_is_tried_again_at_each_tick(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A will is the broker's publish for a client that is gone: no client sends it again.
    With several workers its partition's owner may be a worker that just died (the forward
    is refused): the append fails, and the will is tried again at each tick until it is
    stored [MQTT-3.1.2-8]. (bench.churn --wills with worker kills lost hundreds.)"""
    link, s = h.connect("a", 4, will=Will("will/x", b"gone", 1))
    tried = fail_appends(h, monkeypatch, h.streams.partition_for("will/x"), 2)
    h.drop(s, link)
    assert h.log_payloads("will/x") == [] and tried == [1]
    h.tick(0.5)
    assert h.log_payloads("will/x") == [] and tried == [2]
    h.tick(0.5)
    assert h.log_payloads("will/x") == [b"gone"] and tried == [3]
    h.tick(5)
    assert h.log_payloads("will/x") == [b"gone"] and tried == [3]  # once


def test_a_will_not_stored_for_a_minute_is_dropped(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    link, s = h.connect("a", 4, will=Will("will/x", b"gone", 1))
    tried = fail_appends(h, monkeypatch, h.streams.partition_for("will/x"), 1000)
    h.drop(s, link)
    for _ in range(3):
        h.tick(WILL_RETRY_SECONDS / 2)
    assert tried == [3]  # the first try, then one at each tick up to the limit
    h.tick(5)
    assert tried == [3] and h.log_payloads("will/x") == []


def test_the_connack_of_a_connect_with_a_will_waits_for_its_state_in_the_log(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CONNACK leaves once the state with the will is stored: a broker killed right
    after it (every worker at once, the state forwarded to ``$sessions`` ' owner and not yet
    appended) owed a will it had not stored. Not stored: the connection is closed."""
    link, _ = h.connect("a", 4, will=Will("will/x", b"gone", 1))
    assert (link.holds, link.releases, link.closed) == (1, 1, False)
    link, _ = h.connect("b", 4)  # no will: nothing waits
    assert (link.holds, link.releases) == (0, 0)
    fail_appends(h, monkeypatch, ("$sessions", 0), 1)
    link, _ = h.connect("c", 4, will=Will("will/x", b"gone", 1))
    assert (link.holds, link.releases) == (1, 0)
    assert link.closed is not False  # its CONNACK never leaves
