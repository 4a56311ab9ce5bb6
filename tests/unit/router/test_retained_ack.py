"""A retained QoS 1 message is acknowledged once it is retained too [MQTT-3.3.1-5]: both its
record in its topic's partition and its copy in ``$retained`` are in the log
(broker.router.commit.Both). With several workers ``$retained`` may be another worker's, whose
forward is refused while that worker is dead, when the record's own append succeeds: a
PUBACK then (before) told the client the message was retained when no future subscriber
would get it (bench.churn, found by a kill of the worker owning ``$retained``)."""

from __future__ import annotations

import pytest

from broker.mqtt.packets import PubAck
from broker.mqtt.reason_codes import ReasonCode
from broker.router.commit import OUTCOME_UNKNOWN, Both
from tests.unit.router.conftest import Harness, fail_appends


def test_a_retained_publish_is_acknowledged_once_both_appends_are(h: Harness) -> None:
    link, s = h.connect("p", 4)
    h.publish(s, "state/a", b"on", 1, 5, retain=True)
    assert link.of(PubAck) == []
    h.run()
    assert [p.packet_id for p in link.of(PubAck)] == [5]
    assert h.router.retained["state/a"].payload == b"on"


@pytest.mark.parametrize("version", [4, 5])
def test_a_retained_publish_not_retained_is_not_acknowledged(
    h: Harness, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    """Its record is stored, its copy in ``$retained`` is not: no PUBACK, the connection is
    closed so that the client sends it again (a duplicate of a QoS 1 message is allowed)."""
    link, s = h.connect("p", version)
    fail_appends(h, monkeypatch, ("$retained", 0), 1)
    h.publish(s, "state/a", b"on", 1, 5, retain=True)
    h.run()
    assert link.of(PubAck) == []
    assert link.closed is not False  # closed: send it again
    assert "state/a" not in h.router.retained
    link, s = h.connect("p", version, clean=False, expiry=60 if version == 5 else None)
    h.publish(s, "state/a", b"on", 1, 5, retain=True, dup=True)
    h.run()
    assert [p.packet_id for p in link.of(PubAck)] == [5]
    assert h.router.retained["state/a"].payload == b"on"


def test_a_retained_publish_stored_nowhere_gets_the_failure(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    link, s = h.connect("p", 5)
    fail_appends(h, monkeypatch, h.streams.partition_for("state/a"), 1)
    fail_appends(h, monkeypatch, ("$retained", 0), 1)
    h.publish(s, "state/a", b"on", 1, 5, retain=True)
    h.run()
    assert [(p.packet_id, p.reason_code) for p in link.of(PubAck)] == [
        (5, ReasonCode.UNSPECIFIED_ERROR)
    ]


@pytest.mark.parametrize(
    ("record", "retained", "expected"),
    [
        (7, 3, 7),  # both stored: the record's offset
        (None, None, None),  # neither: not stored
        (7, None, OUTCOME_UNKNOWN),  # one of the two: send it again
        (None, 3, OUTCOME_UNKNOWN),
        (7, OUTCOME_UNKNOWN, OUTCOME_UNKNOWN),
    ],
)
@pytest.mark.parametrize("retained_first", [False, True])
def test_both_answers_once_both_appends_answered(
    record: int | None, retained: int | None, expected: int | None, retained_first: bool
) -> None:
    got: list[int | None] = []
    both = Both(got.append)
    answers = [(both.record, record), (both.retained, retained)]
    for call, offset in reversed(answers) if retained_first else answers:
        assert got == []
        call(offset)
    assert got == [expected]
