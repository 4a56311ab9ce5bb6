"""QoS 1/2 delivery to one subscriber against a small reference model (hypothesis stateful).

The real :class:`Router` runs in process over a log in a temporary directory (the conftest
:class:`Harness`: a fake link, a fake clock, the group commit run when a rule ends an event
loop iteration). One persistent subscriber (MQTT 5 with a receive maximum, or 3.1.1 under the
server's in-flight limit) subscribes ``q1/#`` at QoS 1 and ``q2/#`` at QoS 2; a publisher
publishes at QoS 1 or 2. Rules: publish, end the iteration (group commit), PUBACK, PUBREC
(accepted or refused), PUBCOMP in any order, acknowledgements of unknown or wrong ids, lost
connection, DISCONNECT, reconnect, broker restart.

The subscriber's client is modelled as the spec asks of a receiver: a QoS 1 message goes to
the application on every receipt; a QoS 2 message on its first receipt only, its packet id
kept until PUBREL (s4.3.3, method B). The model of the server's side is the list of records
committed and the deliveries in flight (packet id -> message, PUBREC'd or not).

Checked after every step:

- every committed message is delivered: while the subscriber is connected with room in its
  window, nothing committed is left undelivered (at least once for QoS 1; the application
  sees each QoS 2 message exactly once);
- first deliveries of each topic come in publish order, without gaps;
- never more unacknowledged deliveries than the window [MQTT-3.3.4-9];
- a new delivery never takes a packet id in flight [MQTT-2.2.1-3];
- DUP resends (and PUBREL resends) only on reconnect: all in-flight deliveries, in their
  original order [MQTT-4.4.0-1], [MQTT-4.6.0-1];
- the router's in-flight ids and the log's contents are the model's.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from broker.config import RouterConfig
from broker.mqtt.packets import PubComp, Publish, PubRec, PubRel
from broker.router.session import Session
from tests.unit.router.conftest import FakeLink, Harness

TOPICS = ("q1/a", "q1/b", "q2/a", "q2/b")
SUB_QOS = {"q1": 1, "q2": 2}
NOT_FOUND = 0x92  # Packet Identifier not found


@dataclass
class Msg:
    """A message in flight to the subscriber, as the model sees it."""

    topic: str
    payload: bytes
    qos: int
    released: bool = False  # PUBREC received, PUBREL sent (QoS 2)


class QosModel(RuleBasedStateMachine):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="qos-model-"))
        self.h: Harness | None = None
        # Server side: committed (topic, payload, delivered qos) in log order; published
        # and not yet committed; in flight by packet id, in the order first sent.
        self.committed: list[tuple[str, bytes, int]] = []
        self.pending: list[tuple[str, bytes, int]] = []
        self.inflight: dict[int, Msg] = {}
        # Client side: QoS 2 ids received and not released (method B); what the
        # application got; first deliveries per topic.
        self.qos2_held: set[int] = set()
        self.app: list[bytes] = []
        self.qos2_payloads: set[bytes] = set()  # the messages delivered at QoS 2
        self.firsts: dict[str, list[bytes]] = {t: [] for t in TOPICS}
        self.connected = False
        self.old_links: list[FakeLink] = []
        self.seen_packets = 0
        self.n = 0
        self.pub_pid = 0

    # ------------------------------------------------------------------ setup and helpers

    @initialize(version=st.sampled_from([4, 5]), window=st.sampled_from([1, 2, 3, 10]))
    def start(self, version: int, window: int) -> None:
        self.version, self.window = version, window
        # 3.1.1 has no receive maximum: the server's own in-flight limit is the window.
        config = RouterConfig(max_inflight=window) if version == 4 else RouterConfig()
        self.h = Harness(self.dir / "data", config)
        # A new session that outlives its connections (3.1.1: clean session 0).
        self._connect_subscriber(clean=version == 5)
        self.h.subscribe(self.session, "q1/#", 1)
        self.h.subscribe(self.session, "q2/#", 2)
        self.seen_packets = len(self.link.packets)
        self._connect_publisher()

    def teardown(self) -> None:
        if self.h is not None:
            self.h.streams.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def harness(self) -> Harness:
        assert self.h is not None
        return self.h

    def _connect_subscriber(self, *, clean: bool) -> None:
        h = self.harness
        if self.version == 5:
            link, session = h.connect(
                "sub", 5, clean=clean, expiry=600, receive_maximum=self.window
            )
        else:
            link, session = h.connect("sub", 4, clean=clean)
        self.link, self.session = link, session
        self.seen_packets = 0
        self.connected = True
        self._committed_all()

    def _connect_publisher(self) -> None:
        self.pub_link, self.pub = self.harness.connect("pub", 5)
        self._committed_all()

    def _committed_all(self) -> None:
        """The group commit ran: everything published is in the log."""
        self.committed += self.pending
        self.pending = []

    def _settle_publisher(self) -> None:
        """The publisher releases its QoS 2 messages once PUBREC came (s4.3.3)."""
        for p in self.pub_link.of(PubRec):
            self.harness.router.pubrel(self.pub, p.packet_id)
        self.pub_link.packets = [p for p in self.pub_link.packets if type(p) is not PubRec]

    def _receive(
        self, *, reconnect: bool = False, released: int | None = None, unknown: int | None = None
    ) -> None:
        """The subscriber's client reads what the router sent in this step.

        ``reconnect``: the step was a reconnect (resends allowed); ``released``: the id just
        PUBREC'd (its PUBREL expected); ``unknown``: the id of a PUBREC the router does not
        know (5.0: PUBREL 0x92 expected).
        """
        self._settle_publisher()
        for old in self.old_links:
            assert old.publishes == [], "a delivery went to a closed connection"
        if not self.connected:
            return
        packets = self.link.packets[self.seen_packets :]
        self.seen_packets = len(self.link.packets)
        pubrels = [p for p in packets if type(p) is PubRel]
        resent_rels = []
        for rel in pubrels:
            if rel.reason_code == NOT_FOUND:
                assert rel.packet_id == unknown and self.version == 5, rel
                continue
            assert rel.reason_code == 0, rel
            msg = self.inflight.get(rel.packet_id)
            assert msg is not None and msg.released, f"PUBREL {rel.packet_id} not in flight"
            if rel.packet_id != released:
                assert reconnect, f"PUBREL {rel.packet_id} resent without a reconnect"
                resent_rels.append(rel.packet_id)
            self.qos2_held.discard(rel.packet_id)  # method B: the id is released
        if released is not None:
            assert [r.packet_id for r in pubrels] == [released]
        if unknown is not None and self.version == 5:
            assert [(r.packet_id, r.reason_code) for r in pubrels] == [(unknown, NOT_FOUND)]

        sent = self.link.take()
        dups = [p for p in sent if p.dup]
        if reconnect:
            # Every unacknowledged delivery again, same id, DUP, in the original order;
            # every PUBREC'd one gets its PUBREL again.
            expected = [(pid, m) for pid, m in self.inflight.items() if not m.released]
            assert sent[: len(dups)] == dups, "resends come before new deliveries"
            assert [(p.packet_id, p.topic, p.payload, p.qos) for p in dups] == [
                (pid, m.topic, m.payload, m.qos) for pid, m in expected
            ], "in-flight deliveries resent on reconnect [MQTT-4.4.0-1]"
            assert sorted(resent_rels) == sorted(
                pid for pid, m in self.inflight.items() if m.released
            )
        else:
            assert dups == [], "a DUP resend without a reconnect"
        for p in dups:
            if p.qos == 1:
                self.app.append(p.payload)  # at least once: the client cannot tell
            else:
                assert p.packet_id in self.qos2_held  # a duplicate the client drops
        for p in sent[len(dups) :]:
            pid = p.packet_id
            assert pid is not None and 1 <= pid <= 65535
            assert pid not in self.inflight, f"packet id {pid} in flight reused [MQTT-2.2.1-3]"
            assert len(self.inflight) < self.window, "receive maximum exceeded [MQTT-3.3.4-9]"
            firsts = self.firsts[p.topic]
            n = len(firsts)
            by_topic = [(pl, q) for t, pl, q in self.committed if t == p.topic]
            assert n < len(by_topic), f"{p.payload!r} delivered but not committed"
            assert (p.payload, p.qos) == by_topic[n], "not in publish order, or a gap"
            firsts.append(p.payload)
            self.inflight[pid] = Msg(p.topic, p.payload, p.qos)
            if p.qos == 2:
                assert pid not in self.qos2_held, "a new QoS 2 message the client would drop"
                self.qos2_held.add(pid)
            self.app.append(p.payload)

    def _ids(self, *, qos: int, released: bool = False) -> list[int]:
        return sorted(
            pid for pid, m in self.inflight.items() if m.qos == qos and m.released == released
        )

    # ----------------------------------------------------------------------------- rules

    @rule(
        messages=st.lists(
            st.tuples(st.sampled_from(TOPICS), st.sampled_from([1, 2])), min_size=1, max_size=12
        )
    )
    def publish(self, messages: list[tuple[str, int]]) -> None:
        """One read of PUBLISHes from the publisher (runs of one topic go together)."""
        packets = []
        for topic, qos in messages:
            self.n += 1
            self.pub_pid = self.pub_pid % 65535 + 1
            payload = f"{topic}#{self.n}".encode()
            packets.append(Publish(topic, payload, qos, False, False, self.pub_pid, {}))
            delivered = min(qos, SUB_QOS[topic[:2]])
            self.pending.append((topic, payload, delivered))
            if delivered == 2:
                self.qos2_payloads.add(payload)
        self.harness.router.publish_run(self.pub, packets)
        self._receive()

    @rule()
    def end_iteration(self) -> None:
        """The event loop iteration ends: the group commit appends and wakes the subscriber."""
        self.harness.run()
        self._committed_all()
        self._receive()

    @precondition(lambda self: self.connected and self._ids(qos=1))
    @rule(data=st.data())
    def puback(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(self._ids(qos=1)), label="puback")
        self.harness.router.puback(self.session, pid)
        del self.inflight[pid]
        self._receive()

    @precondition(lambda self: self.connected and self._ids(qos=1))
    @rule(data=st.data())
    def puback_read(self, data: st.DataObject) -> None:
        """Several PUBACKs in one read, in any order (the transport's PubAckRun)."""
        ids = data.draw(st.permutations(self._ids(qos=1)), label="pubacks")
        ids = ids[: data.draw(st.integers(1, len(ids)), label="how many")]
        router = self.harness.router
        router.puback_run(self.session, ids)
        router.pump_acked(self.session)
        for pid in ids:
            del self.inflight[pid]
        self._receive()

    @precondition(lambda self: self.connected and self._ids(qos=2))
    @rule(data=st.data(), refuse=st.booleans())
    def pubrec(self, data: st.DataObject, refuse: bool) -> None:
        pid = data.draw(st.sampled_from(self._ids(qos=2)), label="pubrec")
        if refuse and self.version == 5:
            # The client refuses the message (reason >= 0x80): the flow ends (s4.3.3).
            self.harness.router.pubrec(self.session, pid, 0x80)
            del self.inflight[pid]
            self.qos2_held.discard(pid)
            self._receive()
            return
        self.harness.router.pubrec(self.session, pid, 0)
        self.inflight[pid].released = True
        # A persistent session's PUBREL leaves once the released step is in the log: at the
        # end of the iteration, after the group commit [MQTT-4.3.3-6].
        self.harness.run()
        self._committed_all()
        self._receive(released=pid)

    @precondition(lambda self: self.connected and self._ids(qos=2, released=True))
    @rule(data=st.data())
    def pubcomp(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(self._ids(qos=2, released=True)), label="pubcomp")
        self.harness.router.pubcomp(self.session, pid)
        del self.inflight[pid]
        self._receive()

    @precondition(lambda self: self.connected)
    @rule(kind=st.sampled_from(["puback", "pubrec", "pubcomp"]), pid=st.integers(1, 16))
    def ack_unknown_id(self, kind: str, pid: int) -> None:
        """An acknowledgement naming no delivery in flight changes nothing."""
        if pid in self.inflight:
            return
        router = self.harness.router
        if kind == "puback":
            router.puback(self.session, pid)
        elif kind == "pubrec":
            router.pubrec(self.session, pid, 0)
        else:
            router.pubcomp(self.session, pid)
        self._receive(unknown=pid if kind == "pubrec" else None)

    @precondition(lambda self: self.connected and self.inflight)
    @rule(data=st.data())
    def ack_of_the_wrong_kind(self, data: st.DataObject) -> None:
        """PUBACK for a QoS 2 delivery, PUBCOMP before PUBREC, PUBREC for QoS 1: ignored
        (5.0: PUBREC of an id that is not a QoS 2 delivery gets PUBREL 0x92)."""
        pid = data.draw(st.sampled_from(sorted(self.inflight)), label="wrong ack")
        msg = self.inflight[pid]
        router = self.harness.router
        if msg.qos == 1:
            router.pubrec(self.session, pid, 0)
            self._receive(unknown=pid)
        elif not msg.released:
            router.pubcomp(self.session, pid)
            router.puback(self.session, pid)
            self._receive()
        else:
            router.puback(self.session, pid)
            self._receive()

    @precondition(lambda self: self.connected)
    @rule(graceful=st.booleans())
    def connection_closes(self, graceful: bool) -> None:
        """The network connection is lost, or the client sends DISCONNECT."""
        h = self.harness
        if graceful:
            h.disconnect(self.session, self.link)
        else:
            h.drop(self.session, self.link)
        self._committed_all()
        self.old_links.append(self.link)
        self.connected = False
        self._receive()

    @precondition(lambda self: not self.connected)
    @rule()
    def reconnect(self) -> None:
        self._connect_subscriber(clean=False)
        self._receive(reconnect=True)

    @precondition(lambda self: not self.connected)
    @rule()
    def restart(self) -> None:
        """The broker shuts down cleanly and starts again over the same data."""
        self.harness.restart()
        self._committed_all()
        self.old_links.append(self.pub_link)
        self.pub_link.packets.clear()
        self._connect_publisher()
        self._receive()

    # ------------------------------------------------------------------------ invariants

    @invariant()
    def window_is_respected(self) -> None:
        if self.h is None:
            return
        assert len(self.inflight) <= self.window
        session: Session = self.harness.router.sessions["sub"]
        assert [
            (pid, qos, released)
            for pid, (_, _, qos, _, released, _, _) in session.inflight_entries()
        ] == [(pid, m.qos, m.released) for pid, m in self.inflight.items()]

    @invariant()
    def nothing_committed_is_left_behind(self) -> None:
        """Connected with room in the window: every committed message was delivered."""
        if self.h is None or not self.connected or len(self.inflight) >= self.window:
            return
        for topic in TOPICS:
            assert self.firsts[topic] == [pl for t, pl, _ in self.committed if t == topic], (
                f"{topic}: committed but not delivered, with {len(self.inflight)} of "
                f"{self.window} in flight"
            )

    @invariant()
    def qos2_reaches_the_application_once(self) -> None:
        qos2 = [pl for pl in self.app if pl in self.qos2_payloads]
        assert len(qos2) == len(set(qos2))

    @invariant()
    def the_log_holds_what_was_committed(self) -> None:
        if self.h is None:
            return
        for topic in ("q1/a", "q2/b"):
            assert self.harness.log_payloads(topic) == [
                pl for t, pl, _ in self.committed if t == topic
            ]


FAST = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
DEEP = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_qos_delivery_follows_the_model() -> None:
    run_state_machine_as_test(QosModel, settings=FAST)


@pytest.mark.slow
def test_qos_delivery_follows_the_model_deeper() -> None:
    run_state_machine_as_test(QosModel, settings=DEEP)


def test_pubcomp_is_sent_for_every_pubrel_of_the_publisher(tmp_path: Path) -> None:
    """The model's publisher relies on it: QoS 2 ids are released after PUBREC."""
    h = Harness(tmp_path / "d")
    try:
        link, pub = h.connect("pub", 5)
        h.router.publish_run(pub, [Publish("q2/a", b"x", 2, False, False, 1, {})])
        h.run()
        assert [p.packet_id for p in link.of(PubRec)] == [1]
        h.router.pubrel(pub, 1)
        assert [(p.packet_id, p.reason_code) for p in link.of(PubComp)] == [(1, 0)]
        assert not pub.incoming_qos2
    finally:
        h.streams.close()


def test_a_released_qos2_delivery_stays_released_across_a_crash(tmp_path: Path) -> None:
    """Once PUBREL has left, the PUBLISH is never sent again [MQTT-4.3.3-6]: the receiver
    forgot the id on PUBREL and would take a resend as a new message [MQTT-4.3.3-12]."""
    h = Harness(tmp_path / "d")
    link, s = h.connect("sub", 5, expiry=600)
    h.subscribe(s, "t/#", 2)
    _, p = h.connect("pub", 5)
    h.publish(p, "t/1", b"once", 2, 1)
    h.run()
    (first,) = link.take()
    h.router.pubrec(s, first.packet_id, 0)  # type: ignore[arg-type]
    h.run()  # the iteration ends: its output (the PUBREL) leaves after the group commit
    assert [r.packet_id for r in link.of(PubRel)] == [first.packet_id]
    h.streams.close()  # crash: no close(), no tick
    h.open()
    try:
        link, s = h.connect("sub", 5, clean=False, expiry=600)
        assert link.take() == []  # not the PUBLISH again
        assert [r.packet_id for r in link.of(PubRel)] == [first.packet_id]
    finally:
        h.streams.close()


def test_a_qos2_delivery_freed_by_a_puback_is_persisted_before_the_next_iteration(
    tmp_path: Path,
) -> None:
    """As test_qos.py's test_qos2_delivery_is_persisted_in_the_same_commit, for a delivery
    that a PUBACK lets out (outside the group commit): after a crash at the end of that
    iteration it is resent with DUP and its packet id, not sent again as new."""
    h = Harness(tmp_path / "d")
    link, s = h.connect("sub", 5, expiry=600, receive_maximum=1)
    h.subscribe(s, "t/#", 2)
    _, p = h.connect("pub", 5)
    h.publish(p, "t/1", b"first", 1, 1)
    h.publish(p, "t/1", b"second", 2, 2)
    h.run()
    (first,) = link.take()
    assert first.qos == 1
    h.router.puback(s, first.packet_id)  # type: ignore[arg-type]
    (second,) = link.take()  # the window is free: the QoS 2 delivery leaves
    assert (second.payload, second.qos) == (b"second", 2)
    h.run()  # the iteration ends
    h.streams.close()  # crash: no close(), no tick
    h.open()
    try:
        link, s = h.connect("sub", 5, clean=False, expiry=600, receive_maximum=1)
        (again,) = link.take()
        assert (again.payload, again.packet_id, again.dup) == (b"second", second.packet_id, True)
    finally:
        h.streams.close()
