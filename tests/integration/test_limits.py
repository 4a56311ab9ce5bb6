"""[router] limits from the config file, enforced on real clients.

(keepalive_min/max and connect_timeout: test_connect.py; max_packet_size: test_malformed.py;
max_inflight as Receive Maximum: test_mqtt5.py.)
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import BrokerFactory, BrokerProcess
from tests.integration.rawclient import open_session, raw_connect, read_packet, wait_closed
from tests.mqttbytes import connack5, connect5, connect311, disconnect5, packet, utf8

MAX_TOPIC_LENGTH = 32
MAX_TOPIC_LEVELS = 4
MAX_INFLIGHT = 2


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory, module_workers: int) -> Iterator[BrokerProcess]:
    b = BrokerProcess(
        Path(tmp_path_factory.mktemp("limits")),
        (
            f"[router]\nmax_topic_length = {MAX_TOPIC_LENGTH}\n"
            f"max_topic_levels = {MAX_TOPIC_LEVELS}\nmax_inflight = {MAX_INFLIGHT}\n"
            "session_expiry_max = 60\n"
        ),
        workers=module_workers,
    )
    b.start()
    yield b
    b.stop()


# ------------------------------------------------------------------ max_connections


def test_max_connections(broker_factory: BrokerFactory) -> None:
    b = broker_factory(config="[router]\nmax_connections = 3\n")
    clients = [Client(b.port, f"c{i}", V311) for i in range(3)]
    for c in clients:
        assert c.connect() == 0
    clients[0].subscribe("mc/#", 1)
    # 3.1.1: return code 3, server unavailable; then closed
    s = raw_connect(b.port)
    s.sendall(connect311("c3"))
    assert wait_closed(s)[0].hex() == "20020003"
    s.close()
    # 5.0: reason 0x89, server busy
    s = raw_connect(b.port)
    s.sendall(connect5("c4"))
    out, _ = wait_closed(s)
    assert out[0] == 0x20 and connack5(out[2:])[:2] == (0, 0x89)
    s.close()
    # Real clients see the refusal too.
    for version, words in [("mqttv311", "unavailable"), ("mqttv5", "busy")]:
        proc = subprocess.run(
            [
                "mosquitto_pub",
                "-h",
                "127.0.0.1",
                "-p",
                str(b.port),
                "-t",
                "mc/y",
                "-m",
                "no",
                "-V",
                version,
            ],
            capture_output=True,
            text=True,
            timeout=15,
        )
        assert proc.returncode != 0 and words in proc.stderr.lower(), proc.stderr
    # A takeover replaces a connection: allowed at the limit [MQTT-3.1.4-3].
    again = Client(b.port, "c2", V311)
    assert again.connect() == 0
    assert clients[2].disconnects.get(timeout=5) != 0  # the old one was closed
    # The connected clients are unaffected.
    clients[1].publish("mc/x", "ok", qos=1)
    assert clients[0].expect(1)[0].payload == b"ok"
    # A freed slot is usable again.
    clients[1].disconnect()
    late = Client(b.port, "late", V5)
    for _ in range(50):  # the broker counts the slot free once it saw the close
        if late.connect() == 0:
            break
        late.paho.loop_stop()
        late = Client(b.port, "late", V5)
    else:
        raise AssertionError("slot never freed")
    late.disconnect()
    clients[0].disconnect()
    again.disconnect()


# ------------------------------------------------------------------ topic length and levels


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize(
    ("topic", "ok"),
    [
        pytest.param("t" * MAX_TOPIC_LENGTH, True, id="at-length"),
        pytest.param("t" * (MAX_TOPIC_LENGTH + 1), False, id="over-length"),
        # 16 x U+00E9 is 16 characters but 32 bytes; 17 of them are 34 bytes: the limit is bytes
        pytest.param("\u00e9" * 16, True, id="multibyte-at-length"),
        pytest.param("\u00e9" * 17, False, id="multibyte-over-length"),
        pytest.param("a/b/c/d", True, id="at-levels"),
        pytest.param("a/b/c/d/e", False, id="over-levels"),
    ],
)
def test_publish_topic_limits(mb: BrokerProcess, version: int, topic: str, ok: bool) -> None:
    s, _ = open_session(mb.port, connect5("tl") if version == 5 else connect311("tl"))
    props = b"\x00" if version == 5 else b""
    # PUBLISH QoS 1, id 1
    s.sendall(packet(0x32, utf8(topic) + bytes.fromhex("0001") + props + b"x"))
    if ok:
        first, body = read_packet(s)
        assert first == 0x40 and body[:2] == b"\x00\x01"
    else:
        out, _ = wait_closed(s)
        if version == 5:
            assert disconnect5(out[0], out[2:])[0] == 0x90  # Topic Name invalid
        else:
            assert out == b""
    s.close()


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize(
    ("topic_filter", "ok"),
    [
        pytest.param("f" * MAX_TOPIC_LENGTH, True, id="at-length"),
        pytest.param("f" * (MAX_TOPIC_LENGTH + 1), False, id="over-length"),
        pytest.param("a/+/c/#", True, id="at-levels"),
        pytest.param("a/+/c/d/#", False, id="over-levels"),
        # the $share/<group>/ prefix is not a level of the filter
        pytest.param("$share/g/a/b/c/d", True, id="shared-at-levels"),
        pytest.param("$share/g/a/b/c/d/e", False, id="shared-over-levels"),
    ],
)
def test_subscribe_filter_limits(
    mb: BrokerProcess, version: int, topic_filter: str, ok: bool
) -> None:
    s, _ = open_session(mb.port, connect5("fl") if version == 5 else connect311("fl"))
    props = b"\x00" if version == 5 else b""
    # SUBSCRIBE id 5, a valid filter 'ok' then the one under test, both QoS 1
    s.sendall(
        packet(
            0x82,
            bytes.fromhex("0005") + props + utf8("ok") + b"\x01" + utf8(topic_filter) + b"\x01",
        )
    )
    first, body = read_packet(s)
    assert first == 0x90 and body[:2] == b"\x00\x05"
    codes = body[-2:]
    refused = 0x8F if version == 5 else 0x80  # Topic Filter invalid / 3.1.1 failure
    assert codes == bytes([1, 1 if ok else refused])
    s.sendall(bytes.fromhex("c000"))
    assert read_packet(s) == (0xD0, b"")  # a refused filter does not close the connection
    s.close()


# ------------------------------------------------------------------ max_inflight, 3.1.1


def test_max_inflight_bounds_311_deliveries(mb: BrokerProcess) -> None:
    s, _ = open_session(mb.port, connect311("inflight311"))
    s.sendall(packet(0x82, bytes.fromhex("0001") + utf8("mi/#") + b"\x01"))
    assert read_packet(s) == (0x90, bytes.fromhex("000101"))
    pub = Client(mb.port, "inflight-pub", V311)
    assert pub.connect() == 0
    for i in range(4):
        pub.publish("mi/a", str(i), qos=1)
    got = [read_packet(s) for _ in range(MAX_INFLIGHT)]
    s.settimeout(0.4)
    with pytest.raises(TimeoutError):
        s.recv(1)  # no third unacknowledged delivery
    # PUBACK the first: one more comes
    s.sendall(bytes.fromhex("4002") + got[0][1][6:8])  # body: 00 04 'mi/a' | id | payload
    first, body = read_packet(s)
    assert first == 0x32 and body[-1:] == b"2"
    s.close()
    pub.disconnect()


# ------------------------------------------------------------------ session_expiry_max


def test_session_expiry_clamped_and_announced(mb: BrokerProcess) -> None:
    # CONNECT with Session Expiry Interval 100000 (11 000186a0)
    s, body = open_session(mb.port, connect5("se", props=bytes.fromhex("11000186a0")))
    assert connack5(body)[2][0x11] == 60  # s3.2.2.3.2: the server's value wins
    s.close()
    s, body = open_session(mb.port, connect5("se2", props=bytes.fromhex("110000001e")))
    assert 0x11 not in connack5(body)[2]  # 30 s is within the limit: nothing to announce
    s.close()
