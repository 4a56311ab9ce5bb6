"""Bad input on a raw socket closes that connection only, with the right reason code.

Each case: a raw client connects, publishes one QoS 1 message and waits for its PUBACK,
then sends one bad packet (hand-written hex). The broker must answer a 5.0 client with
DISCONNECT and the reason code, close a 3.1.1 client without a word (3.1.1 s4.8), keep
serving a paho client connected all along, and deliver the acknowledged message [MQTT-4.3.2-2].
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.clients import V5, Client
from tests.integration.conftest import BrokerProcess
from tests.integration.rawclient import open_session, raw_connect, read_packet, wait_closed
from tests.mqttbytes import connect5, connect311, disconnect5, packet

MAX_PACKET = 2048


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory, module_workers: int) -> Iterator[BrokerProcess]:
    b = BrokerProcess(
        Path(tmp_path_factory.mktemp("malformed")),
        f"[router]\nmax_packet_size = {MAX_PACKET}\n",
        workers=module_workers,
    )
    b.start()
    yield b
    b.stop()


@pytest.fixture
def bystander(mb: BrokerProcess) -> Iterator[Client]:
    c = Client(mb.port, "bystander", V5)
    assert c.connect() == 0
    assert c.subscribe("by/#", qos=1) == [1]
    yield c
    c.disconnect()


# (bad packet for 3.1.1, bad packet for 5.0, reason code for 5.0)
CASES = [
    pytest.param(
        # PUBLISH whose remaining length has a fifth byte (s1.5.5: at most four)
        "30ffffffff01",
        "30ffffffff01",
        0x81,
        id="remaining-length-5-bytes",
    ),
    pytest.param(
        # PUBLISH QoS 0, topic 00 02 c3 28 (invalid UTF-8 [MQTT-1.5.4-1]), payload 'x'
        "300500 02c328 78".replace(" ", ""),
        "300600 02c328 00 78".replace(" ", ""),
        0x81,
        id="topic-invalid-utf8",
    ),
    pytest.param(
        # PUBLISH QoS 0, topic 'a\0' (U+0000 [MQTT-1.5.4-2])
        "30050002610078",
        "3006000261000078",
        0x81,
        id="topic-null-char",
    ),
    pytest.param(
        # PUBLISH with QoS bits 11 (QoS 3 [MQTT-3.3.1-4]), topic 'a', id 1
        "36050001610001",
        "3606000161000100",
        0x81,
        id="publish-qos-3",
    ),
    pytest.param(
        # PUBLISH QoS 0 with DUP set [MQTT-3.3.1-2]
        "38040001617a",
        "3805000161007a",
        0x81,
        id="publish-qos0-dup",
    ),
    pytest.param(
        # SUBSCRIBE with fixed-header flags 0000 instead of 0010 [MQTT-3.8.1-1]
        "8006000100016100",
        "800700010000016100",
        0x81,
        id="subscribe-reserved-flags",
    ),
    pytest.param(
        # PUBREL with flags 0000 instead of 0010 [MQTT-3.6.1-1]
        "60020001",
        "60020001",
        0x81,
        id="pubrel-reserved-flags",
    ),
    pytest.param(
        # SUBSCRIBE with packet id and no topic filter [MQTT-3.8.3-3]
        "82020001",
        "8203000100",
        0x82,
        id="subscribe-no-filters",
    ),
    pytest.param(
        # SUBSCRIBE option byte with reserved bits set (0xc1) [MQTT-3.8.3-5]
        "8206000100016 1c1".replace(" ", ""),
        "820700010000016 1c1".replace(" ", ""),
        0x81,
        id="subscribe-reserved-options",
    ),
    pytest.param(
        # PUBLISH QoS 0 to 'a/+': wildcard in a topic name [MQTT-3.3.2-2]
        "3006000361 2f2b 78".replace(" ", ""),
        "3007000361 2f2b 00 78".replace(" ", ""),
        0x90,
        id="publish-wildcard-plus",
    ),
    pytest.param(
        # PUBLISH QoS 0 to '#'
        "30040001237a",
        "3005000123007a",
        0x90,
        id="publish-wildcard-hash",
    ),
    pytest.param(
        # PUBLISH QoS 0 with an empty topic and no alias: 3.1.1 [MQTT-4.7.3-1]; 5.0 s3.3.2.3.4
        # "a Protocol Error if the Topic Name is zero length and there is no Topic Alias"
        "300300007a",
        "30040000007a",
        0x82,
        id="publish-empty-topic",
    ),
    pytest.param(
        # a second CONNECT [MQTT-3.1.0-2]
        connect311("again").hex(),
        connect5("again").hex(),
        0x82,
        id="second-connect",
    ),
    pytest.param(
        # packet type 15 in 3.1.1 / AUTH with no method agreed in 5.0
        "f000",
        "f000",
        0x82,
        id="auth-or-reserved-type",
    ),
    pytest.param(
        # packet type 0 (reserved, s2.1.2)
        "0000",
        "0000",
        0x81,
        id="type-0",
    ),
    pytest.param(
        # CONNACK from a client (server-to-client only, s2.1.2)
        "20020000",
        "2003000000",
        0x82,
        id="connack-from-client",
    ),
]


def _bad_session(mb: BrokerProcess, version: int, cid: str) -> socket.socket:
    s, _ = open_session(mb.port, connect5(cid) if version == 5 else connect311(cid))
    # PUBLISH QoS 1 'by/bad' id 7, payload 'acked' (5.0: empty property list)
    props = b"\x00" if version == 5 else b""
    s.sendall(
        packet(0x32, bytes.fromhex("0006") + b"by/bad" + bytes.fromhex("0007") + props + b"acked")
    )
    first, body = read_packet(s)
    assert first == 0x40 and body[:2] == b"\x00\x07"  # PUBACK id 7
    return s


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize(("v311", "v5", "code"), CASES)
def test_bad_packet_closes_only_that_connection(
    mb: BrokerProcess, bystander: Client, version: int, v311: str, v5: str, code: int
) -> None:
    cid = f"bad-{version}"
    s = _bad_session(mb, version, cid)
    bystander.publish("by/before", "b", qos=1)
    s.sendall(bytes.fromhex(v5 if version == 5 else v311))
    out, _ = wait_closed(s)
    if version == 5:
        reason, props = disconnect5(out[0], out[2:])
        assert reason == code, out.hex()
        assert 0x1F in props  # a reason string: problem information was not refused
    else:
        assert out == b""  # 3.1.1: close without a packet
    s.close()
    bystander.publish("by/after", "a", qos=1)
    msgs = bystander.expect(3)
    assert sorted(m.payload for m in msgs) == [b"a", b"acked", b"b"]
    bystander.expect_none(0.1)


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        # PUBLISH 'a' with Subscription Identifier 1 (0b 01): only servers send it [MQTT-3.3.4-6]
        pytest.param("3007 0001 61 02 0b01 78", 0x82, id="publish-with-subscription-id"),
        # PUBLISH 'a' with Response Topic '#' (08 0001 23) [MQTT-3.3.2-14]
        pytest.param("3009 0001 61 04 08000123 78", 0x82, id="response-topic-wildcard"),
        # PUBLISH 'a' with Topic Alias 3 and Topic Alias 3 again: duplicate property
        pytest.param("300b 0001 61 06 230003 230003 78", 0x82, id="duplicate-property"),
        # PUBLISH 'a' with property id 0x11 (Session Expiry: not a PUBLISH property, s2.2.2.2)
        pytest.param("300a 0001 61 05 110000000a 78", 0x81, id="property-not-for-publish"),
    ],
)
def test_bad_publish_properties_5(
    mb: BrokerProcess, bystander: Client, bad: str, code: int
) -> None:
    s = _bad_session(mb, 5, "badprops")
    s.sendall(bytes.fromhex(bad.replace(" ", "")))
    out, _ = wait_closed(s)
    assert disconnect5(out[0], out[2:])[0] == code, out.hex()
    s.close()
    bystander.publish("by/after", "a", qos=1)
    assert sorted(m.payload for m in bystander.expect(2)) == [b"a", b"acked"]
    bystander.expect_none(0.1)  # nothing from the refused PUBLISH reached a subscriber


@pytest.mark.parametrize("version", [4, 5])
def test_packet_over_max_size_refused_from_its_header(
    mb: BrokerProcess, bystander: Client, version: int
) -> None:
    s = _bad_session(mb, version, f"big-{version}")
    # PUBLISH fixed header announcing 8192 bytes (80 40); the body is never sent: the broker
    # decides from the header alone (s4.13: rejected before the body is buffered).
    s.sendall(bytes.fromhex("308040"))
    out, _ = wait_closed(s)
    if version == 5:
        assert disconnect5(out[0], out[2:])[0] == 0x95  # Packet too large
    else:
        assert out == b""
    s.close()
    bystander.publish("by/after", "a", qos=1)
    assert sorted(m.payload for m in bystander.expect(2)) == [b"a", b"acked"]


def test_packet_at_max_size_accepted(mb: BrokerProcess, bystander: Client) -> None:
    # PUBLISH QoS 0 'by/x' (5.0 props 00): total size exactly MAX_PACKET bytes is allowed.
    head = bytes.fromhex("0004") + b"by/x" + b"\x00"
    payload_len = MAX_PACKET - 1 - 2 - len(head)  # 1 type byte, 2 length bytes (< 16384)
    s, _ = open_session(mb.port, connect5("exact"))
    data = packet(0x30, head + b"p" * payload_len)
    assert len(data) == MAX_PACKET
    s.sendall(data)
    (m,) = bystander.expect(1)
    assert len(m.payload) == payload_len
    s.sendall(bytes.fromhex("c000"))
    assert read_packet(s) == (0xD0, b"")  # still connected
    s.close()


def test_connack_announces_maximum_packet_size(mb: BrokerProcess) -> None:
    c = Client(mb.port, "mps", V5)
    assert c.connect() == 0
    assert c.connack_properties["MaximumPacketSize"] == MAX_PACKET  # s3.2.2.3.6
    c.disconnect()


@pytest.mark.parametrize(
    ("data", "answer"),
    [
        pytest.param("30050001617878", "", id="publish-first"),  # PUBLISH before CONNECT
        pytest.param("c000", "", id="pingreq-first"),  # PINGREQ before CONNECT
        pytest.param("820600010001610 0".replace(" ", ""), "", id="subscribe-first"),
        pytest.param("10ffffffff7f", "", id="connect-bad-length"),  # CONNECT, 5-byte length
        # CONNECT 'MQTT' level 0xff: a level from the future gets the 5.0 CONNACK 0x84
        pytest.param("100c00044d515454ff02003c0000", "2003008400", id="connect-level-255"),
        # 3.1.1 CONNECT whose client id length runs past the packet: malformed, closed
        pytest.param("100e00044d5154540402003c00096331", "", id="connect-short-client-id"),
        # 5.0 CONNECT with Receive Maximum 0 (s3.1.2.11.3 Protocol Error): CONNACK 0x82
        pytest.param(
            "101000044d5154540502003c032100000000", "2003008200", id="connect-receive-maximum-0"
        ),
    ],
)
def test_bad_first_packet(mb: BrokerProcess, bystander: Client, data: str, answer: str) -> None:
    s = raw_connect(mb.port)
    s.sendall(bytes.fromhex(data))
    out, _ = wait_closed(s)  # [MQTT-3.1.0-1], [MQTT-4.8.0-1]
    assert out.hex() == answer
    s.close()
    bystander.publish("by/alive", "yes", qos=1)
    assert bystander.expect(1)[0].payload == b"yes"


@pytest.mark.parametrize(
    ("bad", "answer"),
    [
        # PUBLISH 'a' with Topic Alias 0: 0x94 cannot be a CONNACK code -> 0x82
        pytest.param("3008000161032300007a", "2003008200", id="alias-0"),
        # PUBLISH to 'a/+': 0x90 is a CONNACK code (Topic Name invalid)
        pytest.param("300700036 12f2b007a".replace(" ", ""), "2003009000", id="wildcard"),
        # PUBLISH with QoS 3
        pytest.param("3606000161000100", "2003008100", id="qos-3"),
    ],
)
def test_bad_packet_in_the_connect_segment(
    mb: BrokerProcess, bystander: Client, bad: str, answer: str
) -> None:
    """CONNECT and a bad packet in one write: the CONNECT is not answered with success, the
    refusal carries a code valid for CONNACK (s3.2.2.2), and the connection is closed."""
    s = raw_connect(mb.port)
    s.sendall(connect5("same-segment") + bytes.fromhex(bad))
    out, _ = wait_closed(s)
    assert out.hex() == answer
    s.close()
    bystander.publish("by/alive", "yes", qos=1)
    assert bystander.expect(1)[0].payload == b"yes"
    assert "Traceback" not in mb.log()


def test_split_packets_are_reassembled(mb: BrokerProcess, bystander: Client) -> None:
    """Valid input arriving one byte at a time is not an error (need-more-data)."""
    s = raw_connect(mb.port)
    data = connect311("slow") + packet(
        0x32, bytes.fromhex("0004") + b"by/s" + bytes.fromhex("0001") + b"slow"
    )
    for i in range(len(data)):
        s.sendall(data[i : i + 1])
    assert read_packet(s) == (0x20, b"\x00\x00")
    assert read_packet(s) == (0x40, b"\x00\x01")
    assert bystander.expect(1)[0].payload == b"slow"
    s.close()
