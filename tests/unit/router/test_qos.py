"""QoS flows in the router: QoS 2 duplicate detection, in-flight quota, packet ids."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from broker.config import RouterConfig
from broker.mqtt.packets import PubAck, PubComp, Publish, PubRec, PubRel
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import ReasonCode
from broker.router.commit import OUTCOME_UNKNOWN
from broker.router.session import Inflight, Session
from tests.unit.router.conftest import Harness


def test_qos2_duplicate_is_stored_once_and_acknowledged_each_time(h: Harness) -> None:
    link, s = h.connect("p", 5, expiry=60)
    h.publish(s, "a/b", b"x", 2, 7)
    h.publish(s, "a/b", b"x", 2, 7, dup=True)  # resent before the append finished
    assert link.of(PubRec) == []  # no PUBREC before the record is in the log
    h.run()
    assert [p.packet_id for p in link.of(PubRec)] == [7, 7]  # [MQTT-4.3.3-9]
    h.publish(s, "a/b", b"x", 2, 7, dup=True)  # resent after the append
    assert [p.packet_id for p in link.of(PubRec)] == [7, 7, 7]
    assert h.log_payloads("a/b") == [b"x"]


def test_qos2_duplicate_across_reconnect_and_restart(h: Harness) -> None:
    link, s = h.connect("p", 5, expiry=60)
    h.publish(s, "a/b", b"x", 2, 7)
    h.run()
    h.drop(s, link)
    h.restart()
    link, s = h.connect("p", 5, clean=False, expiry=60)
    h.publish(s, "a/b", b"x", 2, 7, dup=True)
    h.run()
    assert [p.packet_id for p in link.of(PubRec)] == [7]
    h.router.pubrel(s, 7)
    h.run()
    assert [p.packet_id for p in link.of(PubComp)] == [7]
    h.publish(s, "a/b", b"y", 2, 7)  # the id is free again: a new message
    h.run()
    assert h.log_payloads("a/b") == [b"x", b"y"]


def test_pubrec_waits_for_the_session_state_in_the_same_commit(h: Harness) -> None:
    """A persistent publisher's received id is in $sessions before PUBREC is sent, so a
    crash after PUBREC cannot turn the resend into a second copy."""
    link, s = h.connect("p", 5, expiry=60)
    h.publish(s, "a/b", b"x", 2, 9)
    h.run()
    assert link.of(PubRec)
    sessions = h.streams.log("$sessions", 0)
    last = sessions.read(sessions.log_start_offset, 10_000)[-1]
    assert b'"incoming_qos2":[9]' in last.payload
    h.router.pubrel(s, 9)
    assert link.of(PubComp) == []  # waits for the state without the id
    h.run()
    assert link.of(PubComp)
    last = sessions.read(sessions.log_start_offset, 10_000)[-1]
    assert b'"incoming_qos2":[]' in last.payload


def test_pubrel_for_unknown_id(h: Harness) -> None:
    link, s = h.connect("p", 5)
    h.router.pubrel(s, 3)
    (comp,) = link.of(PubComp)
    assert (comp.packet_id, comp.reason_code) == (3, 0x92)  # Packet Identifier not found


def test_receive_maximum_bounds_inflight(h: Harness) -> None:
    link, s = h.connect("sub", 5, receive_maximum=3)
    h.subscribe(s, "t/#", 1)
    _, p = h.connect("pub", 5)
    for i in range(10):
        h.publish(p, "t/1", f"m{i}".encode(), 1, i + 1)
    h.run()
    sent = link.take()
    assert [x.payload for x in sent] == [b"m0", b"m1", b"m2"]  # [MQTT-3.3.4-9]
    h.router.puback(s, sent[0].packet_id)  # type: ignore[arg-type]
    assert [x.payload for x in link.take()] == [b"m3"]
    for x in sent[1:]:
        h.router.puback(s, x.packet_id)  # type: ignore[arg-type]
    assert [x.payload for x in link.take()] == [b"m4", b"m5"]


def test_server_inflight_limit_applies_below_receive_maximum(tmp_path: object) -> None:
    from pathlib import Path

    h = Harness(Path(str(tmp_path)) / "d", RouterConfig(max_inflight=2))
    link, s = h.connect("sub", 5)  # receive maximum 65535
    h.subscribe(s, "t/#", 2)
    _, p = h.connect("pub", 5)
    for i in range(5):
        h.publish(p, "t/1", f"m{i}".encode(), 2, i + 1)
    h.run()
    sent = link.take()
    assert len(sent) == 2
    h.router.pubrec(s, sent[0].packet_id, 0)  # type: ignore[arg-type]
    assert link.take() == []  # PUBREC'd but not complete: still counts (s4.9)
    assert [p.packet_id for p in link.of(PubRel)] == [sent[0].packet_id]
    h.router.pubcomp(s, sent[0].packet_id)  # type: ignore[arg-type]
    assert [x.payload for x in link.take()] == [b"m2"]
    h.streams.close()


def test_qos0_is_not_bounded_by_the_quota(h: Harness) -> None:
    link, s = h.connect("sub", 5, receive_maximum=1)
    h.subscribe(s, "t/#", 0)
    _, p = h.connect("pub", 5)
    for _ in range(5):
        h.publish(p, "t/1", b"q0", 0)
    h.run()
    assert len(link.take()) == 5


def test_packet_ids_skip_those_in_flight_and_wrap() -> None:
    s = Session("x")
    s.next_packet_id = 65534
    s.own_inflight()[65535] = Inflight(("default", 0), 0, 1, False, False, None, "")
    s.own_inflight()[1] = Inflight(("default", 0), 1, 1, False, False, None, "")
    assert s.allocate_packet_id() == 65534
    assert s.allocate_packet_id() == 2  # 65535 and 1 are in use; 0 is never used
    assert s.allocate_packet_id() == 3


def test_packet_ids_are_unique_among_inflight(h: Harness) -> None:
    link, s = h.connect("sub", 5)
    h.subscribe(s, "t/#", 1)
    _, p = h.connect("pub", 5)
    for i in range(50):
        h.publish(p, "t/1", b"x", 1, i + 1)
    h.run()
    ids = [x.packet_id for x in link.take()]
    assert len(set(ids)) == 50 and all(ids)  # [MQTT-2.2.1-3]


def test_unacked_deliveries_resent_with_dup_after_restart(h: Harness) -> None:
    link, s = h.connect("sub", 4, clean=False)
    h.subscribe(s, "t/#", 2)
    _, p = h.connect("pub", 4)
    h.publish(p, "t/1", b"a", 1, 1)
    h.publish(p, "t/1", b"b", 2, 2)
    h.run()
    a, b = link.take()
    h.router.pubrec(s, b.packet_id, 0)  # type: ignore[arg-type]
    h.drop(s, link)
    h.restart()
    link, s = h.connect("sub", 4, clean=False)
    (again,) = link.take()
    assert (again.payload, again.packet_id, again.dup) == (b"a", a.packet_id, True)
    assert [r.packet_id for r in link.of(PubRel)] == [b.packet_id]  # [MQTT-4.4.0-1]
    h.router.puback(s, a.packet_id)  # type: ignore[arg-type]
    h.router.pubcomp(s, b.packet_id)  # type: ignore[arg-type]
    assert s.inflight == {}


def test_expired_inflight_delivery_is_dropped_and_frees_its_id(h: Harness) -> None:
    """An unacknowledged delivery whose message expired while the client was away is not
    resent [MQTT-3.3.2-5], and its packet id no longer counts against the quota."""
    link, s = h.connect("sub", 5, expiry=600, receive_maximum=1)
    h.subscribe(s, "t/#", 1)
    _, p = h.connect("pub", 5)
    h.publish(p, "t/1", b"short", 1, 1, properties={PropertyId.MESSAGE_EXPIRY_INTERVAL: 5})
    h.publish(p, "t/1", b"long", 1, 2)
    h.run()
    assert [x.payload for x in link.take()] == [b"short"]  # quota 1
    h.drop(s, link)
    h.tick(10)
    link, s = h.connect("sub", 5, clean=False, expiry=600, receive_maximum=1)
    (nxt,) = link.take()
    assert (nxt.payload, nxt.dup) == (b"long", False)
    assert list(s.inflight) == [nxt.packet_id]


def test_puback_for_wrong_id_is_ignored(h: Harness) -> None:
    link, s = h.connect("sub", 5)
    h.subscribe(s, "t/#", 1)
    _, p = h.connect("pub", 5)
    h.publish(p, "t/1", b"x", 1, 1)
    h.run()
    (x,) = link.take()
    h.router.puback(s, (x.packet_id or 0) + 1)
    assert list(s.inflight) == [x.packet_id]
    assert not link.of(PubAck)


def test_qos2_delivery_is_persisted_in_the_same_commit(h: Harness) -> None:
    """A QoS 2 delivery's packet id and cursor are in $sessions before the PUBLISH leaves,
    so after a crash it is resent with DUP and the same id, not sent again as new."""
    link, s = h.connect("sub", 5, expiry=600)
    h.subscribe(s, "t/#", 2)
    _, p = h.connect("pub", 5)
    h.publish(p, "t/1", b"once", 2, 1)
    h.run()
    (first,) = link.take()
    h.streams.close()  # crash: no close(), no tick
    h.open()
    link, s = h.connect("sub", 5, clean=False, expiry=600)
    (again,) = link.take()
    assert (again.payload, again.packet_id, again.dup) == (b"once", first.packet_id, True)


def test_pubacks_resume_a_run_stopped_at_the_quota(h: Harness) -> None:
    """A read of PUBACKs pumps a subscriber whose run of deliveries stopped at its send
    quota (receive maximum, s4.9), and only then (Router.pump_acked)."""
    sub_link, sub = h.connect("s", 5, receive_maximum=10)
    h.subscribe(sub, "a/#", 1)
    _, pub = h.connect("p", 5)
    h.router.publish_run(
        pub, [Publish("a/b", b"%d" % i, 1, False, False, i + 1, {}) for i in range(50)]
    )
    h.run()
    assert len(sub_link.publishes) == 10 and sub_link.runs == 1
    assert sub.waiting
    while len(sub_link.publishes) < 50:
        sent = len(sub_link.publishes)
        h.router.puback_run(sub, [p.packet_id for p in sub_link.publishes[-10:]])
        h.router.pump_acked(sub)
        assert len(sub_link.publishes) == sent + 10
    assert [p.payload for p in sub_link.publishes] == [b"%d" % i for i in range(50)]
    h.router.puback_run(sub, [p.packet_id for p in sub_link.publishes[-10:]])
    assert not sub.waiting  # nothing left to send: the last pump did not stop at the quota


def test_a_qos2_delivery_leaves_only_once_its_state_is_stored(h: Harness) -> None:
    """With a replicated ``$sessions`` the state's write is acknowledged later (at the
    quorum commit): the PUBLISH waits on the link (hold) until then, and if the state is not
    stored the connection is closed with it unsent, so a node's death cannot make the same
    message go out again under a new packet id (exactly once, s4.3.3)."""
    link, s = h.connect("sub", 5, expiry=600)
    h.subscribe(s, "t/#", 2)
    link.holds = link.releases = 0  # (the SUBACK's, once the subscription was stored)
    _, p = h.connect("pub", 5)
    commit = h.router.flush.__self__  # type: ignore[attr-defined]
    write = commit.persist
    later: list[Callable[[int | None], None]] = []

    def replicated(session: Session, ack: Callable[[int | None], None] | None) -> None:
        write(session, None)  # in the log; its acknowledgement comes with the commit
        if ack is not None:
            later.append(ack)

    commit.persist = replicated
    h.publish(p, "t/1", b"once", 2, 1)
    h.run()
    (first,) = link.take()  # queued, but held: a real link writes nothing yet
    assert (first.payload, link.holds, link.releases) == (b"once", 1, 0)
    later.pop()(7)
    assert link.releases == 1 and not link.closed
    h.publish(p, "t/2", b"lost", 2, 2)
    h.run()
    assert link.holds == 2
    later.pop()(OUTCOME_UNKNOWN)
    assert link.releases == 1 and link.closed == ReasonCode.UNSPECIFIED_ERROR


def test_a_qos2_delivery_to_a_clean_session_is_not_held(h: Harness) -> None:
    link, s = h.connect("sub", 5)
    h.subscribe(s, "t/#", 2)
    _, p = h.connect("pub", 5)
    h.publish(p, "t/1", b"x", 2, 1)
    h.run()
    assert len(link.take()) == 1 and link.holds == 0


def test_an_inflight_delivery_not_readable_here_yet_is_resent_once_it_is(tmp_path: Path) -> None:
    """A session resumes where its records are not readable yet (a cluster's node whose
    replica is behind the commit: restarted, or its group without a leader for a moment):
    its unacknowledged deliveries are resent once the records arrive, not dropped as if
    retention had deleted them (its cursor is past them: they were lost for good; found
    by bench.churn --cluster 3, two acknowledged publishes a shared group never gave)."""
    a, b = Harness(tmp_path / "a"), Harness(tmp_path / "b")
    link, s = a.connect("sub", 4, clean=False)
    a.subscribe(s, "t/#", 1)
    _, p = a.connect("pub", 4)
    for i in range(3):
        a.publish(p, "t/1", b"m%d" % i, 1, i + 1)
    a.run()
    sent = link.take()
    a.router.puback(s, sent[0].packet_id)  # type: ignore[arg-type]
    state = a.router.hand_over("sub")  # the session moves to b, whose log is empty so far
    assert state is not None
    b.router.adopt("sub", state)
    link, s = b.connect("sub", 4, clean=False)
    assert link.take() == [] and sorted(s.inflight) == [x.packet_id for x in sent[1:]]
    _, q = b.connect("pub", 4)
    b.publish(q, "t/1", b"m0", 1, 1)  # the records reach b's log: offset 0, not yet 1
    b.run()
    assert link.take() == []  # (its cursor, adopted, is past them all)
    for i in (1, 2):
        b.publish(q, "t/1", b"m%d" % i, 1, i + 1)
    b.run()
    assert [(x.payload, x.packet_id, x.dup) for x in link.take()] == [
        (x.payload, x.packet_id, True) for x in sent[1:]
    ]  # [MQTT-4.4.0-1]
    for x in sent[1:]:
        b.router.puback(s, x.packet_id)  # type: ignore[arg-type]
    assert s.inflight == {} and not s.resend_due
