"""CONNECT / CONNACK, keepalive, PINGREQ, DISCONNECT and takeover against the real broker.

Raw sockets carry hand-built bytes (tests/mqttbytes.py, written from the spec);
paho covers what a real client library does with the answers.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import BrokerFactory, BrokerProcess
from tests.integration.rawclient import open_session, raw_connect, read_packet, wait_closed
from tests.mqttbytes import connack5, connect5, connect311, disconnect5, packet


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory, module_workers: int) -> Iterator[BrokerProcess]:
    """One broker for the tests of this module that need no special configuration."""
    b = BrokerProcess(Path(tmp_path_factory.mktemp("connect")), workers=module_workers)
    b.start()
    yield b
    b.stop()


def refused(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything received until the broker closes."""
    s = raw_connect(port)
    s.sendall(data)
    out, _ = wait_closed(s)
    s.close()
    return out


# ------------------------------------------------------------------ protocol name and level


def test_311_connect_accepted(mb: BrokerProcess) -> None:
    s, body = open_session(mb.port, connect311("c311"))
    assert body == bytes.fromhex("0000")  # no session present, return code 0
    s.close()


def test_mqisdp_level_3_accepted(mb: BrokerProcess) -> None:
    # 10 len | 00 06 'MQIsdp' | 03 level 3.1 | 02 clean | 00 3c keepalive | 00 02 'c3'
    body = bytes.fromhex("00064d51497364700302003c00026333")
    s, ack = open_session(mb.port, packet(0x10, body))
    assert ack == bytes.fromhex("0000")
    s.sendall(bytes.fromhex("c000"))  # PINGREQ
    assert read_packet(s) == (0xD0, b"")  # PINGRESP [MQTT-3.12.4-1]
    s.close()


@pytest.mark.parametrize(
    ("body", "answer"),
    [
        # 'MQTT' level 6 (a future version): 5.0-form CONNACK, reason 0x84 [MQTT-3.1.2-2]
        pytest.param("00044d5154540602003c0000", "2003008400", id="mqtt-level-6"),
        # 'MQTT' level 3 (3.1 uses 'MQIsdp'): 3.1.1 CONNACK return code 1
        pytest.param("00044d5154540302003c0000", "20020001", id="mqtt-level-3"),
        # 'MQIsdp' level 4
        pytest.param("00064d51497364700402003c0000", "20020001", id="mqisdp-level-4"),
        # protocol name 'MQTX'
        pytest.param("00044d5154580402003c0000", "20020001", id="name-mqtx"),
    ],
)
def test_unsupported_protocol_refused_then_closed(
    mb: BrokerProcess, body: str, answer: str
) -> None:
    assert refused(mb.port, packet(0x10, bytes.fromhex(body))).hex() == answer


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(0x03, id="reserved-bit"),  # [MQTT-3.1.2-3]
        pytest.param(0x0A, id="will-qos-without-will"),  # [MQTT-3.1.2-13]
        pytest.param(0x22, id="will-retain-without-will"),  # [MQTT-3.1.2-15]
        pytest.param(0x1E, id="will-qos-3"),  # [MQTT-3.1.2-14]
    ],
)
def test_bad_connect_flags_close_311(mb: BrokerProcess, flags: int) -> None:
    # Will flags set need will topic/payload; give them so only the flag rule is broken.
    extra = bytes.fromhex("0001770000") if flags & 0x04 else b""
    data = connect311("flags", flags=flags)
    data = packet(0x10, data[2:] + extra)
    assert refused(mb.port, data) == b""  # 3.1.1: no CONNACK code for it, just close


def test_password_without_username(mb: BrokerProcess) -> None:
    # flags 0x42: password, clean; payload: client id 'pw', password 00 02 'pw'
    pw = bytes.fromhex("0002") + b"pw"
    assert refused(mb.port, packet(0x10, connect311("pw", flags=0x42)[2:] + pw)) == b""
    # 5.0 allows a password without a user name (s3.1.2.9)
    s, body = open_session(mb.port, packet(0x10, connect5("pw5", flags=0x42)[2:] + pw))
    assert connack5(body)[:2] == (0, 0)
    s.close()


def test_reserved_flag_5_gets_connack_malformed(mb: BrokerProcess) -> None:
    out = refused(mb.port, connect5("flags5", flags=0x03))
    assert out == bytes.fromhex("2003008100")  # CONNACK 0x81, then close


@pytest.mark.parametrize(
    ("will", "answer5"),
    [
        pytest.param("0003612f23000178", "2003009000", id="will-topic-wildcard"),
        pytest.param("0000000178", "2003009000", id="will-topic-empty"),
    ],
)
def test_invalid_will_topic_refused(mb: BrokerProcess, will: str, answer5: str) -> None:
    # flags 0x06: will flag, clean; a will published later must have a valid topic name
    w = bytes.fromhex(will)
    assert refused(mb.port, packet(0x10, connect311("badwill", flags=0x06)[2:] + w)) == b""
    out = refused(mb.port, packet(0x10, connect5("badwill", flags=0x06)[2:] + b"\x00" + w))
    assert out.hex() == answer5  # CONNACK 0x90 Topic Name invalid


def test_will_response_topic_with_wildcard_refused(mb: BrokerProcess) -> None:
    # will properties: 08 0001 '#' (Response Topic); will topic 'a', payload 'x'
    w = bytes.fromhex("0408000123000161000178")
    out = refused(mb.port, packet(0x10, connect5("badresp", flags=0x06)[2:] + w))
    assert out.hex() == "2003008200"


def test_will_flag_consistency_accepted(mb: BrokerProcess) -> None:
    # flags 0x2e: will retain, will QoS 1, will flag, clean; will topic 'w', payload 'x'
    body = connect311("willok", flags=0x2E)[2:] + bytes.fromhex("000177000178")
    s, ack = open_session(mb.port, packet(0x10, body))
    assert ack == bytes.fromhex("0000")
    s.close()


# ------------------------------------------------------------------ client identifier


def test_311_empty_id_needs_clean_session(mb: BrokerProcess) -> None:
    # [MQTT-3.1.3-8]: empty id with CleanSession = 0 -> return code 0x02, then close.
    assert refused(mb.port, connect311("", flags=0x00)).hex() == "20020002"
    s, ack = open_session(mb.port, connect311("", flags=0x02))  # [MQTT-3.1.3-6]
    assert ack == bytes.fromhex("0000")
    s.close()


def test_5_empty_id_gets_assigned_identifier(mb: BrokerProcess) -> None:
    s, body = open_session(mb.port, connect5(""))
    flags, reason, props = connack5(body)
    assert (flags, reason) == (0, 0)
    assigned = props[0x12]  # Assigned Client Identifier [MQTT-3.2.2-16]
    assert assigned and isinstance(assigned, str)
    s.close()
    s2, body2 = open_session(mb.port, connect5(""))
    assert connack5(body2)[2][0x12] != assigned  # unique per connection
    s2.close()
    c = Client(mb.port, "", V5)
    assert c.connect() == 0
    assert c.connack_properties["AssignedClientIdentifier"]
    c.disconnect()


def test_5_given_id_gets_no_assigned_identifier(mb: BrokerProcess) -> None:
    s, body = open_session(mb.port, connect5("given"))
    _, _, props = connack5(body)
    assert 0x12 not in props
    assert props[0x21] >= 1 and props[0x27] >= 64 and props[0x22] >= 1  # our limits
    s.close()


# ------------------------------------------------------------------ sessions


@pytest.mark.parametrize("protocol", [V311, V5])
def test_session_present_flag(mb: BrokerProcess, protocol: int) -> None:
    cid = f"sp-{protocol}"
    expiry = 300 if protocol == V5 else None
    c = Client(mb.port, cid, protocol, clean=False, session_expiry=expiry)
    assert c.connect() == 0
    assert c.session_present is False  # no session existed [MQTT-3.2.2-3]
    c.subscribe("sp/#", 1)
    c.disconnect()
    c = Client(mb.port, cid, protocol, clean=False, session_expiry=expiry)
    assert c.connect() == 0
    assert c.session_present is True  # [MQTT-3.2.2-3]
    c.disconnect()
    c = Client(mb.port, cid, protocol, clean=True, session_expiry=expiry)
    assert c.connect() == 0
    assert c.session_present is False  # clean start discards it [MQTT-3.1.2-4]
    c.disconnect()


def test_second_connect_is_a_protocol_error(mb: BrokerProcess) -> None:
    s, _ = open_session(mb.port, connect5("twice"))
    s.sendall(connect5("twice"))  # [MQTT-3.1.0-2]
    out, _ = wait_closed(s)
    assert disconnect5(out[0], out[2:])[0] == 0x82
    s.close()


def test_takeover_311_closes_old_connection(mb: BrokerProcess) -> None:
    old, _ = open_session(mb.port, connect311("take311"))
    new, ack = open_session(mb.port, connect311("take311"))
    assert ack == bytes.fromhex("0000")
    assert wait_closed(old)[0] == b""  # [MQTT-3.1.4-3]: closed, 3.1.1 has no DISCONNECT
    new.sendall(bytes.fromhex("c000"))
    assert read_packet(new) == (0xD0, b"")  # the new one is alive
    new.close()
    old.close()


def test_takeover_5_sends_0x8e_to_old_connection(mb: BrokerProcess) -> None:
    old, _ = open_session(mb.port, connect5("take5"))
    new, ack = open_session(mb.port, connect5("take5"))
    assert connack5(ack)[:2] == (0, 0)  # clean start: no session present
    out, _ = wait_closed(old)
    assert disconnect5(out[0], out[2:])[0] == 0x8E  # Session taken over [MQTT-3.1.4-3]
    new.sendall(bytes.fromhex("c000"))
    assert read_packet(new) == (0xD0, b"")
    new.close()
    old.close()


# ------------------------------------------------------------------ DISCONNECT


def test_disconnect_with_will_reason_publishes_will(mb: BrokerProcess) -> None:
    watcher = Client(mb.port, "will-watch", V5)
    watcher.connect()
    watcher.subscribe("lastwill/#", 1)
    # flags 0x0e: will QoS 1, will flag, clean start; will props empty; topic, payload
    will = (
        bytes.fromhex("00")
        + bytes.fromhex("000a")
        + b"lastwill/a"
        + bytes.fromhex("0004")
        + b"gone"
    )
    normal = packet(0x10, connect5("w-normal", flags=0x0E)[2:] + will)
    s, _ = open_session(mb.port, normal)
    s.sendall(bytes.fromhex("e00100"))  # DISCONNECT 0x00: will discarded [MQTT-3.1.2-10]
    assert wait_closed(s)[0] == b""
    s.close()
    with_will = packet(0x10, connect5("w-will", flags=0x0E)[2:] + will)
    s, _ = open_session(mb.port, with_will)
    s.sendall(bytes.fromhex("e00104"))  # DISCONNECT 0x04: disconnect with will message
    assert wait_closed(s)[0] == b""
    s.close()
    (msg,) = watcher.expect(1)
    assert msg.payload == b"gone"
    watcher.expect_none(0.3)  # the normal disconnect published nothing
    watcher.disconnect()


def test_disconnect_cannot_set_expiry_after_zero(mb: BrokerProcess) -> None:
    s, _ = open_session(mb.port, connect5("exp0"))  # Session Expiry 0 (absent)
    # DISCONNECT 0x00 with Session Expiry Interval 16 (11 00000010) [MQTT-3.14.2-2]
    s.sendall(bytes.fromhex("e00700051100000010"))
    out, _ = wait_closed(s)
    assert disconnect5(out[0], out[2:])[0] == 0x82
    s.close()
    s, _ = open_session(mb.port, connect5("exp10", props=bytes.fromhex("110000000a")))
    s.sendall(bytes.fromhex("e00700051100000010"))  # 10 -> 16 is allowed
    assert wait_closed(s)[0] == b""  # the server sends nothing back [MQTT-3.14.4-1]
    s.close()


def test_disconnect_with_invalid_reason_code(mb: BrokerProcess) -> None:
    s, _ = open_session(mb.port, connect5("badcode"))
    s.sendall(bytes.fromhex("e00105"))  # 0x05 is no DISCONNECT reason code (s3.14.2.1)
    out, _ = wait_closed(s)
    assert disconnect5(out[0], out[2:])[0] in (0x81, 0x82)
    s.close()


def test_shutdown_sends_0x8b(broker_factory: BrokerFactory) -> None:
    b = broker_factory()
    s5, _ = open_session(b.port, connect5("bye5"))
    s4, _ = open_session(b.port, connect311("bye4"))
    assert b.stop() == 0
    out, _ = wait_closed(s5)
    assert disconnect5(out[0], out[2:])[0] == 0x8B  # Server shutting down
    assert wait_closed(s4)[0] == b""
    s5.close()
    s4.close()


def test_paho_disconnect_with_reason_code(mb: BrokerProcess) -> None:
    from paho.mqtt.reasoncodes import ReasonCode as PahoReason

    c = Client(mb.port, "paho-disc", V5)
    assert c.connect() == 0
    props = Properties(PacketTypes.DISCONNECT)
    props.UserProperty = ("why", "test")
    c.paho.disconnect(
        reasoncode=PahoReason(PacketTypes.DISCONNECT, "Normal disconnection"), properties=props
    )
    assert c.disconnects.get(timeout=5) == 0
    c.paho.loop_stop()


# ------------------------------------------------------------------ keepalive
# The real timer, end to end: a silent client is closed. That a PINGREQ (any byte) restarts
# the timer and that keepalive 0 never expires are checked on a fake clock, without waiting
# 2-4 s here: tests/unit/net/test_keepalive.py (test_any_packet_restarts_the_keepalive_timer,
# test_a_live_client_is_looked_at_once_per_one_and_a_half_keepalive,
# test_keepalive_zero_leaves_the_wheel).


def test_keepalive_closes_after_one_and_a_half_times(mb: BrokerProcess) -> None:
    s, _ = open_session(mb.port, connect311("ka1", keepalive=1))
    out, took = wait_closed(s, timeout=5)
    assert out == b""
    # [MQTT-3.1.2-24]: 1.5 s without a packet; timers run every 0.5 s.
    assert 1.0 <= took <= 2.8, took
    s.close()


def test_keepalive_5_sends_disconnect_0x8d(mb: BrokerProcess) -> None:
    s, _ = open_session(mb.port, connect5("ka5", keepalive=1))
    out, took = wait_closed(s, timeout=5)
    assert disconnect5(out[0], out[2:])[0] == 0x8D  # Keep Alive timeout
    assert 1.0 <= took <= 2.8, took
    s.close()


def test_keepalive_bounds(broker_factory: BrokerFactory) -> None:
    b = broker_factory(config="[router]\nkeepalive_min = 2\nkeepalive_max = 10\n")
    # 5.0: clamped and told in Server Keep Alive [MQTT-3.2.2-21]
    s, body = open_session(b.port, connect5("kmax", keepalive=60))
    assert connack5(body)[2][0x13] == 10
    s.close()
    s, body = open_session(b.port, connect5("kzero", keepalive=0))
    assert connack5(body)[2][0x13] == 2
    s.close()
    s, body = open_session(b.port, connect5("kok", keepalive=5))
    assert 0x13 not in connack5(body)[2]
    s.close()
    # 3.1.1 cannot be told: refused with return code 2, then closed
    assert refused(b.port, connect311("k311", keepalive=60)).hex() == "20020002"
    assert refused(b.port, connect311("k311", keepalive=0)).hex() == "20020002"
    s, body = open_session(b.port, connect311("k311", keepalive=5))
    assert body == bytes.fromhex("0000")
    s.close()
    c = Client(b.port, "paho-kmax", V5, keepalive=60)
    assert c.connect() == 0
    assert c.connack_properties["ServerKeepAlive"] == 10
    c.disconnect()


def test_connect_timeout(broker_factory: BrokerFactory) -> None:
    b = broker_factory(config="[router]\nconnect_timeout = 1\n")
    s = raw_connect(b.port)
    out, took = wait_closed(s, timeout=5)  # s3.1.4: no CONNECT in time -> closed
    assert out == b""
    assert 0.9 <= took <= 2.8, took
    s.close()
    s = raw_connect(b.port)
    s.sendall(connect311("late")[:5])  # a partial CONNECT does not count
    assert wait_closed(s, timeout=5)[0] == b""
    s.close()


def test_connected_client_survives_connect_timeout(broker_factory: BrokerFactory) -> None:
    b = broker_factory(config="[router]\nconnect_timeout = 1\n")
    c = Client(b.port, "stays", V311, keepalive=60)
    assert c.connect() == 0
    c.subscribe("stay/#", 1)
    s = raw_connect(b.port)
    wait_closed(s, timeout=5)
    s.close()
    c.publish("stay/1", "still here", qos=1)
    assert c.expect(1)[0].payload == b"still here"
    c.disconnect()


def test_connection_refused_by_socket_errors_are_isolated(mb: BrokerProcess) -> None:
    # A client that resets its socket mid-CONNECT hurts no one else.
    s = raw_connect(mb.port)
    s.sendall(connect311("reset")[:7])
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()  # RST
    c = Client(mb.port, "after-reset", V311)
    assert c.connect() == 0
    c.disconnect()
