"""Publish ingest: a client's PUBLISH (or the broker's own) becomes a record in its
partition's pending batch, for this iteration's group commit (broker.router.commit).

Three ways in, from the most general to the cheapest per message:

- :meth:`Ingest.publish`: any PUBLISH (QoS 2 duplicate detection, retain, properties);
- :meth:`Ingest.publish_run`: the PUBLISHes of one read, runs of one topic gathered at once;
- :meth:`Ingest.plain_route` then :meth:`Ingest.publish_plain`: a connection that keeps
  publishing plain QoS 0/1 messages to one topic (a device) asks once for the partition and
  the ACL's answer, then goes straight into the batch (see broker.net.transport).

The ACL's write rule is applied here (``$SYS/...`` is the broker's own).

Called only from the owning event loop's thread.
"""

from __future__ import annotations

import logging
from typing import Any

from broker.auth.acl import Authorizer
from broker.commitlog import Record
from broker.commitlog.keys import PartitionKey
from broker.mqtt.packets import PubAck, Publish, PubRec
from broker.mqtt.properties import PropertyId, encode_properties
from broker.mqtt.reason_codes import ReasonCode
from broker.router.commit import Ack, AckCallback, Both, GroupCommit
from broker.router.link import Link
from broker.router.session import Session
from broker.router.state import RETAINED, RouterState

log = logging.getLogger("broker.router")

#: Topics whose partition is remembered by the publish path (cleared when full).
TOPIC_KEY_CACHE = 100_000
#: ``_new_record(Record, fields)``: a Record without the NamedTuple constructor's Python call.
_new_record = tuple.__new__


class Ingest:
    """The publish paths of one router. See the module docstring."""

    def __init__(self, state: RouterState, commit: GroupCommit) -> None:
        self.state = state
        self.commit = commit
        # Read on every message: held here rather than reached through the state.
        self._partitions = state.partitions
        self._partition = state.partition
        self._dirty = state.dirty
        self._flush_soon = commit.flush_soon
        self._topic_keys: dict[str, PartitionKey] = {}

    def publish(self, session: Session, packet: Publish, timestamp: int | None = None) -> None:
        """Store a client's PUBLISH; the ack goes out once it is in the log. ``timestamp``
        (ms): the time its read was stamped with (:meth:`publish_run`), else now."""
        qos = packet.qos
        pid = packet.packet_id
        link = session.link
        assert link is not None
        if not self.may_publish(session.client_id, packet.topic):
            self._deny_publish(session, link, packet)
            return
        received = session.incoming_qos2
        if qos == 2 and received is not None and pid in received:
            # A resend of a QoS 2 message we already stored: acknowledge, do not store again
            # [MQTT-4.3.3-9]; if it is still being appended, its PUBREC follows the append.
            pending = session.pending_qos2
            if pending is not None and pid in pending:
                pending[pid] += 1
            else:
                link.send(PubRec(pid))
            return
        ack: AckCallback | None = None
        if qos == 1:
            ack = Ack(self.commit, session, link, PubAck, pid)  # type: ignore[arg-type]
        elif qos == 2:
            if session.incoming_qos2 is None:
                session.incoming_qos2 = set()
            if session.pending_qos2 is None:
                session.pending_qos2 = {}
            session.incoming_qos2.add(pid)  # type: ignore[arg-type]
            session.pending_qos2[pid] = 0  # type: ignore[index]
            self.state.changed(session)
            ack = Ack(self.commit, session, link, PubRec, pid)  # type: ignore[arg-type]
        self.store_publish(
            session.client_id,
            packet.topic,
            packet.payload,
            qos,
            retain=packet.retain,
            properties=packet.properties,
            ack=ack,
            timestamp=timestamp,
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
        commit = self.commit
        timestamp = self.state.now_ms()
        n = len(packets)
        i = 0
        while i < n:
            packet = packets[i]
            topic = packet.topic
            if (
                packet.qos == 2
                or packet.retain
                or packet.properties
                or not self.may_publish(client_id, topic)
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
            key = self.topic_key(topic)
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
                    Ack(commit, session, link, PubAck, packet.packet_id)  # type: ignore[arg-type]
                    if qos
                    else None,
                )
            else:
                part = self._partition(key)
                run = packets[i:j] if j - i < n else packets
                part.add_run(
                    timestamp,
                    topic,
                    client_id,
                    [p.payload for p in run],
                    [p.qos for p in run],
                    [
                        Ack(commit, session, link, PubAck, p.packet_id)  # type: ignore[arg-type]
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
        if not self.may_publish(client_id, topic):
            return None
        return self.topic_key(topic)

    def publish_plain(
        self,
        client_id: str,
        topic: str,
        key: PartitionKey,
        payload: bytes,
        qos: int,
        timestamp: int,
        ack: AckCallback | None,
    ) -> None:
        """Gather one QoS 0/1 PUBLISH without retain flag or properties to ``topic``, whose
        partition is ``key`` and which the client may make (:meth:`plain_route`), for this
        iteration's group commit; ``ack`` is called with its offset after the append
        [MQTT-4.3.2-2] (None if it failed). ``timestamp``: ms."""
        part = self._partitions.get(key)
        if part is None:
            part = self._partition(key)
        part.add(
            _new_record(
                Record, (part.next_offset(), timestamp, topic, payload, qos, False, client_id, b"")
            ),
            ack,
        )
        self._dirty[key] = part
        self._flush_soon()

    def topic_key(self, topic: str) -> PartitionKey:
        """The partition of ``topic``. Topic -> partition is fixed for the process (streams
        do not change at run time): the crc32 and the stream lookup are paid once per topic."""
        key = self._topic_keys.get(topic)
        if key is None:
            if len(self._topic_keys) >= TOPIC_KEY_CACHE:
                self._topic_keys.clear()
            key = self._topic_keys[topic] = self.state.streams.partition_for(topic)
        return key

    def may_publish(self, client_id: str, topic: str) -> bool:
        """Clients never write ``$SYS/...`` (the broker's own); else the ACL decides.
        A session restored from the log after a restart has no login yet: anonymous rules."""
        if topic.startswith("$SYS/"):
            return False
        state = self.state
        acl = state.acl
        if acl is None:
            return True
        authz = state.authz.get(client_id)
        if authz is None:
            authz = state.authz[client_id] = Authorizer(acl.rules_for(None, client_id))
        return authz.can_write(topic)

    def _deny_publish(self, session: Session, link: Link, packet: Publish) -> None:
        """A PUBLISH the client may not make is not stored. 5.0 tells it (0x87, s3.4.2.1);
        3.1.1 has no negative ack, so it is acknowledged as usual, as mosquitto does."""
        self.state.acl_denied += 1
        log.info("%s: PUBLISH to %r denied by the ACL", session.client_id, packet.topic)
        code = ReasonCode.NOT_AUTHORIZED if session.version == 5 else 0
        props: dict[int, Any] = {}
        if session.version == 5 and session.request_problem_information:  # [MQTT-3.1.2-29]
            props[PropertyId.REASON_STRING] = f"not authorized to publish to {packet.topic!r}"
        if packet.qos == 1:
            link.send(PubAck(packet.packet_id, code, props))  # type: ignore[arg-type]
        elif packet.qos == 2:
            # 3.1.1: the PUBREL that follows finds no stored id and gets its PUBCOMP.
            link.send(PubRec(packet.packet_id, code, props))  # type: ignore[arg-type]

    def publish_broker(self, topic: str, payload: bytes) -> None:
        """A retained QoS 0 message of the broker itself (``$SYS/...``), stored and
        delivered like a client's."""
        self.store_publish("", topic, payload, 0, retain=True, properties={}, ack=None)

    def store_publish(
        self,
        client_id: str,
        topic: str,
        payload: bytes,
        qos: int,
        *,
        retain: bool,
        properties: dict[int, Any],
        ack: AckCallback | None,
        timestamp: int | None = None,
    ) -> None:
        """Gather a message (a client's, a will, the broker's) for the next group commit;
        a retained one also goes to ``$retained``."""
        blob = encode_properties(properties) if properties else b""
        if timestamp is None:
            timestamp = self.state.now_ms()
        record = Record(-1, timestamp, topic, payload, qos, retain, client_id, blob)
        if not retain:
            self.commit.enqueue(record, ack, self.topic_key(topic))
            return
        # [MQTT-3.3.1-5] store it; an empty payload removes it [MQTT-3.3.1-10]. The retained
        # index follows the commit (flush, or the owning worker's announcement). Acknowledged
        # once both appends are (broker.router.commit.Both).
        if ack is None:
            self.commit.enqueue(record, None, self.topic_key(topic))
            self.commit.enqueue(record, None, RETAINED)
            return
        both = Both(ack)
        self.commit.enqueue(record, both.record, self.topic_key(topic))
        self.commit.enqueue(record, both.retained, RETAINED)
