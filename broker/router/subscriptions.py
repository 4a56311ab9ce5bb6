"""Subscriptions: SUBSCRIBE and UNSUBSCRIBE, where each new subscription starts reading,
and the retained messages it is due.

An ordinary subscription joins the session's main consumer, at the end of its partitions;
``$replay/<from>/<filter>`` is a consumer of its own, starting where asked
(broker.router.replay); ``$share/<group>/<filter>`` joins a shared group
(broker.router.shared). The ACL's subscribe rule applies to the filter itself.

Called only from the owning event loop's thread.
"""

from __future__ import annotations

import logging
from collections import deque
from functools import partial
from typing import Any

from broker.commitlog.keys import PartitionKey
from broker.mqtt.errors import ProtocolError, TopicFilterInvalid
from broker.mqtt.packets import SubAck, Subscribe, UnsubAck, Unsubscribe
from broker.mqtt.packets import Subscription as SubscriptionRequest
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import ReasonCode
from broker.mqtt.topics import parse_shared, topic_matches, validate_topic_filter
from broker.router.delivery import Delivery, release_once_stored
from broker.router.partition import SessionWatcher
from broker.router.replay import ReplayStart, is_replay, parse_replay
from broker.router.session import MAIN, Consumer, Session, Subscription
from broker.router.shared import SharedGroups
from broker.router.state import RouterState
from broker.router.store import SessionStore

log = logging.getLogger("broker.router")


class Subscriptions:
    """SUBSCRIBE and UNSUBSCRIBE of one router's sessions. See the module docstring."""

    def __init__(
        self,
        state: RouterState,
        store: SessionStore,
        shared: SharedGroups,
        delivery: Delivery,
    ) -> None:
        self.state = state
        self.store = store
        self.shared = shared
        self.partition = state.partition
        self.pump_session = delivery.pump_session

    def subscribe(self, session: Session, packet: Subscribe) -> None:
        link = session.link
        assert link is not None
        ids = packet.properties.get(PropertyId.SUBSCRIPTION_IDENTIFIER)
        sub_id = ids[0] if ids else None
        codes: list[int] = []
        refusals: list[str] = []  # 5.0: the SUBACK's Reason String says why (s3.9.2.1.2)
        joining: set[str] = set()  # shared groups that have not stored this member yet
        for req in packet.subscriptions:
            try:
                code = self._subscribe_one(session, req, sub_id, joining)
            except TopicFilterInvalid as e:
                log.info("%s: SUBSCRIBE %r refused: %s", session.client_id, req.topic_filter, e)
                code = e.reason_code if session.version == 5 else 0x80
                refusals.append(f"{req.topic_filter!r}: {e}")
            else:
                if code >= 0x80:
                    refusals.append(f"{req.topic_filter!r}: not authorized by the ACL")
            codes.append(code)
        self.state.count(session)
        props: dict[int, Any] = {}
        if refusals and session.version == 5 and session.request_problem_information:
            props[PropertyId.REASON_STRING] = "; ".join(refusals)  # [MQTT-3.1.2-29]
        suback = SubAck(packet.packet_id, codes, props)
        if joining or self.shared.subacks.get(session.client_id):
            self.shared.hold_suback(session, suback, joining)  # after those held before
        else:
            link.send(suback)
        if session.persistent:
            # The SUBACK (and what follows it) leaves once the state with the subscription
            # is in the log: with several workers (or nodes) another one appends it, and a
            # kill of every worker between the two lost a subscription already acknowledged.
            # Not stored: the connection closes, the SUBACK unsent (release_once_stored).
            link.hold()
            self.store.write(session, partial(release_once_stored, session, link))
        self.pump_session(session)

    def _subscribe_one(
        self, session: Session, req: SubscriptionRequest, sub_id: int | None, joining: set[str]
    ) -> int:
        """One subscription of a SUBSCRIBE: its SUBACK code. A shared group the session
        joins and that is not stored yet goes into ``joining`` (its SUBACK waits for it)."""
        full = req.topic_filter
        if len(full.encode()) > self.state.config.max_topic_length:
            raise TopicFilterInvalid(f"longer than {self.state.config.max_topic_length} bytes")
        sub = Subscription(
            full, req.qos, req.no_local, req.retain_as_published, req.retain_handling, sub_id
        )
        if is_replay(full):
            start, plain = parse_replay(full, self.state.now_ms())
            self._check_levels(plain)
            if not self._may_subscribe(session, full, plain):
                return self._denied_code(session)
            sub.topic_filter = plain
            consumer = Consumer(full, annotate=True, merge=start.merge)
            consumer.subscriptions[plain] = sub
            self._drop_consumer(session, full)
            session.own_consumers()[full] = consumer
            for key in self.state.keys_for_filter(plain):
                consumer.cursors[key] = self._start_offset(key, start)
                self.partition(key).watchers.add(SessionWatcher(session.client_id, full))
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
            session.own_shared()[full] = sub
            if not self.shared.join_group(session, full):
                joining.add(full)
            return req.qos  # no retained messages for shared subscriptions (s4.8.2)
        consumer = session.main
        existed = plain in consumer.subscriptions
        consumer.subscriptions[plain] = sub  # replaces an identical filter [MQTT-3.8.4-3]
        consumer.match_cache.clear()
        for key in self.state.keys_for_filter(plain):
            if key not in consumer.cursors:
                consumer.cursors[key] = self.partition(key).end_offset
                self.partition(key).watchers.add(SessionWatcher(session.client_id, MAIN))
        # Retained messages (s3.3.1.3): handling 0 always, 1 only for a new subscription.
        if req.retain_handling == 0 or (req.retain_handling == 1 and not existed):
            self._queue_retained(session, sub)
        return req.qos

    def _may_subscribe(self, session: Session, full: str, plain: str) -> bool:
        """The ACL on the filter itself: after ``$replay/<from>/`` or ``$share/<group>/``."""
        state = self.state
        if state.acl is None:
            return True
        authz = state.authz.get(session.client_id)
        if authz is not None and authz.can_subscribe(plain):
            return True
        state.acl_denied += 1
        log.info("%s: SUBSCRIBE %r denied by the ACL", session.client_id, full)
        return False

    @staticmethod
    def _denied_code(session: Session) -> int:
        return ReasonCode.NOT_AUTHORIZED if session.version == 5 else 0x80  # [MQTT-3.9.3-1]

    def _check_levels(self, plain: str) -> None:
        """``max_topic_levels`` applies to the filter itself, not a $share/$replay prefix."""
        if plain.count("/") >= self.state.config.max_topic_levels:
            raise TopicFilterInvalid(f"more than {self.state.config.max_topic_levels} levels")

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
        state = self.state
        authz = state.authz.get(session.client_id) if state.acl is not None else None
        for topic, rec in state.retained.items():
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
                self.shared.leave_group(session, full, orphan_inflight=True)
                del session.shared[full]
                found = True
            else:
                consumer = session.main
                if consumer.subscriptions.pop(full, None) is not None:
                    found = True
                    consumer.match_cache.clear()
                    self._retarget(session, consumer)
            codes.append(ReasonCode.SUCCESS if found else ReasonCode.NO_SUBSCRIPTION_EXISTED)
        self.state.count(session)
        link.send(UnsubAck(packet.packet_id, codes if session.version == 5 else []))
        self.store.persist(session)

    def _retarget(self, session: Session, consumer: Consumer) -> None:
        """Drop cursors of partitions no subscription of ``consumer`` reads any more."""
        keep: set[PartitionKey] = set()
        for sub in consumer.subscriptions.values():
            keep.update(self.state.keys_for_filter(sub.topic_filter))
        for key in list(consumer.cursors):
            if key not in keep:
                del consumer.cursors[key]
                self.partition(key).watchers.discard(
                    SessionWatcher(session.client_id, consumer.name)
                )

    def _drop_consumer(self, session: Session, name: str) -> None:
        consumer = session.consumers.pop(name, None)
        if consumer is not None:
            for key in consumer.cursors:
                self.partition(key).watchers.discard(SessionWatcher(session.client_id, name))
