"""MQTT over TCP: a thin asyncio Protocol between a socket and the sans-IO connection.

Bytes in go to :class:`~broker.mqtt.connection.ServerConnection`, validated packets go to the
router; the router answers through this object's :class:`~broker.router.link.Link` methods.
Output is coalesced: whatever the router queues for a connection during one event-loop
iteration leaves in one ``transport.write``. The protocol keeps no MQTT state of its own: it
moves bytes, and calls the connection (what the bytes mean, what to answer) and the router.

Errors are translated here and only here: an
:class:`~broker.mqtt.errors.MQTTError` closes this one connection with its reason code
(a CONNACK before the session exists, a DISCONNECT for 5.0 after it, a plain close for 3.1.1);
any other exception is a bug, logged with its traceback, and also closes just this connection.

One implementation serves every listener: plain TCP uses it directly, TLS
(:mod:`broker.net.tls`) and WebSocket (:mod:`broker.net.websocket`) hand it a transport
adapter that carries the same MQTT bytes. A CONNECT is admitted by
:class:`~broker.net.admission.Admission` (the login, the session claim across workers);
while that is pending, input is held there and processed, in order, once it ends. The worker
is seen through :class:`~broker.net.context.EdgeContext` only.

The device path (:meth:`MQTTProtocol._plain_publish`): a read the connection recognises as
one plain PUBLISH (:meth:`~broker.mqtt.connection.ServerConnection.plain_publish`: QoS 0/1,
no retain flag or properties, to the topic of this connection's previous such PUBLISH) skips
the decoder and the router's checks: that topic's validity, ACL decision and partition were
established by the full path (:meth:`~broker.router.router.Router.plain_route`), and it goes
straight into the partition's batch (:meth:`~broker.router.router.Router.publish_plain`); its
PUBACK is written from the packet id when the append returns (a fleet of devices, each
publishing to its own topic, arrives that way). Compiled, the same path is a
:class:`~broker.net._devicelane.DeviceLane` (:mod:`broker.net.devicepath`: which one serves),
which also takes reads of several such PUBLISHes (a publisher's burst). Closing, log lines,
idle connections parked, moved to another worker: :mod:`.closing`, :mod:`.connlog`,
:mod:`.parking`, :mod:`.handoff` (``edge.handoff`` is told of each new plain topic).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

from broker.mqtt.connection import ServerConnection
from broker.mqtt.decode import PubAckRun
from broker.mqtt.errors import MQTTError, ProtocolError
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
    Subscribe,
    Unsubscribe,
)
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import ReasonCode
from broker.net.admission import Admission
from broker.net.closing import close_gracefully
from broker.net.connlog import (
    CLIENT_DISCONNECTED,
    PEER_CLOSED,
    closed_by_broker,
    log_connected,
    log_disconnected,
    peer_address,
)
from broker.net.devicepath import burst_lane, new_lane, plain_acked, plain_publish
from broker.net.keepalive import keepalive_deadline
from broker.net.parking import resumed, unpark
from broker.router.router import TOPIC_ALIAS_MAXIMUM

if TYPE_CHECKING:
    from broker.commitlog.keys import PartitionKey
    from broker.net._devicelane import DeviceLane
    from broker.net.context import EdgeContext
    from broker.router.session import Session

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
    """One client connection. Implements :class:`broker.router.link.Link` and
    :class:`broker.net.admission.Applicant`."""

    # Slots: an idle connection's attributes took a 1,584-byte dict (33 keys) before.
    __slots__ = (
        "_acked",
        "_admission",
        "_budget",
        "_closing",
        "_ending",
        "_fresh",
        "_graceful",
        "_handoff",
        "_held",
        "_high_water",
        "_lane",
        "_out",
        "_out_bytes",
        "_parked",
        "_paused",
        "_plain_key",
        "_wrote",
        "client_id",
        "conn",
        "connected_at",
        "edge",
        "keepalive",
        "last_received",
        "metrics",
        "router",
        "session",
        "tls",
        "tls_identity",
        "transport",
        "version",
    )

    def __init__(self, edge: EdgeContext[MQTTProtocol], *, tls: bool = False) -> None:
        self.edge = edge
        self.router = edge.router
        self.metrics = edge.metrics
        self.tls = tls  # came in over the TLS listener (tls_identity: the certificate's CN)
        self.tls_identity: str | None = None
        cfg = edge.config.router
        self.conn = ServerConnection(
            max_packet_size=cfg.max_packet_size,
            topic_alias_maximum=TOPIC_ALIAS_MAXIMUM,  # the value the CONNACK announces
            max_topic_length=cfg.max_topic_length,
            max_topic_levels=cfg.max_topic_levels,
            receive_maximum=cfg.max_inflight,  # announced in CONNACK by the router
        )
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.client_id = ""
        self.version = 4
        self.keepalive = 0
        self.last_received = edge.monotonic()
        self.connected_at = self.last_received
        #: The CONNECT's admission while it is pending (a password check, a session claim):
        #: input is held there, in arrival order, until it ends.
        self._admission: Admission | None = None
        self._fresh = True  # nothing received yet (a TLS ClientHello is recognised then)
        #: Output queued this iteration; None while there is none (idle: no list).
        self._out: list[bytes] | None = None
        self._out_bytes = 0
        self._held = 0  # holds (:meth:`hold`) on the output: while any, nothing leaves
        self._paused = False
        self._acked = False
        self._closing = False
        #: The end of the "Client X disconnected" line (connlog); None: no line to log.
        self._ending: str | None = None
        self._graceful = False
        self._high_water = min(cfg.max_queued_bytes, WRITE_HIGH_WATER)
        self._budget = min(self._high_water, OUTPUT_PER_ITERATION)
        #: The device path (module docstring): the partition of the connection's plain
        #: topic (``conn.plain_topic``), as the router answered; meaningless until there is one.
        self._plain_key: PartitionKey = ("", 0)
        self._lane: DeviceLane | None = None  # the same, compiled (devicepath.py)
        self._parked = 0  # 0 live, >0 parked (its socket), -1 resuming (broker.net.parking)
        self._wrote = False  # output left since the parking lot's last look
        self._handoff: Any = None  # moving: its token; moved here: the bytes it brought

    #: False: the Python device path even where the compiled one is built (tests).
    compiled_device_path: ClassVar[bool] = True
    #: The device path in Python (broker.net.devicepath): the reference, and the fallback.
    _plain_publish = plain_publish
    _plain_acked = plain_acked
    _burst_lane = burst_lane

    @property
    def connect_timeout(self) -> float:
        """s3.1.4: a server may close a connection that sends no CONNECT in reasonable time."""
        return float(self.edge.config.router.connect_timeout)

    @property
    def peer(self) -> str:
        """``host:port`` of the client, for log lines."""
        return peer_address(self)

    @property
    def peer_host(self) -> str:
        """The client's address (the login's host, broker.auth)."""
        return peer_address(self, host_only=True)

    # ---------------------------------------------------------------- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's stream transport, or a carrier (broker.net.carrier) with its surface.
        # TCP_NODELAY: uvloop (and asyncio) set it on every TCP transport they make.
        self.transport = stream = cast(asyncio.Transport, transport)
        stream.set_write_buffer_limits(high=self._high_water)
        if self._parked:
            resumed(self)  # a new transport for a parked connection (broker.net.parking)
            return
        self.edge.links.add(self)
        self.edge.keepalive.file(self, self.connected_at + self.connect_timeout)
        self.metrics.connections_opened += 1

    def data_received(self, data: bytes) -> None:
        lane = self._lane
        if lane is not None and lane.receive(data):
            return  # the compiled device path (module docstring)
        if self._closing:
            return
        if lane is None and data[0] | 2 == 0x32 and self._burst_lane(data):
            return  # a first burst of PUBLISHes, through the compiled lane (devicepath.py)
        self.last_received = self.edge.monotonic()
        self.metrics.bytes_in += len(data)
        if self._admission is not None:
            self._admission.hold_data(data)
            return
        if self._fresh:
            self._fresh = False
            if data[0] == TLS_HANDSHAKE_BYTE and not self.tls:
                # 0x16 is no valid MQTT first byte (CONNECT with reserved flags 0110).
                self._wrong_protocol()
                return
        if lane is None and self.conn.plain_topic and self._plain_publish(data):
            return
        self._receive(data, None)

    def _receive(self, data: bytes | None, packets: list[Packet | PubAckRun] | None) -> None:
        """Decode ``data`` (or take already decoded ``packets``) and dispatch, in order."""
        try:
            if packets is None:
                packets = self.conn.receive_data(data or b"")
            n = len(packets)
            i = 0
            session = self.session
            if session is None:
                if not n:
                    return
                # Before the session only the CONNECT is dispatched: the connection lets no
                # other packet come first [MQTT-3.1.0-1], nor a second CONNECT [MQTT-3.1.0-2].
                connect = packets[0]
                assert isinstance(connect, Connect)
                self._on_connect(connect)
                if self._closing:
                    return
                if self._admission is not None:
                    self._admission.hold(packets[1:])
                    return
                session = self.session
                assert session is not None  # entered, or refused and closing (above)
                i = 1
            while i < n:
                packet = packets[i]
                if type(packet) is Publish:
                    # Consecutive PUBLISHes go to the router together (its batch path).
                    j = i + 1
                    while j < n and type(packets[j]) is Publish:
                        j += 1
                    if TYPE_CHECKING:  # [i, j) holds PUBLISHes only: a cast without the call
                        run = cast("list[Publish]", packets[i:j])
                    else:
                        run = packets[i:j] if j - i < n else packets
                    self._publish(session, run)
                    i = j
                else:
                    _HANDLERS[type(packet)](self, session, packet)
                    i += 1
                if self._closing:
                    return
            if self._acked:
                # One pump for all the PUBACKs of this read, not one per PUBACK.
                self._acked = False
                self.router.pump_acked(session)
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
        port = self.edge.config.server.tls_port
        hint = f"; MQTT over TLS is on port {port}" if port else " ([server] tls_port is 0)"
        log.warning(
            "%s: TLS handshake (ClientHello) on the plain MQTT port; closing%s", self.peer, hint
        )
        self._closing = True
        self._flush_and_close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ending is not None:
            log_disconnected(self.client_id, self._ending)
            self._ending = None
        edge = self.edge
        edge.keepalive.discard(self)
        edge.parking.forget(self)
        if self in edge.links:
            edge.links.discard(self)
            self.metrics.connections_closed += 1
        self._closing = True
        self._lane = None
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
    def _publish(self, session: Session, run: list[Publish]) -> None:
        """Consecutive PUBLISHes of one read: stored by the router in order, as a batch."""
        messages_in = self.metrics.messages_in
        for packet in run:
            messages_in[packet.qos] += 1
        self.router.publish_run(session, run)
        last = run[-1]
        conn = self.conn
        if (
            last.qos < 2
            and not last.retain
            and not last.properties
            and last.topic != conn.plain_topic
        ):
            # Where the device path takes the next ones (module docstring) from.
            key = self.router.plain_route(self.client_id, last.topic)
            if key is not None:
                conn.expect_plain(last.topic)
                self._plain_key = key
                if self.compiled_device_path:
                    self._lane = new_lane(self, key)
                if self.edge.handoff is not None:  # moved to the owner? (broker.net.handoff)
                    self.edge.handoff(self, key)

    # One handler per packet type a client sends after CONNECT, PUBLISH aside (in _HANDLERS).

    def _on_puback_run(self, session: Session, packet: PubAckRun) -> None:
        self.router.puback_run(session, packet.packet_ids)
        self._acked = True

    def _on_puback(self, session: Session, packet: PubAck) -> None:
        self.router.puback(session, packet.packet_id, pump=False)
        self._acked = True  # the freed quota is used once per read, in _receive

    def _on_pubrec(self, session: Session, packet: PubRec) -> None:
        self.router.pubrec(session, packet.packet_id, packet.reason_code)

    def _on_pubrel(self, session: Session, packet: PubRel) -> None:
        self.router.pubrel(session, packet.packet_id)

    def _on_pubcomp(self, session: Session, packet: PubComp) -> None:
        self.router.pubcomp(session, packet.packet_id)

    def _on_subscribe(self, session: Session, packet: Subscribe) -> None:
        self.router.subscribe(session, packet)

    def _on_unsubscribe(self, session: Session, packet: Unsubscribe) -> None:
        self.router.unsubscribe(session, packet)

    def _on_pingreq(self, session: Session, packet: PingReq) -> None:
        self.send(PingResp())  # [MQTT-3.12.4-1]

    def _on_disconnect(self, session: Session, packet: Disconnect) -> None:
        self.router.disconnect(session, packet)
        if self._ending is not None:
            self._ending = CLIENT_DISCONNECTED
        self._graceful = packet.reason_code != ReasonCode.DISCONNECT_WITH_WILL_MESSAGE
        self._closing = True
        self._flush_and_close()  # [MQTT-3.14.4-1]

    def _on_auth(self, session: Session, packet: Auth) -> None:
        # No enhanced authentication method was agreed on CONNECT (s4.12).
        raise ProtocolError("AUTH without an authentication method")

    # ---------------------------------------------------------------- admission
    def _on_connect(self, packet: Connect) -> None:
        """The CONNECT: admit it (broker.net.admission); input waits while that is pending."""
        self.version = packet.protocol_level
        admission = Admission(self.edge, self, packet)
        if admission.start():
            self._admission = admission

    @property
    def closing(self) -> bool:
        """Applicant: the client went away, or this connection is being closed."""
        return self._closing

    def refuse(self, reason_code: int, reason: str = "") -> None:
        """Applicant: a CONNACK refusing the CONNECT (5.0: with ``reason`` as its Reason
        String [MQTT-3.1.2-29]), then close [MQTT-3.2.2-7]."""
        if reason and self.version == 5:
            self.send(ConnAck(False, reason_code, {PropertyId.REASON_STRING: reason}))
        else:
            self._write(self.conn.refuse(reason_code))
        self._closing = True
        self._flush_and_close()

    def enter(self, packet: Connect, username: str | None) -> None:
        """Applicant: the router connects the session (answering the CONNACK) or refuses."""
        result = self.router.connect(self, packet, username=username)
        if result is None:
            self._closing = True
            self._flush_and_close()  # refused: CONNACK sent [MQTT-3.2.2-7]
            return
        self.session, self.keepalive = result
        if self.edge.config.server.connection_messages:
            log_connected(self.peer, self.client_id, packet, username)
            self._ending = PEER_CLOSED
        self.edge.parking.watch(self, self.last_received)
        deadline = keepalive_deadline(self)
        if deadline is None:
            self.edge.keepalive.discard(self)
        else:
            self.edge.keepalive.file(self, deadline)

    def admitted(self, held: list[Packet | PubAckRun], held_data: list[bytes]) -> None:
        """Applicant: the pending admission ended; process what came meanwhile, in order
        (no second admission can start: the connection refuses a second CONNECT)."""
        self._admission = None
        if held and not self._closing:
            self._receive(None, held)
        for data in held_data:
            if self._closing:
                return
            self._receive(data, None)

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
            refusal = self.conn.connect_refusal(error)  # a CONNACK, or a plain close
            if refusal is not None:
                self._write(refusal)
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
        if self._closing or (self.transport is not None and self.transport.is_closing()):
            return  # closed, or closing gracefully (broker.net.closing); parked: unparks
        if self._ending == PEER_CLOSED:
            self._ending = closed_by_broker(reason_code, reason)
        if self._held:  # what waited on a state that may never be stored never leaves
            self._out, self._out_bytes, self._held = None, 0, 0
        if reason_code is not None and self.version == 5 and self.session is not None:
            props: dict[int, Any] = {}
            if reason and self._problem_info():
                props[PropertyId.REASON_STRING] = reason
            self._write(self.conn.send(Disconnect(reason_code, props)))
        self._closing = True
        self._flush_and_close()

    def _problem_info(self) -> bool:  # [MQTT-3.1.2-29]
        return self.session is None or self.session.request_problem_information

    # ---------------------------------------------------------------- output
    def _write(self, data: bytes) -> None:
        if self._out is None:
            self._out = [data]
            if not self._closing:  # closing: shut; later output is dropped
                self.edge.want_flush(self)
        else:
            self._out.append(data)
        self._out_bytes += len(data)

    def hold(self) -> None:  # Link: queued output stays until as many release() calls
        self._held += 1

    def release(self) -> None:
        if self._held:
            self._held -= 1
            if not self._held and self._out and not self._closing:
                self.edge.want_flush(self)

    def flush_output(self) -> None:
        """Write everything queued this iteration in one call (called by the server)."""
        out = self._out
        if out is None or self._held:
            return
        transport = self.transport
        if transport is None:
            unpark(self)  # parked: written when resumed (broker.net.parking)
            return
        full = self._out_bytes >= self._budget
        self._out = None
        self._out_bytes = 0
        if transport.is_closing():
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        self.metrics.bytes_out += len(data)
        transport.write(data)
        self._wrote = True
        if full and not self._paused and self.session is not None and not self._closing:
            # The router stopped feeding this client because this iteration's output reached
            # its budget (can_write), not because the socket is full: nothing else would
            # wake it (no resume_writing), so it reads on now (written next iteration).
            self.router.pump_session(self.session)

    def _flush_and_close(self) -> None:
        self.edge.flush_peers()  # at once, not at the end of the iteration: after its frames
        self.flush_output()
        if self.transport is None:
            unpark(self)  # parked: closed when resumed (broker.net.parking)
            return
        if self._paused:
            # The peer is not reading (its window and our buffer are full): a graceful close
            # would wait for it forever, holding the socket and the buffered bytes. Reset.
            self.transport.abort()
        elif not self.transport.is_closing():
            # Our last bytes, FIN, then its input drained until it closes: the client
            # reads the DISCONNECT or CONNACK instead of a reset.
            close_gracefully(self.transport, self.edge)


#: What a packet a client sends after CONNECT makes the transport do, by type (PUBLISH aside:
#: runs of them go to the router together). The connection lets no other type through.
_HANDLERS: dict[type, Callable[[MQTTProtocol, Session, Any], None]] = {
    PubAckRun: MQTTProtocol._on_puback_run,
    PubAck: MQTTProtocol._on_puback,
    PubRec: MQTTProtocol._on_pubrec,
    PubRel: MQTTProtocol._on_pubrel,
    PubComp: MQTTProtocol._on_pubcomp,
    Subscribe: MQTTProtocol._on_subscribe,
    Unsubscribe: MQTTProtocol._on_unsubscribe,
    PingReq: MQTTProtocol._on_pingreq,
    Disconnect: MQTTProtocol._on_disconnect,
    Auth: MQTTProtocol._on_auth,
}
