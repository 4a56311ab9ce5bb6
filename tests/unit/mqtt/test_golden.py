"""Golden byte vectors for the MQTT codec, written by hand from the specifications.

Every hex literal below was composed from the OASIS standards (MQTT 3.1.1, 29 October 2014 and
MQTT 5.0, 07 March 2019), field by field, without running our codec: the comments name the
fields and the section that lays them out. Each valid vector is checked both ways:
``Decoder`` turns the bytes into exactly the expected packet, and ``encode`` turns the packet
into exactly these bytes (unless the vector is a non-canonical but legal form, marked
``canonical=False``, which we must accept but never emit).

Properties inside one packet are written in ascending identifier order, so a byte-exact encode
check does not depend on whether the encoder keeps insertion order or sorts (the spec gives
order no significance, 5.0 s2.2.2.2).

Malformed vectors name the error class and the reason code the spec asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from broker.mqtt.decode import Decoder
from broker.mqtt.encode import encode, encode_connack_refused, encode_publish
from broker.mqtt.errors import (
    LocalProtocolError,
    MalformedPacket,
    MQTTError,
    PacketTooLarge,
    ProtocolError,
    UnsupportedProtocolVersion,
)
from broker.mqtt.packets import (
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)
from broker.mqtt.properties import PropertyId as P
from broker.mqtt.reason_codes import ReasonCode

# A CONNECT per protocol level, used to put a server-side decoder into that version.
#   10 = CONNECT, RL, protocol name (2-byte length + bytes), level, flags 02 (clean), keepalive 60
CONNECT_HEX: dict[int, str] = {
    # 3.1 (MQIsdp, level 3): RL = 8 + 1 + 1 + 2 + 5 = 17
    3: "10 11  00 06 4D 51 49 73 64 70  03  02  00 3C  00 03 61 62 63",
    # 3.1.1 s3.1: RL = 6 + 1 + 1 + 2 + 5 = 15
    4: "10 0F  00 04 4D 51 54 54  04  02  00 3C  00 03 61 62 63",
    # 5.0 s3.1: RL = 6 + 1 + 1 + 2 + 1 (property length 0) + 5 = 16
    5: "10 10  00 04 4D 51 54 54  05  02  00 3C  00  00 03 61 62 63",
}

SERVER = "server"  # the packet travels client -> server: decoded by Decoder() after a CONNECT
CLIENT = "client"  # server -> client: decoded by Decoder(version=...)
BOTH = "both"


@dataclass(frozen=True)
class Vector:
    id: str
    version: int
    hex: str
    packet: Packet
    spec: str
    side: str = BOTH
    canonical: bool = True

    @property
    def data(self) -> bytes:
        return bytes.fromhex(self.hex)


def _h(*parts: str) -> str:
    return " ".join(parts)


# --------------------------------------------------------------------------- MQTT 3.1 / 3.1.1

V311: list[Vector] = [
    Vector(
        "connect-311-minimal",
        4,
        CONNECT_HEX[4],
        Connect("abc", 4, "MQTT", clean_start=True, keepalive=60),
        "3.1.1 s3.1.2.1-3.1.2.10, s3.1.3.1",
        SERVER,
    ),
    Vector(
        "connect-311-empty-client-id",
        4,
        # RL = 10 + 2
        "10 0C  00 04 4D 51 54 54  04  02  00 00  00 00",
        Connect("", 4, keepalive=0),
        "3.1.1 s3.1.3.1 [MQTT-3.1.3-6] zero-length ClientId",
        SERVER,
    ),
    Vector(
        "connect-311-will-username-password",
        4,
        # flags EC = user 80 | password 40 | will retain 20 | will QoS 1 (08) | will 04; clean 0
        # RL = 10 + 4 (c1) + 5 (w/t) + 5 (bye) + 3 (u) + 4 (01 02) = 31
        _h(
            "10 1F  00 04 4D 51 54 54  04  EC  00 0A",
            "00 02 63 31",
            "00 03 77 2F 74",
            "00 03 62 79 65",
            "00 01 75",
            "00 02 01 02",
        ),
        Connect(
            "c1",
            4,
            clean_start=False,
            keepalive=10,
            will=Will("w/t", b"bye", qos=1, retain=True),
            username="u",
            password=b"\x01\x02",
        ),
        "3.1.1 s3.1.2.3 connect flags, s3.1.3 payload order: ClientId, Will Topic, Will Message, "
        "User Name, Password",
        SERVER,
    ),
    Vector(
        "connect-311-username-only-will-qos2",
        4,
        # flags 96 = user 80 | will QoS 2 (10) | will 04 | clean 02 ... = 0x96
        # RL = 10 + 4 + 3 (w) + 2 (empty message) + 6 (user) = 25
        _h(
            "10 19  00 04 4D 51 54 54  04  96  00 00",
            "00 02 63 31",
            "00 01 77",
            "00 00",
            "00 04 75 73 65 72",
        ),
        Connect("c1", 4, will=Will("w", b"", qos=2), username="user"),
        "3.1.1 s3.1.2.6 Will QoS, s3.1.2.8 User Name Flag",
        SERVER,
    ),
    Vector(
        "connect-31-mqisdp",
        3,
        CONNECT_HEX[3],
        Connect("abc", 3, "MQIsdp", clean_start=True, keepalive=60),
        "MQTT 3.1 protocol name 'MQIsdp', level 3 (3.1.1 s3.1.2.2 non-normative history)",
        SERVER,
    ),
    Vector("connack-311-accepted", 4, "20 02 00 00", ConnAck(False, 0), "3.1.1 s3.2", CLIENT),
    Vector(
        "connack-311-session-present",
        4,
        "20 02 01 00",
        ConnAck(True, 0),
        "3.1.1 s3.2.2.2 Session Present",
        CLIENT,
    ),
    Vector(
        "connack-311-not-authorized",
        4,
        "20 02 00 05",
        ConnAck(False, 5),
        "3.1.1 s3.2.2.3 return code 5",
        CLIENT,
    ),
    Vector(
        "publish-311-qos0",
        4,
        "30 07  00 03 61 2F 62  68 69",
        Publish("a/b", b"hi"),
        "3.1.1 s3.3: no packet identifier at QoS 0",
    ),
    Vector(
        "publish-31-qos0",
        3,
        "30 07  00 03 61 2F 62  68 69",
        Publish("a/b", b"hi"),
        "3.1 encodes PUBLISH like 3.1.1",
        SERVER,
    ),
    Vector(
        "publish-311-retain-empty-payload",
        4,
        "31 05  00 03 61 2F 62",
        Publish("a/b", b"", retain=True),
        "3.1.1 s3.3.1.3 RETAIN, s3.3.3 zero-length payload",
    ),
    Vector(
        "publish-311-qos1",
        4,
        "32 09  00 03 61 2F 62  00 0A  68 69",
        Publish("a/b", b"hi", qos=1, packet_id=10),
        "3.1.1 s3.3.1.2 QoS 1, s3.3.2.2 Packet Identifier",
    ),
    Vector(
        "publish-311-qos2-dup-retain",
        4,
        # 3D = type 3 | DUP 08 | QoS 2 (04) | RETAIN 01
        "3D 09  00 03 61 2F 62  12 34  68 69",
        Publish("a/b", b"hi", qos=2, retain=True, dup=True, packet_id=0x1234),
        "3.1.1 s3.3.1 fixed header flags",
    ),
    Vector(
        "publish-311-utf8-topic",
        4,
        # "A" U+2A6D4 is the spec's own example: 41 F0 AA 9B 94 (3.1.1 s1.5.3 figure 1.3)
        "30 07  00 05 41 F0 AA 9B 94",
        Publish("A\U0002a6d4", b""),
        "3.1.1 s1.5.3 UTF-8 encoded string example",
    ),
    Vector(
        "publish-311-bom-kept",
        4,
        "30 06  00 04 EF BB BF 61",
        Publish("\ufeffa", b""),
        "3.1.1 [MQTT-1.5.3-3] U+FEFF must not be skipped or stripped",
    ),
    Vector(
        "publish-311-rl-128",
        4,
        # Remaining Length 128 -> 0x80 0x01 (3.1.1 s2.2.3 table 2.4)
        "30 80 01  00 03 61 2F 62 " + "41" * 123,
        Publish("a/b", b"A" * 123),
        "3.1.1 s2.2.3 Remaining Length, two bytes",
    ),
    Vector(
        "publish-311-rl-16383",
        4,
        # 16383 -> 0xFF 0x7F
        "30 FF 7F  00 03 61 2F 62 " + "00" * 16378,
        Publish("a/b", bytes(16378)),
        "3.1.1 s2.2.3 table 2.4 largest two-byte value",
    ),
    Vector(
        "publish-311-rl-16384",
        4,
        # 16384 -> 0x80 0x80 0x01
        "30 80 80 01  00 03 61 2F 62 " + "00" * 16379,
        Publish("a/b", bytes(16379)),
        "3.1.1 s2.2.3 table 2.4 smallest three-byte value",
    ),
    Vector("puback-311", 4, "40 02 00 0A", PubAck(10), "3.1.1 s3.4"),
    Vector("pubrec-311", 4, "50 02 00 0A", PubRec(10), "3.1.1 s3.5"),
    Vector("pubrel-311", 4, "62 02 00 0A", PubRel(10), "3.1.1 s3.6, flags 0010 [MQTT-3.6.1-1]"),
    Vector("pubcomp-311", 4, "70 02 00 0A", PubComp(10), "3.1.1 s3.7"),
    Vector(
        "subscribe-311",
        4,
        # 82 = type 8, flags 0010 [MQTT-3.8.1-1]; RL = 2 + 6 + 4
        "82 0C  00 0A  00 03 61 2F 62 01  00 01 23 02",
        Subscribe(10, [Subscription("a/b", 1), Subscription("#", 2)]),
        "3.1.1 s3.8 SUBSCRIBE, s3.8.3 payload: filter + requested QoS byte",
        SERVER,
    ),
    Vector(
        "suback-311",
        4,
        "90 05  00 0A  00 02 80",
        SubAck(10, [0, 2, 0x80]),
        "3.1.1 s3.9.3 return codes 0x00, 0x02, 0x80 (failure)",
        CLIENT,
    ),
    Vector(
        "unsubscribe-311",
        4,
        "A2 0A  00 0C  00 03 61 2F 62  00 01 23",
        Unsubscribe(12, ["a/b", "#"]),
        "3.1.1 s3.10, flags 0010 [MQTT-3.10.1-1]",
        SERVER,
    ),
    Vector(
        "unsuback-311",
        4,
        "B0 02 00 0C",
        UnsubAck(12, []),
        "3.1.1 s3.11: no payload",
        CLIENT,
    ),
    Vector("pingreq-311", 4, "C0 00", PingReq(), "3.1.1 s3.12", SERVER),
    Vector("pingresp-311", 4, "D0 00", PingResp(), "3.1.1 s3.13", CLIENT),
    Vector("disconnect-311", 4, "E0 00", Disconnect(), "3.1.1 s3.14", SERVER),
]

# --------------------------------------------------------------------------- MQTT 5.0

WILL_PROPS: dict[int, Any] = {
    P.PAYLOAD_FORMAT_INDICATOR: 1,
    P.MESSAGE_EXPIRY_INTERVAL: 60,
    P.CONTENT_TYPE: "text/plain",
    P.RESPONSE_TOPIC: "r/t",
    P.CORRELATION_DATA: b"\xca\xfe",
    P.WILL_DELAY_INTERVAL: 5,
    P.USER_PROPERTY: [("a", "b")],
}

CONNECT_PROPS: dict[int, Any] = {
    P.SESSION_EXPIRY_INTERVAL: 3600,
    P.AUTHENTICATION_METHOD: "SCRAM",
    P.AUTHENTICATION_DATA: b"\x01\x02\x03",
    P.REQUEST_PROBLEM_INFORMATION: 0,
    P.REQUEST_RESPONSE_INFORMATION: 1,
    P.RECEIVE_MAXIMUM: 20,
    P.TOPIC_ALIAS_MAXIMUM: 10,
    P.USER_PROPERTY: [("k", "v")],
    P.MAXIMUM_PACKET_SIZE: 1024,
}

CONNACK_PROPS: dict[int, Any] = {
    P.SESSION_EXPIRY_INTERVAL: 120,
    P.ASSIGNED_CLIENT_IDENTIFIER: "auto-1",
    P.SERVER_KEEP_ALIVE: 60,
    P.RESPONSE_INFORMATION: "resp/",
    P.SERVER_REFERENCE: "other:1883",
    P.REASON_STRING: "ok",
    P.RECEIVE_MAXIMUM: 100,
    P.TOPIC_ALIAS_MAXIMUM: 5,
    P.MAXIMUM_QOS: 1,
    P.RETAIN_AVAILABLE: 0,
    P.USER_PROPERTY: [("x", "y"), ("x", "z")],
    P.MAXIMUM_PACKET_SIZE: 65536,
    P.WILDCARD_SUBSCRIPTION_AVAILABLE: 0,
    P.SUBSCRIPTION_IDENTIFIER_AVAILABLE: 1,
    P.SHARED_SUBSCRIPTION_AVAILABLE: 1,
}

PUBLISH_PROPS: dict[int, Any] = {
    P.PAYLOAD_FORMAT_INDICATOR: 1,
    P.MESSAGE_EXPIRY_INTERVAL: 3600,
    P.CONTENT_TYPE: "json",
    P.RESPONSE_TOPIC: "re/s",
    P.CORRELATION_DATA: b"\x00\x01",
    P.SUBSCRIPTION_IDENTIFIER: [1, 268_435_455],
    P.TOPIC_ALIAS: 3,
    P.USER_PROPERTY: [("k", "v")],
}

V5: list[Vector] = [
    Vector(
        "connect-5-minimal",
        5,
        # RL = 10 + 1 (property length 0) + 2 (empty ClientId)
        "10 0D  00 04 4D 51 54 54  05  02  00 00  00  00 00",
        Connect("", 5),
        "5.0 s3.1.2, s3.1.2.11.1 property length 0 [MQTT-2.2.2-1]",
        SERVER,
    ),
    Vector(
        "connect-5-all-properties-will-password",
        5,
        # flags 56 = password 40 | will QoS 2 (10) | will 04 | clean 02 (no user name: 5.0
        # s3.1.2.9 allows a password without a user name); keepalive 30
        _h(
            "10 72",
            "00 04 4D 51 54 54  05  56  00 1E",
            "29",  # property length 41
            "11 00 00 0E 10",  # Session Expiry Interval 3600 (four-byte integer)
            "15 00 05 53 43 52 41 4D",  # Authentication Method "SCRAM"
            "16 00 03 01 02 03",  # Authentication Data (binary)
            "17 00",  # Request Problem Information 0
            "19 01",  # Request Response Information 1
            "21 00 14",  # Receive Maximum 20
            "22 00 0A",  # Topic Alias Maximum 10
            "26 00 01 6B 00 01 76",  # User Property ("k", "v")
            "27 00 00 04 00",  # Maximum Packet Size 1024
            "00 03 63 69 64",  # ClientId "cid"
            "2B",  # will property length 43
            "01 01",  # Payload Format Indicator 1
            "02 00 00 00 3C",  # Message Expiry Interval 60
            "03 00 0A 74 65 78 74 2F 70 6C 61 69 6E",  # Content Type "text/plain"
            "08 00 03 72 2F 74",  # Response Topic "r/t"
            "09 00 02 CA FE",  # Correlation Data
            "18 00 00 00 05",  # Will Delay Interval 5
            "26 00 01 61 00 01 62",  # User Property ("a", "b")
            "00 01 77",  # Will Topic "w"
            "00 04 67 6F 6E 65",  # Will Payload "gone"
            "00 02 70 77",  # Password "pw"
        ),
        Connect(
            "cid",
            5,
            clean_start=True,
            keepalive=30,
            will=Will("w", b"gone", qos=2, retain=False, properties=WILL_PROPS),
            password=b"pw",
            properties=CONNECT_PROPS,
        ),
        "5.0 s3.1.2.11 CONNECT properties, s3.1.3.2 will properties, s3.1.3 payload order",
        SERVER,
    ),
    Vector(
        "connect-5-username-password",
        5,
        # flags C0 = user | password, clean 0; keepalive 65535; RL = 10 + 1 + 3 + 3 + 4
        "10 15  00 04 4D 51 54 54  05  C0  FF FF  00  00 01 78  00 01 75  00 02 70 77",
        Connect("x", 5, clean_start=False, keepalive=65535, username="u", password=b"pw"),
        "5.0 s3.1.2.8-3.1.2.10",
        SERVER,
    ),
    Vector(
        "connack-5-minimal",
        5,
        "20 03  00 00 00",
        ConnAck(False, 0),
        "5.0 s3.2.2: flags, reason code, property length (never omitted in CONNACK)",
        CLIENT,
    ),
    Vector(
        "connack-5-not-authorized",
        5,
        "20 03  00 87 00",
        ConnAck(False, ReasonCode.NOT_AUTHORIZED),
        "5.0 s3.2.2.2 reason code 0x87",
        CLIENT,
    ),
    Vector(
        "connack-5-all-properties",
        5,
        _h(
            "20 51  01  00  4E",  # session present, success, property length 78
            "11 00 00 00 78",  # Session Expiry Interval 120
            "12 00 06 61 75 74 6F 2D 31",  # Assigned Client Identifier "auto-1"
            "13 00 3C",  # Server Keep Alive 60
            "1A 00 05 72 65 73 70 2F",  # Response Information "resp/"
            "1C 00 0A 6F 74 68 65 72 3A 31 38 38 33",  # Server Reference "other:1883"
            "1F 00 02 6F 6B",  # Reason String "ok"
            "21 00 64",  # Receive Maximum 100
            "22 00 05",  # Topic Alias Maximum 5
            "24 01",  # Maximum QoS 1
            "25 00",  # Retain Available 0
            "26 00 01 78 00 01 79  26 00 01 78 00 01 7A",  # User Property twice, same key
            "27 00 01 00 00",  # Maximum Packet Size 65536
            "28 00",  # Wildcard Subscription Available 0
            "29 01",  # Subscription Identifiers Available 1
            "2A 01",  # Shared Subscription Available 1
        ),
        ConnAck(True, 0, CONNACK_PROPS),
        "5.0 s3.2.2.3 CONNACK properties; User Property may repeat, order kept (s3.2.2.3.10)",
        CLIENT,
    ),
    Vector(
        "publish-5-qos0",
        5,
        "30 08  00 03 61 2F 62  00  68 69",
        Publish("a/b", b"hi"),
        "5.0 s3.3.2: topic, property length 0, payload",
    ),
    Vector(
        "publish-5-qos0-retain-user-property",
        5,
        "31 0F  00 03 61 2F 62  07 26 00 01 6B 00 01 76  68 69",
        Publish("a/b", b"hi", retain=True, properties={P.USER_PROPERTY: [("k", "v")]}),
        "5.0 s3.3.2.3.7 User Property at QoS 0",
    ),
    Vector(
        "publish-5-qos2-no-properties",
        5,
        "34 08  00 01 61  00 05  00  78 79",
        Publish("a", b"xy", qos=2, packet_id=5),
        "5.0 s3.3.2: topic, packet identifier, property length 0",
    ),
    Vector(
        "publish-5-qos1-properties",
        5,
        _h(
            "32 35  00 03 61 2F 62  00 01",
            "2B",  # property length 43
            "01 01",  # Payload Format Indicator 1
            "02 00 00 0E 10",  # Message Expiry Interval 3600
            "03 00 04 6A 73 6F 6E",  # Content Type "json"
            "08 00 04 72 65 2F 73",  # Response Topic "re/s"
            "09 00 02 00 01",  # Correlation Data
            "0B 01",  # Subscription Identifier 1
            "0B FF FF FF 7F",  # Subscription Identifier 268,435,455 (largest VBI)
            "23 00 03",  # Topic Alias 3
            "26 00 01 6B 00 01 76",  # User Property
            "7B 7D",  # payload "{}"
        ),
        Publish("a/b", b"{}", qos=1, packet_id=1, properties=PUBLISH_PROPS),
        "5.0 s3.3.2.3 PUBLISH properties; several Subscription Identifiers (s3.3.2.3.8)",
        CLIENT,  # [MQTT-3.3.4-6] only a server sends Subscription Identifiers
    ),
    Vector(
        "publish-5-qos2-topic-alias-empty-topic",
        5,
        "34 09  00 00  00 07  03 23 00 05  78",
        Publish("", b"x", qos=2, packet_id=7, properties={P.TOPIC_ALIAS: 5}),
        "5.0 s3.3.2.3.4 Topic Alias with a zero-length topic name",
    ),
    Vector("puback-5-short", 5, "40 02 00 0A", PubAck(10), "5.0 s3.4.2.1 RL 2: success, none"),
    Vector(
        "puback-5-reason-only",
        5,
        "40 03  00 0A  10",
        PubAck(10, ReasonCode.NO_MATCHING_SUBSCRIBERS),
        "5.0 s3.4.2.2.1 RL < 4: no property length, 0 is used",
    ),
    Vector(
        "puback-5-long-no-properties",
        5,
        "40 04  00 0A  10  00",
        PubAck(10, ReasonCode.NO_MATCHING_SUBSCRIBERS),
        "5.0 s3.4.2.2 explicit property length 0 is legal",
        canonical=False,
    ),
    Vector(
        "puback-5-explicit-success",
        5,
        "40 03  00 0A  00",
        PubAck(10),
        "5.0 s3.4.2.1 explicit reason code 0 is legal",
        canonical=False,
    ),
    Vector(
        "puback-5-explicit-success-long",
        5,
        "40 04  00 0A  00  00",
        PubAck(10),
        "5.0 s3.4.2.2 explicit reason code 0 and property length 0",
        canonical=False,
    ),
    Vector(
        "pubrec-5-long",
        5,
        "50 10  00 0B  80  0C  1F 00 02 6E 6F  26 00 01 6B 00 01 76",
        PubRec(
            11,
            ReasonCode.UNSPECIFIED_ERROR,
            {P.REASON_STRING: "no", P.USER_PROPERTY: [("k", "v")]},
        ),
        "5.0 s3.5.2 reason code and properties",
    ),
    Vector("pubrec-5-short", 5, "50 02 00 0B", PubRec(11), "5.0 s3.5.2.1"),
    Vector(
        "pubrel-5-reason",
        5,
        "62 03  00 0B  92",
        PubRel(11, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND),
        "5.0 s3.6.2.1 reason code 0x92",
    ),
    Vector("pubrel-5-short", 5, "62 02 00 0B", PubRel(11), "5.0 s3.6"),
    Vector(
        "pubcomp-5-success-with-properties",
        5,
        "70 08  00 0B  00  04  1F 00 01 78",
        PubComp(11, 0, {P.REASON_STRING: "x"}),
        "5.0 s3.7.2: reason code 0 cannot be omitted when properties follow",
    ),
    Vector("pubcomp-5-short", 5, "70 02 00 0B", PubComp(11), "5.0 s3.7"),
    Vector(
        "subscribe-5-options",
        5,
        _h(
            "82 19  00 0B",
            "03  0B 80 01",  # Subscription Identifier 128 (two-byte VBI)
            # options 2D = retain handling 2 (20) | RAP 08 | NL 04 | QoS 1
            "00 03 61 2F 2B  2D",
            # "$share/g/x", options 10 = retain handling 1, QoS 0
            "00 0A 24 73 68 61 72 65 2F 67 2F 78  10",
        ),
        Subscribe(
            11,
            [
                Subscription("a/+", 1, no_local=True, retain_as_published=True, retain_handling=2),
                Subscription("$share/g/x", 0, retain_handling=1),
            ],
            {P.SUBSCRIPTION_IDENTIFIER: [128]},
        ),
        "5.0 s3.8.3.1 subscription options, s3.8.2.1.2 Subscription Identifier",
        SERVER,
    ),
    Vector(
        "subscribe-5-no-properties",
        5,
        "82 09  00 0C  00  00 03 61 2F 62  02",
        Subscribe(12, [Subscription("a/b", 2)]),
        "5.0 s3.8.2",
        SERVER,
    ),
    Vector(
        "suback-5",
        5,
        "90 0A  00 0B  05 1F 00 02 6E 6F  01 A2",
        SubAck(
            11,
            [ReasonCode.GRANTED_QOS_1, ReasonCode.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED],
            {P.REASON_STRING: "no"},
        ),
        "5.0 s3.9",
        CLIENT,
    ),
    Vector("suback-5-no-props", 5, "90 04  00 0C  00  02", SubAck(12, [2]), "5.0 s3.9", CLIENT),
    Vector(
        "unsubscribe-5",
        5,
        "A2 0F  00 0D  07 26 00 01 6B 00 01 76  00 03 61 2F 62",
        Unsubscribe(13, ["a/b"], {P.USER_PROPERTY: [("k", "v")]}),
        "5.0 s3.10",
        SERVER,
    ),
    Vector(
        "unsuback-5",
        5,
        "B0 05  00 0D  00  00 11",
        UnsubAck(13, [ReasonCode.SUCCESS, ReasonCode.NO_SUBSCRIPTION_EXISTED]),
        "5.0 s3.11.3 one reason code per topic filter",
        CLIENT,
    ),
    Vector("pingreq-5", 5, "C0 00", PingReq(), "5.0 s3.12", SERVER),
    Vector("pingresp-5", 5, "D0 00", PingResp(), "5.0 s3.13", CLIENT),
    Vector("disconnect-5-short", 5, "E0 00", Disconnect(), "5.0 s3.14.2.1 RL 0"),
    Vector(
        "disconnect-5-reason-only",
        5,
        "E0 01 04",
        Disconnect(ReasonCode.DISCONNECT_WITH_WILL_MESSAGE),
        "5.0 s3.14.2.2.1 RL < 2: property length 0 is used",
        SERVER,
    ),
    Vector(
        "disconnect-5-explicit-long",
        5,
        "E0 02 04 00",
        Disconnect(ReasonCode.DISCONNECT_WITH_WILL_MESSAGE),
        "5.0 s3.14.2.2 explicit property length 0",
        SERVER,
        canonical=False,
    ),
    Vector(
        "disconnect-5-session-expiry",
        5,
        "E0 07  00  05 11 00 00 00 0A",
        Disconnect(0, {P.SESSION_EXPIRY_INTERVAL: 10}),
        "5.0 s3.14.2.2.2 Session Expiry Interval",
        SERVER,
    ),
    Vector(
        "disconnect-5-server-reference",
        5,
        "E0 0A  9C  08 1C 00 01 73  1F 00 01 72",
        Disconnect(ReasonCode.USE_ANOTHER_SERVER, {P.SERVER_REFERENCE: "s", P.REASON_STRING: "r"}),
        "5.0 s3.14.2.2.5 Server Reference",
        CLIENT,
    ),
    Vector("auth-5-short", 5, "F0 00", Auth(), "5.0 s3.15.2.1 RL 0 means success, none"),
    Vector(
        "auth-5-continue",
        5,
        "F0 0F  18  0D 15 00 05 53 43 52 41 4D  16 00 02 AB CD",
        Auth(
            ReasonCode.CONTINUE_AUTHENTICATION,
            {P.AUTHENTICATION_METHOD: "SCRAM", P.AUTHENTICATION_DATA: b"\xab\xcd"},
        ),
        "5.0 s3.15.2 AUTH reason code 0x18 and properties",
    ),
]

VECTORS = V311 + V5


def _fresh_server() -> Decoder:
    return Decoder()


def _server(version: int, **kwargs: Any) -> Decoder:
    """A server-side decoder that has read a CONNECT of ``version``."""
    dec = Decoder(**kwargs)
    dec.feed(bytes.fromhex(CONNECT_HEX[version]))
    first = dec.next_packet()
    assert isinstance(first, Connect) and first.protocol_level == version
    assert dec.version == version
    return dec


def _client(version: int) -> Decoder:
    return Decoder(version=4 if version == 3 else version)


def _decoders(v: Vector) -> list[Decoder]:
    if isinstance(v.packet, Connect):
        return [_fresh_server()]
    sides = [SERVER, CLIENT] if v.side == BOTH else [v.side]
    return [_server(v.version) if side == SERVER else _client(v.version) for side in sides]


def _drain(dec: Decoder) -> list[Packet]:
    out: list[Packet] = []
    while (p := dec.next_packet()) is not None:
        out.append(p)
    return out


# --------------------------------------------------------------------------- the vectors themselves


@pytest.mark.parametrize("v", VECTORS, ids=lambda v: v.id)
def test_vector_is_self_consistent(v: Vector) -> None:
    """Guard against typing slips in the hand-written hex: RL matches the bytes that follow."""
    data = v.data
    value, mult, i = 0, 1, 1
    while True:
        b = data[i]
        value += (b & 0x7F) * mult
        i += 1
        if not b & 0x80:
            break
        mult *= 128
    assert value == len(data) - i


def test_every_property_appears_in_some_vector() -> None:
    seen: set[int] = set()
    for v in VECTORS:
        seen.update(getattr(v.packet, "properties", {}))
        if isinstance(v.packet, Connect) and v.packet.will is not None:
            seen.update(v.packet.will.properties)
    assert {int(p) for p in P} <= seen


def test_every_packet_type_in_both_versions() -> None:
    for version, vectors in ((4, V311), (5, V5)):
        kinds = {type(v.packet) for v in vectors if v.version == version}
        expected = {
            Connect,
            ConnAck,
            Publish,
            PubAck,
            PubRec,
            PubRel,
            PubComp,
            Subscribe,
            SubAck,
            Unsubscribe,
            UnsubAck,
            PingReq,
            PingResp,
            Disconnect,
        }
        if version == 5:
            expected.add(Auth)
        assert expected <= kinds


# --------------------------------------------------------------------------- decode / encode


@pytest.mark.parametrize("v", VECTORS, ids=lambda v: v.id)
def test_decode(v: Vector) -> None:
    for dec in _decoders(v):
        dec.feed(v.data)
        assert dec.next_packet() == v.packet
        assert dec.next_packet() is None
        if isinstance(v.packet, Connect):
            assert dec.version == v.packet.protocol_level


@pytest.mark.parametrize("v", [v for v in VECTORS if len(v.data) < 300], ids=lambda v: v.id)
def test_decode_byte_by_byte(v: Vector) -> None:
    """Incomplete input means "need more data", never an exception (broker/mqtt/decode.py)."""
    for dec in _decoders(v):
        data = v.data
        for i in range(len(data) - 1):
            dec.feed(data[i : i + 1])
            assert dec.next_packet() is None, f"packet completed early at byte {i}"
        dec.feed(data[-1:])
        assert dec.packets() == [v.packet]


@pytest.mark.parametrize("v", [v for v in VECTORS if v.canonical], ids=lambda v: v.id)
def test_encode(v: Vector) -> None:
    assert encode(v.packet, v.version) == v.data


@pytest.mark.parametrize(
    "v", [v for v in VECTORS if v.canonical and isinstance(v.packet, Publish)], ids=lambda v: v.id
)
def test_encode_publish_fast_path(v: Vector) -> None:
    p = v.packet
    assert isinstance(p, Publish)
    out = encode_publish(
        p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id, p.properties, v.version
    )
    assert bytes(out) == v.data


def test_all_vectors_in_one_stream() -> None:
    """Every server-bound vector of a version back to back in one feed."""
    for version in (4, 5):
        vs = [
            v
            for v in VECTORS
            if v.version == version
            and v.side in (SERVER, BOTH)
            and not isinstance(v.packet, Connect)
        ]
        dec = _server(version)
        dec.feed(b"".join(v.data for v in vs))
        assert dec.packets() == [v.packet for v in vs]


# --------------------------------------------------------------------------- encoder refusals


@pytest.mark.parametrize(
    ("packet", "version", "why"),
    [
        (Auth(), 4, "AUTH exists only in 5.0 (3.1.1 s2.2.1: type 15 reserved)"),
        (Auth(), 3, "AUTH exists only in 5.0"),
        (Publish("a", b"", qos=3, packet_id=1), 4, "[MQTT-3.3.1-4] QoS 3"),
        (Publish("a", b"", qos=1), 4, "[MQTT-2.2.1-3] QoS 1 needs a packet identifier"),
        (Publish("a", b"", qos=2), 5, "[MQTT-2.2.1-3] QoS 2 needs a packet identifier"),
        (Publish("a", b"", qos=1, packet_id=0), 4, "[MQTT-2.2.1-3] non-zero packet identifier"),
        (Publish("a", b"", packet_id=5), 4, "[MQTT-2.2.1-2] no packet identifier at QoS 0"),
        (Publish("a", b"", dup=True), 4, "[MQTT-3.3.1-2] DUP must be 0 at QoS 0"),
        (PubAck(65536), 4, "s2.2.1 packet identifiers are 16-bit"),
        (PubAck(1, 0x10), 4, "3.1.1 s3.4: PUBACK has no reason code before 5.0"),
        (Subscribe(0, [Subscription("a")]), 4, "[MQTT-2.2.1-3]"),
        (Subscribe(1, []), 4, "[MQTT-3.8.3-3] at least one topic filter"),
        (Unsubscribe(1, []), 5, "[MQTT-3.10.3-2] at least one topic filter"),
        (Subscribe(1, [Subscription("a", 3)]), 4, "[MQTT-3-8.3-4] QoS 3"),
        (Subscribe(1, [Subscription("a", 1, no_local=True)]), 4, "3.1.1: reserved option bits"),
        (Subscribe(1, [Subscription("a", 1, retain_handling=3)]), 5, "s3.8.3.1 retain handling 3"),
        (Connect("c", 4, password=b"x"), 4, "3.1.1 [MQTT-3.1.2-22] password needs user name"),
        (Connect("c", 4, will=Will("w", b"", 3)), 4, "[MQTT-3.1.2-14] Will QoS 3"),
        (Connect("c", 4, keepalive=65536), 4, "s3.1.2.10 keep alive is two bytes"),
        (Connect("c", 5, password=b"x" * 65536), 5, "s1.5.6 binary data at most 65,535 bytes"),
        (ConnAck(False, 0x87), 4, "3.1.1 s3.2.2.3 return codes are 0..5"),
        (Publish("a" * 65536, b""), 4, "[MQTT-4.7.3-3] / s1.5.4 at most 65,535 bytes"),
        (Publish("a\x00", b""), 4, "[MQTT-1.5.4-2] no U+0000"),
        (Publish("a\ud800", b""), 4, "[MQTT-1.5.4-1] no surrogates"),
        (Publish("a", b"", properties={0x11: 1}), 5, "s2.2.2.2 property not valid in PUBLISH"),
        (Publish("a", b"", properties={0x7F: 1}), 5, "s2.2.2.2 unknown property"),
        (Publish("a", b"", properties={0x01: 300}), 5, "s2.2.2.2 a byte property"),
        (Publish("a", b"", properties={0x03: 5}), 5, "s2.2.2.2 value of the wrong type"),
        (Connect("c", 5, properties={0x21: 70000}), 5, "s3.1.2.11.3 two-byte integer"),
        (
            Subscribe(1, [Subscription("a")], {0x0B: [268_435_456]}),
            5,
            "s1.5.5 VBI at most 268,435,455",
        ),
        (Subscribe(1, [Subscription("a")], {0x0B: [0]}), 5, "s3.8.2.1.2 not 0"),
        (PingReq(), 6, "no protocol level 6"),
    ],
)
def test_encode_refuses(packet: Packet, version: int, why: str) -> None:
    with pytest.raises(LocalProtocolError):
        encode(packet, version)


@pytest.mark.parametrize(
    ("reason", "level", "hex_bytes", "why"),
    [
        # 5.0: 20 | RL 3 | flags 00 | reason code | property length 00
        (0x84, 5, "20 03 00 84 00", "5.0 s3.2.2.2 Unsupported Protocol Version"),
        (0x84, 6, "20 03 00 84 00", "[MQTT-3.1.2-2] a later level reads the 5.0 form"),
        (0x86, 5, "20 03 00 86 00", "5.0 s3.2.2.2 Bad User Name or Password"),
        (0x82, 5, "20 03 00 82 00", "5.0 s3.2.2.2 Protocol Error"),
        # 3.1.1: 20 | RL 2 | flags 00 | return code (3.1.1 s3.2.2.3)
        (0x84, 4, "20 02 00 01", "3.1.1 s3.2.2.3 1: unacceptable protocol version"),
        (0x84, 2, "20 02 00 01", "3.1.1 s3.1.2.2 an older level reads the 3.1.1 form"),
        (0x84, None, "20 02 00 01", "no level readable: the 3.1.1 form"),
        (0x85, 4, "20 02 00 02", "3.1.1 s3.2.2.3 2: identifier rejected"),
        (0x88, 4, "20 02 00 03", "3.1.1 s3.2.2.3 3: server unavailable"),
        (0x89, 3, "20 02 00 03", "server busy: 3, server unavailable (MQTT 3.1 alike)"),
        (0x86, 4, "20 02 00 04", "3.1.1 s3.2.2.3 4: bad user name or password"),
        (0x87, 4, "20 02 00 05", "3.1.1 s3.2.2.3 5: not authorized"),
        (0x8A, 4, "20 02 00 05", "banned: 5, not authorized"),
        (0x95, 4, "20 02 00 05", "no 3.1.1 code for packet too large: 5, not authorized"),
    ],
)
def test_connack_refused(reason: int, level: int | None, hex_bytes: str, why: str) -> None:
    """The refusing CONNACK in the form of the level the client asked for; a client decodes
    it back to a CONNACK without session present [MQTT-3.2.2-4], [MQTT-3.2.2-6]."""
    data = encode_connack_refused(reason, level)
    assert data == bytes.fromhex(hex_bytes), why
    client = Decoder(version=5 if level is not None and level >= 5 else 4)
    client.feed(data)
    (packet,) = client.packets()
    assert packet == ConnAck(False, data[3])


def test_connack_refused_needs_a_refusing_reason() -> None:
    with pytest.raises(LocalProtocolError):
        encode_connack_refused(0x00, 5)  # Success is no refusal (s3.2.2.2: >= 0x80)


def test_311_encodes_no_properties() -> None:
    """Packets of versions 3/4 encode no properties (3.1.1 has none; broker/mqtt/encode.py)."""
    assert encode(Publish("a", b"x", properties={P.PAYLOAD_FORMAT_INDICATOR: 1}), 4) == (
        bytes.fromhex("30 04 00 01 61 78")
    )


def test_second_connect_decodes() -> None:
    """A second CONNECT decodes; the connection layer rejects it
    ([MQTT-3.1.0-2] is a connection-state rule, not a framing one)."""
    dec = _server(4)
    dec.feed(bytes.fromhex(CONNECT_HEX[4]))
    assert dec.packets() == [Connect("abc", 4, keepalive=60)]


def test_empty_feed_needs_more_data() -> None:
    dec = Decoder()
    dec.feed(b"")
    assert dec.next_packet() is None
    assert dec.packets() == []
    assert dec.version is None


# --------------------------------------------------------------------------- malformed input


@dataclass(frozen=True)
class Bad:
    id: str
    version: int | None  # None: a fresh server decoder (the bytes start with CONNECT)
    hex: str
    error: type[MQTTError]
    spec: str
    side: str = SERVER
    reason: int | None = None  # when the spec asks for another code than the class default


BAD: list[Bad] = [
    # -- variable byte integers (5.0 s1.5.5, 3.1.1 s2.2.3: at most four bytes)
    Bad(
        "vbi-5-bytes-remaining-length",
        4,
        "30 80 80 80 80 01",
        MalformedPacket,
        "3.1.1 s2.2.3 / 5.0 s1.5.5: at most four bytes",
    ),
    Bad("vbi-5-bytes-remaining-length-ff", 5, "30 FF FF FF FF 7F", MalformedPacket, "5.0 s1.5.5"),
    Bad(
        "vbi-5-bytes-property-length",
        5,
        "30 08  00 01 61  80 80 80 80 01",
        MalformedPacket,
        "5.0 s1.5.5, s2.2.2.1 property length is a VBI",
    ),
    Bad(
        "vbi-5-bytes-subscription-identifier",
        5,
        "82 0D  00 01  06 0B 80 80 80 80 01  00 01 61 00",
        MalformedPacket,
        "5.0 s1.5.5, s3.8.2.1.2 Subscription Identifier is a VBI",
    ),
    # -- UTF-8 strings
    Bad(
        "utf8-invalid-byte",
        4,
        "30 05  00 03 61 FF 62",
        MalformedPacket,
        "3.1.1 [MQTT-1.5.3-1] ill-formed UTF-8",
    ),
    Bad(
        "utf8-overlong",
        5,
        "30 05  00 02 C0 AF  00",
        MalformedPacket,
        "5.0 [MQTT-1.5.4-1] well-formed per Unicode: overlong '/' is ill-formed",
    ),
    Bad(
        "utf8-truncated-sequence", 4, "30 04  00 02 61 E2", MalformedPacket, "3.1.1 [MQTT-1.5.3-1]"
    ),
    Bad(
        "utf8-null-in-topic",
        4,
        "30 05  00 03 61 00 62",
        MalformedPacket,
        "3.1.1 [MQTT-1.5.3-2] no U+0000",
    ),
    Bad(
        "utf8-null-in-client-id",
        None,
        "10 0E  00 04 4D 51 54 54  04  02  00 00  00 02 61 00",
        MalformedPacket,
        "3.1.1 [MQTT-1.5.3-2]",
    ),
    Bad(
        "utf8-null-in-user-property",
        5,
        "30 0C  00 01 61  07 26 00 01 00 00 01 76  78",
        MalformedPacket,
        "5.0 [MQTT-1.5.4-2], s1.5.7 a string pair is two UTF-8 strings",
    ),
    Bad(
        "utf8-high-surrogate",
        4,
        "30 06  00 03 ED A0 80  78",
        MalformedPacket,
        "3.1.1 [MQTT-1.5.3-1] no code points U+D800..U+DFFF",
    ),
    Bad(
        "utf8-low-surrogate", 5, "30 06  00 03 ED BF BF  00", MalformedPacket, "5.0 [MQTT-1.5.4-1]"
    ),
    # -- reserved fixed-header flag bits (3.1.1 [MQTT-2.2.2-2], 5.0 s2.1.3)
    Bad(
        "reserved-flags-pubrel",
        4,
        "60 02 00 01",
        MalformedPacket,
        "3.1.1 [MQTT-3.6.1-1] PUBREL flags must be 0010",
    ),
    Bad(
        "reserved-flags-subscribe",
        4,
        "80 06  00 01  00 01 61 00",
        MalformedPacket,
        "3.1.1 [MQTT-3.8.1-1]",
    ),
    Bad(
        "reserved-flags-unsubscribe",
        5,
        "A0 06  00 01  00  00 01 61",
        MalformedPacket,
        "5.0 [MQTT-3.10.1-1]",
    ),
    Bad("reserved-flags-pingreq", 4, "C1 00", MalformedPacket, "3.1.1 [MQTT-2.2.2-2]"),
    Bad("reserved-flags-puback", 5, "41 02 00 01", MalformedPacket, "5.0 s2.1.3"),
    Bad("reserved-flags-disconnect", 5, "E2 00", MalformedPacket, "5.0 s2.1.3"),
    Bad(
        "reserved-flags-connect",
        None,
        "11" + CONNECT_HEX[4].replace(" ", "")[2:],
        MalformedPacket,
        "3.1.1 [MQTT-2.2.2-2] CONNECT flags must be 0000",
    ),
    Bad(
        "connect-flags-reserved-bit",
        None,
        "10 0F  00 04 4D 51 54 54  04  03  00 3C  00 03 61 62 63",
        MalformedPacket,
        "3.1.1 [MQTT-3.1.2-3] / 5.0 [MQTT-3.1.2-3] reserved connect flag must be 0",
    ),
    Bad(
        "connect-will-qos-3",
        None,
        "10 15  00 04 4D 51 54 54  04  1E  00 3C  00 03 61 62 63  00 01 77  00 01 78",
        MalformedPacket,
        "3.1.1 [MQTT-3.1.2-14] Will QoS must not be 3",
    ),
    Bad(
        "connect-will-qos-without-will-flag",
        None,
        "10 0F  00 04 4D 51 54 54  04  0A  00 3C  00 03 61 62 63",
        MalformedPacket,
        "3.1.1 [MQTT-3.1.2-13] Will QoS must be 0 when the Will Flag is 0",
    ),
    Bad(
        "connect-will-retain-without-will-flag",
        None,
        "10 0F  00 04 4D 51 54 54  04  22  00 3C  00 03 61 62 63",
        MalformedPacket,
        "3.1.1 [MQTT-3.1.2-15] Will Retain must be 0 when the Will Flag is 0",
    ),
    Bad(
        "subscription-options-reserved-bits",
        5,
        "82 07  00 01  00  00 01 61 C1",
        MalformedPacket,
        "5.0 [MQTT-3.8.3-5] reserved bits 6-7 must be 0",
    ),
    Bad(
        "subscribe-311-requested-qos-reserved-bits",
        4,
        "82 06  00 01  00 01 61 04",
        MalformedPacket,
        "3.1.1 [MQTT-3-8.3-4] upper 6 bits of requested QoS must be 0",
    ),
    Bad(
        "subscribe-qos-3",
        4,
        "82 06  00 01  00 01 61 03",
        MalformedPacket,
        "3.1.1 [MQTT-3-8.3-4] / 5.0 s3.8.3.1: Maximum QoS 3 is a Malformed Packet",
    ),
    Bad(
        "subscribe-retain-handling-3",
        5,
        "82 07  00 01  00  00 01 61 30",
        ProtocolError,
        "5.0 s3.8.3.1: It is a Protocol Error to send a Retain Handling value of 3",
    ),
    # -- properties (5.0 s2.2.2.2)
    Bad(
        "property-not-allowed-publish-session-expiry",
        5,
        "30 0A  00 01 61  05 11 00 00 00 0A  78",
        MalformedPacket,
        "5.0 s2.2.2.2: an Identifier not valid for its packet type is a Malformed Packet",
    ),
    Bad(
        "property-not-allowed-connect-topic-alias",
        None,
        "10 13  00 04 4D 51 54 54  05  02  00 00  03 23 00 01  00 03 61 62 63",
        MalformedPacket,
        "5.0 s2.2.2.2",
    ),
    Bad(
        "property-not-allowed-puback-payload-format",
        5,
        "40 06  00 01  00  02 01 01",
        MalformedPacket,
        "5.0 s2.2.2.2",
    ),
    Bad(
        "property-unknown-identifier",
        5,
        "30 07  00 01 61  02 7F 00  78",
        MalformedPacket,
        "5.0 s2.2.2.2: 0x7F is not a property identifier",
    ),
    Bad(
        "property-duplicated-payload-format",
        5,
        "30 09  00 01 61  04 01 01 01 00  78",
        ProtocolError,
        "5.0 s3.3.2.3.2: Protocol Error to include it more than once",
    ),
    Bad(
        "property-duplicated-session-expiry",
        None,
        _h(
            "10 1A  00 04 4D 51 54 54  05  02  00 00",
            "0A 11 00 00 00 01 11 00 00 00 02  00 03 61 62 63",
        ),
        ProtocolError,
        "5.0 s3.1.2.11.2: Protocol Error to include it more than once",
    ),
    Bad(
        "property-duplicated-reason-string",
        5,
        "40 0C  00 01  10  08 1F 00 01 61 1F 00 01 62",
        ProtocolError,
        "5.0 s3.4.2.2.2: Protocol Error to include it more than once",
    ),
    Bad(
        "property-duplicated-subscription-identifier-in-subscribe",
        5,
        "82 0B  00 01  04 0B 01 0B 02  00 01 61 00",
        ProtocolError,
        "5.0 s3.8.2.1.2: Protocol Error to include it more than once",
    ),
    Bad(
        "property-length-beyond-packet",
        5,
        "30 06  00 01 61  0A 01 01",
        MalformedPacket,
        "5.0 s2.2.2.1 / s4.13: lengths disagree",
    ),
    Bad(
        "property-value-receive-maximum-0",
        None,
        "10 13  00 04 4D 51 54 54  05  02  00 3C  03 21 00 00  00 03 61 62 63",
        ProtocolError,
        "5.0 s3.1.2.11.3: Protocol Error for the Receive Maximum to have the value 0",
    ),
    Bad(
        "property-value-maximum-packet-size-0",
        None,
        "10 15  00 04 4D 51 54 54  05  02  00 3C  05 27 00 00 00 00  00 03 61 62 63",
        ProtocolError,
        "5.0 s3.1.2.11.4: Protocol Error to include a Maximum Packet Size of zero",
    ),
    Bad(
        "property-value-request-problem-information-2",
        None,
        "10 12  00 04 4D 51 54 54  05  02  00 3C  02 17 02  00 03 61 62 63",
        ProtocolError,
        "5.0 s3.1.2.11.7: Protocol Error to have a value other than 0 or 1",
    ),
    Bad(
        "property-value-subscription-identifier-0",
        5,
        "82 09  00 01  02 0B 00  00 01 61 00",
        ProtocolError,
        "5.0 s3.8.2.1.2: Protocol Error if the Subscription Identifier has a value of 0",
    ),
    Bad(
        "property-value-topic-alias-0",
        5,
        "30 08  00 01 61  03 23 00 00  78",
        ProtocolError,
        "5.0 s3.3.4: a Topic Alias value of 0 ... is a Protocol Error, the receiver uses "
        "DISCONNECT with Reason Code 0x94 (Topic Alias invalid)",
        reason=ReasonCode.TOPIC_ALIAS_INVALID,
    ),
    # -- CONNECT structure
    Bad(
        "connect-311-password-without-username",
        None,
        "10 13  00 04 4D 51 54 54  04  42  00 3C  00 03 61 62 63  00 02 70 77",
        MalformedPacket,
        "3.1.1 [MQTT-3.1.2-22] password flag requires the user name flag",
    ),
    Bad(
        "connect-trailing-byte",
        None,
        "10 10  00 04 4D 51 54 54  04  02  00 3C  00 03 61 62 63  00",
        MalformedPacket,
        "3.1.1 s3.1.3: the payload is exactly the fields the flags announce",
    ),
    Bad(
        "connect-will-topic-missing",
        None,
        "10 0F  00 04 4D 51 54 54  04  06  00 3C  00 03 61 62 63",
        MalformedPacket,
        "3.1.1 [MQTT-3.1.2-9] will flag set: Will Topic and Will Message must be present",
    ),
    Bad(
        "connack-reserved-ack-flags",
        4,
        "20 02  02 00",
        MalformedPacket,
        "3.1.1 / 5.0 [MQTT-3.2.2-1] bits 7-1 of the acknowledge flags are reserved, 0",
        CLIENT,
    ),
    # -- PUBLISH header
    Bad(
        "publish-qos-3",
        4,
        "36 07  00 03 61 2F 62  00 01",
        MalformedPacket,
        "3.1.1 [MQTT-3.3.1-4] / 5.0 [MQTT-3.3.1-4] QoS bits 11",
    ),
    Bad(
        "publish-qos-3-v5",
        5,
        "36 08  00 03 61 2F 62  00 01  00",
        MalformedPacket,
        "5.0 [MQTT-3.3.1-4]",
    ),
    Bad(
        "publish-qos0-dup",
        4,
        "38 05  00 03 61 2F 62",
        MalformedPacket,
        "3.1.1 / 5.0 [MQTT-3.3.1-2] DUP must be 0 for QoS 0",
    ),
    Bad(
        "publish-qos1-packet-id-0",
        4,
        "32 05  00 01 61  00 00",
        ProtocolError,
        "3.1.1 / 5.0 [MQTT-2.2.1-3] non-zero packet identifier",
    ),
    Bad("subscribe-packet-id-0", 4, "82 06  00 00  00 01 61 00", ProtocolError, "[MQTT-2.2.1-3]"),
    Bad("subscribe-no-filters-311", 4, "82 02  00 01", ProtocolError, "3.1.1 [MQTT-3.8.3-3]"),
    Bad("subscribe-no-filters-5", 5, "82 03  00 01  00", ProtocolError, "5.0 [MQTT-3.8.3-2]"),
    Bad("unsubscribe-no-filters-311", 4, "A2 02  00 01", ProtocolError, "3.1.1 [MQTT-3.10.3-2]"),
    # -- CONNECT protocol name / level
    Bad(
        "unknown-protocol-level-6",
        None,
        "10 0F  00 04 4D 51 54 54  06  02  00 3C  00 03 61 62 63",
        UnsupportedProtocolVersion,
        "3.1.1 [MQTT-3.1.2-2] / 5.0 s3.1.2.2 -> 0x84",
    ),
    Bad(
        "unknown-protocol-level-2",
        None,
        "10 0F  00 04 4D 51 54 54  02  02  00 3C  00 03 61 62 63",
        UnsupportedProtocolVersion,
        "3.1.1 [MQTT-3.1.2-2]",
    ),
    Bad(
        "unknown-protocol-name",
        None,
        "10 0F  00 04 4D 51 54 58  04  02  00 3C  00 03 61 62 63",
        UnsupportedProtocolVersion,
        "3.1.1 [MQTT-3.1.2-1] protocol name 'MQTX'",
    ),
    Bad(
        "mqtt-name-with-level-3",
        None,
        "10 0F  00 04 4D 51 54 54  03  02  00 3C  00 03 61 62 63",
        UnsupportedProtocolVersion,
        "contract: 'MQTT' goes with levels 4 and 5 only",
    ),
    Bad(
        "mqisdp-name-with-level-4",
        None,
        "10 11  00 06 4D 51 49 73 64 70  04  02  00 3C  00 03 61 62 63",
        UnsupportedProtocolVersion,
        "contract: 'MQIsdp' goes with level 3 only",
    ),
    # -- first packet
    Bad(
        "first-packet-pingreq",
        None,
        "C0 00",
        ProtocolError,
        "3.1.1 / 5.0 [MQTT-3.1.0-1] first packet must be CONNECT",
    ),
    Bad(
        "first-packet-publish",
        None,
        "30 07  00 03 61 2F 62  68 69",
        ProtocolError,
        "[MQTT-3.1.0-1]",
    ),
    # -- packet types and lengths
    Bad("packet-type-0", 4, "00 00", MalformedPacket, "3.1.1 s2.2.1 type 0 reserved"),
    Bad("packet-type-15-in-311", 4, "F0 00", MalformedPacket, "3.1.1 s2.2.1 type 15 reserved"),
    Bad("puback-too-short", 4, "40 01 00", MalformedPacket, "3.1.1 s3.4 RL must be 2"),
    Bad(
        "publish-topic-length-beyond-packet",
        4,
        "30 03  00 05 61",
        MalformedPacket,
        "3.1.1 s1.5.3 string length exceeds the packet",
    ),
    Bad("pingreq-with-body", 4, "C0 01 00", MalformedPacket, "3.1.1 s3.12 RL 0"),
    Bad(
        "puback-311-too-long",
        4,
        "40 03  00 0A 00",
        MalformedPacket,
        "3.1.1 s3.4.1 RL must be 2 (no reason code in 3.1.1)",
    ),
    Bad("disconnect-311-with-body", 4, "E0 01 00", MalformedPacket, "3.1.1 s3.14 RL 0"),
    Bad("connack-short", 5, "20 01 00", MalformedPacket, "5.0 s3.2.2", CLIENT),
]


def _bad_decoder(b: Bad, **kwargs: Any) -> Decoder:
    if b.version is None:
        return Decoder(**kwargs)
    if b.side == CLIENT:
        return Decoder(version=b.version, **kwargs)
    return _server(b.version, **kwargs)


@pytest.mark.parametrize("b", BAD, ids=lambda b: b.id)
def test_malformed(b: Bad) -> None:
    dec = _bad_decoder(b)
    with pytest.raises(MQTTError) as info:
        dec.feed(bytes.fromhex(b.hex))
        _drain(dec)
    err = info.value
    assert type(err) is b.error, f"{b.spec}: expected {b.error.__name__}, got {err!r}"
    expected_reason = b.reason if b.reason is not None else b.error.reason_code
    assert err.reason_code == expected_reason, f"{b.spec}: reason code {err.reason_code:#x}"
    # After an error the decoder is dead: the same error again [contract].
    with pytest.raises(b.error):
        dec.next_packet()


def test_reason_codes_of_error_classes() -> None:
    assert MalformedPacket("x").reason_code == 0x81
    assert ProtocolError("x").reason_code == 0x82
    assert UnsupportedProtocolVersion("x").reason_code == 0x84
    assert PacketTooLarge("x").reason_code == 0x95


# --------------------------------------------------------------------------- maximum packet size


def test_oversized_packet_rejected_from_fixed_header_alone() -> None:
    """Only the fixed header is fed: PUBLISH with RL 1000 against a 100-byte limit.

    5.0 s3.1.2.11.4 / [MQTT-3.2.2-15]: packets larger than Maximum Packet Size are refused;
    the decoder rejects them from the fixed header, before the body is buffered.
    """
    dec = _server(5, max_packet_size=100)
    with pytest.raises(PacketTooLarge) as info:
        dec.feed(bytes.fromhex("30 E8 07"))  # RL 1000 = 0xE8 0x07
        dec.next_packet()
    assert info.value.reason_code == 0x95


def test_incomplete_fixed_header_is_not_an_error() -> None:
    dec = _server(5, max_packet_size=100)
    dec.feed(bytes.fromhex("30 E8"))  # continuation bit set: RL not known yet
    assert dec.next_packet() is None


def test_oversized_connect_rejected_from_fixed_header() -> None:
    dec = Decoder(max_packet_size=64)
    with pytest.raises(PacketTooLarge):
        dec.feed(bytes.fromhex("10 FF FF FF 7F"))
        dec.next_packet()


def test_maximum_packet_size_counts_the_whole_packet() -> None:
    """5.0 s3.1.2.11.4: the Maximum Packet Size is "the total number of bytes in an MQTT
    Control Packet", fixed header included: 2 + 98 = 100 passes, 2 + 99 = 101 does not."""
    ok = bytes.fromhex("30 62  00 01 61  00") + bytes(94)  # RL 0x62 = 98
    assert len(ok) == 100
    dec = _server(5, max_packet_size=100)
    dec.feed(ok)
    assert dec.packets() == [Publish("a", bytes(94))]
    too_big = bytes.fromhex("30 63")  # RL 99 -> 101 bytes
    dec = _server(5, max_packet_size=100)
    with pytest.raises(PacketTooLarge):
        dec.feed(too_big)
        dec.next_packet()
