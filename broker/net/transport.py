"""MQTT over TCP: a thin asyncio Protocol between a socket and the sans-IO connection.

Bytes in go to :class:`~broker.mqtt.connection.ServerConnection`, validated packets go to the
router; the router answers through this object's :class:`~broker.router.link.Link` methods.
Output is coalesced: whatever the router queues for a connection during one event-loop
iteration leaves in one ``transport.write``.

Errors are translated here and only here (CONVENTIONS habit 4): an
:class:`~broker.mqtt.errors.MQTTError` closes this one connection with its reason code
(a CONNACK before the session exists, a DISCONNECT for 5.0 after it, a plain close for 3.1.1);
any other exception is a bug, logged with its traceback, and also closes just this connection.

One implementation serves every listener: plain TCP uses it directly, TLS
(:mod:`broker.net.tls`) and WebSocket (:mod:`broker.net.websocket`) hand it a transport
adapter that carries the same MQTT bytes. Logins (:mod:`broker.auth`) that need a password
check run scrypt in a worker thread; packets arriving meanwhile are held and processed, in
order, once the CONNECT is answered.

The device path (:meth:`MQTTProtocol._plain_publish`): a read that is exactly one QoS 0/1
PUBLISH without retain flag or properties, to the topic this connection's previous such
PUBLISH went to, skips the decoder and the router's checks: its topic bytes are compared with
the last ones, whose validity, ACL decision and partition were established by the full path
(:meth:`~broker.router.router.Router.plain_route`), and it goes straight into the partition's
batch (:meth:`~broker.router.router.Router.publish_plain`); its PUBACK is written from the
packet id when the append returns. A fleet of devices each publishing one message per second
to its own topic arrives that way; anything else takes the full path.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

from broker.auth import LoginResult, PendingLogin
from broker.mqtt.connection import ServerConnection, keepalive_expired
from broker.mqtt.decode import PubAckRun
from broker.mqtt.encode import encode, encode_puback_success
from broker.mqtt.errors import MQTTError, ProtocolError, UnsupportedProtocolVersion
from broker.mqtt.packets import (
    REASON_CODES_V5,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    Subscribe,
    Unsubscribe,
)
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import CONNACK_311_FOR_REASON, ConnackReturnCode311, ReasonCode
from broker.router.router import TOPIC_ALIAS_MAXIMUM
from broker.workers.sessions import STATE

if TYPE_CHECKING:
    from broker.commitlog.keys import PartitionKey
    from broker.router.router import Router
    from broker.router.session import Session
    from broker.server import Server

log = logging.getLogger("broker.net.transport")

#: Output bytes queued in the kernel-side transport buffer before we stop feeding a client.
WRITE_HIGH_WATER = 1 << 20
#: Output bytes the router may queue for one client per event-loop iteration. The rest follows
#: after this iteration's writes (flush_output pumps again), so a burst to many subscribers is
#: written as it is encoded rather than all at the end of one long iteration.
OUTPUT_PER_ITERATION = 256 << 10
#: First byte of a TLS record carrying a handshake (a ClientHello), RFC 8446 s5.1.
TLS_HANDSHAKE_BYTE = 0x16


class MQTTProtocol(asyncio.Protocol):
    """One client connection. Implements :class:`broker.router.link.Link`."""

    # Slots: an idle connection's attributes took a 1,584-byte dict (33 keys) before.
    __slots__ = (
        "_acked",
        "_authorizing",
        "_budget",
        "_closing",
        "_fresh",
        "_graceful",
        "_held",
        "_held_data",
        "_high_water",
        "_max_packet_size",
        "_out",
        "_out_bytes",
        "_paused",
        "_plain_field",
        "_plain_key",
        "_plain_topic",
        "client_id",
        "conn",
        "connect_timeout",
        "connected_at",
        "keepalive",
        "last_received",
        "metrics",
        "peer",
        "peer_host",
        "router",
        "server",
        "session",
        "tls",
        "tls_identity",
        "transport",
        "username",
        "version",
    )

    def __init__(self, server: Server, *, tls: bool = False) -> None:
        self.server = server
        self.router: Router = server.router
        self.metrics = server.metrics
        #: Came in over the TLS listener (then ``tls_identity`` is the certificate's CN).
        self.tls = tls
        self.tls_identity: str | None = None
        self.username: str | None = None
        cfg = server.config.router
        self.conn = ServerConnection(
            max_packet_size=cfg.max_packet_size,
            topic_alias_maximum=TOPIC_ALIAS_MAXIMUM,  # the value the CONNACK announces
            max_topic_length=cfg.max_topic_length,
            max_topic_levels=cfg.max_topic_levels,
            receive_maximum=cfg.max_inflight,  # announced in CONNACK by the router
        )
        # s3.1.4: a server may close a connection that sends no CONNECT in reasonable time.
        self.connect_timeout = float(cfg.connect_timeout)
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.client_id = ""
        self.version = 4
        self.keepalive = 0
        self.last_received = server.monotonic()
        self.connected_at = self.last_received
        self.peer = "?"
        self.peer_host = "?"
        #: A password check or a session claim (several workers) is running: input is held
        #: in arrival order until it ends.
        self._authorizing = False
        self._held: list[Packet | PubAckRun] = []
        self._held_data: list[bytes] = []
        self._fresh = True  # nothing received yet (a TLS ClientHello is recognised then)
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._paused = False
        self._acked = False
        self._closing = False
        self._graceful = False
        self._high_water = min(cfg.max_queued_bytes, WRITE_HIGH_WATER)
        self._budget = min(self._high_water, OUTPUT_PER_ITERATION)
        #: The device path (module docstring): the topic name field (length and UTF-8) of
        #: the last plain PUBLISH, its topic and partition; b"" until there is one.
        self._plain_field = b""
        self._plain_topic = ""
        self._plain_key: PartitionKey = ("", 0)
        self._max_packet_size = cfg.max_packet_size

    # ---------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.peer_host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        transport.set_write_buffer_limits(high=self._high_water)  # type: ignore[attr-defined]
        self.server.links.add(self)
        self.server.keepalive.file(self, self.connected_at + self.connect_timeout)
        self.metrics.connections_opened += 1

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self.last_received = self.server.monotonic()
        self.metrics.bytes_in += len(data)
        if self._authorizing:
            self._held_data.append(data)
            return
        if self._fresh:
            self._fresh = False
            if data[0] == TLS_HANDSHAKE_BYTE and not self.tls:
                # 0x16 is no valid MQTT first byte (CONNECT with reserved flags 0110).
                self._wrong_protocol()
                return
        if self._plain_field and self._plain_publish(data):
            return
        self._receive(data, None)

    def _plain_publish(self, data: bytes) -> bool:
        """The device path (module docstring): take ``data`` if it is exactly one QoS 0/1
        PUBLISH (no DUP, no retain flag, no 5.0 properties) to the last plain topic, with
        nothing buffered before it; False leaves it to the decoder, which also reports
        whatever is wrong with it."""
        first = data[0]
        if first != 0x32 and first != 0x30:
            return False
        n = len(data)
        length = data[1] if n > 1 else 0x80
        pos = 2
        if length & 0x80:  # a second byte of remaining length (up to 16,383 bytes)
            if n < 3 or data[2] & 0x80:
                return False
            length = (length & 0x7F) | (data[2] << 7)
            pos = 3
        field = self._plain_field
        conn = self.conn
        if (
            pos + length != n
            or n > self._max_packet_size
            or not data.startswith(field, pos)
            or conn.buffered
        ):
            return False
        pos += len(field)
        packet_id = 0
        if first == 0x32:
            if pos + 2 > n:
                return False
            packet_id = (data[pos] << 8) | data[pos + 1]
            pos += 2
            if not packet_id:
                return False  # the decoder refuses it [MQTT-2.2.1-3]
        ack = None
        if conn.version == 5:
            if pos >= n or data[pos]:
                return False  # properties (or none announced): the full path
            pos += 1
            if packet_id:
                # s4.9: the client's quota (our Receive Maximum) as the decoder keeps it.
                unacked = conn.inbound_unacked
                if packet_id in unacked or len(unacked) >= conn.receive_maximum:
                    return False
                unacked.add(packet_id)
        if packet_id:
            ack = partial(self._plain_acked, packet_id)
        qos = first >> 1 & 1
        self.metrics.messages_in[qos] += 1
        router = self.router
        router.publish_plain(
            self.client_id,
            self._plain_topic,
            self._plain_key,
            data[pos:],
            qos,
            int(router.clock() * 1000),
            ack,
        )
        return True

    def _receive(self, data: bytes | None, packets: list[Packet | PubAckRun] | None) -> None:
        """Decode ``data`` (or take already decoded ``packets``) and dispatch, in order."""
        try:
            if packets is None:
                packets = self.conn.receive_data(data or b"")
            i = 0
            n = len(packets)
            while i < n:
                packet = packets[i]
                if type(packet) is Publish:
                    # Consecutive PUBLISHes go to the router together (its batch path).
                    j = i + 1
                    while j < n and type(packets[j]) is Publish:
                        j += 1
                    self._publish(packets[i:j] if j - i < n else packets)  # type: ignore[arg-type]
                    i = j
                else:
                    self._handle(packet)
                    i += 1
                if self._closing:
                    return
                if self._authorizing:
                    self._held.extend(packets[i:])
                    return
            if self._acked:
                # One pump for all the PUBACKs of this read, not one per PUBACK.
                self._acked = False
                if self.session is not None:
                    self.router.pump_acked(self.session)
        except MQTTError as e:
            self._protocol_error(e)
        except Exception:
            log.exception(
                "bug while serving %s (%s); closing that connection",
                self.client_id or "?",
                self.peer,
            )
            self.close(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR, "internal error")

    def _wrong_protocol(self) -> None:
        tls_port = self.server.config.server.tls_port
        hint = (
            f"; MQTT over TLS is on port {tls_port}"
            if tls_port
            else " and this broker has no TLS listener ([server] tls_port)"
        )
        log.warning(
            "%s: TLS handshake (ClientHello) on the plain MQTT port; closing%s", self.peer, hint
        )
        self._closing = True
        self._flush_and_close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.keepalive.discard(self)
        if self in self.server.links:
            self.server.links.discard(self)
            self.metrics.connections_closed += 1
        self._closing = True
        session = self.session
        if session is not None:
            self.session = None
            try:
                self.router.connection_lost(session, self, graceful=self._graceful)
            except Exception:
                log.exception("bug while closing session %s", self.client_id)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self.session is not None and not self._closing:
            self.router.pump_session(self.session)

    # ---------------------------------------------------------------- dispatch

    def _publish(self, run: list[Publish]) -> None:
        """Consecutive PUBLISHes of one read: stored by the router in order, as a batch."""
        messages_in = self.metrics.messages_in
        for packet in run:
            messages_in[packet.qos] += 1
        self.router.publish_run(self.session, run)  # type: ignore[arg-type]
        last = run[-1]
        if (
            last.qos < 2
            and not last.retain
            and not last.properties
            and last.topic != self._plain_topic
        ):
            # Where the device path takes the next ones (module docstring) from.
            key = self.router.plain_route(self.client_id, last.topic)
            if key is not None:
                topic = last.topic.encode()
                self._plain_field = len(topic).to_bytes(2, "big") + topic
                self._plain_topic = last.topic
                self._plain_key = key

    def _plain_acked(self, packet_id: int, offset: int | None) -> None:
        """A PUBLISH of the device path is in the log (``offset``; None: the append failed):
        acknowledge it as :class:`~broker.router.router.Router.publish` would."""
        if self._closing:
            return
        if offset is None:
            if self.version == 5:
                self.send(PubAck(packet_id, ReasonCode.UNSPECIFIED_ERROR))
            else:
                self.close()  # 3.1.1 has no negative acknowledgement
            return
        self.conn.inbound_unacked.discard(packet_id)  # the client's quota comes back (s4.9)
        self._write(encode_puback_success(packet_id))

    def _handle(self, packet: Packet | PubAckRun) -> None:
        kind = type(packet)
        session = self.session
        if kind is PubAckRun:
            self.router.puback_run(session, packet.packet_ids)  # type: ignore[arg-type, union-attr]
            self._acked = True
        elif kind is PubAck:
            self.router.puback(session, packet.packet_id, pump=False)  # type: ignore[arg-type, union-attr]
            self._acked = True  # the freed quota is used once per read, in _receive
        elif kind is PubRec:
            self.router.pubrec(session, packet.packet_id, packet.reason_code)  # type: ignore[arg-type, union-attr]
        elif kind is PubRel:
            self.router.pubrel(session, packet.packet_id)  # type: ignore[arg-type, union-attr]
        elif kind is PubComp:
            self.router.pubcomp(session, packet.packet_id)  # type: ignore[arg-type, union-attr]
        elif kind is Subscribe:
            self.router.subscribe(session, packet)  # type: ignore[arg-type]
        elif kind is Unsubscribe:
            self.router.unsubscribe(session, packet)  # type: ignore[arg-type]
        elif kind is PingReq:
            self.send(PingResp())  # [MQTT-3.12.4-1]
        elif kind is Connect:
            self._on_connect(packet)  # type: ignore[arg-type]
        elif kind is Disconnect:
            self.router.disconnect(session, packet)  # type: ignore[arg-type]
            self._graceful = packet.reason_code != ReasonCode.DISCONNECT_WITH_WILL_MESSAGE  # type: ignore[union-attr]
            self._closing = True
            self._flush_and_close()  # [MQTT-3.14.4-1]
        elif kind is Auth:
            # No enhanced authentication method was agreed on CONNECT (s4.12).
            raise ProtocolError("AUTH without an authentication method")

    def _on_connect(self, packet: Connect) -> None:
        self.version = packet.protocol_level
        if self.version == 5 and PropertyId.AUTHENTICATION_METHOD in packet.properties:
            # Enhanced authentication (s4.12): the router refuses the method (0x8C).
            self._connect_router(packet)
            return
        decision = self.server.auth.precheck(
            self.peer_host,
            packet.username,
            packet.password,
            tls_identity=self.tls_identity,
            tls=self.tls,
        )
        if isinstance(decision, PendingLogin):
            # scrypt takes tens of ms: verify in a worker thread, answer when it is done.
            self._authorizing = True
            future = self.server.auth.executor.submit(decision.run)
            loop = self.server.loop

            def done(f: Future[bool]) -> None:  # runs in the worker thread
                if not loop.is_closed():
                    loop.call_soon_threadsafe(self._login_verified, packet, decision, f)

            future.add_done_callback(done)
            return
        self._login_decided(packet, decision)

    def _login_verified(self, packet: Connect, pending: PendingLogin, future: Future[bool]) -> None:
        """Back on the loop with the scrypt answer: finish the CONNECT, replay held input."""
        self._authorizing = False
        if self._closing:
            return  # the client went away meanwhile
        try:
            ok = future.result()
        except Exception:
            log.exception("bug while verifying the password of %s (%s)", packet.username, self.peer)
            ok = False
        result = self.server.auth.complete(self.peer_host, pending, ok)
        try:
            self._login_decided(packet, result)
        except Exception:
            log.exception(
                "bug while connecting %s (%s); closing that connection",
                packet.client_id or "?",
                self.peer,
            )
            self.close(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR, "internal error")
            return
        if not self._authorizing:
            self._resume_input()

    def _resume_input(self) -> None:
        """The CONNECT is answered: process the input held meanwhile, in order."""
        held, self._held = self._held, []
        if held and not self._closing:
            self._receive(None, held)
        while self._held_data and not self._closing and not self._authorizing:
            self._receive(self._held_data.pop(0), None)

    def _login_decided(self, packet: Connect, result: LoginResult) -> None:
        if result.reason:
            log.info(
                "%s (%s): login refused: %s (reason 0x%02X)",
                packet.client_id or "-",
                self.peer,
                result.message,
                result.reason,
            )
            code = (
                result.reason if self.version == 5 else CONNACK_311_FOR_REASON.get(result.reason, 5)
            )
            self.send(ConnAck(False, code))
            self._closing = True
            self._flush_and_close()  # [MQTT-3.2.2-7]
            return
        self.username = result.username
        self._connect_router(packet)

    def _connect_router(self, packet: Connect) -> None:
        runtime = self.server.runtime
        if runtime is not None and packet.client_id:
            # One of several workers: the session may be held by another one. Its home
            # worker decides (broker.workers.sessions); input is held meanwhile.
            self._authorizing = True
            claim = runtime.sessions.claim(
                packet.client_id, lambda answer: self._claimed(packet, answer)
            )
            self.server.loop.create_task(claim).add_done_callback(self._claim_failed)
            return
        self._connect_session(packet)

    def _claimed(self, packet: Connect, answer: bytes) -> None:
        """The session of ``packet.client_id`` is this worker's now (``answer``: see
        :meth:`SessionDirectory.claim`): adopt a handed-over state, then connect."""
        self._authorizing = False
        if answer[:1] == STATE:
            self.router.adopt(packet.client_id, answer[1:])
        if self._closing:
            return  # the client went away meanwhile; the session stays here, offline
        try:
            self._connect_session(packet)
        except Exception:
            log.exception(
                "bug while connecting %s (%s); closing that connection", packet.client_id, self.peer
            )
            self.close(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR, "internal error")
            return
        self._resume_input()

    def _claim_failed(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("%s: cannot take the session over: %s", self.peer, task.exception())
        self._authorizing = False
        if not self._closing:
            self.send(
                ConnAck(
                    False,
                    ReasonCode.SERVER_UNAVAILABLE
                    if self.version == 5
                    else ConnackReturnCode311.SERVER_UNAVAILABLE,
                )
            )
            self._closing = True
            self._flush_and_close()

    def _connect_session(self, packet: Connect) -> None:
        result = self.router.connect(self, packet, username=self.username)
        if result is None:
            self._closing = True
            self._flush_and_close()  # refused: CONNACK sent [MQTT-3.2.2-7]
            return
        self.session, self.keepalive = result
        deadline = self.keepalive_deadline()
        if deadline is None:
            self.server.keepalive.discard(self)
        else:
            self.server.keepalive.file(self, deadline)

    # ---------------------------------------------------------------- errors

    def _protocol_error(self, error: MQTTError) -> None:
        log.info(
            "%s (%s): %s (reason 0x%02X); closing",
            self.client_id or "-",
            self.peer,
            error.message,
            error.reason_code,
        )
        if self.session is None:
            level = self.conn.requested_level
            if isinstance(error, UnsupportedProtocolVersion):
                # [MQTT-3.1.2-2]: an unsupported level is refused, then the connection closed.
                # A client asking for level 5 or above reads the 5.0 CONNACK (reason 0x84);
                # older ones the 3.1.1 form with return code 0x01 (3.1.1 s3.1.2.2).
                if level is not None and level >= 5:
                    self._write(encode(ConnAck(False, error.reason_code), 5))
                else:
                    self._write(
                        b"\x20\x02\x00"
                        + bytes([ConnackReturnCode311.UNACCEPTABLE_PROTOCOL_VERSION])
                    )
            elif level == 5:
                # A 5.0 CONNECT we cannot accept (malformed, bad property...): CONNACK with
                # the reason code (s3.2.2.2), then close [MQTT-3.2.2-7]. 3.1.1 has no code
                # for these and is simply closed (3.1.1 s4.8). An error in a packet that came
                # in the same read as the CONNECT may have a code CONNACK cannot carry
                # (0x93, 0x94...): it is reported as the Protocol Error it is.
                code = error.reason_code
                if code not in REASON_CODES_V5[PacketType.CONNACK]:
                    code = ReasonCode.PROTOCOL_ERROR
                self._write(encode(ConnAck(False, code), 5))
            self._closing = True
            self._flush_and_close()
            return
        self.close(error.reason_code, error.message)

    # ---------------------------------------------------------------- Link

    def send(self, packet: Packet) -> None:
        self._write(self.conn.send(packet))

    def send_publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        dup: bool,
        packet_id: int | None,
        properties: dict[int, Any] | None,
    ) -> bool:
        data = self.conn.send_publish(topic, payload, qos, retain, dup, packet_id, properties)
        if data is None:
            self.metrics.oversize_dropped += 1
            return False
        self.metrics.messages_out[qos] += 1
        self._write(data)
        return True

    def send_publish_run(
        self,
        topics: Sequence[str],
        payloads: Sequence[bytes],
        retains: Sequence[bool] | None,
        qos: int,
        first_packet_id: int | None,
    ) -> bool:
        data = self.conn.send_publish_run(topics, payloads, retains, qos, first_packet_id)
        if data is None:
            return False
        self.metrics.messages_out[qos] += len(topics)
        self._write(data)
        return True

    def can_write(self) -> bool:
        return not self._paused and not self._closing and self._out_bytes < self._budget

    def output_room(self) -> int:
        if self._paused or self._closing:
            return 0
        return max(0, self._budget - self._out_bytes)

    def close(self, reason_code: int | None = None, reason: str = "") -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if (
            reason_code is not None
            and self.version == 5
            and self.session is not None
            and not self._closing
        ):
            props: dict[int, Any] = {}
            if reason and self._problem_info():
                props[PropertyId.REASON_STRING] = reason
            self._write(self.conn.send(Disconnect(reason_code, props)))
        self._closing = True
        self._flush_and_close()

    def _problem_info(self) -> bool:
        return self.session is None or self.session.request_problem_information

    # ---------------------------------------------------------------- output

    def _write(self, data: bytes) -> None:
        if not self._out:
            self.server.want_flush(self)
        self._out.append(data)
        self._out_bytes += len(data)

    def flush_output(self) -> None:
        """Write everything queued this iteration in one call (called by the server)."""
        out = self._out
        if not out:
            return
        full = self._out_bytes >= self._budget
        self._out = []
        self._out_bytes = 0
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        self.metrics.bytes_out += len(data)
        transport.write(data)
        if full and not self._paused and self.session is not None and not self._closing:
            # The router stopped feeding this client because this iteration's output reached
            # its budget (can_write), not because the socket is full: nothing else would
            # wake it (no resume_writing), so it reads on now (written next iteration).
            self.router.pump_session(self.session)

    def _flush_and_close(self) -> None:
        self.flush_output()
        if self.transport is None:
            return
        if self._paused:
            # The peer is not reading (its window and our buffer are full): a graceful close
            # would wait for it forever, holding the socket and the buffered bytes. Reset.
            self.transport.abort()
        else:
            self.transport.close()

    def keepalive_expired(self, now: float) -> bool:
        """[MQTT-3.1.2-24]: nothing received for 1.5 x keepalive; or no CONNECT in time."""
        if self.session is None:
            return now - self.connected_at > self.connect_timeout
        return keepalive_expired(self.keepalive, self.last_received, now)

    def keepalive_deadline(self) -> float | None:
        """When :meth:`keepalive_expired` may next become true if nothing arrives; None
        when it never will (keepalive 0, s3.1.2.10)."""
        if self.session is None:
            return self.connected_at + self.connect_timeout
        if self.keepalive <= 0:
            return None
        return self.last_received + 1.5 * self.keepalive
