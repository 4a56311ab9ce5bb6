"""Decoder behaviour: incremental input, limits, error handling and the server-side rules.

Malformed inputs are hand-built bytes (tests/mqttbytes.py, not produced by our encoder) so that
the decoder is checked against the spec, not against itself. Random and mutated input (fuzzing)
is in test_fuzz.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from broker.mqtt import (
    Auth,
    ConnAck,
    Connect,
    Decoder,
    Disconnect,
    MalformedPacket,
    MQTTError,
    Packet,
    PacketTooLarge,
    PingReq,
    PropertyId,
    ProtocolError,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    Subscribe,
    Subscription,
    Unsubscribe,
    UnsupportedProtocolVersion,
    Will,
    encode,
)
from tests.mqttbytes import packet as pkt

P = PropertyId

CONNECT_V4 = b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x3c\x00\x01c"
CONNECT_V5 = b"\x10\x0e\x00\x04MQTT\x05\x02\x00\x3c\x00\x00\x01c"
CONNECT_V3 = b"\x10\x0f\x00\x06MQIsdp\x03\x02\x00\x3c\x00\x01c"
CONNECT_BY_VERSION = {3: CONNECT_V3, 4: CONNECT_V4, 5: CONNECT_V5}


def session(version: int) -> list[Packet]:
    """What a client sends in a typical session, CONNECT first."""
    props: dict[int, Any] = {P.USER_PROPERTY: [("k", "v")]} if version == 5 else {}
    name = "MQIsdp" if version == 3 else "MQTT"
    packets: list[Packet] = [
        Connect("client", version, name, True, 30, Will("will", b"w", 1, False), "u", b"p"),
        Subscribe(1, [Subscription("a/#", 1), Subscription("b/+", 2)], props),
        Publish("a/1", b"x" * 10, 0),
        Publish("a/2", b"y" * 200, 1, True, False, 2, props),  # two-byte remaining length
        Publish("a/3", b"", 2, False, True, 3),
        PubAck(4),
        PubRec(5),
        PubRel(5),
        PubComp(6),
        Unsubscribe(7, ["a/#"], props),
        PingReq(),
        Disconnect(),
    ]
    if version == 5:
        packets.insert(-1, Auth(0x18, {P.AUTHENTICATION_METHOD: "m"}))
    return packets


def stream(version: int) -> bytes:
    return b"".join(encode(p, version) for p in session(version))


# --------------------------------------------------------------------------- partial input


@pytest.mark.parametrize("version", [3, 4, 5])
def test_split_at_every_point(version: int) -> None:
    data = stream(version)
    expected = session(version)
    for cut in range(len(data) + 1):
        dec = Decoder()
        dec.feed(data[:cut])
        got = dec.packets()
        dec.feed(data[cut:])
        got += dec.packets()
        assert got == expected, f"split at {cut}"
        assert dec.buffered == 0


@pytest.mark.parametrize("version", [4, 5])
def test_one_byte_at_a_time(version: int) -> None:
    data = stream(version)
    dec = Decoder()
    got: list[Packet] = []
    for i in range(len(data)):
        dec.feed(data[i : i + 1])
        packet = dec.next_packet()
        if packet is not None:
            got.append(packet)
        assert dec.next_packet() is None  # never more than one complete packet per byte
    assert got == session(version)


@pytest.mark.parametrize("version", [4, 5])
def test_three_way_splits_through_headers(version: int) -> None:
    """Cuts inside the fixed header and inside the body of the same packet."""
    data = stream(version)
    expected = session(version)
    for a in range(0, len(data), 7):
        for b in range(a, min(a + 9, len(data) + 1)):
            dec = Decoder()
            got: list[Packet] = []
            for piece in (data[:a], data[a:b], data[b:]):
                dec.feed(piece)
                got += dec.packets()
            assert got == expected


def test_next_packet_and_packets_drain_the_same() -> None:
    data = stream(5)
    dec = Decoder()
    dec.feed(data)
    one_by_one = []
    while (packet := dec.next_packet()) is not None:
        one_by_one.append(packet)
    dec2 = Decoder()
    dec2.feed(data)
    assert dec2.packets() == one_by_one == session(5)
    assert dec.packets() == [] and dec.next_packet() is None


def test_feed_accepts_bytearray_and_memoryview_and_copies() -> None:
    data = bytearray(CONNECT_V4 + b"\xc0\x00")
    dec = Decoder()
    dec.feed(memoryview(data)[:5])
    dec.feed(data[5:])
    data[:] = b"\x00" * len(data)  # the caller reuses its buffer
    assert dec.packets() == [Connect("c", 4, "MQTT", True, 60), PingReq()]


@pytest.mark.parametrize("cuts", [(3,), (3, 7), (len(CONNECT_V4) - 2, len(CONNECT_V4) + 1)])
def test_take_hands_over_what_is_buffered(cuts: tuple[int, ...]) -> None:
    """take() returns every byte not yet a packet (joined from several reads) and leaves
    the decoder empty; fed back, they decode as if never taken (the compiled device path)."""
    data = CONNECT_V4 + b"\xc0\x00"
    dec = Decoder()
    decoded: list[Any] = []
    for a, b in zip((0, *cuts), cuts, strict=False):
        dec.feed(data[a:b])
        decoded += dec.packets()
    consumed = len(CONNECT_V4) if decoded else 0
    assert dec.take() == data[consumed : cuts[-1]]
    assert dec.buffered == 0 and dec.packets() == []
    dec.feed(data[consumed:])
    assert decoded + dec.packets() == [Connect("c", 4, "MQTT", True, 60), PingReq()]


def test_large_packet_in_many_small_reads() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    data = CONNECT_V4 + encode(Publish("big", payload, 1, False, False, 9), 4) + b"\xc0\x00"
    dec = Decoder()
    got: list[Packet] = []
    for i in range(0, len(data), 4093):
        dec.feed(data[i : i + 4093])
        got += dec.packets()
    assert got[1] == Publish("big", payload, 1, False, False, 9)
    assert got[2] == PingReq()
    assert dec.buffered == 0


def test_incomplete_input_is_not_an_error() -> None:
    dec = Decoder()
    assert dec.next_packet() is None
    dec.feed(b"")
    dec.feed(CONNECT_V4[:1])
    assert dec.packets() == []
    dec.feed(CONNECT_V4[1:] + b"\x30\xff\xff\xff")  # remaining length bytes not finished
    assert dec.packets() == [Connect("c", 4, "MQTT", True, 60)]
    assert dec.next_packet() is None


# --------------------------------------------------------------------------- limits


def test_too_large_rejected_from_fixed_header() -> None:
    """The size is known from the fixed header: reject before the body is received."""
    dec = Decoder(max_packet_size=100)
    dec.feed(CONNECT_V5)
    dec.next_packet()
    dec.feed(b"\x30\xe8\x07")  # PUBLISH, remaining length 1000, no body yet
    with pytest.raises(PacketTooLarge) as info:
        dec.next_packet()
    assert info.value.reason_code == ReasonCode.PACKET_TOO_LARGE


def test_too_large_counts_the_whole_packet() -> None:
    """Maximum Packet Size is the total size, fixed header included (s3.1.2.11.4)."""
    packet = encode(Publish("t", b"x" * 95, 0), 4)
    assert len(packet) == 2 + 98
    ok = Decoder(max_packet_size=100)
    ok.feed(CONNECT_V4 + packet)
    assert len(ok.packets()) == 2
    too_big = Decoder(max_packet_size=99)
    too_big.feed(CONNECT_V4 + packet[:2])
    too_big.next_packet()
    with pytest.raises(PacketTooLarge):
        too_big.next_packet()


def test_too_large_first_packet() -> None:
    dec = Decoder(max_packet_size=10)
    dec.feed(b"\x10\x7f")
    with pytest.raises(PacketTooLarge):
        dec.packets()


# --------------------------------------------------------------------------- errors


def test_dead_after_error() -> None:
    dec = Decoder()
    dec.feed(CONNECT_V4 + b"\x30\x02\x00")  # fine so far
    dec.packets()
    dec.feed(b"\x05\xc0\x00")  # topic length 5 > remaining length
    with pytest.raises(MalformedPacket) as first:
        dec.packets()
    for call in (dec.packets, dec.next_packet, lambda: dec.feed(b"\xc0\x00")):
        with pytest.raises(MalformedPacket) as again:
            call()
        assert again.value is first.value


def test_good_packets_before_an_error_are_returned_by_next_packet() -> None:
    dec = Decoder(version=4)
    dec.feed(b"\xd0\x00" + b"\xd0\x01\x00")
    assert dec.next_packet() is not None
    with pytest.raises(MalformedPacket):
        dec.next_packet()


@pytest.mark.parametrize(
    "first",
    [b"\xc0\x00", b"\x30\x03\x00\x01a", b"\x20\x02\x00\x00", b"\xe0\x00", b"\x00\x00", b"\xf0\x00"],
)
def test_first_packet_must_be_connect(first: bytes) -> None:
    """[MQTT-3.1.0-1]: after the network connection, the first packet must be CONNECT."""
    dec = Decoder()
    dec.feed(first)
    with pytest.raises(ProtocolError):
        dec.packets()


@pytest.mark.parametrize("version", [3, 4, 5])
def test_connect_sets_version_and_second_connect_decodes(version: int) -> None:
    dec = Decoder()
    assert dec.version is None
    dec.feed(CONNECT_BY_VERSION[version] * 2)
    packets = dec.packets()
    assert dec.version == version
    assert len(packets) == 2 and packets[0] == packets[1]
    assert isinstance(packets[0], Connect) and packets[0].protocol_level == version


def test_client_side_decoder() -> None:
    dec = Decoder(version=5)
    dec.feed(b"\x20\x03\x01\x00\x00" + b"\x40\x02\x00\x07")
    assert dec.packets() == [ConnAck(True, 0), PubAck(7)]
    with pytest.raises(ValueError):
        Decoder(version=6)


S = b"\x00\x01a"  # the string "a"

MALFORMED: list[tuple[str, int, bytes, type[MQTTError]]] = [
    # name, version (0 = server side, CONNECT first), bytes, error
    ("remaining-length-5-bytes", 4, b"\x30\xff\xff\xff\xff\x01", MalformedPacket),
    ("reserved-type-0", 4, b"\x00\x00", MalformedPacket),
    ("type-15-in-311", 4, b"\xf0\x00", MalformedPacket),
    ("publish-qos3", 4, pkt(0x36, S + b"\x00\x01"), MalformedPacket),
    ("publish-qos0-dup", 4, pkt(0x38, S), MalformedPacket),
    ("publish-packet-id-0", 4, pkt(0x32, S + b"\x00\x00"), ProtocolError),
    ("publish-topic-too-long", 4, pkt(0x30, b"\x00\x05ab"), MalformedPacket),
    ("publish-no-topic-length", 4, pkt(0x30, b"\x00"), MalformedPacket),
    ("publish-qos1-no-packet-id", 4, pkt(0x32, S + b"\x00"), MalformedPacket),
    ("publish-invalid-utf8", 4, pkt(0x30, b"\x00\x02\xc3\x28"), MalformedPacket),
    ("publish-overlong-utf8", 4, pkt(0x30, b"\x00\x02\xc0\xaf"), MalformedPacket),
    ("publish-surrogate", 4, pkt(0x30, b"\x00\x03\xed\xa0\x80"), MalformedPacket),
    ("publish-nul", 4, pkt(0x30, b"\x00\x03a\x00b"), MalformedPacket),
    ("puback-flags", 4, b"\x41\x02\x00\x01", MalformedPacket),
    ("pubrel-flags-0", 4, b"\x60\x02\x00\x01", MalformedPacket),
    ("pubrel-flags-3", 4, b"\x63\x02\x00\x01", MalformedPacket),
    ("subscribe-flags-0", 4, pkt(0x80, b"\x00\x01" + S + b"\x00"), MalformedPacket),
    ("unsubscribe-flags-0", 4, pkt(0xA0, b"\x00\x01" + S), MalformedPacket),
    ("pingreq-flags", 4, b"\xc1\x00", MalformedPacket),
    ("disconnect-flags", 4, b"\xe8\x00", MalformedPacket),
    ("connack-flags", 4, b"\x22\x02\x00\x00", MalformedPacket),
    ("puback-short", 4, b"\x40\x01\x00", MalformedPacket),
    ("puback-311-long", 4, b"\x40\x03\x00\x01\x00", MalformedPacket),
    ("puback-id-0", 4, b"\x40\x02\x00\x00", ProtocolError),
    ("pingreq-with-body", 4, b"\xc0\x01\x00", MalformedPacket),
    ("disconnect-311-with-body", 4, b"\xe0\x01\x00", MalformedPacket),
    ("subscribe-no-filters", 4, b"\x82\x02\x00\x01", ProtocolError),
    ("subscribe-missing-options", 4, pkt(0x82, b"\x00\x01" + S), MalformedPacket),
    ("subscribe-reserved-bits-311", 4, pkt(0x82, b"\x00\x01" + S + b"\x04"), MalformedPacket),
    ("subscribe-qos3", 4, pkt(0x82, b"\x00\x01" + S + b"\x03"), MalformedPacket),
    ("subscribe-reserved-bits-5", 5, pkt(0x82, b"\x00\x01\x00" + S + b"\x40"), MalformedPacket),
    ("subscribe-retain-handling-3", 5, pkt(0x82, b"\x00\x01\x00" + S + b"\x30"), ProtocolError),
    ("unsubscribe-no-filters", 4, b"\xa2\x02\x00\x01", ProtocolError),
    ("connack-return-code-6", 4, b"\x20\x02\x00\x06", ProtocolError),
    ("suback-bad-code", 4, pkt(0x90, b"\x00\x01\x03"), ProtocolError),
    ("puback-v5-bad-reason", 5, b"\x40\x03\x00\x01\x01", ProtocolError),
    ("v5-property-length-too-long", 5, pkt(0x30, S + b"\x05\x01\x01"), MalformedPacket),
    ("v5-unknown-property", 5, pkt(0x30, S + b"\x02\x7f\x00"), MalformedPacket),
    ("v5-property-value-truncated", 5, pkt(0x30, S + b"\x02\x02\x00"), MalformedPacket),
    ("v5-property-not-allowed", 5, pkt(0x30, S + b"\x05\x11\x00\x00\x00\x01"), MalformedPacket),
    ("v5-duplicate-property", 5, pkt(0x30, S + b"\x04\x01\x00\x01\x01"), ProtocolError),
    ("v5-duplicate-sub-id-subscribe", 5,
     pkt(0x82, b"\x00\x01\x04\x0b\x01\x0b\x02" + S + b"\x00"), ProtocolError),
    ("v5-sub-id-0", 5, pkt(0x82, b"\x00\x01\x02\x0b\x00" + S + b"\x00"), ProtocolError),
    ("v5-sub-id-5-bytes", 5, pkt(0x30, S + b"\x06\x0b\xff\xff\xff\xff\x01"), MalformedPacket),
    ("v5-payload-format-2", 5, pkt(0x30, S + b"\x02\x01\x02"), ProtocolError),
    ("v5-user-property-half", 5, pkt(0x30, S + b"\x04\x26\x00\x01k"), MalformedPacket),
    ("v5-connack-no-properties", 5, b"\x20\x02\x00\x00", MalformedPacket),
    ("v5-disconnect-trailing", 5, b"\xe0\x03\x00\x00\x00", MalformedPacket),
    ("connect-bad-name", 0, pkt(0x10, b"\x00\x04MQTX\x04\x02\x00\x00" + S),
     UnsupportedProtocolVersion),
    ("connect-bad-level", 0, pkt(0x10, b"\x00\x04MQTT\x06\x02\x00\x00" + S),
     UnsupportedProtocolVersion),
    ("connect-mqisdp-level-4", 0, pkt(0x10, b"\x00\x06MQIsdp\x04\x02\x00\x00" + S),
     UnsupportedProtocolVersion),
    ("connect-reserved-flag", 0, pkt(0x10, b"\x00\x04MQTT\x04\x03\x00\x00" + S), MalformedPacket),
    ("connect-will-qos-without-will", 0, pkt(0x10, b"\x00\x04MQTT\x04\x0a\x00\x00" + S),
     MalformedPacket),
    ("connect-will-retain-without-will", 0, pkt(0x10, b"\x00\x04MQTT\x04\x22\x00\x00" + S),
     MalformedPacket),
    ("connect-will-qos-3", 0, pkt(0x10, b"\x00\x04MQTT\x04\x1e\x00\x00" + S + S + S),
     MalformedPacket),
    ("connect-password-no-user-311", 0, pkt(0x10, b"\x00\x04MQTT\x04\x42\x00\x00" + S + S),
     MalformedPacket),
    ("connect-missing-client-id", 0, pkt(0x10, b"\x00\x04MQTT\x04\x02\x00\x00"), MalformedPacket),
    ("connect-trailing", 0, pkt(0x10, b"\x00\x04MQTT\x04\x02\x00\x00" + S + b"\x00"),
     MalformedPacket),
    ("connect-flags-nonzero", 0, pkt(0x11, b"\x00\x04MQTT\x04\x02\x00\x00" + S), MalformedPacket),
    ("connect-nul-client-id", 0, pkt(0x10, b"\x00\x04MQTT\x04\x02\x00\x00\x00\x01\x00"),
     MalformedPacket),
]  # fmt: skip


@pytest.mark.parametrize(("version", "data", "error"), [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])  # fmt: skip
def test_malformed(version: int, data: bytes, error: type[MQTTError]) -> None:
    dec = Decoder() if version == 0 else Decoder(version=version)
    dec.feed(data)
    with pytest.raises(error) as info:
        dec.packets()
    assert type(info.value) is error
    assert info.value.reason_code == error.reason_code


def test_topic_alias_0_is_topic_alias_invalid() -> None:
    """s3.3.4: Topic Alias 0 is a Protocol Error answered with 0x94 (Topic Alias invalid)."""
    dec = Decoder(version=5)
    dec.feed(pkt(0x30, S + b"\x03\x23\x00\x00"))
    with pytest.raises(ProtocolError) as info:
        dec.packets()
    assert info.value.reason_code == ReasonCode.TOPIC_ALIAS_INVALID


def test_v5_puback_forms() -> None:
    dec = Decoder(version=5)
    dec.feed(
        b"\x40\x02\x00\x01"  # no reason code, no properties
        + b"\x40\x03\x00\x02\x10"  # reason code only
        + b"\x40\x04\x00\x03\x00\x00"  # reason code + empty properties
        + b"\x40\x08\x00\x04\x80\x04\x1f\x00\x01x"  # reason string
    )
    assert dec.packets() == [
        PubAck(1),
        PubAck(2, 0x10),
        PubAck(3),
        PubAck(4, 0x80, {P.REASON_STRING: "x"}),
    ]
