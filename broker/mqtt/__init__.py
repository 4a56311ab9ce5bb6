"""Sans-IO MQTT 3.1 / 3.1.1 / 5.0 protocol layer: packets, codec, topics, errors.

Imports no asyncio, no socket and nothing else of the broker (pyproject.toml
``[tool.importlinter]``, tests/unit/test_layers.py). The codec contract:

* ``Decoder`` turns bytes into packets: :meth:`~Decoder.feed` then
  :meth:`~Decoder.next_packet` / :meth:`~Decoder.packets`; incomplete input is "need more
  data" (``None``), never an exception; malformed input raises an :class:`MQTTError`
  subclass carrying the reason code to answer with, and the decoder stays dead after it;
* ``encode`` / ``encode_publish`` turn packets into bytes the other side decodes back to
  equal packets (properties are dropped at levels 3/4, which have none); sending what the
  spec forbids raises :class:`LocalProtocolError`, a bug on our side;
* packets are plain values (:mod:`broker.mqtt.packets` states their shared conventions).

The invariants are stated in full in :mod:`broker.mqtt.decode` and :mod:`broker.mqtt.encode`.
"""

from broker.mqtt.decode import DEFAULT_MAX_PACKET_SIZE, Decoder
from broker.mqtt.encode import encode, encode_publish
from broker.mqtt.errors import (
    LocalProtocolError,
    MalformedPacket,
    MQTTError,
    PacketTooLarge,
    ProtocolError,
    TopicFilterInvalid,
    TopicNameInvalid,
    UnsupportedProtocolVersion,
)
from broker.mqtt.packets import (
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    PingReq,
    PingResp,
    ProtocolVersion,
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
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import ConnackReturnCode311, ReasonCode

__all__ = [
    "DEFAULT_MAX_PACKET_SIZE",
    "Auth",
    "ConnAck",
    "ConnackReturnCode311",
    "Connect",
    "Decoder",
    "Disconnect",
    "LocalProtocolError",
    "MQTTError",
    "MalformedPacket",
    "Packet",
    "PacketTooLarge",
    "PacketType",
    "PingReq",
    "PingResp",
    "PropertyId",
    "ProtocolError",
    "ProtocolVersion",
    "PubAck",
    "PubComp",
    "PubRec",
    "PubRel",
    "Publish",
    "ReasonCode",
    "SubAck",
    "Subscribe",
    "Subscription",
    "TopicFilterInvalid",
    "TopicNameInvalid",
    "UnsubAck",
    "Unsubscribe",
    "UnsupportedProtocolVersion",
    "Will",
    "encode",
    "encode_publish",
]
