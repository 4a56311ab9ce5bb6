"""Will messages (3.1.1 s3.1.2.5, 5.0 s3.1.2.5 and s3.1.3.2.2) against the real broker.

A watcher subscribes to the will topic; "not published" is checked by publishing a marker on
the same topic afterwards and seeing it arrive first, so no test waits on a guess.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import WORKERS, BrokerFactory, BrokerProcess
from tests.integration.rawclient import RawClient

VERSIONS = [pytest.param(4, id="v311"), pytest.param(5, id="v5")]
WILL = ("will/dev1", b"dev1 gone", 1, False)


def watch(port: int, topic: str = "will/#") -> Client:
    w = Client(port, "", V5)
    w.connect()
    w.subscribe(topic, qos=1)
    return w


def assert_no_will(port: int, w: Client, topic: str = "will/dev1") -> None:
    """The next message on the will topic is a marker published now: no will before it."""
    pub = Client(port, "", V5)
    pub.connect()
    pub.publish(topic, "marker", qos=1)
    (m,) = w.expect(1)
    assert m.payload == b"marker", f"will published: {m}"
    pub.disconnect()


@pytest.mark.parametrize("version", VERSIONS)
def test_will_on_socket_close_without_disconnect(broker: BrokerProcess, version: int) -> None:
    w = watch(broker.port)
    c = RawClient(broker.port, version)
    c.connect("dev1", will=WILL)
    c.close()  # [MQTT-3.1.2-8]: network connection closed without DISCONNECT
    (m,) = w.expect(1)
    assert (m.topic, m.payload, m.qos, m.retain) == ("will/dev1", b"dev1 gone", 1, False)
    assert_no_will(broker.port, w)  # published once, and removed [MQTT-3.1.2-10]


@pytest.mark.parametrize("version", VERSIONS)
def test_will_on_keepalive_timeout(broker: BrokerProcess, version: int) -> None:
    w = watch(broker.port)
    c = RawClient(broker.port, version)
    c.connect("dev1", keepalive=1, will=WILL)
    started = time.monotonic()
    # Silent client: closed after 1.5 x keepalive [MQTT-3.1.2-24], and its will goes out.
    (m,) = w.expect(1, timeout=5)
    assert m.payload == b"dev1 gone"
    assert time.monotonic() - started >= 1.4
    disc = c.closed_by_broker()
    if version == 5:
        assert disc is not None and disc.body[0] == 0x8D  # Keep Alive timeout
    else:
        assert disc is None


@pytest.mark.parametrize("version", VERSIONS)
def test_no_will_on_normal_disconnect(broker: BrokerProcess, version: int) -> None:
    w = watch(broker.port)
    c = RawClient(broker.port, version)
    c.connect("dev1", will=WILL)
    c.disconnect()  # [MQTT-3.1.2-10]: the will is deleted, not published
    assert_no_will(broker.port, w)


def test_will_on_disconnect_with_will_message_0x04(broker: BrokerProcess) -> None:
    w = watch(broker.port)
    c = RawClient(broker.port, 5)
    c.connect("dev1", will=WILL)
    c.disconnect(0x04)  # s3.14.2.1: Disconnect with Will Message
    (m,) = w.expect(1)
    assert m.payload == b"dev1 gone"


def test_paho_will_on_drop(broker: BrokerProcess) -> None:
    w = watch(broker.port)
    c = Client(broker.port, "paho-dev", V311, will=("will/paho", b"bye", 1, False))
    c.connect()
    c.drop()
    (m,) = w.expect(1)
    assert (m.topic, m.payload) == ("will/paho", b"bye")


@pytest.mark.parametrize(
    "workers", [n for n in WORKERS if n > 1], ids=[f"w{n}" for n in WORKERS if n > 1]
)
def test_will_delay_cancelled_by_reconnect(broker: BrokerProcess) -> None:
    """Only with several workers, where the reconnect may land on another worker than the
    one whose timer holds the will; on one router the same is checked on a fake clock
    (tests/unit/router/test_will.py::test_reconnect_within_delay_cancels_the_will)."""
    w = watch(broker.port)
    c = RawClient(broker.port, 5)
    c.connect("dev1", clean=False, session_expiry=60, will=WILL, will_delay=1)
    c.close()
    c = RawClient(broker.port, 5)
    # Reconnecting within the delay cancels the will [MQTT-3.1.3-9] (s3.1.3.2.2).
    assert c.connect("dev1", clean=False, session_expiry=60) == (True, 0)
    # Past the delay plus one timer tick (0.5 s): the only way to see a timer did *not* fire.
    time.sleep(1.7)
    assert_no_will(broker.port, w)
    c.disconnect()


def test_will_delay_publishes_after_the_delay(broker: BrokerProcess) -> None:
    w = watch(broker.port)
    c = RawClient(broker.port, 5)
    c.connect("dev1", clean=False, session_expiry=60, will=WILL, will_delay=1)
    c.close()
    closed = time.monotonic()
    (m,) = w.expect(1, timeout=5)
    assert m.payload == b"dev1 gone"
    assert time.monotonic() - closed >= 0.9  # not before the delay
    # The session itself lives on (expiry 60 s): its end is a separate event.
    c = RawClient(broker.port, 5)
    assert c.connect("dev1", clean=False, session_expiry=60) == (True, 0)
    c.disconnect()


def test_will_published_when_session_ends_before_the_delay(broker: BrokerProcess) -> None:
    """The will goes out at the earlier of delay and session end (s3.1.3.2.2)."""
    w = watch(broker.port)
    c = RawClient(broker.port, 5)
    c.connect("dev1", clean=False, session_expiry=1, will=WILL, will_delay=600)
    c.close()
    (m,) = w.expect(1, timeout=5)
    assert m.payload == b"dev1 gone"


def test_will_delay_with_session_expiry_zero_publishes_at_once(broker: BrokerProcess) -> None:
    w = watch(broker.port)
    c = RawClient(broker.port, 5)
    c.connect("dev1", will=WILL, will_delay=600)  # clean start, expiry 0: session ends now
    c.close()
    (m,) = w.expect(1, timeout=2)
    assert m.payload == b"dev1 gone"


@pytest.mark.parametrize("version", VERSIONS)
def test_retained_will(broker: BrokerProcess, version: int) -> None:
    live = watch(broker.port, "status/#")
    c = RawClient(broker.port, version)
    c.connect("dev1", will=("status/dev1", b"offline", 1, True))
    c.close()
    (m,) = live.expect(1)
    assert (m.topic, m.payload) == ("status/dev1", b"offline")
    late = watch(broker.port, "status/#")
    (r,) = late.expect(1)
    assert (r.payload, r.retain) == (b"offline", True)  # kept as retained [MQTT-3.1.2-17]
    late.disconnect()
    live.disconnect()


def test_will_on_takeover_of_connection_with_will(broker: BrokerProcess) -> None:
    """A takeover closes the old connection without DISCONNECT: its will (no delay) is
    published (5.0 s3.1.4 and s4.13), and the new connection's own will is kept."""
    w = watch(broker.port)
    first = RawClient(broker.port, 5)
    first.connect("dev1", clean=False, session_expiry=60, will=WILL)
    second = RawClient(broker.port, 5)
    second.connect(
        "dev1", clean=False, session_expiry=60, will=("will/dev1", b"second gone", 1, False)
    )
    (m,) = w.expect(1)
    assert m.payload == b"dev1 gone"
    second.close()
    (m2,) = w.expect(1)
    assert m2.payload == b"second gone"


def test_will_of_client_connected_when_broker_is_killed_comes_after_restart(
    broker_factory: BrokerFactory,
) -> None:
    """s3.1.2.5: the server may defer a will to its next start; it must not lose it."""
    broker = broker_factory(fsync="always")
    c = RawClient(broker.port, 5)
    c.connect("dev1", clean=False, session_expiry=600, will=WILL)
    c.subscribe("x/#", 1)  # a round trip after CONNECT; the session is written by the tick
    deadline = time.monotonic() + 5
    while "dev1" not in (broker.data_dir / "$sessions" / "0").joinpath(
        "00000000000000000000.log"
    ).read_bytes().decode("latin-1"):
        assert time.monotonic() < deadline, "session never written"
        time.sleep(0.05)
    broker.kill()
    c.close()
    broker.start()
    w = watch(broker.port, "$replay/earliest/will/#")
    (m,) = w.expect(1, timeout=5)
    assert (m.topic, m.payload) == ("will/dev1", b"dev1 gone")


def test_delayed_will_pending_at_shutdown_is_published_after_restart(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory()
    c = RawClient(broker.port, 5)
    c.connect("dev1", clean=False, session_expiry=600, will=WILL, will_delay=1)
    c.close()
    broker.restart()  # well within the delay
    w = watch(broker.port, "$replay/earliest/will/#")
    (m,) = w.expect(1, timeout=5)
    assert m.payload == b"dev1 gone"
