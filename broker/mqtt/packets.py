"""MQTT control packets as plain values (MQTT 3.1 / 3.1.1 / 5.0).

Every packet is a slotted dataclass: equality is field equality, so a decoded packet compares
equal to the one that was encoded. They are deliberately *not* frozen: measured on the
2-core CI machine, a frozen 7-field dataclass costs ~1.9 us to construct (every field goes
through ``object.__setattr__``) against ~0.45 us for a plain slotted one, which alone would
hold PUBLISH decoding under the 300,000 packets/s target (``bench/codec.py``). Treat packets
as immutable values anyway: the codec never mutates a packet it returned or was given, and
the router may share one decoded packet between subscribers.

Conventions shared by every packet (the decoder produces and the encoder expects them):

* ``properties`` is a ``dict[int, Any]`` keyed by :class:`~broker.mqtt.properties.PropertyId`;
  it is always empty for protocol levels 3 and 4, which have no properties.
* ``reason_code`` is the 5.0 reason code (s2.4); for a 3.1.1 CONNACK it is the 0..5 return
  code, and 3.1.1 packets other than CONNACK / SUBACK carry no reason code (always 0).
* ``packet_id`` is 1..65535 wherever the spec requires one [MQTT-2.2.1-3].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TypeAlias

from broker.mqtt.reason_codes import ReasonCode

__all__ = [
    "REASON_CODES_V5",
    "REASON_CODES_V311",
    "Auth",
    "ConnAck",
    "Connect",
    "Disconnect",
    "Packet",
    "PacketType",
    "PingReq",
    "PingResp",
    "ProtocolVersion",
    "PubAck",
    "PubComp",
    "PubRec",
    "PubRel",
    "Publish",
    "SubAck",
    "Subscribe",
    "Subscription",
    "UnsubAck",
    "Unsubscribe",
    "Will",
]


class ProtocolVersion(IntEnum):
    """The CONNECT protocol level. 3 goes with the name "MQIsdp", 4 and 5 with "MQTT"."""

    MQTT31 = 3
    MQTT311 = 4
    MQTT5 = 5


class PacketType(IntEnum):
    """The control packet type in the high nibble of the first fixed-header byte (s2.1.2)."""

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


def _props() -> dict[int, Any]:
    return {}


@dataclass(slots=True)
class Will:
    """The will message of a CONNECT (s3.1.2.5, s3.1.3.2-3.1.3.4)."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class Connect:
    """CONNECT (s3.1). ``clean_start`` is 3.1.1's Clean Session flag at levels 3 and 4.

    ``protocol_name`` is "MQIsdp" for level 3 and "MQTT" for levels 4 and 5.
    ``password`` is binary data (s3.1.3.5); 3.1.1 forbids it without a username
    [MQTT-3.1.2-22], 5.0 allows it.
    """

    client_id: str
    protocol_level: int = 4
    protocol_name: str = "MQTT"
    clean_start: bool = True
    keepalive: int = 0
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class ConnAck:
    """CONNACK (s3.2). At levels 3/4 ``reason_code`` is the 0..5 return code."""

    session_present: bool = False
    reason_code: int = 0
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class Publish:
    """PUBLISH (s3.3). ``packet_id`` is None exactly when ``qos`` is 0 [MQTT-2.2.1-2].

    ``topic`` may be "" in 5.0 when a TOPIC_ALIAS property is present (s3.3.2.3.4); topic
    rules beyond UTF-8 well-formedness are the connection layer's job (broker/mqtt/topics.py).
    """

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class PubAck:
    """PUBACK (s3.4): the answer to a QoS 1 PUBLISH."""

    packet_id: int
    reason_code: int = 0
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class PubRec:
    """PUBREC (s3.5): first answer to a QoS 2 PUBLISH."""

    packet_id: int
    reason_code: int = 0
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class PubRel:
    """PUBREL (s3.6); its fixed-header flags are 0b0010 [MQTT-3.6.1-1]."""

    packet_id: int
    reason_code: int = 0
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class PubComp:
    """PUBCOMP (s3.7): the end of the QoS 2 exchange."""

    packet_id: int
    reason_code: int = 0
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class Subscription:
    """One topic filter of a SUBSCRIBE with its options (s3.8.3.1).

    ``no_local``, ``retain_as_published`` and ``retain_handling`` exist only in 5.0; at
    levels 3/4 they are always their defaults.
    """

    topic_filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(slots=True)
class Subscribe:
    """SUBSCRIBE (s3.8); flags 0b0010 [MQTT-3.8.1-1], at least one filter [MQTT-3.8.3-3]."""

    packet_id: int
    subscriptions: list[Subscription]
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class SubAck:
    """SUBACK (s3.9): one reason code (3.1.1: return code) per subscription, in order."""

    packet_id: int
    reason_codes: list[int]
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class Unsubscribe:
    """UNSUBSCRIBE (s3.10); flags 0b0010 [MQTT-3.10.1-1], at least one filter [MQTT-3.10.3-2]."""

    packet_id: int
    topic_filters: list[str]
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class UnsubAck:
    """UNSUBACK (s3.11). 3.1.1 UNSUBACK has no reason codes, so it decodes to ``[]``."""

    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class PingReq:
    """PINGREQ (s3.12): no variable header, no payload."""


@dataclass(slots=True)
class PingResp:
    """PINGRESP (s3.13): no variable header, no payload."""


@dataclass(slots=True)
class Disconnect:
    """DISCONNECT (s3.14). At levels 3/4 it carries nothing (reason 0, no properties)."""

    reason_code: int = 0
    properties: dict[int, Any] = field(default_factory=_props)


@dataclass(slots=True)
class Auth:
    """AUTH (s3.15), 5.0 only: extended authentication exchange."""

    reason_code: int = 0
    properties: dict[int, Any] = field(default_factory=_props)


Packet: TypeAlias = (
    Connect
    | ConnAck
    | Publish
    | PubAck
    | PubRec
    | PubRel
    | PubComp
    | Subscribe
    | SubAck
    | Unsubscribe
    | UnsubAck
    | PingReq
    | PingResp
    | Disconnect
    | Auth
)

_R = ReasonCode

#: The reason codes each 5.0 packet type may carry (s3.2.2.2, s3.4.2.1, s3.5.2.1, s3.6.2.1,
#: s3.7.2.1, s3.9.3, s3.11.3, s3.14.2.1, s3.15.2.1). Anything else is a Protocol Error.
REASON_CODES_V5: dict[int, frozenset[int]] = {
    PacketType.CONNACK: frozenset(
        {
            _R.SUCCESS,
            _R.UNSPECIFIED_ERROR,
            _R.MALFORMED_PACKET,
            _R.PROTOCOL_ERROR,
            _R.IMPLEMENTATION_SPECIFIC_ERROR,
            _R.UNSUPPORTED_PROTOCOL_VERSION,
            _R.CLIENT_IDENTIFIER_NOT_VALID,
            _R.BAD_USER_NAME_OR_PASSWORD,
            _R.NOT_AUTHORIZED,
            _R.SERVER_UNAVAILABLE,
            _R.SERVER_BUSY,
            _R.BANNED,
            _R.BAD_AUTHENTICATION_METHOD,
            _R.TOPIC_NAME_INVALID,
            _R.PACKET_TOO_LARGE,
            _R.QUOTA_EXCEEDED,
            _R.PAYLOAD_FORMAT_INVALID,
            _R.RETAIN_NOT_SUPPORTED,
            _R.QOS_NOT_SUPPORTED,
            _R.USE_ANOTHER_SERVER,
            _R.SERVER_MOVED,
            _R.CONNECTION_RATE_EXCEEDED,
        }
    ),
    PacketType.PUBACK: frozenset(
        {
            _R.SUCCESS,
            _R.NO_MATCHING_SUBSCRIBERS,
            _R.UNSPECIFIED_ERROR,
            _R.IMPLEMENTATION_SPECIFIC_ERROR,
            _R.NOT_AUTHORIZED,
            _R.TOPIC_NAME_INVALID,
            _R.PACKET_IDENTIFIER_IN_USE,
            _R.QUOTA_EXCEEDED,
            _R.PAYLOAD_FORMAT_INVALID,
        }
    ),
    PacketType.PUBREL: frozenset({_R.SUCCESS, _R.PACKET_IDENTIFIER_NOT_FOUND}),
    PacketType.SUBACK: frozenset(
        {
            _R.GRANTED_QOS_0,
            _R.GRANTED_QOS_1,
            _R.GRANTED_QOS_2,
            _R.UNSPECIFIED_ERROR,
            _R.IMPLEMENTATION_SPECIFIC_ERROR,
            _R.NOT_AUTHORIZED,
            _R.TOPIC_FILTER_INVALID,
            _R.PACKET_IDENTIFIER_IN_USE,
            _R.QUOTA_EXCEEDED,
            _R.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED,
            _R.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED,
            _R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED,
        }
    ),
    PacketType.UNSUBACK: frozenset(
        {
            _R.SUCCESS,
            _R.NO_SUBSCRIPTION_EXISTED,
            _R.UNSPECIFIED_ERROR,
            _R.IMPLEMENTATION_SPECIFIC_ERROR,
            _R.NOT_AUTHORIZED,
            _R.TOPIC_FILTER_INVALID,
            _R.PACKET_IDENTIFIER_IN_USE,
        }
    ),
    PacketType.DISCONNECT: frozenset(
        {
            _R.NORMAL_DISCONNECTION,
            _R.DISCONNECT_WITH_WILL_MESSAGE,
            _R.UNSPECIFIED_ERROR,
            _R.MALFORMED_PACKET,
            _R.PROTOCOL_ERROR,
            _R.IMPLEMENTATION_SPECIFIC_ERROR,
            _R.NOT_AUTHORIZED,
            _R.SERVER_BUSY,
            _R.SERVER_SHUTTING_DOWN,
            _R.KEEP_ALIVE_TIMEOUT,
            _R.SESSION_TAKEN_OVER,
            _R.TOPIC_FILTER_INVALID,
            _R.TOPIC_NAME_INVALID,
            _R.RECEIVE_MAXIMUM_EXCEEDED,
            _R.TOPIC_ALIAS_INVALID,
            _R.PACKET_TOO_LARGE,
            _R.MESSAGE_RATE_TOO_HIGH,
            _R.QUOTA_EXCEEDED,
            _R.ADMINISTRATIVE_ACTION,
            _R.PAYLOAD_FORMAT_INVALID,
            _R.RETAIN_NOT_SUPPORTED,
            _R.QOS_NOT_SUPPORTED,
            _R.USE_ANOTHER_SERVER,
            _R.SERVER_MOVED,
            _R.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED,
            _R.CONNECTION_RATE_EXCEEDED,
            _R.MAXIMUM_CONNECT_TIME,
            _R.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED,
            _R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED,
        }
    ),
    PacketType.AUTH: frozenset({_R.SUCCESS, _R.CONTINUE_AUTHENTICATION, _R.RE_AUTHENTICATE}),
}
REASON_CODES_V5[PacketType.PUBREC] = REASON_CODES_V5[PacketType.PUBACK]
REASON_CODES_V5[PacketType.PUBCOMP] = REASON_CODES_V5[PacketType.PUBREL]

#: 3.1.1 return codes: CONNACK 0..5 (s3.2.2.3), SUBACK 0, 1, 2 or 0x80 (s3.9.3).
REASON_CODES_V311: dict[int, frozenset[int]] = {
    PacketType.CONNACK: frozenset(range(6)),
    PacketType.SUBACK: frozenset({0, 1, 2, 0x80}),
}
