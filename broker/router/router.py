"""The router: sessions, subscriptions, offsets and QoS flows over the partition logs.

Connections are stateless (the rumqttd design): they hand the router validated packets and
the router answers through their :class:`~broker.router.link.Link`. The router is synchronous
logic with an injected clock; I/O lives at the edges (the transport writes bytes, the log
writes files).

Data path, per event-loop iteration:

1. ``publish`` turns each PUBLISH into a :class:`Record` gathered by its partition;
2. ``flush`` (scheduled once per iteration) appends each partition's batch with one write,
   then acknowledges publishers (PUBACK / PUBREC only after the append [MQTT-4.3.2-2]) and
   wakes the consumers reading that partition;
3. a consumer reads from its cursor: from memory when caught up, from the log when behind,
   and stops when its client has no send quota or its output buffer is full, to resume when
   the client acknowledges or the buffer drains. One slow client therefore costs nothing to
   publishers or to other subscribers.

Partition ownership: this router writes only the partitions it owns (all of them with one
worker). Every partition's state is reached through :meth:`Router.partition`, the one place a
multi-worker build changes.

Called only from the owning event loop's thread.
"""

from __future__ import annotations

import logging
import time
import uuid
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, repeat
from operator import add, itemgetter
from typing import Any, cast

import orjson

from broker.auth import Acl, Authorizer
from broker.commitlog import OffsetOutOfRange, Record, Streams
from broker.config import RouterConfig
from broker.mqtt.errors import ProtocolError, TopicFilterInvalid
from broker.mqtt.packets import (
    ConnAck,
    Connect,
    Disconnect,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
)
from broker.mqtt.properties import PropertyId, decode_properties, encode_properties
from broker.mqtt.reason_codes import CONNACK_311_FOR_REASON, ReasonCode
from broker.mqtt.topics import (
    filters_overlap,
    is_wildcard,
    parse_shared,
    topic_matches,
    validate_topic_filter,
)
from broker.router.link import GroupPeers, Link
from broker.router.partition import Columns, Partition, PartitionBase
from broker.router.replay import ReplayStart, is_replay, parse_replay
from broker.router.session import (
    MAIN,
    Consumer,
    Inflight,
    InflightRun,
    PartitionKey,
    RemoteMember,
    Session,
    SharedGroup,
    Subscription,
)

log = logging.getLogger("broker.router")

RETAINED_STREAM = "$retained"
SESSIONS_STREAM = "$sessions"
#: Session expiry of 0xFFFFFFFF means "never" (s3.1.2.11.2).
EXPIRY_NEVER = 0xFFFFFFFF
#: Topic aliases a client may use towards us (announced in CONNACK, s3.2.2.3.8).
TOPIC_ALIAS_MAXIMUM = 64
_USER = PropertyId.USER_PROPERTY
#: Topics whose partition is remembered by the publish path (cleared when full).
TOPIC_KEY_CACHE = 100_000
#: Topics whose subscription match is remembered per consumer (cleared when full).
MATCH_CACHE = 10_000
#: Records from which a consumer's read is delivered as one run (:meth:`Router._send_run`).
RUN_MIN = 8
#: :meth:`Router._send_run`: the next record waits for the send quota (s4.9).
QUOTA_FULL = -1
_RETAINED: PartitionKey = (RETAINED_STREAM, 0)
_SESSIONS: PartitionKey = (SESSIONS_STREAM, 0)


class Router:
    """Owns every session and partition of one worker. See the module docstring."""

    def __init__(
        self,
        streams: Streams,
        config: RouterConfig,
        *,
        schedule: Callable[[Callable[[], None]], Any],
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        partition_factory: Callable[[PartitionKey], PartitionBase] | None = None,
        load: bool = True,
    ) -> None:
        """``partition_factory`` makes the partition objects (one worker of several: owned
        or remote ones); ``load=False`` defers :meth:`load` (a worker first learns where
        its peers' sessions are)."""
        self.streams = streams
        self.config = config
        self._schedule = schedule
        self.clock = clock
        self.monotonic = monotonic
        self.sessions: dict[str, Session] = {}
        self.groups: dict[str, SharedGroup] = {}
        self.partitions: dict[PartitionKey, PartitionBase] = {}
        self.retained: dict[str, Record] = {}  # topic -> record in $retained (with its offset)
        self.connections = 0
        self._dirty: dict[PartitionKey, PartitionBase] = {}
        self._flush_scheduled = False
        self._groups_dirty = False
        #: Sessions to write to $sessions before this flush's acknowledgements go out, and
        #: what waits for that write.
        self._persist_due: dict[str, Session] = {}
        self._persist_waiters: dict[str, list[Callable[[int | None], None]]] = {}
        self._topic_keys: dict[str, PartitionKey] = {}
        self.dropped = 0  # QoS 0 records skipped by the slow-subscriber policy
        #: The ACL ([auth] acl_file); None allows everything. Set by the server.
        self.acl: Acl | None = None
        #: Per client id: its resolved ACL, from CONNECT until its session ends.
        self._authz: dict[str, Authorizer] = {}
        #: Per client id: the user name it logged in with (a shared group held by another
        #: worker applies that user's ACL rules to it).
        self._usernames: dict[str, str | None] = {}
        self.acl_denied = 0  # PUBLISHes dropped and subscriptions refused by the ACL
        self.log_appends = 0  # batches appended (one write each)
        self.records_appended = 0
        #: Called with the seconds an fsync=always append (write + fdatasync) took.
        self.on_sync_append: Callable[[float], None] | None = None
        self._make_partition = partition_factory
        # Hooks of a multi-worker broker (broker.workers.runtime sets them):
        #: told when a session held here ends, so its home forgets it;
        self.on_session_end: Callable[[str], None] | None = None
        #: which sessions and groups (by client id / group filter) this worker loads;
        self.is_home: Callable[[str], bool] = lambda name: True
        #: told when this worker's connected clients change, and how many the others have
        #: (as they last said: max_connections holds for the broker, a few ms late).
        self.on_connections: Callable[[int], None] | None = None
        self.peer_connections: Callable[[], int] = lambda: 0
        #: shared groups held by other workers are reached through this.
        self.group_peers: GroupPeers | None = None
        if load:
            self.load()

    def load(self, skip: Iterable[str] = ()) -> list[str]:
        """Load retained messages and the sessions this worker is home to, except those in
        ``skip`` (held by another worker); returns the client ids loaded."""
        self._load_retained()
        return self._load_sessions(skip=set(skip))

    # ================================================================ partitions

    def partition(self, key: PartitionKey) -> PartitionBase:
        part = self.partitions.get(key)
        if part is None:
            if self._make_partition is not None:
                part = self._make_partition(key)
            else:
                part = Partition(key, self.streams.log(*key))
            self.partitions[key] = part
        return part

    def append_forwarded(
        self, key: PartitionKey, rows: list[tuple[Any, ...]], ack: Callable[[int | None], None]
    ) -> None:
        """Records another worker forwarded to partition ``key``, which this worker owns, as
        rows without their offset (:meth:`PartitionBase.add_rows`): appended in this
        iteration's group commit, consecutively; ``ack`` gets the first record's offset
        (None if the append failed)."""
        part = self.partition(key)
        part.add_rows(rows, ack)
        self._dirty[key] = part
        self._flush_soon()

    def wake(self, part: PartitionBase) -> None:
        """New records in ``part``, which another worker owns and announced."""
        self._wake(part)

    def apply_retained(self, records: Iterable[Record]) -> None:
        """Committed ``$retained`` records update the retained index [MQTT-3.3.1-5]; an
        empty payload removes the topic's message [MQTT-3.3.1-10]."""
        retained = self.retained
        for rec in records:
            if rec.payload:
                retained[rec.topic] = rec
            else:
                retained.pop(rec.topic, None)

    def _keys_for_filter(self, plain: str) -> list[PartitionKey]:
        """Partitions a (non-shared, non-replay) filter can receive records from."""
        if not is_wildcard(plain):
            return [self.streams.partition_for(plain)]
        keys: list[PartitionKey] = []
        for spec in self.streams.specs.values():
            if spec.name.startswith("$") and not spec.topic_filters:
                continue  # compacted broker state ($retained, $sessions), not messages
            if spec.name == "default" or any(filters_overlap(f, plain) for f in spec.topic_filters):
                keys.extend((spec.name, p) for p in range(spec.partitions))
        return keys

    def _enqueue(
        self,
        record: Record,
        ack: Callable[[int | None], None] | None,
        key: PartitionKey | None = None,
    ) -> None:
        """Gather a record for the next group commit; ``key`` defaults to its topic's."""
        if key is None:
            key = self._topic_key(record.topic)
        part = self.partition(key)
        part.add(record, ack)
        self._dirty[key] = part
        self._flush_soon()

    def _flush_soon(self) -> None:
        """Run the group commit at the end of this event-loop iteration (once)."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._schedule(self.flush)

    def _topic_key(self, topic: str) -> PartitionKey:
        """The partition of ``topic``. Topic -> partition is fixed for the process (streams
        do not change at run time): the crc32 and the stream lookup are paid once per topic."""
        key = self._topic_keys.get(topic)
        if key is None:
            if len(self._topic_keys) >= TOPIC_KEY_CACHE:
                self._topic_keys.clear()
            key = self._topic_keys[topic] = self.streams.partition_for(topic)
        return key

    def flush(self) -> None:
        """Group commit: append every gathered batch, acknowledge, wake consumers."""
        self._flush_scheduled = False
        while self._dirty:
            dirty, self._dirty = self._dirty, {}
            for key, part in dirty.items():
                if part.appends_here:  # else forwarded to the worker that owns it
                    self.log_appends += 1
                    self.records_appended += len(part.pending)
                try:
                    if self.on_sync_append is not None and part.log.config.fsync == "always":
                        started = time.perf_counter()
                        first, end = part.commit()
                        self.on_sync_append(time.perf_counter() - started)
                    else:
                        first, end = part.commit()
                except Exception:
                    log.exception("append to %s/%d failed; its publishers get an error", *key)
                    continue
                if key == _RETAINED and end > first:
                    self.apply_retained(part.read(first, end - first))
                self._wake(part)
            if self._persist_due:
                # Written in this same flush (the loop goes round again for $sessions), so
                # before the acknowledgements queued above leave at the end of the iteration.
                due, self._persist_due = self._persist_due, {}
                for client_id, session in due.items():
                    waiters = self._persist_waiters.pop(client_id, None)
                    if not session.persistent:
                        for then in waiters or ():
                            then(None)
                        continue
                    self._persist(session, _Each(waiters) if waiters else None)

    def _persist_before_acks(
        self, session: Session, then: Callable[[int | None], None] | None = None
    ) -> None:
        """Persist ``session`` within the current group commit (see :meth:`flush`).

        Output queued during :meth:`flush` leaves after it returns, so what is sent there
        follows the state; outside a flush, the state follows in the next one. ``then`` is
        called once the state is in the log: with one worker in this same flush, with
        several once the worker owning ``$sessions`` appended it.
        """
        self._persist_due[session.client_id] = session
        if then is not None:
            self._persist_waiters.setdefault(session.client_id, []).append(then)
        self._flush_soon()

    def _wake(self, part: PartitionBase) -> None:
        for watcher in list(part.watchers):
            if watcher[0] == "s":
                session = self.sessions.get(watcher[1])
                consumer = session.consumers.get(watcher[2]) if session else None
                if session is None or consumer is None or session.link is None:
                    continue
                self._pump(session, consumer, part.key)
            else:
                group = self.groups.get(watcher[1])
                if group is not None:
                    self._pump_group(group)

    # ================================================================ connect

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
        cfg = self.config
        if version == 5 and PropertyId.AUTHENTICATION_METHOD in props:
            # Enhanced authentication (s4.12) with a method we do not offer.
            self._refuse(link, version, ReasonCode.BAD_AUTHENTICATION_METHOD)
            return None
        current = self.sessions.get(packet.client_id) if packet.client_id else None
        connected = self.connections + self.peer_connections()
        if connected >= cfg.max_connections and (current is None or current.link is None):
            # A takeover replaces a connection, so it is let in even at the limit.
            self._refuse(link, version, ReasonCode.SERVER_BUSY)
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
            if version < 5 and not packet.clean_start:
                self._refuse(link, version, ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
                return None
            client_id = assigned = "mqlog-" + uuid.uuid4().hex  # [MQTT-3.1.3-6]
        if version == 5:
            expiry = props.get(PropertyId.SESSION_EXPIRY_INTERVAL, 0)
        else:
            expiry = 0 if packet.clean_start else EXPIRY_NEVER
        expiry = min(expiry, cfg.session_expiry_max)

        existing = self.sessions.get(client_id)
        if existing is not None and existing.link is not None:
            old = existing.link
            self.connection_lost(existing, old, graceful=False)
            old.close(ReasonCode.SESSION_TAKEN_OVER, "another connection took the session")
            existing = self.sessions.get(client_id)  # may have ended with the old connection
        if existing is not None and packet.clean_start:
            self._end_session(existing)  # [MQTT-3.1.2-4]
            existing = None
        session_present = existing is not None  # [MQTT-3.2.2-2], [MQTT-3.2.2-3]
        session = existing or Session(client_id)
        self.sessions[client_id] = session
        session.version = version
        session.persistent = expiry > 0
        session.expiry_interval = expiry
        session.will = packet.will
        session.will_due = None  # a new connection cancels a delayed will [MQTT-3.1.3-9]
        session.link = link
        session.disconnected_at = None
        session.receive_maximum = props.get(PropertyId.RECEIVE_MAXIMUM, 65535)
        session.request_problem_information = bool(
            props.get(PropertyId.REQUEST_PROBLEM_INFORMATION, 1)
        )
        session.dirty = session.persistent
        link.client_id = client_id
        self.connections += 1
        if self.on_connections is not None:
            self.on_connections(self.connections)
        if self.acl is not None:
            self._authz[client_id] = Authorizer(self.acl.rules_for(username, client_id))
            self._usernames[client_id] = username
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
            self._join_group(session, key)
        self._resend_inflight(session)
        self.pump_session(session)
        return session, keepalive

    def _refuse(self, link: Link, version: int, reason: int) -> None:
        """Answer CONNACK with ``reason`` (3.1.1: its return code); the caller closes."""
        code = reason if version == 5 else CONNACK_311_FOR_REASON.get(reason, 3)
        link.send(ConnAck(False, code))

    # ================================================================ disconnect & will

    def disconnect(self, session: Session, packet: Disconnect) -> None:
        """A DISCONNECT from the client: the will is dropped unless asked for (0x04)."""
        new_expiry = packet.properties.get(PropertyId.SESSION_EXPIRY_INTERVAL)
        if new_expiry is not None:
            if session.expiry_interval == 0 and new_expiry != 0:
                raise ProtocolError("session expiry set on DISCONNECT after 0 [MQTT-3.14.2-2]")
            session.expiry_interval = min(new_expiry, self.config.session_expiry_max)
            session.persistent = session.expiry_interval > 0
        if packet.reason_code != ReasonCode.DISCONNECT_WITH_WILL_MESSAGE:
            session.will = None  # [MQTT-3.1.2-10]

    def connection_lost(self, session: Session, link: Link, *, graceful: bool) -> None:
        """The link of ``session`` closed. Publishes or schedules the will unless graceful."""
        if session.link is not link:
            return  # taken over already
        session.link = None
        self.connections -= 1
        if self.on_connections is not None:
            self.on_connections(self.connections)
        session.disconnected_at = self.clock()
        will = session.will
        if will is not None and not graceful:
            delay = will.properties.get(PropertyId.WILL_DELAY_INTERVAL, 0)
            if delay and session.expiry_interval > 0:
                session.will_due = self.monotonic() + min(delay, session.expiry_interval)
            else:
                self._publish_will(session)
        elif graceful:
            session.will = None
        for key in list(session.shared):
            self._leave_group(session, key)
        if session.expiry_interval == 0:
            self._end_session(session)
        else:
            session.dirty = True
            self._persist(session)

    def _publish_will(self, session: Session) -> None:
        will = session.will
        session.will = None
        session.will_due = None
        if will is None:
            return
        if not self._may_publish(session.client_id, will.topic):
            log.info("%s: will to %r dropped: not authorized", session.client_id, will.topic)
            return
        props = {k: v for k, v in will.properties.items() if k != PropertyId.WILL_DELAY_INTERVAL}
        self._store_publish(
            session.client_id, will.topic, will.payload, will.qos, will.retain, props, None
        )

    def _end_session(self, session: Session) -> None:
        """The session ends: its will goes out now if still pending, its state is deleted."""
        if session.will_due is not None:
            self._publish_will(session)
        for full in list(session.shared):
            self._leave_group(session, full, orphan_inflight=True)
            del session.shared[full]
        self._forget(session)
        if session.persistent or session.dirty:
            self._enqueue(Record(-1, self._now_ms(), session.client_id, b""), None, _SESSIONS)
        if self.on_session_end is not None:
            self.on_session_end(session.client_id)

    def _forget(self, session: Session) -> None:
        """Take ``session`` out of this router: its cursors stop watching partitions."""
        for consumer in session.consumers.values():
            for key in consumer.cursors:
                part = self.partitions.get(key)
                if part is not None:
                    part.watchers.discard(("s", session.client_id, consumer.name))
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
            self._authz.pop(session.client_id, None)
            self._usernames.pop(session.client_id, None)

    def tick(self) -> None:
        """Run timers: delayed wills, session expiry, persisting positions. Call every ~1 s."""
        mono = self.monotonic()
        now = self.clock()
        for session in list(self.sessions.values()):
            if session.link is None:
                if session.will_due is not None and session.will_due <= mono:
                    self._publish_will(session)
                if (
                    session.expiry_interval != EXPIRY_NEVER
                    and session.disconnected_at is not None
                    and session.disconnected_at + session.expiry_interval <= now
                ):
                    self._end_session(session)
                    continue
            if session.dirty and session.persistent:
                self._persist(session)
        if self._groups_dirty:
            self._persist_groups()

    # ================================================================ publish

    def publish(self, session: Session, packet: Publish, timestamp: int | None = None) -> None:
        """Store a client's PUBLISH; the ack goes out once it is in the log. ``timestamp``
        (ms): the time its read was stamped with (:meth:`publish_run`), else now."""
        qos = packet.qos
        pid = packet.packet_id
        link = session.link
        assert link is not None
        if not self._may_publish(session.client_id, packet.topic):
            self._deny_publish(session, link, packet)
            return
        if qos == 2 and pid in session.incoming_qos2:
            # A resend of a QoS 2 message we already stored: acknowledge, do not store again
            # [MQTT-4.3.3-9]; if it is still being appended, its PUBREC follows the append.
            if pid in session.pending_qos2:
                session.pending_qos2[pid] += 1
            else:
                link.send(PubRec(pid))
            return
        ack: Callable[[int | None], None] | None = None
        if qos == 1:
            ack = _Ack(self, session, link, PubAck, pid)  # type: ignore[arg-type]
        elif qos == 2:
            session.incoming_qos2.add(pid)  # type: ignore[arg-type]
            session.pending_qos2[pid] = 0  # type: ignore[index]
            session.dirty = session.persistent
            ack = _Ack(self, session, link, PubRec, pid)  # type: ignore[arg-type]
        self._store_publish(
            session.client_id,
            packet.topic,
            packet.payload,
            qos,
            packet.retain,
            packet.properties,
            ack,
            timestamp,
        )

    def publish_run(self, session: Session, packets: list[Publish]) -> None:
        """Store consecutive PUBLISHes of one read, in order; the same as :meth:`publish`
        on each, with the per-message work done once per run of one topic.

        A run is a stretch of QoS 0/1 PUBLISHes to one topic without properties or retain
        flag: one ACL decision (same client, same topic, same answer), one partition lookup,
        one timestamp and one step into the partition's pending batch. Anything else (QoS 2,
        retained, properties, denied) takes :meth:`publish`. Each QoS 1 message keeps its own
        acknowledgement, sent after the append [MQTT-4.3.2-2]; per-publisher order holds
        because runs are gathered in arrival order and one topic has one partition. Every
        message of the read carries the read's timestamp, those that take :meth:`publish`
        too: a partition's timestamps do not go back from one offset to the next within a
        read (a read from a time starts at a partition's first record at or after it).
        """
        link = session.link
        assert link is not None
        client_id = session.client_id
        timestamp = self._now_ms()
        n = len(packets)
        i = 0
        while i < n:
            packet = packets[i]
            topic = packet.topic
            if (
                packet.qos == 2
                or packet.retain
                or packet.properties
                or not self._may_publish(client_id, topic)
            ):
                self.publish(session, packet, timestamp)
                i += 1
                continue
            j = i + 1
            while j < n:
                other = packets[j]
                if other.topic != topic or other.qos == 2 or other.retain or other.properties:
                    break
                j += 1
            key = self._topic_key(topic)
            if j == i + 1:
                # One packet (a device's read): no lists to build.
                qos = packet.qos
                self.publish_plain(
                    client_id,
                    topic,
                    key,
                    packet.payload,
                    qos,
                    timestamp,
                    _Ack(self, session, link, PubAck, packet.packet_id)  # type: ignore[arg-type]
                    if qos
                    else None,
                )
            else:
                part = self.partition(key)
                run = packets[i:j] if j - i < n else packets
                part.add_run(
                    timestamp,
                    topic,
                    client_id,
                    [p.payload for p in run],
                    [p.qos for p in run],
                    [
                        _Ack(self, session, link, PubAck, p.packet_id)  # type: ignore[arg-type]
                        if p.qos
                        else None
                        for p in run
                    ],
                )
                self._dirty[key] = part
            i = j
        self._flush_soon()

    def plain_route(self, client_id: str, topic: str) -> PartitionKey | None:
        """The partition of ``client_id`` 's QoS 0/1 PUBLISHes to ``topic`` without retain
        flag or properties, or None if it may not make them (ACL, ``$SYS``). The answer
        holds while its session lives (the ACL is read once, at start): a connection that
        keeps publishing to one topic (a device) asks once and then goes straight to
        :meth:`publish_plain` (see broker.net.transport, the device path)."""
        if not self._may_publish(client_id, topic):
            return None
        return self._topic_key(topic)

    def publish_plain(
        self,
        client_id: str,
        topic: str,
        key: PartitionKey,
        payload: bytes,
        qos: int,
        timestamp: int,
        ack: Callable[[int | None], None] | None,
    ) -> None:
        """Gather one QoS 0/1 PUBLISH without retain flag or properties to ``topic``, whose
        partition is ``key`` and which the client may make (:meth:`plain_route`), for this
        iteration's group commit; ``ack`` is called with its offset after the append
        [MQTT-4.3.2-2] (None if it failed). ``timestamp``: ms."""
        part = self.partitions.get(key)
        if part is None:
            part = self.partition(key)
        part.add(
            _new_record(
                Record, (part.next_offset(), timestamp, topic, payload, qos, False, client_id, b"")
            ),
            ack,
        )
        self._dirty[key] = part
        self._flush_soon()

    def _may_publish(self, client_id: str, topic: str) -> bool:
        """Clients never write ``$SYS/...`` (the broker's own); else the ACL decides.
        A session restored from the log after a restart has no login yet: anonymous rules."""
        if topic.startswith("$SYS/"):
            return False
        if self.acl is None:
            return True
        authz = self._authz.get(client_id)
        if authz is None:
            authz = self._authz[client_id] = Authorizer(self.acl.rules_for(None, client_id))
        return authz.can_write(topic)

    def _deny_publish(self, session: Session, link: Link, packet: Publish) -> None:
        """A PUBLISH the client may not make is not stored. 5.0 tells it (0x87, s3.4.2.1);
        3.1.1 has no negative ack, so it is acknowledged as usual, as mosquitto does."""
        self.acl_denied += 1
        log.info("%s: PUBLISH to %r denied by the ACL", session.client_id, packet.topic)
        code = ReasonCode.NOT_AUTHORIZED if session.version == 5 else 0
        if packet.qos == 1:
            link.send(PubAck(packet.packet_id, code))  # type: ignore[arg-type]
        elif packet.qos == 2:
            # 3.1.1: the PUBREL that follows finds no stored id and gets its PUBCOMP.
            link.send(PubRec(packet.packet_id, code))  # type: ignore[arg-type]

    def publish_broker(self, topic: str, payload: bytes) -> None:
        """A retained QoS 0 message of the broker itself (``$SYS/...``), stored and
        delivered like a client's."""
        self._store_publish("", topic, payload, 0, True, {}, None)

    def _store_publish(
        self,
        client_id: str,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        properties: dict[int, Any],
        ack: Callable[[int | None], None] | None,
        timestamp: int | None = None,
    ) -> None:
        blob = encode_properties(properties) if properties else b""
        if timestamp is None:
            timestamp = self._now_ms()
        record = Record(-1, timestamp, topic, payload, qos, retain, client_id, blob)
        self._enqueue(record, ack)
        if retain:
            # [MQTT-3.3.1-5] store it; an empty payload removes it [MQTT-3.3.1-10]. The
            # retained index follows the commit (flush, or the owning worker's announcement).
            self._enqueue(record, None, _RETAINED)

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    # ================================================================ acknowledgements

    def puback(self, session: Session, packet_id: int, *, pump: bool = True) -> None:
        """A delivery is acknowledged; ``pump=False`` when the caller sends what the freed
        quota allows itself, once for a whole read of PUBACKs."""
        entry = session.inflight_entry(packet_id)
        if entry is not None and entry[_QOS] == 1:
            del session.inflight[packet_id]
            session.dirty = session.persistent
            key, offset, _, _, _, group, _ = entry
            if group is not None:
                self._group_done(session, group, key, offset)
            if pump:
                self.pump_session(session)

    def puback_run(self, session: Session, packet_ids: Sequence[int]) -> None:
        """:meth:`puback` with ``pump=False`` for each of ``packet_ids`` (the PUBACKs of one
        read, :class:`~broker.mqtt.decode.PubAckRun`), in one step when every id names a
        QoS 1 delivery of no shared group: a subscriber's window of replayed deliveries
        comes back that way, and one call per PUBACK was ~25% of a QoS 1 replay."""
        inflight = session.inflight
        # The distinct entries: the few runs a window was sent in (QoS 1 of no group each),
        # or the tuples of deliveries sent one by one, checked in C.
        got = set(map(inflight.get, packet_ids))
        singles = cast(list[Inflight], [e for e in got if type(e) is tuple])
        if (
            None not in got
            and sum(map(_QOS_OF, singles)) == len(singles)
            and not any(map(_GROUP_OF, singles))
        ):
            deque(map(inflight.pop, packet_ids, repeat(None)), 0)  # a repeated id: no-op
            session.dirty = session.persistent
            return
        for packet_id in packet_ids:
            self.puback(session, packet_id, pump=False)

    def pubrec(self, session: Session, packet_id: int, reason_code: int) -> None:
        entry = session.inflight_entry(packet_id)
        link = session.link
        assert link is not None
        if entry is None or entry[_QOS] != 2:
            if session.version == 5:
                link.send(PubRel(packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
            return
        key, offset, qos, retain, _, group, consumer = entry
        if reason_code >= 0x80:
            # The receiver refused the message: the flow ends here (s4.3.3).
            del session.inflight[packet_id]
            if group is not None:
                self._group_done(session, group, key, offset)
            self.pump_session(session)
            return
        session.inflight[packet_id] = (key, offset, qos, retain, True, group, consumer)
        session.dirty = session.persistent
        link.send(PubRel(packet_id))

    def pubrel(self, session: Session, packet_id: int) -> None:
        link = session.link
        assert link is not None
        if packet_id in session.incoming_qos2:
            if packet_id in session.pending_qos2:
                return  # not stored yet: the client resends PUBREL after our PUBREC
            session.incoming_qos2.discard(packet_id)
            if session.persistent:
                # Forget the id durably before PUBCOMP frees it for reuse [MQTT-4.3.3-9]:
                # a stale id after a crash would swallow the client's next message.
                self._persist(session, _Ack(self, session, link, PubComp, packet_id))
            else:
                link.send(PubComp(packet_id))
        elif session.version == 5:
            link.send(PubComp(packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
        else:
            link.send(PubComp(packet_id))

    def pubcomp(self, session: Session, packet_id: int) -> None:
        entry = session.inflight_entry(packet_id)
        if entry is not None and entry[_QOS] == 2 and entry[_RELEASED]:
            del session.inflight[packet_id]
            session.dirty = session.persistent
            key, offset, _, _, _, group, _ = entry
            if group is not None:
                self._group_done(session, group, key, offset)
            self.pump_session(session)

    # ================================================================ subscribe

    def subscribe(self, session: Session, packet: Subscribe) -> None:
        link = session.link
        assert link is not None
        ids = packet.properties.get(PropertyId.SUBSCRIPTION_IDENTIFIER)
        sub_id = ids[0] if ids else None
        codes: list[int] = []
        for req in packet.subscriptions:
            try:
                codes.append(self._subscribe_one(session, req, sub_id))
            except TopicFilterInvalid as e:
                log.info("%s: SUBSCRIBE %r refused: %s", session.client_id, req.topic_filter, e)
                codes.append(e.reason_code if session.version == 5 else 0x80)
        session.dirty = session.persistent
        link.send(SubAck(packet.packet_id, codes))
        self._persist(session)
        self.pump_session(session)

    def _subscribe_one(self, session: Session, req: Any, sub_id: int | None) -> int:
        full = req.topic_filter
        if len(full.encode()) > self.config.max_topic_length:
            raise TopicFilterInvalid(f"longer than {self.config.max_topic_length} bytes")
        sub = Subscription(
            full, req.qos, req.no_local, req.retain_as_published, req.retain_handling, sub_id
        )
        if is_replay(full):
            start, plain = parse_replay(full, self._now_ms())
            self._check_levels(plain)
            if not self._may_subscribe(session, full, plain):
                return self._denied_code(session)
            sub.topic_filter = plain
            consumer = Consumer(full, annotate=True)
            consumer.subscriptions[plain] = sub
            self._drop_consumer(session, full)
            session.consumers[full] = consumer
            for key in self._keys_for_filter(plain):
                consumer.cursors[key] = self._start_offset(key, start)
                self.partition(key).watchers.add(("s", session.client_id, full))
            return req.qos
        validate_topic_filter(full)
        group, plain = parse_shared(full)
        self._check_levels(plain)
        if not self._may_subscribe(session, full, plain):
            return self._denied_code(session)
        if group is not None:
            if req.no_local:
                raise ProtocolError("no local on a shared subscription [MQTT-3.8.3-4]")
            sub.topic_filter = plain
            session.shared[full] = sub
            self._join_group(session, full)
            return req.qos  # no retained messages for shared subscriptions (s4.8.2)
        consumer = session.main
        existed = plain in consumer.subscriptions
        consumer.subscriptions[plain] = sub  # replaces an identical filter [MQTT-3.8.4-3]
        consumer.match_cache.clear()
        for key in self._keys_for_filter(plain):
            if key not in consumer.cursors:
                consumer.cursors[key] = self.partition(key).end_offset
                self.partition(key).watchers.add(("s", session.client_id, MAIN))
        # Retained messages (s3.3.1.3): handling 0 always, 1 only for a new subscription.
        if req.retain_handling == 0 or (req.retain_handling == 1 and not existed):
            self._queue_retained(session, sub)
        return req.qos

    def _may_subscribe(self, session: Session, full: str, plain: str) -> bool:
        """The ACL on the filter itself: after ``$replay/<from>/`` or ``$share/<group>/``."""
        if self.acl is None:
            return True
        authz = self._authz.get(session.client_id)
        if authz is not None and authz.can_subscribe(plain):
            return True
        self.acl_denied += 1
        log.info("%s: SUBSCRIBE %r denied by the ACL", session.client_id, full)
        return False

    @staticmethod
    def _denied_code(session: Session) -> int:
        return ReasonCode.NOT_AUTHORIZED if session.version == 5 else 0x80  # [MQTT-3.9.3-1]

    def _check_levels(self, plain: str) -> None:
        """``max_topic_levels`` applies to the filter itself, not a $share/$replay prefix."""
        if plain.count("/") >= self.config.max_topic_levels:
            raise TopicFilterInvalid(f"more than {self.config.max_topic_levels} levels")

    def _start_offset(self, key: PartitionKey, start: ReplayStart) -> int:
        plog = self.partition(key).log
        first, end = plog.log_start_offset, plog.end_offset
        if start.kind == "earliest":
            return first
        if start.kind == "latest":
            return end
        if start.kind == "offset":
            return min(max(start.offset, first), end)
        if start.kind == "offsets":
            for p, off in start.offsets:
                if p == key[1]:
                    return min(max(off, first), end)
            return first
        return max(plog.offset_for_time(start.timestamp_ms), first)

    def _queue_retained(self, session: Session, sub: Subscription) -> None:
        authz = self._authz.get(session.client_id) if self.acl is not None else None
        for topic, rec in self.retained.items():
            if topic_matches(sub.topic_filter, topic) and (authz is None or authz.can_read(topic)):
                ids = [sub.identifier] if sub.identifier else []
                if session.pending_retained is None:
                    session.pending_retained = deque()
                session.pending_retained.append((rec.offset, min(rec.qos, sub.qos), ids))

    def unsubscribe(self, session: Session, packet: Unsubscribe) -> None:
        link = session.link
        assert link is not None
        codes: list[int] = []
        for full in packet.topic_filters:
            found = False
            if full in session.consumers and full != MAIN:
                self._drop_consumer(session, full)
                found = True
            elif full in session.shared:
                # Its unacknowledged deliveries go back to the group: the session is no
                # longer a member to redeliver them to.
                self._leave_group(session, full, orphan_inflight=True)
                del session.shared[full]
                found = True
            else:
                consumer = session.main
                if consumer.subscriptions.pop(full, None) is not None:
                    found = True
                    consumer.match_cache.clear()
                    self._retarget(session, consumer)
            codes.append(ReasonCode.SUCCESS if found else ReasonCode.NO_SUBSCRIPTION_EXISTED)
        session.dirty = session.persistent
        link.send(UnsubAck(packet.packet_id, codes if session.version == 5 else []))
        self._persist(session)

    def _retarget(self, session: Session, consumer: Consumer) -> None:
        """Drop cursors of partitions no subscription of ``consumer`` reads any more."""
        keep: set[PartitionKey] = set()
        for sub in consumer.subscriptions.values():
            keep.update(self._keys_for_filter(sub.topic_filter))
        for key in list(consumer.cursors):
            if key not in keep:
                del consumer.cursors[key]
                self.partition(key).watchers.discard(("s", session.client_id, consumer.name))

    def _drop_consumer(self, session: Session, name: str) -> None:
        consumer = session.consumers.pop(name, None)
        if consumer is not None:
            for key in consumer.cursors:
                self.partition(key).watchers.discard(("s", session.client_id, name))

    # ================================================================ shared groups

    def _group(self, full: str) -> SharedGroup:
        """The shared group ``full`` held here, created at the end of its partitions."""
        group = self.groups.get(full)
        if group is None:
            name, plain = parse_shared(full)
            assert name is not None
            consumer = Consumer(full, group=name)
            consumer.subscriptions[plain] = Subscription(plain, 2)
            group = self.groups[full] = SharedGroup(name, plain, consumer)
            for key in self._keys_for_filter(plain):
                consumer.cursors[key] = self.partition(key).end_offset
                self.partition(key).watchers.add(("g", full))
            self._groups_dirty = True
        return group

    def _group_home(self, full: str) -> int | None:
        """The worker holding group ``full``; None when it is this one (always, alone)."""
        return None if self.group_peers is None else self.group_peers.home(full)

    def _join_group(self, session: Session, full: str) -> None:
        if session.link is None:
            return
        home = self._group_home(full)
        if home is not None:
            assert self.group_peers is not None
            sub = session.shared[full]
            window = min(session.receive_maximum, self.config.max_inflight)
            self.group_peers.join(
                home,
                full,
                session.client_id,
                sub.qos,
                sub.identifier,
                session.version,
                window,
                self._usernames.get(session.client_id),
            )
            return
        group = self._group(full)
        if session.client_id not in group.members:
            group.members.append(session.client_id)

    def _leave_group(self, session: Session, full: str, *, orphan_inflight: bool = False) -> None:
        """Remove a member. Its unacknowledged deliveries go to other members when the
        session is ending (s4.8.2); a persistent session keeps them for its return."""
        orphans: list[tuple[PartitionKey, int]] = []
        if orphan_inflight or not session.persistent:
            for pid, (key, offset, _, _, _, taken_from, _) in session.inflight_entries():
                if taken_from == full:
                    orphans.append((key, offset))
                    del session.inflight[pid]
        # Records a group elsewhere sent that never left go back whatever the session is.
        for item in list(session.group_queue or ()):
            if item[0] == full:
                orphans.append((item[1], item[2]))
                session.group_queue.remove(item)  # type: ignore[union-attr]
        home = self._group_home(full)
        if home is not None:
            assert self.group_peers is not None
            self.group_peers.leave(home, full, session.client_id, orphans)
            return
        group = self.groups.get(full)
        if group is None:
            return
        if session.client_id in group.members:
            group.members.remove(session.client_id)
        group.orphans.extend(orphans)
        if group.orphans and group.members:
            self._pump_group(group)

    # ------------------------------------------------ groups across workers

    def remote_join(
        self,
        worker: int,
        full: str,
        client_id: str,
        qos: int,
        identifier: int | None,
        version: int,
        window: int,
        username: str | None,
    ) -> None:
        """A session on ``worker`` is a member of group ``full``, held here; ``username``
        selects its ACL rules, applied here as for a member of this worker."""
        group = self._group(full)
        authz = (
            Authorizer(self.acl.rules_for(username, client_id)) if self.acl is not None else None
        )
        group.remote[client_id] = RemoteMember(
            client_id, worker, qos, identifier, version, window, authz
        )
        if client_id not in group.members:
            group.members.append(client_id)
        self._pump_group(group)

    def remote_leave(
        self, full: str, client_id: str, orphans: list[tuple[PartitionKey, int]]
    ) -> None:
        """A member elsewhere left (or gave records back): ``orphans`` go to the others."""
        group = self.groups.get(full)
        if group is None:
            return
        member = group.remote.pop(client_id, None)
        if member is not None and client_id in group.members:
            group.members.remove(client_id)
        group.orphans.extend(orphans)
        if group.orphans and group.members:
            self._pump_group(group)

    def remote_done(self, full: str, client_id: str, key: PartitionKey, offset: int) -> None:
        """A member elsewhere completed a delivery: room for the next one."""
        group = self.groups.get(full)
        member = group.remote.get(client_id) if group is not None else None
        if group is not None and member is not None:
            member.outstanding.discard((key, offset))
            self._pump_group(group)

    def worker_left(self, worker: int) -> None:
        """``worker`` died: its members leave every group held here, and what they had
        outstanding goes to the other members (at least once: a persistent session restored
        elsewhere may deliver it again)."""
        for group in list(self.groups.values()):
            gone = [m for m in group.remote.values() if m.worker == worker]
            for member in gone:
                self.remote_leave(group.consumer.name, member.client_id, sorted(member.outstanding))

    def rejoin_groups(self, worker: int) -> None:
        """``worker`` (re)started: the members here of the groups it holds join again."""
        for session in list(self.sessions.values()):
            for full in session.shared:
                if self._group_home(full) == worker:
                    self._join_group(session, full)

    def remote_deliver(
        self, full: str, client_id: str, key: PartitionKey, offset: int, qos: int
    ) -> None:
        """The worker holding group ``full`` sent this record for ``client_id`` here."""
        session = self.sessions.get(client_id)
        if session is None or session.link is None or full not in session.shared:
            home = self._group_home(full)
            if home is not None and self.group_peers is not None:
                self.group_peers.leave(home, full, client_id, [(key, offset)])
            return
        if session.group_queue is None:
            session.group_queue = deque()
        session.group_queue.append((full, key, offset, qos))
        self._send_group_queue(session)

    def _send_group_queue(self, session: Session) -> None:
        """Deliver the records groups elsewhere sent for ``session``, as its quota allows."""
        queue = session.group_queue
        while queue:
            full, key, offset, qos = queue[0]
            if not self._can_send(session, qos):
                return
            queue.popleft()
            # The group's worker read it, so it is committed, even if the owner's mark has
            # not reached this worker yet.
            self.partition(key).committed_through(offset)
            rec = self._read_exact(key, offset)
            sub = session.shared.get(full)
            if rec is not None and sub is not None:
                ids = [sub.identifier] if sub.identifier and session.version == 5 else []
                self._deliver(session, rec, key, qos, False, ids, False, full, group=full)
            if qos == 0 or rec is None or session.link is None:
                self._group_done(session, full, key, offset)

    def _group_done(self, session: Session, full: str, key: PartitionKey, offset: int) -> None:
        """A delivery of group ``full`` is complete; its home, if elsewhere, is told."""
        home = self._group_home(full)
        if home is not None and self.group_peers is not None:
            self.group_peers.done(home, full, session.client_id, key, offset)

    def _pump_group(self, group: SharedGroup) -> None:
        """Spread the group's records over members that can take them, round robin.

        Each record goes to exactly one member, at the minimum of its QoS and that member's
        subscription QoS [MQTT-3.8.4-8], never as retained (s4.8.2).
        """
        while group.orphans:
            key, offset = group.orphans[0]
            rec = self._read_exact(key, offset)
            if rec is None:
                group.orphans.popleft()  # deleted by retention: nothing left to redeliver
                continue
            chosen = self._group_member(group, rec.qos, rec.topic)
            if chosen is None:
                if self._group_may_read(group, rec.topic):
                    return
                group.orphans.popleft()  # no member may read it (ACL): drop, do not block
                continue
            group.orphans.popleft()
            self._group_send(group, *chosen, rec, key)
        for key in list(group.consumer.cursors):
            part = self.partition(key)
            cursor = group.consumer.cursors[key]
            while cursor < part.end_offset:
                records = self._read(part, cursor)
                if records is None:
                    cursor = part.log.log_start_offset
                    continue
                for rec in records:
                    if not topic_matches(group.topic_filter, rec.topic):
                        cursor = rec.offset + 1
                        continue
                    chosen = self._group_member(group, rec.qos, rec.topic)
                    if chosen is None and not self._group_may_read(group, rec.topic):
                        cursor = rec.offset + 1  # no member may read it (ACL): skip it
                        continue
                    if chosen is None:
                        group.consumer.cursors[key] = cursor
                        self._groups_dirty = True
                        return
                    self._group_send(group, *chosen, rec, key)
                    cursor = rec.offset + 1
            group.consumer.cursors[key] = cursor
            self._groups_dirty = True

    def _may_read(self, session: Session, topic: str) -> bool:
        """The ACL's read rule for ``topic`` (a deny inside an allowed filter applies)."""
        if self.acl is None:
            return True
        authz = self._authz.get(session.client_id)
        return authz is None or authz.can_read(topic)

    def _group_may_read(self, group: SharedGroup, topic: str) -> bool:
        """False only when the group has members and the ACL lets none of them read
        ``topic``: then the record is skipped. With no members the group keeps its
        position for the next one, as a consumer group does."""
        if self.acl is None or not group.members:
            return True
        if any(m.authz is None or m.authz.can_read(topic) for m in group.remote.values()):
            return True
        sessions = (self.sessions.get(cid) for cid in group.members)
        return any(s is not None and self._may_read(s, topic) for s in sessions)

    def _group_send(
        self,
        group: SharedGroup,
        member: Session | RemoteMember,
        qos: int,
        ids: list[int],
        rec: Record,
        key: PartitionKey,
    ) -> None:
        full = group.consumer.name
        if isinstance(member, RemoteMember):
            assert self.group_peers is not None
            member.outstanding.add((key, rec.offset))
            self.group_peers.deliver(member.worker, full, member.client_id, key, rec.offset, qos)
        else:
            self._deliver(member, rec, key, qos, False, ids, False, full, group=full)

    def _group_member(
        self, group: SharedGroup, rec_qos: int, topic: str
    ) -> tuple[Session | RemoteMember, int, list[int]] | None:
        """The next member, round robin, that may read ``topic`` and can take a record of
        ``rec_qos`` now: with the QoS it gets it at and its subscription identifier (5.0);
        None if none can. A member on another worker can while it has fewer records
        outstanding than its window (its worker applies the quota)."""
        n = len(group.members)
        for i in range(n):
            idx = (group.next_member + i) % n
            remote = group.remote.get(group.members[idx])
            if remote is not None:
                if remote.authz is not None and not remote.authz.can_read(topic):
                    continue
                if len(remote.outstanding) < remote.window:
                    group.next_member = idx + 1
                    ids = [remote.identifier] if remote.identifier else []
                    return remote, min(rec_qos, remote.qos), ids if remote.version == 5 else []
                continue
            session = self.sessions.get(group.members[idx])
            if session is None or not self._may_read(session, topic):
                continue
            sub = session.shared.get(group.consumer.name)
            qos = min(rec_qos, sub.qos) if sub is not None else rec_qos
            if self._can_send(session, qos):
                group.next_member = idx + 1
                ids = [sub.identifier] if sub is not None and sub.identifier else []
                return session, qos, ids if session.version == 5 else []
        return None

    # ================================================================ delivery

    def _can_send(self, session: Session, qos: int) -> bool:
        link = session.link
        if link is None or not link.can_write():
            return False
        return qos == 0 or len(session.inflight) < min(
            session.receive_maximum, self.config.max_inflight
        )

    def pump_session(self, session: Session) -> None:
        """Send what ``session`` can take now: retained first, then each consumer's records.

        Also the router's input for "this link can take more": called by the transport when
        its output drained, or once after a read that carried acknowledgements."""
        if session.link is None:
            return
        session.waiting = False
        self._send_retained(session)
        if session.group_queue:
            self._send_group_queue(session)
        for consumer in list(session.consumers.values()):
            for key in list(consumer.cursors):
                self._pump(session, consumer, key)
        for full in session.shared:
            group = self.groups.get(full)
            if group is not None:
                self._pump_group(group)

    def pump_acked(self, session: Session) -> None:
        """After a read of PUBACKs: :meth:`pump_session` if what they freed is awaited (a
        consumer stopped at the send quota, or retained messages or shared groups, which
        are always pumped). A subscriber well within its quota (a fleet's, acknowledging a
        delivery or two per read) was pumped on every read for nothing: 3% of a worker's
        time in the fleet (timed)."""
        if session.waiting or session.pending_retained or session.group_queue or session.shared:
            self.pump_session(session)

    def _send_retained(self, session: Session) -> None:
        pending = session.pending_retained
        key = _RETAINED
        while pending:
            offset, qos, ids = pending[0]
            if not self._can_send(session, qos):
                return
            pending.popleft()
            rec = self._read_exact(key, offset)
            if rec is not None and rec.payload:
                self._deliver(session, rec, key, qos, True, ids, False, MAIN)  # [MQTT-3.3.1-8]

    def _read(self, part: PartitionBase, offset: int) -> list[Record] | None:
        """Records from ``offset``; None if retention deleted it (caller skips forward)."""
        try:
            return part.read(offset)
        except OffsetOutOfRange:
            log.warning(
                "%s/%d: offset %d was deleted by retention; skipping to %d",
                *part.key,
                offset,
                part.log.log_start_offset,
            )
            return None

    def _read_columns(self, part: PartitionBase, offset: int) -> Columns | None:
        """:meth:`_read` as columns (for :meth:`_send_run`)."""
        try:
            return part.read_columns(offset)
        except OffsetOutOfRange:
            log.warning(
                "%s/%d: offset %d was deleted by retention; skipping to %d",
                *part.key,
                offset,
                part.log.log_start_offset,
            )
            return None

    def _read_exact(self, key: PartitionKey, offset: int) -> Record | None:
        part = self.partition(key)
        try:
            recs = part.read(offset, 1)
        except OffsetOutOfRange:
            return None
        if recs and recs[0].offset == offset:
            return recs[0]
        return None

    def _pump(self, session: Session, consumer: Consumer, key: PartitionKey) -> None:
        part = self.partition(key)
        cursor = consumer.cursors[key]
        end = part.end_offset
        if cursor >= end:
            return
        link = session.link
        if link is None:
            return
        # The slow-subscriber policy is for live subscriptions that fell behind; a $replay
        # asked for the history (its reads are paced by the socket, the log is the buffer).
        if (
            end - cursor > self.config.max_lag_records
            and consumer.name == MAIN
            and self._qos0_only(consumer)
        ):
            if not self._slow_qos0(session, consumer, key, end - cursor):
                return
            cursor = consumer.cursors[key]
        client_id = session.client_id
        version = session.version
        quota = min(session.receive_maximum, self.config.max_inflight)
        inflight = session.inflight
        annotate = consumer.annotate
        # A deny rule that only overlaps a subscription applies per topic (cached with it).
        authz = self._authz.get(client_id) if self.acl is not None else None
        while cursor < end:
            if not link.can_write():
                break
            if end - cursor >= RUN_MIN:
                # Fewer records than a run cannot make one: no columns for them (a fleet's
                # caught-up subscriber reads 1-3 records at a time).
                cols = self._read_columns(part, cursor)
                if cols is None:
                    cursor = part.log.log_start_offset
                    continue
                if not cols:
                    break
                if len(cols) >= RUN_MIN:
                    taken = self._send_run(session, consumer, key, cols, link, quota, authz)
                    if taken > 0:
                        cursor = cols.offsets[cols.start + taken - 1] + 1
                        continue
                    if taken == QUOTA_FULL:
                        session.waiting = True
                        break
            records = self._read(part, cursor)
            if records is None:
                cursor = part.log.log_start_offset
                continue
            if not records:
                break
            for rec in records:
                match = self._match_cached(consumer, rec.topic, authz)
                if match is None:
                    cursor = rec.offset + 1
                    continue
                qos, ids, no_local_all, rap = match
                if no_local_all and rec.client_id == client_id:
                    cursor = rec.offset + 1  # [MQTT-3.8.3-3]
                    continue
                if rec.qos < qos:
                    qos = rec.qos  # [MQTT-3.8.4-8] the minimum of both
                if qos and len(inflight) >= quota:
                    consumer.cursors[key] = cursor
                    session.waiting = True
                    return
                self._deliver(
                    session,
                    rec,
                    key,
                    qos,
                    rec.retain and rap,
                    ids if version == 5 else (),
                    annotate,
                    consumer.name,
                )
                cursor = rec.offset + 1
                if not link.can_write():
                    break
            if session.link is not link:
                break
        consumer.cursors[key] = cursor
        session.dirty = session.persistent

    def _match_cached(
        self, consumer: Consumer, topic: str, authz: Authorizer | None
    ) -> tuple[int, list[int], bool, bool] | None:
        """:meth:`_match` with the ACL's read rule, cached per topic on the consumer."""
        cache = consumer.match_cache
        match = cache.get(topic, _MISS)
        if match is _MISS:
            match = self._match(consumer, topic)
            if match is not None and authz is not None and not authz.can_read(topic):
                match = None
            if len(cache) >= MATCH_CACHE:
                cache.clear()
            cache[topic] = match
        return match

    def _send_run(
        self,
        session: Session,
        consumer: Consumer,
        key: PartitionKey,
        cols: Columns,
        link: Link,
        quota: int,
        authz: Authorizer | None,
    ) -> int:
        """Deliver a prefix of the read ``cols`` as one run, when no per-message rule
        applies, or pass over it all when none matches; returns how many records it took
        (0: the caller goes message by message; QUOTA_FULL: the first record waits for a
        PUBACK, as the one-by-one path would find).

        A run takes records that all match with the same options, carry no properties (so
        no message expiry [MQTT-3.3.2-5] and nothing to forward), need no subscription
        identifier or replay annotation (5.0), are not subject to no-local [MQTT-3.8.3-3],
        and go out at one QoS, 0 or 1: the minimum of the record's and the subscription's
        [MQTT-3.8.4-8]. QoS 1 takes consecutive free packet ids within the send quota
        (receive maximum / max_inflight, s4.9). It stops at this iteration's output room;
        the link refuses runs that need topic aliases or the maximum packet size check.
        Measured on a 1,000,000-record replay: 40% of the broker's time went to the
        per-message :meth:`_deliver` and encode, which a run does in C loops; then 45% to
        transposing the log's Record tuples back into columns, which reading the log's
        columns (:meth:`PartitionBase.read_columns`) avoids.
        """
        start, stop = cols.start, cols.stop
        match = self._match_cached(consumer, cols.topic_at(start), authz)
        if match is None:
            # Records of other topics sharing the partition: a read of them all is passed
            # over at once, from its string table (a $replay/earliest of one scenario's
            # topics behind 2,000,000 records of others ran at 43k msg/s, one record at a
            # time; and the bench's third replay run at 0.45x its first, building columns).
            if all(self._match_cached(consumer, t, authz) is None for t in set(cols.strings)):
                return stop - start
            return 0
        topics = cols.built().topics
        room = link.output_room()
        if not room:
            return 0
        # A PUBLISH takes at least 5 bytes (fixed header, topic length, a topic): look no
        # further than the room allows (the last runs of an iteration fill a small rest).
        stop = min(stop, start + room // 5 + 1)
        sub_qos, ids, no_local_all, rap = match
        inflight = session.inflight
        qoses = cols.qos
        if sub_qos and qoses[start]:
            # A QoS 1 run takes at most the free send quota: look no further (a PUBACK
            # frees one slot at a time; the read holds up to READ_BATCH records).
            stop = min(stop, start + quota - len(inflight))
            if stop <= start:
                if no_local_all and cols.publishers()[start] == session.client_id:
                    return 0  # skipped without quota [MQTT-3.8.3-3]
                return QUOTA_FULL
        n = stop - start
        if any(cols.properties[start:stop]):
            return 0
        run_topics = topics[start:stop]
        distinct = set(run_topics)
        # Compared in C when every topic's match is cached (equal tuples; usually the same).
        known = list(map(consumer.match_cache.get, distinct, repeat(_MISS)))
        if known.count(match) != len(known) and any(
            self._match_cached(consumer, t, authz) != match for t in distinct
        ):
            return 0
        if session.version == 5 and (ids or consumer.annotate):
            return 0
        if no_local_all and session.client_id in cols.publishers()[start:stop]:
            return 0
        qoses = qoses[start:stop]
        zeros = qoses.count(0)
        if not sub_qos or zeros == n:
            qos = 0
        elif not zeros and (sub_qos == 1 or 2 not in qoses):
            qos = 1
        else:
            return 0
        # As many records as fit the output room (at least one) ...
        payloads = cols.payloads[start:stop]
        # Header (at most 5 bytes), topic length and bytes, packet id, 5.0 properties: a
        # bound four times the topic's characters took ~55% of the room, then 55% of the
        # rest..., a dozen runs per iteration over the whole read (measured).
        overhead = max(map(len, map(str.encode, distinct))) + 10
        bound = accumulate(map(add, map(len, payloads), repeat(overhead)), initial=0)
        take = min(n, max(1, bisect_right(list(bound), room) - 1))
        first_pid: int | None = None
        if qos:
            # ... and the send quota, with consecutive packet ids that are free.
            first_pid = session.next_packet_id
            take = min(take, quota - len(inflight), 65536 - first_pid)
            if take <= 0 or not inflight.keys().isdisjoint(range(first_pid, first_pid + take)):
                return 0
        if take < n:
            run_topics, payloads = run_topics[:take], payloads[:take]
        retains = list(map(bool, cols.retains[start : start + take])) if rap else None
        if not link.send_publish_run(run_topics, payloads, retains, qos, first_pid):
            return 0
        if first_pid is not None:
            run = InflightRun(
                key, first_pid, cols.offsets[start : start + take], retains, consumer.name
            )
            inflight.update(dict.fromkeys(range(first_pid, first_pid + take), run))
            nxt = first_pid + take
            session.next_packet_id = nxt if nxt <= 65535 else 1
        return take

    def _qos0_only(self, consumer: Consumer) -> bool:
        return all(s.qos == 0 for s in consumer.subscriptions.values())

    def _slow_qos0(self, session: Session, consumer: Consumer, key: PartitionKey, lag: int) -> bool:
        """Apply ``slow_qos0_policy`` to a QoS 0 reader too far behind. True to go on."""
        if self.config.slow_qos0_policy == "disconnect":
            log.info(
                "%s: %d records behind on %s/%d; disconnecting (slow_qos0_policy)",
                session.client_id,
                lag,
                *key,
            )
            link = session.link
            assert link is not None
            self.connection_lost(session, link, graceful=False)
            link.close(ReasonCode.QUOTA_EXCEEDED, "subscriber too far behind")
            return False
        end = self.partition(key).end_offset
        skip = lag - self.config.max_lag_records // 2
        self.dropped += skip
        consumer.cursors[key] = end - self.config.max_lag_records // 2
        return True

    def _match(self, consumer: Consumer, topic: str) -> tuple[int, list[int], bool, bool] | None:
        """Overlapping subscriptions deliver once at the highest QoS, with every matching
        subscription identifier [MQTT-3.3.4-2], [MQTT-3.3.4-3]."""
        qos = -1
        ids: list[int] = []
        no_local_all = True
        rap = False
        for sub in consumer.subscriptions.values():
            if topic_matches(sub.topic_filter, topic):
                if sub.qos > qos:
                    qos = sub.qos
                if sub.identifier:
                    ids.append(sub.identifier)
                no_local_all = no_local_all and sub.no_local
                rap = rap or sub.retain_as_published
        if qos < 0:
            return None
        return qos, ids, no_local_all, rap

    def _deliver(
        self,
        session: Session,
        rec: Record,
        key: PartitionKey,
        qos: int,
        retain: bool,
        ids: Iterable[int],
        annotate: bool,
        consumer: str,
        *,
        group: str | None = None,
        dup: bool = False,
        packet_id: int | None = None,
    ) -> None:
        link = session.link
        assert link is not None
        props: dict[int, Any] | None = None
        if rec.properties:
            props = decode_properties(rec.properties)
            expiry = props.get(PropertyId.MESSAGE_EXPIRY_INTERVAL)
            if expiry is not None:
                elapsed = (self._now_ms() - rec.timestamp) // 1000
                if elapsed >= expiry:
                    # Expired: not delivered [MQTT-3.3.2-5]. A resend (packet_id given) also
                    # frees its packet id, or it would hold a slot of the quota forever
                    # (mosquitto does the same).
                    if packet_id is not None and packet_id in session.inflight:
                        del session.inflight[packet_id]
                        session.dirty = session.persistent
                    if group is not None:
                        self._group_done(session, group, key, rec.offset)
                    return
                props[PropertyId.MESSAGE_EXPIRY_INTERVAL] = expiry - elapsed  # [MQTT-3.3.2-6]
        if session.version == 5:
            if ids:
                props = props or {}
                props[PropertyId.SUBSCRIPTION_IDENTIFIER] = list(ids)
            if annotate:
                props = props or {}
                user = list(props.get(_USER, ()))
                user.append(("mqlog-partition", str(key[1])))
                user.append(("mqlog-offset", str(rec.offset)))
                props[_USER] = user
        else:
            props = None
        if qos:
            if packet_id is None:
                packet_id = session.allocate_packet_id()
                session.inflight[packet_id] = (key, rec.offset, qos, retain, False, group, consumer)
                if qos == 2 and session.persistent:
                    # Exactly once across a crash: were this delivery (its packet id and the
                    # advanced cursor) lost, the record would go out again under a new packet
                    # id and the client could not tell it is a duplicate (s4.3.3).
                    self._persist_before_acks(session)
        else:
            packet_id = None
        sent = link.send_publish(rec.topic, rec.payload, qos, retain, dup, packet_id, props)
        if not sent and packet_id is not None:
            session.inflight.pop(packet_id, None)  # too large: counts as delivered
            if group is not None:
                self._group_done(session, group, key, rec.offset)

    def _resend_inflight(self, session: Session) -> None:
        """On session resume, resend unacknowledged deliveries with DUP [MQTT-4.4.0-1]."""
        link = session.link
        assert link is not None
        for pid, (
            key,
            offset,
            qos,
            retain,
            released,
            group,
            consumer,
        ) in session.inflight_entries():
            if released:
                link.send(PubRel(pid))
                continue
            rec = self._read_exact(key, offset)
            if rec is None:
                del session.inflight[pid]  # gone by retention: nothing left to deliver
                continue
            self._deliver(
                session,
                rec,
                key,
                qos,
                retain,
                (),
                False,
                consumer,
                group=group,
                dup=True,
                packet_id=pid,
            )

    # ================================================================ persistence

    def _persist(self, session: Session, ack: Callable[[int | None], None] | None = None) -> None:
        """Write the session's state to the compacted ``$sessions`` stream; ``ack`` is
        called once it is in the log."""
        if not session.persistent:
            return
        session.dirty = False
        state = session.to_state(self.monotonic())
        payload = orjson.dumps(state)
        self._enqueue(Record(-1, self._now_ms(), session.client_id, payload), ack, _SESSIONS)

    def _persist_groups(self) -> None:
        self._groups_dirty = False
        for full, group in self.groups.items():
            cursors = [[k[0], k[1], off] for k, off in group.consumer.cursors.items()]
            self._enqueue(
                Record(-1, self._now_ms(), full, orjson.dumps({"cursors": cursors})),
                None,
                _SESSIONS,
            )

    def close(self) -> None:
        """Persist every session and flush: called on shutdown."""
        for session in self.sessions.values():
            if session.persistent:
                if session.link is not None:
                    session.disconnected_at = self.clock()
                self._persist(session)
        self._persist_groups()
        self.flush()

    def _load_retained(self) -> None:
        self.apply_retained(_read_all(self, _RETAINED))

    def _session_states(self) -> dict[str, bytes]:
        """The latest ``$sessions`` record per key (client id or group filter)."""
        states: dict[str, bytes] = {}
        for rec in _read_all(self, _SESSIONS):
            states[rec.topic] = rec.payload
        return states

    def _load_sessions(self, skip: set[str]) -> list[str]:
        """Sessions and shared groups from ``$sessions`` (those this worker is home to, but
        not in ``skip``); returns the client ids of the sessions loaded."""
        loaded = []
        for name, payload in self._session_states().items():
            if payload and name not in skip and self.is_home(name):
                if name.startswith("$share/"):
                    self._restore_group(name, orjson.loads(payload))
                else:
                    self._restore_session(name, orjson.loads(payload))
                    loaded.append(name)
        return loaded

    def restore_sessions(self, client_ids: Iterable[str]) -> list[str]:
        """Load these sessions from ``$sessions`` as held here, offline (their worker died;
        wills and expiry run here until their clients come back); returns those found."""
        wanted = set(client_ids) - set(self.sessions)
        found = []
        for name, payload in self._session_states().items():
            if name in wanted and payload:
                self._restore_session(name, orjson.loads(payload))
                found.append(name)
        return found

    def _restore_group(self, full: str, state: dict[str, Any]) -> None:
        name, plain = parse_shared(full)
        assert name is not None
        consumer = Consumer(full, group=name)
        consumer.subscriptions[plain] = Subscription(plain, 2)
        for stream, p, off in state["cursors"]:
            consumer.cursors[(stream, p)] = off
            self.partition((stream, p)).watchers.add(("g", full))
        self.groups[full] = SharedGroup(name, plain, consumer)

    def _restore_session(self, client_id: str, state: dict[str, Any]) -> Session:
        """A session from its persisted (or handed over) state, registered as offline."""
        session = Session.from_state(client_id, state)
        if session.disconnected_at is None:
            session.disconnected_at = self.clock()
        if session.will is not None:
            # A will still pending at shutdown keeps its remaining delay; one of a client
            # that was connected when the broker died is due as for an abnormal close,
            # deferred to this start as s3.1.2.5 allows. tick() publishes it.
            left = state.get("will_left")
            if left is None:
                left = min(
                    session.will.properties.get(PropertyId.WILL_DELAY_INTERVAL, 0),
                    session.expiry_interval,
                )
            session.will_due = self.monotonic() + left
        self.sessions[client_id] = session
        for consumer in session.consumers.values():
            for key in consumer.cursors:
                self.partition(key).watchers.add(("s", client_id, consumer.name))
        return session

    def adopt(self, client_id: str, state: bytes) -> None:
        """The session of ``client_id``, handed over by the worker that held it, is held
        here now (offline until :meth:`connect`)."""
        self._restore_session(client_id, orjson.loads(state))

    def hand_over(self, client_id: str) -> bytes | None:
        """Give the session of ``client_id`` to another worker, where its client
        reconnected: the connection here is closed as taken over [MQTT-3.1.4-3] and the
        session leaves this router (no will beyond what the close itself publishes, no
        tombstone). Returns its state, None if it has none (a clean session ended)."""
        session = self.sessions.get(client_id)
        if session is None:
            return None
        link = session.link
        if link is not None:
            self.connection_lost(session, link, graceful=False)
            link.close(ReasonCode.SESSION_TAKEN_OVER, "another connection took the session")
            session = self.sessions.get(client_id)
            if session is None:
                return None  # it ended with its connection
        state = orjson.dumps(session.to_state(self.monotonic()))
        self._forget(session)
        return state


_MISS: Any = object()
#: ``_new_record(Record, fields)``: a Record without the NamedTuple constructor's Python call.
_new_record = tuple.__new__
_QOS = 2  # Inflight fields read alone
_RELEASED = 4
_QOS_OF = itemgetter(_QOS)  # for map()
_GROUP_OF = itemgetter(5)


def _read_all(router: Router, key: PartitionKey) -> Iterable[Record]:
    part = router.partition(key)
    offset = part.log.log_start_offset
    while offset < part.end_offset:
        recs = part.log.read(offset, max_records=1000)
        if not recs:
            break
        yield from recs
        offset = recs[-1].offset + 1


class _Ack:
    """Acknowledge a client's QoS 1/2 PUBLISH (or PUBREL) once its record (or its session
    state) is in the log."""

    __slots__ = ("cls", "link", "packet_id", "router", "session")

    def __init__(
        self, router: Router, session: Session, link: Link, cls: type, packet_id: int
    ) -> None:
        self.router = router
        self.session = session
        self.link = link
        self.cls = cls
        self.packet_id = packet_id

    def __call__(self, offset: int | None) -> None:
        session = self.session
        pid = self.packet_id
        resends = 0
        if self.cls is PubRec:
            resends = session.pending_qos2.pop(pid, 0)
            if offset is None:
                session.incoming_qos2.discard(pid)
            elif session.persistent:
                # The packet id must be known as received before the PUBREC can leave, also
                # across a crash, or a resend after restart would be stored twice (s4.3.3).
                self.router._persist_before_acks(
                    session, lambda _state_offset: self._answer(offset, resends)
                )
                return
        self._answer(offset, resends)

    def _answer(self, offset: int | None, resends: int) -> None:
        session = self.session
        pid = self.packet_id
        if session.link is not self.link:
            # The client reconnected meanwhile; resends it made there are answered there.
            if offset is not None and resends and session.link is not None:
                for _ in range(resends):
                    session.link.send(self.cls(pid))
            return
        if offset is not None:
            for _ in range(1 + resends):  # one PUBREC per PUBLISH received [MQTT-4.3.3-9]
                self.link.send(self.cls(pid))
        elif session.version == 5 and self.cls is not PubComp:
            self.link.send(self.cls(pid, ReasonCode.UNSPECIFIED_ERROR))
        else:
            self.link.close()  # 3.1.1 (and PUBCOMP) have no negative acknowledgement


class _Each:
    """Call every callback with the offset (several waiters on one append)."""

    __slots__ = ("callbacks",)

    def __init__(self, callbacks: list[Callable[[int | None], None]]) -> None:
        self.callbacks = callbacks

    def __call__(self, offset: int | None) -> None:
        for callback in self.callbacks:
            callback(offset)
