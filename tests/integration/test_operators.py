"""Operators' habits (issue 24) against real brokers: who can reach a broker started from the
shipped file, Mosquitto's client lifecycle lines, a reason string on every refusal a 5.0 client
can be told, a DISCONNECT the client reads instead of a reset, and a persistent session that
only its owner may take."""

from __future__ import annotations

import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import orjson
import paho.mqtt.client as mqtt
import pytest

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import ROOT, BrokerFactory, BrokerProcess, free_port
from tests.integration.rawclient import open_session, raw_connect, read_packet
from tests.integration.test_auth import make_password_file
from tests.mqttbytes import connack5, connect5, disconnect5, packet, read_props, utf8, varint

REASON_STRING = 0x1F
ACL = """\
user alice
topic readwrite alice/#
user bob
topic readwrite bob/#
"""


def wait_for_log(broker: BrokerProcess, pattern: str, timeout: float = 10.0) -> str:
    """The first line of the broker's log matching ``pattern`` (a regex), once written."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(pattern, broker.log(), re.M)
        if found:
            return found.group(0)
        assert time.monotonic() < deadline, f"no log line {pattern!r} in:\n{broker.log()}"
        time.sleep(0.02)


# ------------------------------------------------------------------ who can reach it


def serve_shipped(tmp_path: Path, *flags: str) -> tuple[str, int]:
    """Start `mqlog serve -c config/broker.toml` (the shipped file, as `make run` does) on
    free ports; return its log up to the listening line, and the MQTT port."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "broker.cli",
        "serve",
        "-c",
        str(ROOT / "config" / "broker.toml"),
        "-p",
        str(port),
        "--http-port",
        str(free_port()),
        "--data-dir",
        str(tmp_path / "data"),
        "--workers",
        "1",
        *flags,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "listening on mqtt://" in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    return "".join(lines), port


def test_shipped_config_serves_this_machine_only(tmp_path: Path) -> None:
    log, port = serve_shipped(tmp_path)
    assert f"listening on mqtt://127.0.0.1:{port}" in log, log
    assert (
        "anonymous access and no password file: listening on 127.0.0.1 only (this machine); "
        "name an address with [server] host or --host" in log
    ), log
    assert "WARNING" not in log, log


def test_naming_an_address_with_anonymous_access_warns(tmp_path: Path) -> None:
    log, port = serve_shipped(tmp_path, "-h", "0.0.0.0")
    assert f"listening on mqtt://0.0.0.0:{port}" in log, log
    warning = next(line for line in log.splitlines() if "WARNING" in line)
    assert "MQTT on 0.0.0.0 with anonymous access: anyone who can reach this address" in warning
    assert "allow_anonymous = false" in warning


# ------------------------------------------------------------------ lifecycle lines


def test_connect_and_disconnect_lines_as_mosquitto_writes_them(
    broker: BrokerProcess,
) -> None:
    c = Client(broker.port, "sensor-7", V311, keepalive=60)
    c.paho.username_pw_set("alice", "any")  # no password file: names are not checked
    assert c.connect() == 0
    line = wait_for_log(broker, r"New client connected from .* as sensor-7 .*")
    local = c.paho.socket().getsockname()
    assert line.endswith(
        f"New client connected from 127.0.0.1:{local[1]} as sensor-7 (p2, c1, k60, u'alice')."
    ), line
    c.disconnect()
    wait_for_log(broker, r"Client sensor-7 disconnected\.$")

    v5 = Client(broker.port, "dev-5", V5, clean=False, session_expiry=60, keepalive=0)
    assert v5.connect() == 0
    assert wait_for_log(broker, r"as dev-5 .*$").endswith("as dev-5 (p5, c0, k0).")
    v5.drop()  # the socket closes without a DISCONNECT
    wait_for_log(broker, r"Client dev-5 closed its connection\.$")


def test_connection_messages_switch_silences_them(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(server="connection_messages = false\n")
    c = Client(broker.port, "quiet-1", V311)
    assert c.connect() == 0  # the line would be logged before the CONNACK is sent
    c.disconnect()
    loud = Client(broker.port, "quiet-2", V311)
    assert loud.connect() == 0
    loud.disconnect()
    assert "New client connected" not in broker.log()
    assert "Client quiet-1" not in broker.log()


# ------------------------------------------------------------------ graceful close


MAX_INFLIGHT = 3


def qos2_publish(topic: str, pid: int, payload: bytes) -> bytes:
    return packet(0x34, utf8(topic) + struct.pack("!H", pid) + varint(0) + payload)


def test_a_client_past_receive_maximum_reads_the_0x93(broker_factory: BrokerFactory) -> None:
    """A client still writing when the broker closes reads DISCONNECT 0x93 and its reason
    string, and none of its writes meets a connection reset (which makes a client library
    drop the connection unread): the broker sends, half-closes and drains the input."""
    broker = broker_factory(config=f"[router]\nmax_inflight = {MAX_INFLIGHT}\n")
    s, body = open_session(broker.port, connect5("flood"))
    assert connack5(body)[2][0x21] == MAX_INFLIGHT
    chunk = b"".join(qos2_publish("flood/x", 1 + i, b"x" * 512) for i in range(120))
    failed: list[OSError] = []

    def write() -> None:  # ~8 MB in 64 KB writes: still writing when the broker decides
        try:
            for _ in range(128):
                s.sendall(chunk)
        except OSError as e:
            failed.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        while True:
            first, body = read_packet(s, timeout=10)
            if first == 0xE0:
                break
            assert first == 0x50, f"expected PUBREC or DISCONNECT, got {first:#x}"
        code, props = disconnect5(first, body)
        assert code == 0x93
        assert "unacknowledged" in props[REASON_STRING]
    finally:
        writer.join(30)
        s.close()
    assert not failed, f"a write met {failed[0]!r}"
    wait_for_log(broker, r"Client flood disconnected: .* \(0x93\)\.$")


def test_paho_past_receive_maximum_is_told_0x93(broker_factory: BrokerFactory) -> None:
    """A real client (paho ignores the broker's Receive Maximum and keeps up to 1000 in
    flight here) bursting QoS 2 publishes reads the DISCONNECT and its reason code."""
    broker = broker_factory(config=f"[router]\nmax_inflight = {MAX_INFLIGHT}\n")
    told: list[tuple[int, Any]] = []
    gone = threading.Event()

    def on_disconnect(c: Any, u: Any, flags: Any, rc: Any, props: Any = None) -> None:
        told.append((int(rc.value), props))
        gone.set()

    paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, "paho-flood", protocol=V5)
    paho.max_inflight_messages_set(1000)
    paho.max_queued_messages_set(0)
    paho.on_disconnect = on_disconnect
    connected = threading.Event()
    paho.on_connect = lambda *_: connected.set()
    paho.connect("127.0.0.1", broker.port)
    paho.loop_start()
    try:
        # The flood starts once the CONNACK (and the Receive Maximum in it) arrived:
        # PUBLISHes read with the CONNECT, before it, are refused with the CONNECT (a
        # CONNACK 0x82: the connection's decoder counts them), not told 0x93.
        assert connected.wait(10), "no CONNACK"
        for _ in range(1000):
            paho.publish("flood/paho", b"y" * 512, qos=2)
            if gone.is_set():
                break
        assert gone.wait(20), "never disconnected"
        code, props = told[0]
        assert code == 0x93, told
        assert "unacknowledged" in props.ReasonString
    finally:
        paho.loop_stop()


# ------------------------------------------------------------------ reason strings


@pytest.fixture
def acl_broker(broker_factory: BrokerFactory, tmp_path: Path) -> BrokerProcess:
    pw = make_password_file(tmp_path / "passwd", {"alice": "a-pw", "bob": "b-pw"})
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    return broker_factory(
        config=(
            f'[auth]\nallow_anonymous = false\npassword_file = "{pw}"\nacl_file = "{acl}"\n'
            "max_failures = 100\n"
        )
    )


def login5(
    broker: BrokerProcess, client_id: str, user: str, password: str, flags: int = 0x02
) -> socket.socket:
    """A raw 5.0 CONNECT with a user and password (Request Problem Information left at its
    default, 1); returns the socket, the CONNACK not read yet."""
    body = (
        utf8("MQTT")
        + bytes([5, flags | 0x80 | 0x40])
        + (60).to_bytes(2, "big")
        + varint(5)
        + b"\x11"
        + struct.pack("!I", 600)  # Session Expiry Interval: persistent
        + utf8(client_id)
        + utf8(user)
        + utf8(password)
    )
    s = raw_connect(broker.port)
    s.sendall(packet(0x10, body))
    return s


def test_refusals_carry_a_reason_string(acl_broker: BrokerProcess) -> None:
    s = login5(acl_broker, "wrong", "alice", "nope")
    first, body = read_packet(s)
    _, code, props = connack5(body)
    assert (first, code) == (0x20, 0x86)
    assert "bad user name or password" in props[REASON_STRING]
    s.close()

    s = login5(acl_broker, "alice-5", "alice", "a-pw")
    assert connack5(read_packet(s)[1])[1] == 0
    # SUBSCRIBE: a $replay with a bad <from>, a filter the ACL does not grant, one it does
    filters = ["$replay/yesterday/alice/#", "bob/#", "alice/#"]
    payload = b"".join(utf8(f) + b"\x01" for f in filters)
    s.sendall(packet(0x82, b"\x00\x07" + varint(0) + payload))
    first, body = read_packet(s)
    assert first == 0x90 and body[:2] == b"\x00\x07"
    props, end = read_props(body, 2)
    assert list(body[end:]) == [0x8F, 0x87, 0x01]
    reason = props[REASON_STRING]
    assert "'$replay/yesterday/alice/#'" in reason and "'bob/#': not authorized" in reason
    # PUBLISH QoS 1 to a topic the ACL does not grant: PUBACK 0x87 with its reason
    s.sendall(packet(0x32, utf8("bob/x") + b"\x00\x09" + varint(0) + b"hi"))
    first, body = read_packet(s)
    assert first == 0x40 and body[:3] == b"\x00\x09\x87"
    assert read_props(body, 3)[0][REASON_STRING] == "not authorized to publish to 'bob/x'"
    s.close()


# ------------------------------------------------------------------ session ownership


def test_a_persistent_session_belongs_to_its_user(acl_broker: BrokerProcess) -> None:
    """bob cannot take alice's persistent session by its client id (3.1.1: CONNACK 2,
    5.0: 0x85 with a reason string, even with clean start); alice's queued message is
    there when she comes back."""
    alice = Client(acl_broker.port, "alice-phone", V311, clean=False)
    alice.paho.username_pw_set("alice", "a-pw")
    assert alice.connect() == 0
    assert alice.subscribe("alice/inbox", 1) == [1]
    alice.disconnect()
    pub = Client(acl_broker.port, "alice-laptop", V311)
    pub.paho.username_pw_set("alice", "a-pw")
    assert pub.connect() == 0
    pub.publish("alice/inbox", b"queued for alice", qos=1)
    pub.disconnect()

    bob = Client(acl_broker.port, "alice-phone", V311, clean=False)
    bob.paho.username_pw_set("bob", "b-pw")
    assert bob.connect() == 0x85  # paho reports 3.1.1's return code 2 (identifier rejected) so
    bob.paho.loop_stop()
    for flags in (0x00, 0x02):  # resume, then clean start (which would end her session)
        s = login5(acl_broker, "alice-phone", "bob", "b-pw", flags)
        _, code, props = connack5(read_packet(s)[1])
        assert code == 0x85
        assert props[REASON_STRING] == "this client id holds another user's session"
        s.close()
    assert "CONNECT as 'bob' refused: client id 'alice-phone' holds the session of 'alice'" in (
        acl_broker.log()
    )

    back = Client(acl_broker.port, "alice-phone", V311, clean=False)
    back.paho.username_pw_set("alice", "a-pw")
    assert back.connect() == 0 and back.session_present
    (msg,) = back.expect(1)
    assert (msg.topic, msg.payload) == ("alice/inbox", b"queued for alice")
    back.disconnect()


# ------------------------------------------------------------------ every worker counted


def test_healthz_counts_every_workers_clients(broker: BrokerProcess) -> None:
    """With two workers, SO_REUSEPORT spreads the 8 connections over both (all 8 on one
    has a chance of 1 in 128): /healthz adds up every worker's, not worker 0's alone."""
    clients = [Client(broker.port, f"health-{i}", V311, clean=False) for i in range(8)]
    for c in clients:
        assert c.connect() == 0
    with urllib.request.urlopen(broker.http_url + "/healthz", timeout=10) as resp:
        health = orjson.loads(resp.read())
    assert health["status"] == "ok"
    assert (health["connections"], health["sessions"]) == (8, 8), health
    if broker.workers > 1:
        assert health["workers_reporting"] == broker.workers
    for c in clients:
        c.disconnect()


# ------------------------------------------------------------------ $replay ;merge


def test_replay_merge_gives_one_time_line(broker_factory: BrokerFactory) -> None:
    """Nine messages over three topics in three partitions: `$replay/earliest;merge/...`
    returns them in publish order; a plain replay, partition by partition."""
    broker = broker_factory(
        config='[[streams]]\nname = "fleet"\ntopic_filter = "fleet/#"\npartitions = 3\n'
    )
    # three topics in three different partitions (crc32 % 3)
    topics: dict[int, str] = {}
    for i in range(100):
        topics.setdefault(zlib.crc32(f"fleet/d{i}".encode()) % 3, f"fleet/d{i}")
    pub = Client(broker.port, "merge-pub", V5)
    assert pub.connect() == 0
    sent = []
    for i in range(9):
        pub.publish(topics[i % 3], b"m%d" % i, qos=1)  # acknowledged: stored
        sent.append(b"m%d" % i)
        time.sleep(0.003)  # distinct broker timestamps (ms), not a wait for an event
    pub.disconnect()
    merged = Client(broker.port, "merge-sub", V5)
    assert merged.connect() == 0
    assert merged.subscribe("$replay/earliest;merge/fleet/#", 1) == [1]
    got = merged.expect(9)
    assert [m.payload for m in got] == sent
    assert {m.properties["UserProperty"][0][0] for m in got} == {"mqlog-partition"}
    plain = Client(broker.port, "plain-sub", V5)
    assert plain.connect() == 0
    assert plain.subscribe("$replay/earliest/fleet/#", 1) == [1]
    by_partition = [m.payload for m in plain.expect(9)]
    assert sorted(by_partition) == sorted(sent) and by_partition != sent


@pytest.mark.parametrize("problem_info", [1, 0])
def test_refused_replay_suback_reason_string_follows_problem_information(
    broker: BrokerProcess, problem_info: int
) -> None:
    """[MQTT-3.1.2-29]: a client asking for no problem information gets no Reason String on
    a SUBACK (it still gets the reason code)."""
    s, _ = open_session(
        broker.port, connect5(f"pi-{problem_info}", props=bytes([0x17, problem_info]))
    )
    s.sendall(packet(0x82, b"\x00\x05" + varint(0) + utf8("$replay/yesterday/a/#") + b"\x00"))
    first, body = read_packet(s)
    props, end = read_props(body, 2)
    assert (first, body[end:]) == (0x90, b"\x8f")
    if problem_info:
        assert props[REASON_STRING].startswith("'$replay/yesterday/a/#': ")
        assert "<from> must be earliest, latest" in props[REASON_STRING]
    else:
        assert REASON_STRING not in props
    s.close()
