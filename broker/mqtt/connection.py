"""Server side of one MQTT network connection, sans-IO: bytes in, validated packets out.

This owns what the spec scopes to a *network connection* and nothing else: the decoder, the
protocol version, topic aliases in both directions [MQTT-3.3.2-7], and the client's announced
limits (receive maximum, maximum packet size, topic alias maximum). Session state
(subscriptions, offsets, in-flight packets) belongs to the router, so this object can be thrown
away with its socket.

Errors are raised as :class:`~broker.mqtt.errors.MQTTError` with their reason code; the
transport turns them into a close, writing first the bytes this object gives for them (a
CONNACK before the session exists, :meth:`ServerConnection.connect_refusal`; a DISCONNECT
after). No asyncio, no sockets.

The device path (:meth:`ServerConnection.plain_publish`): a read that is exactly one QoS 0/1
PUBLISH without DUP, retain flag or properties, to the topic the transport last declared
plain (:meth:`ServerConnection.expect_plain`), is recognised from its bytes without the
decoder. What it returns is what :meth:`ServerConnection.receive_data` would have returned for
those bytes, with the same accounting (the 5.0 Receive Maximum); anything else is left to
:meth:`~ServerConnection.receive_data`, which also reports whatever is wrong with it. The
equivalence is tested in ``tests/unit/net/test_device_path.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from broker.mqtt.decode import Decoder, PubAckRun
from broker.mqtt.encode import (
    encode,
    encode_connack_refused,
    encode_puback_success,
    encode_publish,
    encode_publish_run,
)
from broker.mqtt.errors import (
    MQTTError,
    ProtocolError,
    TopicNameInvalid,
    UnsupportedProtocolVersion,
)
from broker.mqtt.packets import (
    REASON_CODES_V5,
    Auth,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    PingReq,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    Subscribe,
    Unsubscribe,
)
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import ReasonCode
from broker.mqtt.topics import validate_topic_name

#: QoS 0 PUBLISH bytes shared by every connection (same topic, payload, retain flag and
#: protocol level -> same bytes): a record fanned out to N subscribers is encoded once. Bounded
#: by entries and by payload size (at most ~4 MiB held); cleared when full.
SHARED_QOS0_ENTRIES = 4096
SHARED_QOS0_MAX_PAYLOAD = 1024
_shared_qos0: dict[tuple[str, bytes, bool, int], bytes] = {}
#: The inbound quota of every connection before (or without) a 5.0 CONNECT: always empty
#: (an empty set is 216 bytes; an idle 3.1.1 device needs none of its own).
_NO_QUOTA: set[int] = set()


class _NoDecoder(Decoder):
    """The decoder of a parked connection (:meth:`ServerConnection.drop_decoder`): none."""

    __slots__ = ()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        raise RuntimeError("input to a parked connection before its decoder was made again")


_NO_DECODER = _NoDecoder()

#: Packets a client may send to a server (s2.1.2 "Direction of flow").
_CLIENT_TO_SERVER = (
    Publish,
    PubAck,
    PubAckRun,
    PubRec,
    PubRel,
    PubComp,
    Subscribe,
    Unsubscribe,
    PingReq,
    Disconnect,
    Auth,
)


class TopicAliasInvalid(MQTTError):
    """A topic alias of 0 or above the maximum we announced [MQTT-3.3.2-9], [MQTT-3.3.2-10]."""

    reason_code = ReasonCode.TOPIC_ALIAS_INVALID


def keepalive_expired(keepalive: int, last_received: float, now: float) -> bool:
    """True when a connection with ``keepalive`` seconds must be closed at time ``now``.

    [MQTT-3.1.2-24]: the server closes the connection if it receives no control packet
    within one and a half times the Keep Alive; 0 turns the mechanism off (s3.1.2.10).
    Times are seconds of one monotonic clock, injected so tests can drive it.
    """
    return keepalive > 0 and now - last_received > 1.5 * keepalive


def _connect_level(head: bytes) -> int | None:
    """The protocol level byte of a (possibly refused) CONNECT from its first bytes.

    Used only to choose the form of the refusal CONNACK for an unsupported protocol; None
    when ``head`` is too short or is not a CONNECT.
    """
    if len(head) < 2 or head[0] != 0x10:
        return None
    pos = 1
    while pos < len(head) and head[pos] & 0x80 and pos < 4:
        pos += 1
    pos += 1  # past the last remaining-length byte
    if pos + 2 > len(head):
        return None
    pos += 2 + ((head[pos] << 8) | head[pos + 1])  # protocol name
    return head[pos] if pos < len(head) else None


class ServerConnection:
    """Protocol state of one client connection as seen by the server.

    Invariant: :attr:`version` is ``None`` until the CONNECT has been decoded; every packet
    returned by :meth:`receive_data` after it has a resolved topic (no inbound alias left).
    """

    __slots__ = (
        "_decoder",
        "_head",
        "_max_packet_size",
        "_plain_field",
        "client_max_packet_size",
        "client_receive_maximum",
        "client_topic_alias_maximum",
        "connected",
        "inbound_aliases",
        "inbound_unacked",
        "max_topic_length",
        "max_topic_levels",
        "outbound_aliases",
        "plain_topic",
        "receive_maximum",
        "topic_alias_maximum",
        "version",
    )

    def __init__(
        self,
        *,
        max_packet_size: int,
        topic_alias_maximum: int = 0,
        max_topic_length: int = 65535,
        max_topic_levels: int = 1 << 16,
        receive_maximum: int = 65535,
    ) -> None:
        self._decoder = Decoder(max_packet_size=max_packet_size, puback_runs=True)
        self._max_packet_size = max_packet_size
        self._head = b""  # first bytes until the CONNECT is decoded (see requested_level)
        self.version: int | None = None
        #: The CONNECT was decoded. Only the fact is kept: the packet (its password, its will)
        #: goes to the transport and the router, which keep what they need.
        self.connected = False
        self.topic_alias_maximum = topic_alias_maximum  # what we accept from the client
        self.max_topic_length = max_topic_length
        self.max_topic_levels = max_topic_levels
        # Receive Maximum we announce (5.0): QoS 1/2 PUBLISHes the client may have unacked.
        self.receive_maximum = receive_maximum
        # Packet ids of the client's QoS 1/2 PUBLISHes not yet answered by PUBACK, PUBCOMP
        # or a PUBREC >= 0x80 on this connection (s4.9 flow control).
        # 3.1.1 has no Receive Maximum: the set is made for a 5.0 CONNECT (_on_connect);
        # until then this shared one, which nothing adds to (every add is under version 5).
        self.inbound_unacked: set[int] = _NO_QUOTA
        #: Topic aliases (5.0), each made on its first alias: None until then.
        self.inbound_aliases: dict[int, str] | None = None
        self.outbound_aliases: dict[str, int] | None = None
        self.client_topic_alias_maximum = 0
        self.client_receive_maximum = 65535
        self.client_max_packet_size: int | None = None
        #: The device path (module docstring): the topic :meth:`plain_publish` recognises
        #: ("" until :meth:`expect_plain`: no call is worth making before), and its topic
        #: name field as it appears on the wire (length, then UTF-8).
        self.plain_topic = ""
        self._plain_field = b""

    # ---------------------------------------------------------------- inbound

    def receive_data(self, data: bytes) -> list[Packet | PubAckRun]:
        """Decode every complete packet in ``data`` plus what was buffered before; a run of
        4-byte PUBACKs comes as one :class:`~broker.mqtt.decode.PubAckRun`.

        Raises MQTTError for the first violation; packets decoded before it in the same
        call are lost with the connection, which is what the spec asks [MQTT-4.13.1-1].
        """
        if not self.connected and len(self._head) < 64:
            self._head += data[: 64 - len(self._head)]
        self._decoder.feed(data)
        out: list[Packet | PubAckRun] = []
        for packet in self._decoder.packets():
            if type(packet) is Publish:
                packet = self._inbound_publish(packet)
            elif not self.connected:
                # The decoder guarantees the first packet is a CONNECT [MQTT-3.1.0-1].
                assert isinstance(packet, Connect)
                self._on_connect(packet)
            elif isinstance(packet, Connect):
                raise ProtocolError("second CONNECT on one connection [MQTT-3.1.0-2]")
            elif not isinstance(packet, _CLIENT_TO_SERVER):
                raise ProtocolError(f"{type(packet).__name__} is not sent by clients")
            elif isinstance(packet, Auth) and self.version != 5:
                raise ProtocolError("AUTH exists only in MQTT 5")
            out.append(packet)
        return out

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as packets (part of a packet)."""
        return self._decoder.buffered

    def drop_decoder(self) -> None:
        """Free the decoder of a connected, idle connection (nothing buffered): a parked
        one's (broker.net.parking) is made again by :meth:`new_decoder` before it reads."""
        assert self.connected and not self._decoder.buffered
        self._decoder = _NO_DECODER

    def new_decoder(self, rest: bytes = b"") -> None:
        """A decoder for a connection past its CONNECT (it never asks for one again), given
        ``rest``: the start of a packet another decoder had buffered (:meth:`take_buffered`)."""
        self._decoder = Decoder(self._max_packet_size, self.version, puback_runs=True)
        if rest:
            self._decoder.feed(rest)

    def take_buffered(self) -> bytes:
        """The bytes buffered and not yet a packet (a connection that moves to another
        worker takes them along, broker.net.handoff); the decoder is left empty."""
        return self._decoder.take()

    @property
    def requested_level(self) -> int | None:
        """Protocol level the client asked for: known even when the CONNECT was refused."""
        if self.version is not None:
            return self.version
        return _connect_level(self._head)

    def expect_plain(self, topic: str) -> None:
        """Let :meth:`plain_publish` take the next PUBLISHes to ``topic`` (replacing the
        previous plain topic).

        The caller vouches that ``topic`` came in a PUBLISH :meth:`receive_data` returned
        (so it is a valid topic name within our limits) and that plain PUBLISHes to it may
        skip whatever else it checks (the router's ACL decision).
        """
        field = topic.encode()
        self._plain_field = len(field).to_bytes(2, "big") + field
        self.plain_topic = topic

    def plain_publish(self, data: bytes) -> tuple[str, bytes, int, int] | None:
        """The device path (module docstring): ``(topic, payload, qos, packet id)`` when
        ``data`` is exactly one QoS 0/1 PUBLISH without DUP, retain flag or 5.0 properties to
        :attr:`plain_topic`, with nothing buffered before it (packet id 0 for QoS 0).

        A 5.0 QoS 1 id is counted against our Receive Maximum as :meth:`receive_data` counts
        it (s4.9); :meth:`puback` gives it back. ``None``, with nothing changed, leaves
        ``data`` to :meth:`receive_data`: another packet, several, part of one, a new topic,
        a remaining length over two bytes, or one it refuses (packet id 0 [MQTT-2.2.1-3], a
        Receive Maximum exceeded [MQTT-3.3.4-7], too large). One call per read, on the
        per-message path of a fleet of devices: kept to byte comparisons, no decoding.
        """
        first = data[0]
        if first != 0x32 and first != 0x30:  # QoS 1 or 0; no DUP, no retain (s3.3.1)
            return None
        n = len(data)
        length = data[1] if n > 1 else 0x80
        pos = 2
        if length & 0x80:  # a second byte of remaining length (up to 16,383 bytes)
            if n < 3 or data[2] & 0x80:
                return None
            length = (length & 0x7F) | (data[2] << 7)
            pos = 3
        field = self._plain_field
        if (
            pos + length != n
            or n > self._max_packet_size
            or not field
            or not data.startswith(field, pos)
            or self._decoder.buffered
        ):
            return None
        pos += len(field)
        packet_id = 0
        if first == 0x32:
            if pos + 2 > n:
                return None
            packet_id = (data[pos] << 8) | data[pos + 1]
            pos += 2
            if not packet_id:
                return None  # the decoder refuses it [MQTT-2.2.1-3]
        if self.version == 5:
            if pos >= n or data[pos]:
                return None  # properties (or none announced): the decoder's
            pos += 1
            if packet_id:
                # s4.9: the client's quota (our Receive Maximum), as _inbound_publish keeps it.
                unacked = self.inbound_unacked
                if packet_id in unacked or len(unacked) >= self.receive_maximum:
                    return None
                unacked.add(packet_id)
        return self.plain_topic, data[pos:], first >> 1 & 1, packet_id

    def burst_topic(self, data: bytes) -> str | None:
        """The topic of the PUBLISH ``data`` starts with when :meth:`plain_publish` could
        take it (QoS 0/1, no DUP or retain flag, a remaining length of one or two bytes,
        within our maximum packet size) and :meth:`receive_data` would accept it as a topic
        name (well-formed UTF-8 without U+0000 [MQTT-1.5.4-2], valid and within our limits,
        s4.7): a topic the device path may be given (:meth:`expect_plain`) before the
        PUBLISH is decoded, so that it takes a read of many (a publisher's first burst).
        None: anything else, or part of a packet buffered before ``data``."""
        n = len(data)
        if n < 4 or (data[0] != 0x32 and data[0] != 0x30) or self._decoder.buffered:
            return None
        length = data[1]
        pos = 2
        if length & 0x80:
            if data[2] & 0x80:
                return None
            length = (length & 0x7F) | (data[2] << 7)
            pos = 3
        stop = pos + 2 + ((data[pos] << 8) | data[pos + 1]) if pos + 2 <= n else n + 1
        if pos + length > self._max_packet_size or stop > min(n, pos + length):
            return None
        try:
            topic = data[pos + 2 : stop].decode("utf-8")
            if "\x00" in topic:
                return None
            self._check_topic(topic)
        except (UnicodeDecodeError, MQTTError):
            return None
        return topic

    def _on_connect(self, packet: Connect) -> None:
        self._head = b""
        self.connected = True
        self.version = packet.protocol_level
        if self.version == 5:
            self.inbound_unacked = set()
        props = packet.properties
        if props:
            self.client_topic_alias_maximum = props.get(PropertyId.TOPIC_ALIAS_MAXIMUM, 0)
            rm = props.get(PropertyId.RECEIVE_MAXIMUM, 65535)
            if rm == 0:
                raise ProtocolError("receive maximum of 0 is a protocol error (s3.1.2.11.3)")
            self.client_receive_maximum = rm
            mps = props.get(PropertyId.MAXIMUM_PACKET_SIZE)
            if mps == 0:
                raise ProtocolError("maximum packet size of 0 (s3.1.2.11.4)")
            self.client_max_packet_size = mps
        will = packet.will
        if will is not None:
            # The will is published to its topic later: it must be a valid topic name
            # within our limits now (s3.1.3.3, [MQTT-4.7.1-1]), or the CONNECT is refused.
            self._check_topic(will.topic)
            self._check_response_topic(will.properties)

    def _inbound_publish(self, packet: Publish) -> Publish:
        if not self.connected:
            raise ProtocolError("PUBLISH before CONNECT [MQTT-3.1.0-1]")
        props = packet.properties
        if props and PropertyId.TOPIC_ALIAS in props:
            alias = props[PropertyId.TOPIC_ALIAS]
            if alias == 0 or alias > self.topic_alias_maximum:
                raise TopicAliasInvalid(
                    f"topic alias {alias} outside 1..{self.topic_alias_maximum} [MQTT-3.3.2-9]"
                )
            aliases = self.inbound_aliases
            if aliases is None:
                aliases = self.inbound_aliases = {}
            if packet.topic:
                aliases[alias] = packet.topic
            else:
                topic = aliases.get(alias)
                if topic is None:
                    raise ProtocolError(f"topic alias {alias} was never set (s3.3.2.3.4)")
                packet = replace(packet, topic=topic)
            packet = replace(
                packet,
                properties={k: v for k, v in props.items() if k != PropertyId.TOPIC_ALIAS},
            )
        topic = packet.topic
        if not topic and self.version == 5:
            # s3.3.2.1: "It is a Protocol Error if the Topic Name is zero length and there is
            # no Topic Alias" (an alias was resolved above). 3.1.1: invalid name, below.
            raise ProtocolError("empty topic name without a topic alias (s3.3.2.1)")
        if (
            len(topic) * 4 > self.max_topic_length
            or "+" in topic
            or "#" in topic
            or not topic
            or topic.count("/") >= self.max_topic_levels
        ):
            # _check_topic's quick tests, here: a call less per PUBLISH when they all pass.
            self._check_topic(topic)
        if props:
            if PropertyId.SUBSCRIPTION_IDENTIFIER in props:
                # [MQTT-3.3.4-6]: only a server puts Subscription Identifiers in a PUBLISH;
                # stored, it would reach subscribers as if it were theirs.
                raise ProtocolError("PUBLISH from a client with a subscription identifier")
            self._check_response_topic(props)
        if packet.qos and self.version == 5:
            pid = packet.packet_id
            unacked = self.inbound_unacked
            # A QoS 2 resend of an unfinished id is not a new one. (QoS > 0 has an id.)
            if pid is not None and pid not in unacked:
                if len(unacked) >= self.receive_maximum:
                    # [MQTT-3.3.4-7] the client must respect our Receive Maximum; s3.3.4:
                    # exceeding it is answered with DISCONNECT 0x93.
                    raise ProtocolError(
                        f"more than {self.receive_maximum} unacknowledged QoS 1/2 PUBLISHes",
                        ReasonCode.RECEIVE_MAXIMUM_EXCEEDED,
                    )
                unacked.add(pid)
        return packet

    def _check_topic(self, topic: str) -> None:
        """A topic name to publish to: valid (s4.7) and within the configured limits."""
        # A code point is at most 4 bytes of UTF-8: encode only topics that may be too long.
        if len(topic) * 4 > self.max_topic_length or "+" in topic or "#" in topic or not topic:
            validate_topic_name(topic)  # raises with the precise reason
            if len(topic.encode()) > self.max_topic_length:
                raise TopicNameInvalid(f"topic longer than {self.max_topic_length} bytes")
        if topic.count("/") >= self.max_topic_levels:
            raise TopicNameInvalid(f"topic has more than {self.max_topic_levels} levels")

    @staticmethod
    def _check_response_topic(props: dict[int, Any]) -> None:
        """A Response Topic is a topic name: no wildcards [MQTT-3.3.2-14] (a will's: s3.1.3.2.5)."""
        response = props.get(PropertyId.RESPONSE_TOPIC)
        if response is not None:
            try:
                validate_topic_name(response)
            except MQTTError as e:
                raise ProtocolError(f"response topic: {e.message}") from None

    # ---------------------------------------------------------------- outbound

    def send(self, packet: Packet) -> bytes:
        """Encode a packet for this client's protocol version."""
        assert self.version is not None
        kind = type(packet)
        if isinstance(packet, PubAck) and not (packet.reason_code or packet.properties):
            # puback() inlined: this is every QoS 1 PUBLISH's acknowledgement.
            self.inbound_unacked.discard(packet.packet_id)  # its quota comes back (s4.9)
            return encode_puback_success(packet.packet_id)
        if isinstance(packet, (PubAck, PubComp, PubRec)) and (
            kind is not PubRec or packet.reason_code >= 0x80
        ):
            # The client's send quota for this id comes back (s4.9): after PUBACK, PUBCOMP,
            # or a PUBREC refusing the message (reason code >= 0x80).
            self.inbound_unacked.discard(packet.packet_id)
        return encode(packet, self.version)

    def puback(self, packet_id: int) -> bytes:
        """The PUBACK (Success, no properties) of the client's QoS 1 PUBLISH ``packet_id``:
        its quota comes back (s4.9)."""
        self.inbound_unacked.discard(packet_id)
        return encode_puback_success(packet_id)

    def refuse(self, reason_code: int) -> bytes:
        """The CONNACK refusing the client's CONNECT with the 5.0 ``reason_code``, in the
        form of the level it asked for (:func:`~broker.mqtt.encode.encode_connack_refused`);
        the connection is then closed [MQTT-3.2.2-7]."""
        return encode_connack_refused(reason_code, self.requested_level)

    def connect_refusal(self, error: MQTTError) -> bytes | None:
        """What to write before closing for ``error``, raised before the session exists: a
        refusing CONNACK, or None when the connection is closed without one.

        [MQTT-3.1.2-2]: an unsupported level is refused with a CONNACK, then the connection
        is closed; a client asking for level 5 or above reads the 5.0 form (reason 0x84),
        older ones the 3.1.1 form with return code 0x01 (3.1.1 s3.1.2.2). A 5.0 CONNECT we
        cannot accept otherwise (malformed, bad property...) is answered with its reason
        code (s3.2.2.2); 3.1.1 has no code for these and is simply closed (3.1.1 s4.8). An
        error in a packet that came in the same read as the CONNECT may have a code CONNACK
        cannot carry (0x93, 0x94...): it is reported as the Protocol Error it is.
        """
        level = self.requested_level
        if isinstance(error, UnsupportedProtocolVersion):
            return encode_connack_refused(error.reason_code, level)
        if level != 5:
            return None
        code = error.reason_code
        if code not in REASON_CODES_V5[PacketType.CONNACK]:
            code = ReasonCode.PROTOCOL_ERROR
        return encode_connack_refused(code, 5)

    def send_publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        dup: bool,
        packet_id: int | None,
        properties: dict[int, Any] | None,
    ) -> bytes | None:
        """Encode a PUBLISH, using an outbound topic alias when the client allows them.

        Returns ``None`` when the packet would exceed the client's maximum packet size: the
        server must not send it and treats it as delivered [MQTT-3.1.2-25].
        """
        version = self.version
        assert version is not None
        if self.client_topic_alias_maximum and version == 5:
            aliases = self.outbound_aliases
            if aliases is None:
                aliases = self.outbound_aliases = {}
            alias = aliases.get(topic)
            props = dict(properties) if properties else {}
            if alias is not None:
                props[PropertyId.TOPIC_ALIAS] = alias
                data = encode_publish("", payload, qos, retain, dup, packet_id, props, version)
            else:
                new_alias = None
                if len(aliases) < self.client_topic_alias_maximum:
                    new_alias = len(aliases) + 1
                    props[PropertyId.TOPIC_ALIAS] = new_alias
                data = encode_publish(topic, payload, qos, retain, dup, packet_id, props, version)
                # The mapping exists for the client only once a PUBLISH carrying both topic
                # and alias reached it: one skipped for its size [MQTT-3.1.2-25] set nothing.
                if new_alias is not None and (
                    self.client_max_packet_size is None or len(data) <= self.client_max_packet_size
                ):
                    aliases[topic] = new_alias
        elif qos == 0 and not properties and len(payload) <= SHARED_QOS0_MAX_PAYLOAD:
            # The same QoS 0 bytes go to every subscriber of a record: encode them once.
            key = (topic, payload, retain, version)
            shared = _shared_qos0.get(key)
            if shared is None:
                if len(_shared_qos0) >= SHARED_QOS0_ENTRIES:
                    _shared_qos0.clear()
                shared = _shared_qos0[key] = encode_publish(
                    topic, payload, 0, retain, False, None, None, version
                )
            data = shared
        else:
            data = encode_publish(
                topic, payload, qos, retain, dup, packet_id, properties or None, version
            )
        if self.client_max_packet_size is not None and len(data) > self.client_max_packet_size:
            return None
        return data

    def send_publish_run(
        self,
        topics: Sequence[str],
        payloads: Sequence[bytes],
        retains: Sequence[bool] | None,
        qos: int,
        first_packet_id: int | None,
    ) -> bytes | None:
        """Encode PUBLISHes without properties for a run of messages in one pass (see
        :func:`~broker.mqtt.encode.encode_publish_run`).

        Returns ``None`` when the run needs per-packet decisions: outbound topic aliases in
        use, or a packet that might exceed the client's maximum packet size
        [MQTT-3.1.2-25]; the caller then sends the messages one by one.
        """
        version = self.version
        assert version is not None
        if self.client_topic_alias_maximum and version == 5:
            return None
        limit = self.client_max_packet_size
        if limit is not None:
            # An upper bound: 5 bytes of fixed header, topic length, packet id, properties.
            largest = max(map(len, payloads)) + 4 * max(map(len, topics)) + 10
            if largest > limit:
                return None
        return encode_publish_run(topics, payloads, retains, qos, first_packet_id, version)
