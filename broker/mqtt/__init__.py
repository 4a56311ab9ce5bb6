"""Sans-IO MQTT 3.1 / 3.1.1 / 5.0 protocol layer: packets, codec, topics, errors.

Imports no asyncio and no socket. The codec contract is /work/notes/codec_api.md:
``Decoder`` turns bytes into packets, ``encode`` / ``encode_publish`` turn packets into bytes.
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
