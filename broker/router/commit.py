"""Group commit: what one event-loop iteration gathered is appended once per partition.

Publishes (broker.router.ingest), forwarded records (several workers) and session state
(broker.router.store) are gathered in their partition's pending batch and the partition is
marked dirty; :meth:`GroupCommit.flush`, scheduled once per iteration, appends each dirty
partition's batch with one write, then acknowledges (PUBACK / PUBREC only after the append
[MQTT-4.3.2-2]) and wakes the partition's readers (broker.router.delivery).

Session state that must be in the log before an acknowledgement leaves is written in that
same flush (:meth:`GroupCommit.persist_before_acks`): output queued during a flush leaves
after it returns.

Called only from the owning event loop's thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from broker.commitlog import Record
from broker.commitlog.keys import PartitionKey
from broker.mqtt.packets import PubComp, PubRec
from broker.mqtt.reason_codes import ReasonCode
from broker.router.link import Link
from broker.router.partition import PartitionBase
from broker.router.session import Session
from broker.router.state import RETAINED, RouterState

log = logging.getLogger("broker.router")

#: Called with the first offset of what was appended, or None if the append failed, or
#: :data:`OUTCOME_UNKNOWN`.
AckCallback = Callable[[int | None], None]

#: What an ack callback gets when the append may or may not have committed (a replicated
#: partition's leader lost its leadership with the entry in flight): the publisher gets no
#: acknowledgement and its connection is closed, so that it publishes again (a QoS 1
#: duplicate is allowed [MQTT-4.3.2-1]; a lost acknowledged message is not).
OUTCOME_UNKNOWN = -2


def stored(offset: int | None) -> bool:
    """Whether an append's answer (an :data:`AckCallback` 's argument) says it is stored."""
    return offset is not None and offset != OUTCOME_UNKNOWN


class GroupCommit:
    """The group commit of one router. See the module docstring."""

    # Set by the router (these components call back into the commit):
    #: Wake the readers of a partition with new records (broker.router.delivery).
    wake: Callable[[PartitionBase], None]
    #: Committed ``$retained`` records update the retained index (broker.router.store).
    apply_retained: Callable[[list[Record]], None]
    #: Write a session's state to ``$sessions`` (broker.router.store).
    persist: Callable[[Session, AckCallback | None], None]

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self._dirty = state.dirty
        self._schedule = state.schedule
        self._scheduled = False
        #: Sessions to write to $sessions before this flush's acknowledgements go out, and
        #: what waits for that write.
        self._persist_due: dict[str, Session] = {}
        self._persist_waiters: dict[str, list[AckCallback]] = {}

    def enqueue(self, record: Record, ack: AckCallback | None, key: PartitionKey) -> None:
        """Gather ``record`` for the next group commit of partition ``key``."""
        part = self.state.partition(key)
        part.add(record, ack)
        self._dirty[key] = part
        self.flush_soon()

    def append_forwarded(
        self, key: PartitionKey, rows: list[tuple[Any, ...]], ack: AckCallback
    ) -> None:
        """Records another worker forwarded to partition ``key``, which this worker owns, as
        rows without their offset (:meth:`PartitionBase.add_rows`): appended in this
        iteration's group commit, consecutively; ``ack`` gets the first record's offset
        (None if the append failed)."""
        part = self.state.partition(key)
        part.add_rows(rows, ack)
        self._dirty[key] = part
        self.flush_soon()

    def append_forwarded_batch(
        self, key: PartitionKey, batch: bytes, count: int, ack: AckCallback
    ) -> None:
        """A checked batch of ``count`` records another worker encoded for partition ``key``,
        which this worker owns (:meth:`PartitionBase.add_batch`): appended in this
        iteration's group commit as it is; ``ack`` gets its first record's offset (None if
        the append failed)."""
        part = self.state.partition(key)
        part.add_batch(batch, count, ack)
        self.state.records_appended += count
        self._dirty[key] = part
        self.flush_soon()

    def flush_soon(self) -> None:
        """Run the group commit at the end of this event-loop iteration (once)."""
        if not self._scheduled:
            self._scheduled = True
            self._schedule(self.flush)

    def flush(self) -> None:
        """Group commit: append every gathered batch, acknowledge, wake consumers."""
        self._scheduled = False
        state = self.state
        dirty = self._dirty
        # Sessions due to be persisted count as work even with no record gathered (a QoS 2
        # delivery a PUBACK let out, a PUBREC): persist() gathers their state in $sessions.
        while dirty or self._persist_due:
            batch = list(dirty.items())
            dirty.clear()  # the same dict: the publish path holds it
            for key, part in batch:
                if part.appends_here:  # else forwarded to the worker that owns it
                    state.log_appends += 1
                    state.records_appended += len(part.pending)
                try:
                    on_sync_append = state.on_sync_append
                    if on_sync_append is not None and part.log.config.fsync == "always":
                        started = time.perf_counter()
                        first, end = part.commit()
                        on_sync_append(time.perf_counter() - started)
                    else:
                        first, end = part.commit()
                except Exception:
                    log.exception("append to %s/%d failed; its publishers get an error", *key)
                    continue
                if key == RETAINED and end > first:
                    self.apply_retained(part.read(first, end - first))
                if part.appends_here:  # else forwarded: its readers wake when it is appended
                    self.wake(part)
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
                    self.persist(session, _Each(waiters) if waiters else None)

    def persist_before_acks(self, session: Session, then: AckCallback | None = None) -> None:
        """Persist ``session`` within the current group commit (see :meth:`flush`).

        Output queued during :meth:`flush` leaves after it returns, so what is sent there
        follows the state; outside a flush, the state follows in the next one. ``then`` is
        called once the state is in the log: with one worker in this same flush, with
        several once the worker owning ``$sessions`` appended it.
        """
        self._persist_due[session.client_id] = session
        if then is not None:
            self._persist_waiters.setdefault(session.client_id, []).append(then)
        self.flush_soon()


class Ack:
    """Acknowledge a client's QoS 1/2 PUBLISH (or PUBREL) once its record (or its session
    state) is in the log: ``cls`` is PubAck, PubRec or PubComp."""

    __slots__ = ("cls", "commit", "link", "packet_id", "session")

    def __init__(
        self, commit: GroupCommit, session: Session, link: Link, cls: type, packet_id: int
    ) -> None:
        self.commit = commit
        self.session = session
        self.link = link
        self.cls = cls
        self.packet_id = packet_id

    def __call__(self, offset: int | None) -> None:
        session = self.session
        pid = self.packet_id
        if offset == OUTCOME_UNKNOWN:
            if self.cls is PubRec:
                _forget_qos2(session, pid)
            if session.link is self.link:
                self.link.close(
                    ReasonCode.UNSPECIFIED_ERROR, "publish outcome unknown: send it again"
                )
            return
        resends = 0
        if self.cls is PubRec:
            resends = session.pending_qos2.pop(pid, 0) if session.pending_qos2 else 0
            if offset is None:
                _forget_qos2(session, pid)
            elif session.persistent:
                # The packet id must be known as received before the PUBREC can leave, also
                # across a crash, or a resend after restart would be stored twice (s4.3.3).
                self.commit.persist_before_acks(
                    session, lambda state_offset: self._stored(state_offset, offset, resends)
                )
                return
        self._answer(offset, resends)

    def _stored(self, state_offset: int | None, offset: int, resends: int) -> None:
        """The session state a PUBREC follows is stored (``state_offset``), or not: then no
        PUBREC; the connection is closed so that the client resends the PUBLISH, which this
        session (its packet id received) answers without storing it again. With a
        replicated ``$sessions`` the state may fail to commit (no leader, leadership lost)."""
        if not stored(state_offset):
            if self.session.link is self.link:
                self.link.close(ReasonCode.UNSPECIFIED_ERROR, "session state not stored")
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

    def __init__(self, callbacks: list[AckCallback]) -> None:
        self.callbacks = callbacks

    def __call__(self, offset: int | None) -> None:
        for callback in self.callbacks:
            callback(offset)


def _forget_qos2(session: Session, packet_id: int) -> None:
    """The QoS 2 id was not stored after all: a resend of it is a new message (s4.3.3)."""
    if session.pending_qos2 is not None:
        session.pending_qos2.pop(packet_id, None)
    if session.incoming_qos2 is not None:
        session.incoming_qos2.discard(packet_id)


class Both:
    """One acknowledgement for the two appends of a retained message: its record in its
    topic's partition and its copy in ``$retained`` (broker.router.ingest). ``ack`` is
    called once both answered: with the record's offset when both are stored (only then is
    the message retained for future subscribers [MQTT-3.3.1-5]), None when neither is, and
    :data:`OUTCOME_UNKNOWN` otherwise, so that the publisher sends it again (a QoS 1
    duplicate is allowed; an acknowledged retained message lost is not). With several
    workers ``$retained`` may be another worker's, whose forward can be refused (that worker
    died) while the record's own append succeeds."""

    __slots__ = ("_answered", "_offset", "ack")

    def __init__(self, ack: AckCallback) -> None:
        self.ack = ack
        self._offset: int | None = None
        self._answered: list[bool] = []  # per append answered: stored?

    def record(self, offset: int | None) -> None:
        self._offset = offset
        self._answer(offset)

    def retained(self, offset: int | None) -> None:
        self._answer(offset)

    def _answer(self, offset: int | None) -> None:
        self._answered.append(stored(offset))
        if len(self._answered) < 2:
            return
        if all(self._answered):
            self.ack(self._offset)
        else:
            self.ack(None if not any(self._answered) else OUTCOME_UNKNOWN)
