"""Delivery: records go from the partitions to the sessions reading them.

A consumer (broker.router.session) reads from its cursor: from memory when caught up, from
the log when behind, and stops when its client has no send quota (s4.9) or its output
buffer is full, to resume when the client acknowledges or the buffer drains. One slow
client therefore costs nothing to publishers or to other subscribers.

Pump, run-send and deliver stay together here, on one object: they are the per-message path
(a read of records goes out as one run, :meth:`Delivery.send_run`, when no per-message rule
applies, else one by one, :meth:`Delivery.deliver`), and no call is added between them.

Called only from the owning event loop's thread."""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable
from functools import partial
from itertools import accumulate, islice, repeat
from operator import add
from typing import Any

from broker.auth.acl import Authorizer
from broker.commitlog import CorruptRecordBatch, OffsetOutOfRange, Record
from broker.commitlog.keys import PartitionKey
from broker.mqtt.properties import PropertyId, decode_properties
from broker.mqtt.reason_codes import ReasonCode
from broker.mqtt.topics import topic_matches
from broker.router.commit import GroupCommit, stored
from broker.router.link import Link
from broker.router.partition import (
    Columns,
    GroupWatcher,
    PartitionBase,
    QueueWatcher,
    SessionWatcher,
)
from broker.router.session import (
    MAIN,
    Consumer,
    Inflight,
    InflightRun,
    Match,
    Session,
    SharedGroup,
    new_inflight,
)
from broker.router.state import RETAINED, RouterState

log = logging.getLogger("broker.router")

_USER = PropertyId.USER_PROPERTY
#: Topics whose subscription match is remembered per consumer (cleared when full).
MATCH_CACHE = 10_000
#: Records from which a consumer's read is delivered as one run (:meth:`Delivery.send_run`).
RUN_MIN = 8
#: :meth:`Delivery.send_run`: the next record waits for the send quota (s4.9).
QUOTA_FULL = -1
_MISS: Any = object()


class Delivery:
    """The delivery path of one router. See the module docstring."""

    # Set by the router (shared groups and the lifecycle call into delivery too):
    #: Spread a shared group's records over its members (broker.router.shared).
    pump_group: Callable[[SharedGroup], None]
    #: Deliver what groups held elsewhere sent for a session (broker.router.shared).
    send_group_queue: Callable[[Session], None]
    resend_when_readable: Callable[[Session], None]  # what it waits to resend (router.qos)
    #: A delivery of a shared group is complete (broker.router.shared).
    group_done: Callable[[Session, str, PartitionKey, int], None]
    #: The link of a session closed (broker.router.lifecycle).
    connection_lost: Callable[..., None]

    def __init__(self, state: RouterState, commit: GroupCommit) -> None:
        self.state = state
        self.config = state.config
        self.sessions = state.sessions
        self.groups = state.groups
        self.partition = state.partition
        self.persist_before_acks = commit.persist_before_acks

    def wake(self, part: PartitionBase) -> None:
        """New records in ``part``: its readers take what they can."""
        sessions = self.sessions
        for watcher in list(part.watchers):
            if type(watcher) is SessionWatcher:
                session = sessions.get(watcher.client_id)
                consumer = session.consumers.get(watcher.consumer) if session else None
                if session is None or consumer is None or session.link is None:
                    continue
                self.pump(session, consumer, part.key)
            elif type(watcher) is GroupWatcher:
                group = self.groups.get(watcher.group)
                if group is not None:
                    self.pump_group(group)
            elif type(watcher) is QueueWatcher:
                part.watchers.discard(watcher)  # woken once
                if (session := sessions.get(watcher.client_id)) is not None:
                    if session.resend_due:
                        self.resend_when_readable(session)
                    self.send_group_queue(session)

    def can_send(self, session: Session, qos: int) -> bool:
        """``session`` is connected, can write, and has send quota for ``qos`` (s4.9)."""
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
            self.send_group_queue(session)
        for consumer in list(session.consumers.values()):
            for key in list(consumer.cursors):
                self.pump(session, consumer, key)
        for full in session.shared:
            group = self.groups.get(full)
            if group is not None:
                self.pump_group(group)

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
        key = RETAINED
        while pending:
            offset, qos, ids = pending[0]
            if not self.can_send(session, qos):
                return
            pending.popleft()
            rec = self.read_exact(key, offset)
            if rec is not None and rec.payload:  # [MQTT-3.3.1-8]
                self.deliver(session, rec, key, qos, ids, MAIN, retain=True)

    def read(self, part: PartitionBase, offset: int) -> list[Record] | None:
        """Records from ``offset``; None if retention deleted it (caller skips forward).

        ``[]`` (nothing to send yet) at a damaged range the stream holds (``on_corruption =
        "stop"``): the consumer stays at ``offset``, its other partitions and every other
        client go on; the log reported the range."""
        try:
            return part.read(offset)
        except OffsetOutOfRange:
            _deleted(part, offset)
            return None
        except CorruptRecordBatch:
            return []

    def read_columns(self, part: PartitionBase, offset: int) -> Columns | None:
        """:meth:`read` as columns (for :meth:`send_run`)."""
        try:
            return part.read_columns(offset)
        except OffsetOutOfRange:
            _deleted(part, offset)
            return None
        except CorruptRecordBatch:
            return Columns([], [], None)

    def read_exact(self, key: PartitionKey, offset: int) -> Record | None:
        try:
            recs = self.partition(key).read(offset, 1)
        except (OffsetOutOfRange, CorruptRecordBatch):
            return None
        return recs[0] if recs and recs[0].offset == offset else None

    def pump(self, session: Session, consumer: Consumer, key: PartitionKey) -> None:
        if consumer.merge:
            self.pump_merged(session, consumer)
            return
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
        inflight = session.own_inflight()  # the sends below add to it
        annotate = consumer.annotate
        # A deny rule that only overlaps a subscription applies per topic (cached with it).
        state = self.state
        authz = state.authz.get(client_id) if state.acl is not None else None
        while cursor < end:
            if not link.can_write():
                break
            if end - cursor >= RUN_MIN:
                # Fewer records than a run cannot make one: no columns for them (a fleet's
                # caught-up subscriber reads 1-3 records at a time).
                cols = self.read_columns(part, cursor)
                if cols is None:
                    cursor = part.log.log_start_offset
                    continue
                if not cols:
                    break
                if len(cols) >= RUN_MIN:
                    taken = self.send_run(session, consumer, key, cols, link, quota, authz)
                    if taken > 0:
                        cursor = cols.offsets[cols.start + taken - 1] + 1
                        continue
                    if taken == QUOTA_FULL:
                        session.waiting = True
                        break
            records = self.read(part, cursor)
            if records is None:
                cursor = part.log.log_start_offset
                continue
            if not records:
                break
            for rec in records:
                match = self.match_cached(consumer, rec.topic, authz)
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
                self.deliver(
                    session,
                    rec,
                    key,
                    qos,
                    ids if version == 5 else (),
                    consumer.name,
                    retain=rec.retain and rap,
                    annotate=annotate,
                )
                cursor = rec.offset + 1
                if not link.can_write():
                    break
            if session.link is not link:
                break
        consumer.cursors[key] = cursor
        if session.persistent and not session.dirty:
            self.state.mark_dirty(session)

    def pump_merged(self, session: Session, consumer: Consumer) -> None:
        """A ``$replay/<from>;merge/...`` consumer: the records of all its partitions, in
        timestamp order (ties: the lower partition first), one at a time.

        Invariant: a record is sent only when no partition of the consumer has an unsent
        committed record with an earlier timestamp. Each partition is read from its cursor
        in batches kept for this call; the next record is the earliest of their heads. The
        cost against a per-partition replay: a choice among P heads per record and one
        write per record (no runs): half the rate for a 3.1.1 subscriber, about the same for
        a 5.0 one, whose replays are annotated record by record anyway (README, "Quick
        start"). Live, a partition's new records wait for nothing (they exist only once
        committed)."""
        link = session.link
        if link is None:
            return
        state = self.state
        authz = state.authz.get(session.client_id) if state.acl is not None else None
        quota = min(session.receive_maximum, self.config.max_inflight)
        version = session.version
        cursors = consumer.cursors
        keys = sorted(cursors)
        heads: dict[PartitionKey, deque[Record]] = {}
        while link.can_write() and session.link is link:
            best: PartitionKey | None = None
            best_ts = 0
            for key in keys:
                buf = heads.get(key)
                if not buf:
                    part = self.partition(key)
                    if cursors[key] >= part.end_offset:
                        continue
                    records = self.read(part, cursors[key])
                    if records is None:  # deleted by retention: on from the log start
                        cursors[key] = part.log.log_start_offset
                        records = self.read(part, cursors[key])
                    if not records:
                        continue
                    buf = heads[key] = deque(records)
                ts = buf[0].timestamp
                if best is None or ts < best_ts:
                    best, best_ts = key, ts
            if best is None:
                break
            rec = heads[best][0]
            match = self.match_cached(consumer, rec.topic, authz)
            if match is not None:
                qos, ids, no_local_all, rap = match
                if not (no_local_all and rec.client_id == session.client_id):
                    qos = min(qos, rec.qos)  # [MQTT-3.8.4-8]
                    if qos and len(session.inflight) >= quota:
                        session.waiting = True
                        break
                    self.deliver(
                        session,
                        rec,
                        best,
                        qos,
                        ids if version == 5 else (),
                        consumer.name,
                        retain=rec.retain and rap,
                        annotate=consumer.annotate,
                    )
            heads[best].popleft()
            cursors[best] = rec.offset + 1
        self.state.changed(session)

    def match_cached(
        self, consumer: Consumer, topic: str, authz: Authorizer | None
    ) -> Match | None:
        """:meth:`match` with the ACL's read rule, cached per topic on the consumer."""
        cache = consumer.match_cache
        match: Match | None = cache.get(topic, _MISS)
        if match is _MISS:
            match = self.match(consumer, topic)
            if match is not None and authz is not None and not authz.can_read(topic):
                match = None
            if len(cache) >= MATCH_CACHE:
                cache.clear()
            cache[topic] = match
        return match

    def send_run(
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

        A run takes records that all match with the same options, carry no properties (so no
        message expiry [MQTT-3.3.2-5] and nothing to forward), need no subscription identifier
        or replay annotation (5.0), are not subject to no-local [MQTT-3.8.3-3], and go out at
        one QoS, 0 or 1: the minimum of the record's and the subscription's [MQTT-3.8.4-8].
        QoS 1 takes consecutive free packet ids within the send quota (receive maximum /
        max_inflight, s4.9). It stops at this iteration's output room; the link refuses runs
        that need topic aliases or the maximum packet size check. On a 1,000,000-record
        replay 40% of the broker's time went to the per-message :meth:`deliver` and encode,
        which a run does in C loops; then 45% to transposing the log's Record tuples back into
        columns, which reading the log's columns (:meth:`PartitionBase.read_columns`) avoids."""
        start, stop = cols.start, cols.stop
        match = self.match_cached(consumer, cols.topic_at(start), authz)
        if match is None:
            # Records of other topics sharing the partition: a read of them all is passed
            # over at once, from its string table (one record at a time, a $replay/earliest
            # behind 2,000,000 records of other topics ran at 43k msg/s).
            if all(self.match_cached(consumer, t, authz) is None for t in set(cols.strings)):
                return stop - start
            return 0
        topics = cols.built().topics
        room = link.output_room()
        if not room:
            return 0
        # A PUBLISH takes 5 bytes or more: look no further than the room allows.
        stop = min(stop, start + room // 5 + 1)
        sub_qos, ids, no_local_all, rap = match
        inflight = session.own_inflight()  # the run is added to it below
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
            self.match_cached(consumer, t, authz) != match for t in distinct
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
        # Header (at most 5 bytes), topic length and bytes, packet id, 5.0 properties: a bound
        # four times the topic's characters took ~55% of the room, then 55% of the rest..., a
        # dozen runs per iteration over the whole read (measured). At most room // overhead fit
        # (summing the whole read for later runs: 4% of a QoS 0 fan-in); all, most often.
        overhead = max(map(len, map(str.encode, distinct))) + 10
        take = n
        if n > room // overhead or sum(map(len, payloads)) + n * overhead > room:
            sizes = list(map(len, islice(payloads, room // overhead + 1)))
            if sizes.count(sizes[0]) == len(sizes):  # one size (telemetry): no running sum
                take = min(n, max(1, room // (sizes[0] + overhead)))
            else:
                bound = accumulate(map(add, sizes, repeat(overhead)), initial=0)
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
        self.state.dropped += skip
        consumer.cursors[key] = end - self.config.max_lag_records // 2
        return True

    def match(self, consumer: Consumer, topic: str) -> Match | None:
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

    def deliver(
        self,
        session: Session,
        rec: Record,
        key: PartitionKey,
        qos: int,
        ids: Iterable[int],
        consumer: str,
        *,
        retain: bool = False,
        annotate: bool = False,
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
                elapsed = (self.state.now_ms() - rec.timestamp) // 1000
                if elapsed >= expiry:
                    # Expired: not delivered [MQTT-3.3.2-5]. A resend (packet_id given) also
                    # frees its packet id, or it would hold a slot of the quota forever
                    # (mosquitto does the same).
                    if packet_id is not None and packet_id in session.inflight:
                        del session.inflight[packet_id]
                        self.state.changed(session)
                    if group is not None:
                        self.group_done(session, group, key, rec.offset)
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
                if type(inflight := session.inflight) is not dict:  # NO_ENTRIES: no call
                    inflight = session.own_inflight()
                inflight[packet_id] = new_inflight(
                    Inflight, (key, rec.offset, qos, retain, False, group, consumer)
                )
                if qos == 2 and session.persistent:
                    # Exactly once across a crash: were this delivery (its packet id and the
                    # advanced cursor) lost, the record would go out again under a new packet
                    # id and the client could not tell it is a duplicate (s4.3.3). So the
                    # PUBLISH (and what follows it to this client, in order) leaves only once
                    # the state is in the log: in a cluster, committed by a majority of
                    # $sessions' replicas, so a kill -9 of this node cannot lose it.
                    link.hold()
                    self.persist_before_acks(session, partial(release_once_stored, session, link))
        else:
            packet_id = None
        sent = link.send_publish(rec.topic, rec.payload, qos, retain, dup, packet_id, props)
        if not sent and packet_id is not None:
            session.inflight.pop(packet_id, None)  # too large: counts as delivered
            if group is not None:
                self.group_done(session, group, key, rec.offset)


def release_once_stored(session: Session, link: Link, offset: int | None) -> None:
    """The state of ``session`` that output held on ``link`` waited for (a QoS 2 delivery's,
    a CONNECT's will) is in the log: that output may leave. Not stored (no leader of
    ``$sessions``, its owner worker dead): the connection is closed with the output unsent,
    and the client's next session resumes from the committed state."""
    if not stored(offset):
        if session.link is link:
            link.close(ReasonCode.UNSPECIFIED_ERROR, "session state not stored")
        return
    link.release()


def _deleted(part: PartitionBase, offset: int) -> None:
    """Log that a consumer's ``offset`` was deleted by retention (it skips to the start)."""
    start = part.log.log_start_offset
    log.warning(
        "%s/%d: offset %d was deleted by retention; skipping to %d", *part.key, offset, start
    )
