"""Session lifecycle: CONNECT (new, resumed or taken over), DISCONNECT, the connection
lost, wills (delayed or not), session expiry and the timers that run them.

A session outlives its connection while its expiry interval runs (s3.1.2.11.2); a clean
start ends the old one [MQTT-3.1.2-4]; a second connection with the same client id takes
the session over and closes the first [MQTT-3.1.4-3]. The will goes out when the
connection is lost without DISCONNECT, after its delay if any, or when the session ends
first [MQTT-3.1.2-8], [MQTT-3.1.3-9]. A will's publish is a record the broker appends for a
client that is gone, which no client sends again: an append that fails (the partition's
owning worker died, its forward refused) is tried again at each tick, for up to
:data:`WILL_RETRY_SECONDS`; one of unknown outcome too (at least once).

Called only from the owning event loop's thread.
"""

from __future__ import annotations

import heapq
import logging
import sys
import uuid
from functools import partial
from typing import Any

import orjson

from broker.auth.acl import Authorizer
from broker.mqtt.errors import ProtocolError
from broker.mqtt.packets import ConnAck, Connect, Disconnect, Will
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import CONNACK_311_FOR_REASON, ReasonCode
from broker.router.commit import AckCallback, GroupCommit, stored
from broker.router.delivery import Delivery, release_once_stored
from broker.router.ingest import Ingest
from broker.router.link import Link
from broker.router.qos import QosFlows
from broker.router.session import EXPIRY_NEVER, Session
from broker.router.shared import SharedGroups
from broker.router.state import MIN_WAIT, RouterState
from broker.router.store import SessionStore

log = logging.getLogger("broker.router")

#: Topic aliases a client may use towards us (announced in CONNACK, s3.2.2.3.8).
TOPIC_ALIAS_MAXIMUM = 64
#: Seconds a will whose append failed is tried again (module docstring).
WILL_RETRY_SECONDS = 60.0


class Lifecycle:
    """Connections and sessions of one router coming and going. See the module docstring."""

    def __init__(
        self,
        state: RouterState,
        commit: GroupCommit,
        store: SessionStore,
        ingest: Ingest,
        shared: SharedGroups,
        delivery: Delivery,
        qos: QosFlows,
    ) -> None:
        self.state = state
        self.commit = commit
        self.store = store
        self.ingest = ingest
        self.shared = shared
        self.delivery = delivery
        self.qos = qos
        #: Wills whose append failed, tried again at the next tick: (client id, will, the
        #: monotonic time of the first try).
        self._wills_again: list[tuple[str, Will, float]] = []

    def connect(
        self, link: Link, packet: Connect, username: str | None = None
    ) -> tuple[Session, int] | None:
        """Handle CONNECT: answer CONNACK, resume or create the session.

        ``username`` is the authenticated identity (the transport checked the password or
        took the TLS certificate's CN); it selects the client's ACL rules.

        Returns the session and the keepalive to enforce, or None when refused (the CONNACK
        with the reason was sent and the link should close) [MQTT-3.2.2-7].
        """
        version = packet.protocol_level
        props = packet.properties
        state = self.state
        cfg = state.config
        if version == 5 and PropertyId.AUTHENTICATION_METHOD in props:
            # Enhanced authentication (s4.12) with a method we do not offer.
            self._refuse(
                link,
                version,
                ReasonCode.BAD_AUTHENTICATION_METHOD,
                "no enhanced authentication is offered",
            )
            return None
        current = state.sessions.get(packet.client_id) if packet.client_id else None
        connected = state.connections + state.hooks.connected_elsewhere()
        if connected >= cfg.max_connections and (current is None or current.link is None):
            # A takeover replaces a connection, so it is let in even at the limit.
            self._refuse(
                link,
                version,
                ReasonCode.SERVER_BUSY,
                f"{cfg.max_connections} connections (router.max_connections)",
            )
            return None
        if version < 5 and not cfg.keepalive_min <= packet.keepalive <= cfg.keepalive_max:
            # 3.1.1 has no Server Keep Alive to tell a client a clamped value, and enforcing
            # one it does not know would disconnect it while it behaves; so, as mosquitto
            # does, refuse with "identifier rejected" (3.1.1 s3.2.2.3 has no better code).
            self._refuse(link, version, ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
            return None
        client_id = packet.client_id
        assigned = None
        if not client_id:
            if version < 5 and not packet.clean_start:  # (3.1.1 only: no reason string)
                self._refuse(link, version, ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
                return None
            client_id = assigned = "mqlog-" + uuid.uuid4().hex  # [MQTT-3.1.3-6]
        if version == 5:
            expiry = props.get(PropertyId.SESSION_EXPIRY_INTERVAL, 0)
        else:
            expiry = 0 if packet.clean_start else EXPIRY_NEVER
        expiry = min(expiry, cfg.session_expiry_max)

        existing = state.sessions.get(client_id)
        if existing is not None and existing.owner_known and existing.owner != username:
            # A session belongs to the user who made it. Refused rather than replaced by a
            # fresh one: a fresh session under this client id would end the owner's, and
            # with it the messages queued for the owner's return (its positions in the log).
            log.warning(
                "CONNECT as %s refused: client id %r holds the session of %s",
                _who(username),
                client_id,
                _who(existing.owner),
            )
            self._refuse(
                link,
                version,
                ReasonCode.CLIENT_IDENTIFIER_NOT_VALID,
                "this client id holds another user's session",
            )
            return None
        if existing is not None and existing.link is not None:
            old = existing.link
            self.connection_lost(existing, old, graceful=False)
            old.close(ReasonCode.SESSION_TAKEN_OVER, "another connection took the session")
            existing = state.sessions.get(client_id)  # may have ended with the old connection
        if existing is not None and packet.clean_start:
            self.end_session(existing)  # [MQTT-3.1.2-4]
            existing = None
        session_present = existing is not None  # [MQTT-3.2.2-2], [MQTT-3.2.2-3]
        session = existing or Session(client_id)
        state.sessions[client_id] = session
        session.version = version
        session.persistent = expiry > 0
        session.expiry_interval = expiry
        if session.will_due is not None and session.will_due <= state.monotonic():
            # Its will fell due while no connection held the session and the timer has not
            # published it yet (a session restored after its worker died is due at once): it
            # goes out now, before the new connection's replaces it [MQTT-3.1.2-8]. Only a
            # will whose delay is still running is cancelled [MQTT-3.1.3-9].
            self.publish_will(session)
        session.will = packet.will
        session.will_due = None  # a new connection cancels a delayed will [MQTT-3.1.3-9]
        # Interned: a fleet's devices often share a user name, kept once, not per session.
        session.owner = sys.intern(username) if username is not None else None
        session.owner_known = True
        session.link = link
        session.disconnected_at = None
        session.receive_maximum = props.get(PropertyId.RECEIVE_MAXIMUM, 65535)
        session.request_problem_information = bool(
            props.get(PropertyId.REQUEST_PROBLEM_INFORMATION, 1)
        )
        session.dirty = False
        state.changed(session)
        if session.will is not None:
            # The state with its will is written now (a clean session's too), so that the will
            # survives this worker or node: in a cluster another node publishes it when this
            # one dies (broker.workers.orphans), with several workers the session's home
            # worker does (broker.workers.sessions), and one node defers it to its next start
            # (s3.1.2.5) [MQTT-3.1.2-8]. A persistent session's, written at the next tick,
            # left the previous connection's state to whoever restored it meanwhile. The
            # CONNACK (and what follows it) leaves once the state is in the log: a broker
            # killed right after (every worker at once: the state forwarded to $sessions'
            # owner, not yet appended) owed a will it had not stored.
            link.hold()
            self.store.write(session, partial(release_once_stored, session, link))
        link.client_id = client_id
        state.connections += 1
        state.hooks.connections_changed(state.connections)
        if state.acl is not None:
            state.authz[client_id] = Authorizer(state.acl.rules_for(username, client_id))
            state.usernames[client_id] = username
            for consumer in session.consumers.values():
                consumer.match_cache.clear()  # read rights may differ from the last login

        keepalive = packet.keepalive
        if keepalive > cfg.keepalive_max or (keepalive < cfg.keepalive_min and version == 5):
            keepalive = max(cfg.keepalive_min, min(keepalive, cfg.keepalive_max))
        ack_props: dict[int, Any] = {}
        if version == 5:
            ack_props[PropertyId.RECEIVE_MAXIMUM] = cfg.max_inflight
            ack_props[PropertyId.MAXIMUM_PACKET_SIZE] = cfg.max_packet_size
            ack_props[PropertyId.TOPIC_ALIAS_MAXIMUM] = TOPIC_ALIAS_MAXIMUM
            if assigned is not None:
                ack_props[PropertyId.ASSIGNED_CLIENT_IDENTIFIER] = assigned
            if keepalive != packet.keepalive:
                ack_props[PropertyId.SERVER_KEEP_ALIVE] = keepalive  # [MQTT-3.2.2-21]
            if expiry != props.get(PropertyId.SESSION_EXPIRY_INTERVAL, 0):
                ack_props[PropertyId.SESSION_EXPIRY_INTERVAL] = expiry
            if props.get(PropertyId.REQUEST_RESPONSE_INFORMATION):
                ack_props[PropertyId.RESPONSE_INFORMATION] = f"mqlog/response/{client_id}"
        link.send(ConnAck(session_present, ReasonCode.SUCCESS, ack_props))
        for key in session.shared:
            self.shared.join_group(session, key)
        self.qos.resend_inflight(session)
        self.delivery.pump_session(session)
        return session, keepalive

    def release_link(self, session: Session, link: Link) -> bytes | None:
        """Hand-off (broker.workers.handoff), the worker giving the connection up: ``link``,
        whose socket went to another worker, leaves ``session`` with no will and no close
        (the connection goes on there), and the session leaves this router with its
        authorisation state. Returns its state for the other worker; None, with nothing
        changed, if ``link`` no longer holds it (taken over meanwhile)."""
        state = self.state
        if state.sessions.get(session.client_id) is not session or session.link is not link:
            return None
        session.link = None
        state.connections -= 1
        state.hooks.connections_changed(state.connections)
        for key in list(session.shared):
            self.shared.leave_group(session, key)
        data = orjson.dumps(session.to_state(state.monotonic()))
        self.store.forget(session)  # and its username and ACL decisions here
        return data

    def attach_handed(
        self, link: Link, client_id: str, receive_maximum: int, problem_info: bool, stored: bool
    ) -> Session | None:
        """Hand-off, the worker taking the connection: ``link`` continues the session of
        ``client_id`` just adopted (:meth:`SessionStore.adopt`) as its connection: no
        CONNACK (the client saw it), its will stays pending [MQTT-3.1.2-8], its login's
        ACL rules are restored (``owner``: the user it logged in as). ``stored``: whether
        its state is in ``$sessions`` (a clean session's is not, unless it has a will: its
        end then writes no tombstone)."""
        state = self.state
        session = state.sessions.get(client_id)
        if session is None:
            return None
        session.link = link
        session.will_due = None  # adopted as if lost: the connection goes on
        session.disconnected_at = None
        session.persistent = session.expiry_interval > 0
        session.receive_maximum = receive_maximum
        session.request_problem_information = problem_info
        session.stored = stored
        session.dirty = False
        state.changed(session)  # written here once (this worker's tick)
        link.client_id = client_id
        state.connections += 1
        state.hooks.connections_changed(state.connections)
        if state.acl is not None:
            state.authz[client_id] = Authorizer(state.acl.rules_for(session.owner, client_id))
            state.usernames[client_id] = session.owner
        for key in session.shared:
            self.shared.join_group(session, key)
        self.qos.resend_inflight(session)
        self.delivery.pump_session(session)
        return session

    def _refuse(self, link: Link, version: int, reason: int, text: str = "") -> None:
        """Answer CONNACK with ``reason`` (3.1.1: its return code; 5.0: with ``text`` as its
        Reason String, which a CONNACK may always carry [MQTT-3.1.2-29]); the caller closes."""
        if version == 5:
            props: dict[int, Any] = {PropertyId.REASON_STRING: text} if text else {}
            link.send(ConnAck(False, reason, props))
            return
        link.send(ConnAck(False, CONNACK_311_FOR_REASON.get(reason, 3)))

    def disconnect(self, session: Session, packet: Disconnect) -> None:
        """A DISCONNECT from the client: the will is dropped unless asked for (0x04)."""
        new_expiry = packet.properties.get(PropertyId.SESSION_EXPIRY_INTERVAL)
        if new_expiry is not None:
            if session.expiry_interval == 0 and new_expiry != 0:
                raise ProtocolError("session expiry set on DISCONNECT after 0 [MQTT-3.14.2-2]")
            session.expiry_interval = min(new_expiry, self.state.config.session_expiry_max)
            session.persistent = session.expiry_interval > 0
        if packet.reason_code != ReasonCode.DISCONNECT_WITH_WILL_MESSAGE:
            session.will = None  # [MQTT-3.1.2-10]

    def connection_lost(self, session: Session, link: Link, *, graceful: bool) -> None:
        """The link of ``session`` closed. Publishes or schedules the will unless graceful."""
        if session.link is not link:
            return  # taken over already
        state = self.state
        session.link = None
        state.connections -= 1
        state.hooks.connections_changed(state.connections)
        session.disconnected_at = state.clock()
        will = session.will
        if will is not None and not graceful:
            delay = will.properties.get(PropertyId.WILL_DELAY_INTERVAL, 0)
            if delay and session.expiry_interval > 0:
                session.will_due = state.monotonic() + min(delay, session.expiry_interval)
            else:
                self.publish_will(session)
        elif graceful:
            session.will = None
        for key in list(session.shared):
            self.shared.leave_group(session, key)
        if session.expiry_interval == 0:
            self.end_session(session)
        else:
            state.mark_dirty(session)
            self.store.persist(session)
            state.wait_offline(session)

    def publish_will(self, session: Session) -> None:
        """The will of ``session`` is due: it goes out now, or, in a cluster, once the
        session's owner is confirmed in ``$sessions`` (broker.workers.will_fence)."""
        will = session.will
        session.will = None
        session.will_due = None
        if will is None:
            return
        # Its state is written again without it (the timer persists a dirty session): one
        # that still held it would have the will published again after a restart here, or
        # by the next node to hold the session in a cluster.
        self.state.mark_dirty(session)
        if self.state.hooks.will_now(session.client_id, will):
            self._send_will_until_stored(session.client_id, will, self.state.monotonic())

    def _send_will_until_stored(self, client_id: str, will: Will, first: float) -> None:
        """:meth:`send_will`, tried again at the next tick while its append fails (module
        docstring): with several workers, the wills of the sessions a dead worker held go
        out from their home worker at once, to partitions the dead worker may own."""

        def answered(offset: int | None) -> None:
            if stored(offset):
                return
            if self.state.monotonic() - first < WILL_RETRY_SECONDS:
                self._wills_again.append((client_id, will, first))
            else:
                log.error(
                    "%s: will to %r not stored in %.0f s; dropped",
                    client_id,
                    will.topic,
                    WILL_RETRY_SECONDS,
                )

        self.send_will(client_id, will, answered)

    def send_will(self, client_id: str, will: Will, ack: AckCallback | None = None) -> bool:
        """Publish ``will`` of ``client_id``; ``ack`` once it is in the log. False if it is
        dropped, not authorized."""
        if not self.ingest.may_publish(client_id, will.topic):
            log.info("%s: will to %r dropped: not authorized", client_id, will.topic)
            return False
        props = {k: v for k, v in will.properties.items() if k != PropertyId.WILL_DELAY_INTERVAL}
        self.ingest.store_publish(
            client_id,
            will.topic,
            will.payload,
            will.qos,
            retain=will.retain,
            properties=props,
            ack=ack,
        )
        return True

    def end_session(self, session: Session) -> None:
        """The session ends: its will goes out now if still pending, its state is deleted."""
        if session.will_due is not None:
            self.publish_will(session)
        for full in list(session.shared):
            self.shared.leave_group(session, full, orphan_inflight=True)
            del session.shared[full]
        self.store.forget(session)
        if session.persistent or session.dirty or session.stored:
            self.store.delete(session.client_id)
        self.state.hooks.session_ended(session.client_id)

    def tick(self) -> None:
        """Run timers: delayed wills, session expiry, persisting positions. Call every ~1 s.

        It looks only at the sessions that may have work for it: the dirty ones
        (``state.timed``, each dropped once written), and the offline ones whose time came
        (``state.offline_due``, a heap: one waiting days for its expiry costs no pass).
        """
        state = self.state
        mono = state.monotonic()
        sessions = state.sessions
        if self._wills_again:
            again, self._wills_again = self._wills_again, []
            for client_id, will, first in again:
                self._send_will_until_stored(client_id, will, first)
        self.store.delete_again()
        due = state.offline_due
        if due and due[0][0] <= mono:
            now = state.clock()
            while due and due[0][0] <= mono:
                at, _, client_id = heapq.heappop(due)
                session = sessions.get(client_id)
                if session is None or session._due != at:
                    continue  # ended, moved, or its time changed since (another entry)
                session._due = None
                if session.link is not None:
                    continue  # back online
                if session.will_due is not None and session.will_due <= mono:
                    self.publish_will(session)
                if (
                    session.expiry_interval != EXPIRY_NEVER
                    and session.disconnected_at is not None
                    and session.disconnected_at + session.expiry_interval <= now
                ):
                    self.end_session(session)
                    continue
                state.wait_offline(session, mono + MIN_WAIT)
        timed = state.timed
        for key, session in list(timed.items()):
            if session.dirty and session.persistent and sessions.get(session.client_id) is session:
                self.store.persist(session)  # (raising, it and the rest stay for the next)
            del timed[key]  # marked again when it changes again
        if not timed:
            timed.clear()  # its table too: a burst's is not walked again
        if state.groups_dirty:
            self.store.persist_groups()


def _who(username: str | None) -> str:
    return "anonymous" if username is None else repr(username)
