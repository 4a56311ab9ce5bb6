"""Errors of the MQTT protocol layer.

Split as h11 does: :class:`MQTTError` subclasses are *remote* errors (the peer sent something
the spec forbids) and carry the MQTT 5 reason code to answer with; only the connection layer
turns them into a CONNACK / DISCONNECT and a close. :class:`LocalProtocolError` is *our* misuse
of the codec (encoding a packet the spec forbids) and is a bug wherever it is raised.
"""

from __future__ import annotations

from broker.mqtt.reason_codes import ReasonCode


class MQTTError(Exception):
    """The peer violated the protocol. ``reason_code`` is what a 5.0 peer is told."""

    reason_code: int = ReasonCode.UNSPECIFIED_ERROR

    def __init__(self, message: str, reason_code: int | None = None) -> None:
        super().__init__(message)
        if reason_code is not None:
            self.reason_code = reason_code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class MalformedPacket(MQTTError):
    """Bytes that cannot be parsed per the spec (s1.5, s2.1-2.2) [MQTT-4.13.1-1]."""

    reason_code = ReasonCode.MALFORMED_PACKET


class ProtocolError(MQTTError):
    """A parsable packet that the spec forbids at this point or with these values."""

    reason_code = ReasonCode.PROTOCOL_ERROR


class UnsupportedProtocolVersion(MQTTError):
    """CONNECT with a protocol name or level we do not speak [MQTT-3.1.2-2]."""

    reason_code = ReasonCode.UNSUPPORTED_PROTOCOL_VERSION


class PacketTooLarge(MQTTError):
    """A packet larger than the configured maximum, rejected from its fixed header."""

    reason_code = ReasonCode.PACKET_TOO_LARGE


class TopicNameInvalid(MQTTError):
    """A PUBLISH topic name that breaks s4.7 (empty, wildcard, U+0000)."""

    reason_code = ReasonCode.TOPIC_NAME_INVALID


class TopicFilterInvalid(MQTTError):
    """A SUBSCRIBE / UNSUBSCRIBE topic filter that breaks s4.7-4.8."""

    reason_code = ReasonCode.TOPIC_FILTER_INVALID


class LocalProtocolError(Exception):
    """We asked the codec to produce something the spec forbids: a bug on our side."""
