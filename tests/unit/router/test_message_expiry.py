"""Message expiry [MQTT-3.3.2-5] / [MQTT-3.3.2-6] on the router's injected clock.

The expiry interval counts whole seconds of wall time since the record was appended; these
tests move the harness clock instead of sleeping (they were broker-process tests waiting
1.2-1.3 s for a second to pass). That the broker runs the router on the wall clock is seen
end to end by tests/integration/test_mqtt5.py and test_pubsub.py (a live and a replayed
delivery receive the interval decremented by the time the message was held).
"""

from __future__ import annotations

from broker.mqtt.properties import PropertyId
from tests.unit.router.conftest import Harness

EXPIRY = PropertyId.MESSAGE_EXPIRY_INTERVAL


def _publish_short_and_long(h: Harness, long: int) -> None:
    _, pub = h.connect("pub", 5)
    h.publish(pub, "exp/a", b"short-lived", 1, 1, properties={EXPIRY: 1})
    h.publish(pub, "exp/a", b"long-lived", 1, 2, properties={EXPIRY: long})
    h.run()


def test_replay_skips_an_expired_message_and_decrements_the_rest(h: Harness) -> None:
    _publish_short_and_long(h, 3600)
    early, s = h.connect("early", 5)
    h.subscribe(s, "$replay/earliest/exp/a", 1)
    assert [m.payload for m in early.take()] == [b"short-lived", b"long-lived"]
    h.tick(1.2)
    late, s = h.connect("late", 5)
    h.subscribe(s, "$replay/earliest/exp/a", 1)
    (m,) = late.take()
    assert m.payload == b"long-lived"  # the expired one is not delivered [MQTT-3.3.2-5]
    assert m.properties is not None
    assert m.properties[EXPIRY] == 3599  # less the whole seconds it was held [MQTT-3.3.2-6]


def test_expired_message_not_delivered_to_a_returning_session(h: Harness) -> None:
    link, s = h.connect("sub", 5, clean=False, expiry=300)
    h.subscribe(s, "exp/#", 1)
    h.disconnect(s, link)
    _publish_short_and_long(h, 600)
    h.tick(1.3)
    link, s = h.connect("sub", 5, clean=False, expiry=300)
    h.run()
    (m,) = link.take()
    assert m.payload == b"long-lived"  # s3.3.2.3.3: the expired one is not delivered
    assert m.properties is not None
    assert m.properties[EXPIRY] == 599
