"""One stalled subscriber must cost nothing to publishers or to other subscribers.

The stalled subscriber is a raw socket (hand-built MQTT 3.1.1 bytes, tests/mqttbytes.py) with a
tiny receive buffer that subscribes and then stops reading, so its TCP window closes and the
broker's per-connection buffer fills: the broker must pause that one connection and go on serving
everyone else at the same pace. Being a position in the log, the stalled subscriber still gets
every QoS 1 message once it reads again; a QoS 0 one that falls more than ``max_lag_records``
behind is handled by ``slow_qos0_policy`` ("drop" skips ahead, "disconnect" resets it).
"""

from __future__ import annotations

import socket
import struct
import time
import urllib.request
from typing import Any

import orjson

from tests.integration.clients import Client, mosquitto_sub
from tests.integration.conftest import BrokerFactory, BrokerProcess
from tests.mqttbytes import packet, split_packet, utf8

PAYLOAD = 4000  # bytes: more than the kernel buffers of a stalled socket (~4 MB) hold
N = 2500


class StalledSubscriber:
    """A 3.1.1 subscriber that can stop reading; parses PUBLISH and answers PUBACK."""

    def __init__(self, port: int, client_id: str, topic_filter: str, qos: int) -> None:
        self.sock = socket.socket()
        # A small receive buffer set before connect bounds the window the broker can fill.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        self.buf = b""
        # CONNECT: persistent session (clean session 0), keepalive 0 (never times out).
        self.sock.sendall(
            packet(0x10, utf8("MQTT") + bytes([4, 0x00]) + b"\x00\x00" + utf8(client_id))
        )
        assert self._next(5.0) == (0x20, b"\x00\x00"), "CONNACK accepted"
        self.sock.sendall(packet(0x82, b"\x00\x01" + utf8(topic_filter) + bytes([qos])))
        assert self._next(5.0) == (0x90, b"\x00\x01" + bytes([qos])), "SUBACK"

    def _next(self, timeout: float) -> tuple[int, bytes] | None:
        """The next packet (first byte, body), or None on timeout. Raises EOFError on close."""
        deadline = time.monotonic() + timeout
        while True:
            parsed = self._parse()
            if parsed is not None:
                return parsed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                return None
            if not chunk:
                raise EOFError
            self.buf += chunk

    def _parse(self) -> tuple[int, bytes] | None:
        parsed = split_packet(self.buf)
        if parsed is None:
            return None
        first, body, end = parsed
        self.buf = self.buf[end:]
        return first, body

    def read_publishes(self, want: int, timeout: float) -> list[int]:
        """Read PUBLISH packets (acknowledging QoS 1) until ``want`` arrived or the time is
        up; returns the sequence numbers in arrival order."""
        seqs: list[int] = []
        deadline = time.monotonic() + timeout
        while len(seqs) < want:
            got = self._next(max(0.0, deadline - time.monotonic()))
            if got is None:
                break
            first, body = got
            if first >> 4 != 3:
                continue
            tlen = struct.unpack_from("!H", body)[0]
            pos = 2 + tlen
            if (first >> 1) & 3:
                self.sock.sendall(b"\x40\x02" + body[pos : pos + 2])  # PUBACK
                pos += 2
            seqs.append(int(body[pos : pos + 8]))
        return seqs

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------- helpers


def sessions(broker: BrokerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(broker.http_url + "/api/v1/sessions", timeout=5) as r:
        return {s["client_id"]: s for s in orjson.loads(r.read())["sessions"]}


def payload(i: int) -> bytes:
    return b"%08d" % i + b"x" * (PAYLOAD - 8)


def publish_phase(pub: Client, healthy: Client, start: int, n: int) -> tuple[float, float]:
    """Publish ``n`` QoS 1 messages; returns (seconds until all were acknowledged, seconds
    until the healthy subscriber had them all, in order)."""
    t0 = time.monotonic()
    for i in range(start, start + n):
        pub.publish("load/t", payload(i), qos=1, wait=False)
    acked = None
    got: list[int] = []
    deadline = t0 + 30
    while len(got) < n or acked is None:
        assert time.monotonic() < deadline, f"healthy subscriber got {len(got)} of {n}"
        if acked is None and len(pub.published) >= start + n:
            acked = time.monotonic() - t0
        try:
            got.append(int(healthy.messages.get(timeout=0.05).payload[:8]))
        except Exception:  # queue.Empty
            continue
    assert got == list(range(start, start + n))
    return acked, time.monotonic() - t0


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


# ---------------------------------------------------------------- tests


def test_stalled_subscriber_does_not_slow_publisher_or_healthy_subscriber(
    broker_factory: BrokerFactory,
) -> None:
    # A quota of in-flight messages large enough that the stall is the TCP window's.
    broker = broker_factory(config="[router]\nmax_inflight = 65535\n")
    healthy = Client(broker.port, "healthy")
    assert healthy.connect() == 0
    healthy.subscribe("load/#", qos=1)
    pub = Client(broker.port, "pub")
    pub.paho.max_inflight_messages_set(200)
    assert pub.connect() == 0

    base_ack, base_recv = publish_phase(pub, healthy, 0, N)

    stalled = StalledSubscriber(broker.port, "stalled", "load/#", 1)
    try:
        stall_ack, stall_recv = publish_phase(pub, healthy, N, N)
        print(
            f"\n{N} x {PAYLOAD} B QoS 1: alone acked {base_ack:.2f}s received "
            f"{base_recv:.2f}s; with a stalled subscriber acked {stall_ack:.2f}s "
            f"received {stall_recv:.2f}s"
        )
        # The stalled one really is stalled: the broker stopped feeding it (it is behind).
        lag = sessions(broker)["stalled"]["positions"][0]["lag"]
        assert lag > N // 10, f"stalled subscriber only {lag} behind: not stalled"
        # Publisher and healthy subscriber keep their pace (generous bounds for shared CPUs).
        assert stall_ack < 3 * base_ack + 2.0
        assert stall_recv < 3 * base_recv + 2.0

        # The broker stays responsive: a new client round-trips, the admin API answers.
        t0 = time.monotonic()
        probe = Client(broker.port, "probe")
        assert probe.connect() == 0
        probe.subscribe("probe/x", qos=1)
        probe.publish("probe/x", "ping", qos=1)
        assert probe.expect(1)[0].payload == b"ping"
        assert time.monotonic() - t0 < 2.0
        probe.disconnect()

        # Reading again, the stalled subscriber gets every message, in order: a position in
        # the log loses nothing.
        seqs = stalled.read_publishes(N, timeout=30)
        assert seqs == list(range(N, 2 * N))
        wait_until(
            lambda: sessions(broker)["stalled"]["positions"][0]["lag"] == 0,
            5,
            "stalled subscriber caught up",
        )
    finally:
        stalled.close()
    pub.disconnect()
    healthy.disconnect()


def _qos0_setup(broker: BrokerProcess) -> tuple[StalledSubscriber, Client]:
    stalled = StalledSubscriber(broker.port, "slow0", "load/#", 0)
    pub = Client(broker.port, "pub")
    pub.paho.max_inflight_messages_set(200)
    assert pub.connect() == 0
    for i in range(N):
        pub.publish("load/t", payload(i), qos=1, wait=False)
    wait_until(lambda: len(pub.published) >= N, 30, "publishes acknowledged")
    return stalled, pub


def test_slow_qos0_policy_drop(broker_factory: BrokerFactory) -> None:
    max_lag = 200
    broker = broker_factory(
        config=f'[router]\nslow_qos0_policy = "drop"\nmax_lag_records = {max_lag}\n'
    )
    stalled, pub = _qos0_setup(broker)
    try:
        assert sessions(broker)["slow0"]["connected"] is True  # kept connected
        seqs = stalled.read_publishes(N, timeout=5)
        assert seqs, "it receives again once it reads"
        assert seqs == sorted(set(seqs)), "in order, no duplicates"
        assert seqs[-1] == N - 1, "it ends caught up with the newest message"
        assert len(seqs) < N, "records beyond max_lag_records were dropped"
        # What it got at the end is a contiguous run of at most max_lag_records.
        tail = 1
        while tail < len(seqs) and seqs[-tail - 1] == seqs[-tail] - 1:
            tail += 1
        assert tail <= max_lag
        assert sessions(broker)["slow0"]["positions"][0]["lag"] == 0
    finally:
        stalled.close()
    pub.disconnect()


def test_slow_qos0_policy_disconnect(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(
        config='[router]\nslow_qos0_policy = "disconnect"\nmax_lag_records = 200\n'
    )
    stalled, pub = _qos0_setup(broker)
    try:
        wait_until(
            lambda: sessions(broker)["slow0"]["connected"] is False,
            5,
            "the broker disconnects a QoS 0 subscriber too far behind",
        )
        assert "disconnecting (slow_qos0_policy)" in broker.log()

        # Reset, not a graceful close that would wait forever for a reader that is not
        # reading: the socket is gone while the client still has not read anything.
        def reset() -> bool:
            try:
                stalled.sock.send(b"\xc0\x00")  # PINGREQ
            except (ConnectionResetError, BrokenPipeError):
                return True
            time.sleep(0.05)
            return False

        wait_until(reset, 5, "connection reset by the broker")
        # The session (persistent) stays, offline, at its position.
        assert sessions(broker)["slow0"]["positions"][0]["lag"] > 0
    finally:
        stalled.close()
    pub.disconnect()


def test_qos0_replay_is_not_cut_by_the_slow_policy(broker_factory: BrokerFactory) -> None:
    # A $replay asks for the history: it is paced by its socket, the log is its buffer, so
    # the slow-subscriber policy (for live subscriptions) must not drop any of it.
    broker = broker_factory(config='[router]\nslow_qos0_policy = "drop"\nmax_lag_records = 200\n')
    pub = Client(broker.port, "pub")
    pub.paho.max_inflight_messages_set(200)
    assert pub.connect() == 0
    for i in range(N):
        pub.publish("hist/t", payload(i), qos=1, wait=False)
    wait_until(lambda: len(pub.published) >= N, 30, "publishes acknowledged")
    pub.disconnect()
    lines = mosquitto_sub(broker.port, "$replay/earliest/hist/#", N)  # QoS 0, the default
    assert [int(line.split()[1][:8]) for line in lines] == list(range(N))
