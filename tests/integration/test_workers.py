"""Several worker processes (``--workers 2``): what only shows with more than one.

The rest of the integration suite runs with one and with two workers (conftest.py); here:
the supervisor's view of the workers, a worker killed under load, and sessions moving
between workers as their clients reconnect (SO_REUSEPORT spreads connections by their
addresses, so a dozen reconnects land on both workers).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.commitlog import Streams, StreamSpec
from broker.mqtt.topics import topic_matches
from broker.workers.mesh import owner_of
from tests.integration.clients import V311, Client
from tests.integration.conftest import BrokerProcess
from tests.integration.rawclient import RawClient
from tests.integration.test_durability import replay_all
from tests.mqttbytes import PUBCOMP, PUBREC, PUBREL

STREAMS = '[[streams]]\nname = "telemetry"\ntopic_filter = ["devices/#"]\npartitions = 4\n'


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    b = BrokerProcess(tmp_path / "b", STREAMS, fsync="always", workers=2)
    b.start()
    yield b
    try:
        b.stop()
    except RuntimeError:
        b.kill()
        raise


def workers(broker: BrokerProcess) -> dict[int, tuple[int, list[str]]]:
    """Worker index -> (pid, partitions it owns), from the latest start's log lines."""
    found: dict[int, tuple[int, list[str]]] = {}
    for m in re.finditer(r"worker (\d+) \(pid (\d+)\): serving \S+; owns (.*)", broker.log()):
        found[int(m.group(1))] = (int(m.group(2)), m.group(3).split(", "))
    return found


def metric(broker: BrokerProcess, name: str) -> float:
    with urllib.request.urlopen(f"{broker.http_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_serve_shows_the_workers_and_each_partition_has_one_owner(broker: BrokerProcess) -> None:
    text = broker.log()
    assert "supervisor (pid" in text and "2 workers serving" in text
    found = workers(broker)
    assert sorted(found) == [0, 1]
    assert found[0][0] != found[1][0]
    owned = found[0][1] + found[1][1]
    expected = {"$retained/0", "$sessions/0", "$sys/0", "default/0"} | {
        f"telemetry/{p}" for p in range(4)
    }
    assert sorted(owned) == sorted(expected)  # each exactly once
    assert {p for p in found[0][1] if p.startswith("telemetry/")}  # both own a share
    assert {p for p in found[1][1] if p.startswith("telemetry/")}


@pytest.mark.slow  # a worker killed under load, then restarted
def test_a_killed_worker_is_restarted_and_nothing_acknowledged_is_lost(
    broker: BrokerProcess,
) -> None:
    topic = "devices/7/telemetry"
    specs = [StreamSpec("telemetry", ("devices/#",), 4)]
    with Streams(broker.data_dir, specs, matches=topic_matches) as streams:
        key = streams.partition_for(topic)
    victim = owner_of(key, 2)  # the worker that owns the partition being written
    pid = workers(broker)[victim][0]

    pub = Client(broker.port, "", V311)
    assert pub.connect() == 0
    mids: dict[int, int] = {}
    sent = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal sent
        while not stop.is_set() and sent < 600:
            mids[pub.paho.publish(topic, f"n{sent}", qos=1).mid] = sent
            sent += 1
            time.sleep(0.001)

    t = threading.Thread(target=load)
    t.start()
    deadline = time.monotonic() + 10
    while len(pub.published) < 100 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    stop.set()
    t.join()
    pub.paho.loop_stop()
    acked = sorted(mids[m] for m in set(pub.published) if m in mids)
    assert len(acked) >= 100

    # The supervisor starts it again; the partition recovers from its log.
    deadline = time.monotonic() + 20
    while workers(broker).get(victim, (pid,))[0] == pid:
        assert time.monotonic() < deadline, broker.log()
        time.sleep(0.05)
    assert re.search(
        rf"worker {victim} \(pid {pid}\) was killed by SIGKILL; restarting it", broker.log()
    )
    stored = [int(p[1:]) for p in replay_all(broker.port, topic)]
    assert stored == sorted(stored)
    assert set(acked) <= set(stored), sorted(set(acked) - set(stored))[:10]


def test_sessions_move_between_workers_without_loss_or_duplicates(broker: BrokerProcess) -> None:
    """A QoS 2 subscriber and a QoS 2 publisher reconnect a dozen times, each time leaving
    a flow half done; their sessions are handed from worker to worker, and every message
    arrives exactly once, in order."""
    sub = RawClient(broker.port, 5)
    sub.connect("roaming-sub", clean=False, session_expiry=600)
    sub.subscribe("devices/roam/#", 2)
    sub.close()
    received: list[bytes] = []
    for round_ in range(12):
        # The publisher: its QoS 2 PUBLISH is PUBREC'd, then it goes away before PUBREL and
        # resends it (DUP) after reconnecting, wherever it lands: stored once [MQTT-4.3.3-9].
        pub = RawClient(broker.port, 5)
        assert pub.connect("roaming-pub", clean=False, session_expiry=600)[1] == 0
        pub.publish("devices/roam/t", f"m{round_}".encode(), 2, 7, dup=round_ > 0)
        assert pub.expect(PUBREC).packet_id == 7
        pub.ack(PUBREL, 7)
        assert pub.expect(PUBCOMP).packet_id == 7
        pub.publish("devices/roam/t", f"half{round_}".encode(), 2, 7)
        assert pub.expect(PUBREC).packet_id == 7
        pub.close()
        pub = RawClient(broker.port, 5)
        assert pub.connect("roaming-pub", clean=False, session_expiry=600) == (True, 0)
        pub.publish("devices/roam/t", f"half{round_}".encode(), 2, 7, dup=True)
        assert pub.expect(PUBREC).packet_id == 7
        pub.ack(PUBREL, 7)
        assert pub.expect(PUBCOMP).packet_id == 7
        pub.disconnect()
        # The subscriber takes its messages; it acknowledges the first only.
        sub = RawClient(broker.port, 5)
        assert sub.connect("roaming-sub", clean=False, session_expiry=600)[0] is True
        first = sub.read_packet(10)
        d = sub.decode_publish(first)
        if d.dup:  # the one left unacknowledged last round, resent [MQTT-4.4.0-1]
            sub.ack(PUBREC, d.packet_id)
            assert sub.expect(PUBREL).packet_id == d.packet_id
            sub.ack(PUBCOMP, d.packet_id)
            received.append(d.payload)
            d = sub.deliveries(1)[0]
        sub.ack(PUBREC, d.packet_id)
        assert sub.expect(PUBREL).packet_id == d.packet_id
        sub.ack(PUBCOMP, d.packet_id)
        received.append(d.payload)
        (left,) = sub.deliveries(1)  # the second stays unacknowledged
        assert not left.dup
        sub.close()
    sub = RawClient(broker.port, 5)
    assert sub.connect("roaming-sub", clean=False, session_expiry=600)[0] is True
    (last,) = sub.deliveries(1)
    assert last.dup
    received.append(last.payload)
    sub.disconnect()
    expected = [f"{kind}{i}".encode() for i in range(12) for kind in ("m", "half")]
    assert received == expected
    assert replay_all(broker.port, "devices/roam/t")[:24] == expected
    assert metric(broker, "mqlog_session_handovers_total") > 0  # both workers were used


@pytest.mark.slow  # kills the worker that owns $retained, up to seven times
def test_a_retained_message_acknowledged_while_its_retained_owner_is_dead_is_retained(
    broker: BrokerProcess,
) -> None:
    """A retained QoS 1 PUBLISH whose own partition is on the live worker, sent right after
    the worker owning ``$retained`` was killed: its record is stored, its copy's forward is
    refused (that worker is dead). It must not be acknowledged then (the client sends it
    again), or, acknowledged, be retained for a new subscriber once the worker is back
    [MQTT-3.3.1-5]. Before 2026-11-29 (evening) it was acknowledged and lost."""
    owner = next(w for w, (_, parts) in workers(broker).items() if "$retained/0" in parts)
    live = 1 - owner
    topic = "state/x" if "default/0" in workers(broker)[live][1] else None
    specs = [StreamSpec("telemetry", ("devices/#",), 4)]
    with Streams(broker.data_dir, specs, matches=topic_matches) as streams:
        n = 0
        while topic is None:  # a topic of a partition the live worker owns
            if owner_of(streams.partition_for(f"devices/{n}/state"), 2) == live:
                topic = f"devices/{n}/state"
            n += 1
    refused = 0
    for attempt in range(7):  # the supervisor's delay before a restart grows: 0.1 s, 0.2...
        pid = workers(broker)[owner][0]
        os.kill(pid, signal.SIGKILL)
        acked = False
        for _ in range(100):  # the dead worker's listener may take a connection, reset
            try:
                c = RawClient(broker.port)
                assert c.connect(f"retainer{attempt}")[1] == 0
            except (ConnectionError, OSError):
                time.sleep(0.001)
                continue
            try:
                c.publish(topic, f"v{attempt}".encode(), 1, 1, retain=True)
                acked = c.expect(4, timeout=5).packet_id == 1  # PUBACK
            except (ConnectionError, OSError):
                pass  # closed without PUBACK: the client would send it again
            finally:
                c.close()
            break
        deadline = time.monotonic() + 20
        while workers(broker).get(owner, (pid,))[0] == pid:
            assert time.monotonic() < deadline, broker.log()
            time.sleep(0.05)
        time.sleep(0.5)  # its mesh and retained index up
        refused = len(
            re.findall(
                rf"\$retained/0: worker {owner} (?:is not reachable|went away); \d+ records",
                broker.log(),
            )
        )
        if acked:
            sub = RawClient(broker.port)
            sub.connect(f"reader{attempt}")
            sub.subscribe(topic, 1)
            got = sub.deliveries(1)[0]
            sub.close()
            assert (got.payload, got.retain) == (f"v{attempt}".encode(), True), attempt
        if refused:
            break
    assert refused, "the publish never fell while the $retained owner was down"
