"""QoS flows: the acknowledgements clients send, and in-flight deliveries resent on resume.

Outgoing QoS 1 ends with PUBACK; outgoing QoS 2 goes PUBLISH, PUBREC, PUBREL, PUBCOMP
(s4.3.3), the released step recorded in the :class:`~broker.router.session.Inflight` entry.
Incoming QoS 2 ends with the client's PUBREL, answered PUBCOMP once the packet id is
forgotten durably [MQTT-4.3.3-9]. Each completed delivery frees a slot of the send quota
(s4.9): the session is pumped again (broker.router.delivery).

Called only from the owning event loop's thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import repeat
from operator import itemgetter
from typing import cast

from broker.mqtt.packets import PubComp, PubRel
from broker.mqtt.reason_codes import ReasonCode
from broker.router.commit import Ack, GroupCommit, stored
from broker.router.delivery import Delivery
from broker.router.link import Link
from broker.router.partition import QueueWatcher
from broker.router.session import Inflight, Session
from broker.router.shared import SharedGroups
from broker.router.state import RouterState
from broker.router.store import SessionStore

# For map() over Inflight entries: by position, as fast as on a plain tuple.
_QOS_OF = itemgetter(Inflight._fields.index("qos"))
_GROUP_OF = itemgetter(Inflight._fields.index("group"))


class QosFlows:
    """PUBACK, PUBREC, PUBREL and PUBCOMP of one router's sessions. See the module
    docstring."""

    def __init__(
        self,
        state: RouterState,
        commit: GroupCommit,
        store: SessionStore,
        delivery: Delivery,
        shared: SharedGroups,
    ) -> None:
        self.state = state
        self.commit = commit
        self.store = store
        self.delivery = delivery
        self.pump_session = delivery.pump_session
        self.group_done = shared.group_done

    def puback(self, session: Session, packet_id: int, *, pump: bool = True) -> None:
        """A delivery is acknowledged; ``pump=False`` when the caller sends what the freed
        quota allows itself, once for a whole read of PUBACKs."""
        entry = session.inflight_entry(packet_id)
        if entry is not None and entry.qos == 1:
            del session.inflight[packet_id]
            if session.persistent and not session.dirty:
                self.state.mark_dirty(session)
            if entry.group is not None:
                self.group_done(session, entry.group, entry.key, entry.offset)
            if pump:
                self.pump_session(session)

    def puback_run(self, session: Session, packet_ids: Sequence[int]) -> None:
        """:meth:`puback` with ``pump=False`` for each of ``packet_ids`` (the PUBACKs of one
        read, :class:`~broker.mqtt.decode.PubAckRun`), in one step when every id names a
        QoS 1 delivery of no shared group: a subscriber's window of replayed deliveries
        comes back that way, and one call per PUBACK was ~25% of a QoS 1 replay."""
        inflight = session.inflight
        # The distinct entries: the few runs a window was sent in (QoS 1 of no group each),
        # or the entries of deliveries sent one by one, checked in C.
        got = set(map(inflight.get, packet_ids))
        singles = cast(list[Inflight], [e for e in got if type(e) is Inflight])
        if (
            None not in got
            and sum(map(_QOS_OF, singles)) == len(singles)
            and not any(map(_GROUP_OF, singles))
        ):
            deque(map(inflight.pop, packet_ids, repeat(None)), 0)  # a repeated id: no-op
            if session.persistent and not session.dirty:
                self.state.mark_dirty(session)
            return
        for packet_id in packet_ids:
            self.puback(session, packet_id, pump=False)

    def pubrec(self, session: Session, packet_id: int, reason_code: int) -> None:
        entry = session.inflight_entry(packet_id)
        link = session.link
        assert link is not None
        if entry is None or entry.qos != 2:
            if session.version == 5:
                link.send(PubRel(packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
            return
        if reason_code >= 0x80:
            # The receiver refused the message: the flow ends here (s4.3.3).
            del session.inflight[packet_id]
            if entry.group is not None:
                self.group_done(session, entry.group, entry.key, entry.offset)
            self.pump_session(session)
            return
        session.inflight[packet_id] = entry._replace(released=True)
        if not session.persistent:
            link.send(PubRel(packet_id))
            return
        # Once PUBREL has left, the receiver may forget the id [MQTT-4.3.3-12] and take a
        # resent PUBLISH as a new message: the released step is in the log before it leaves,
        # so that a crash in between resends the PUBREL, never the PUBLISH [MQTT-4.3.3-6].
        self.state.mark_dirty(session)
        self.commit.persist_before_acks(session, lambda offset: _released(link, packet_id, offset))

    def pubrel(self, session: Session, packet_id: int) -> None:
        link = session.link
        assert link is not None
        received = session.incoming_qos2
        if received is not None and packet_id in received:
            if session.pending_qos2 and packet_id in session.pending_qos2:
                return  # not stored yet: the client resends PUBREL after our PUBREC
            received.discard(packet_id)
            if session.persistent:
                # Forget the id durably before PUBCOMP frees it for reuse [MQTT-4.3.3-9]:
                # a stale id after a crash would swallow the client's next message.
                self.store.persist(session, Ack(self.commit, session, link, PubComp, packet_id))
            else:
                link.send(PubComp(packet_id))
        elif session.version == 5:
            link.send(PubComp(packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
        else:
            link.send(PubComp(packet_id))

    def pubcomp(self, session: Session, packet_id: int) -> None:
        entry = session.inflight_entry(packet_id)
        if entry is not None and entry.qos == 2 and entry.released:
            del session.inflight[packet_id]
            self.state.changed(session)
            if entry.group is not None:
                self.group_done(session, entry.group, entry.key, entry.offset)
            self.pump_session(session)

    def resend_inflight(self, session: Session) -> None:
        """On session resume, resend unacknowledged deliveries with DUP [MQTT-4.4.0-1].

        A record not readable here yet is resent once it is: in a cluster the session may
        resume on a node whose replica has not caught up with the commit (restarted, or
        its group without a leader for a moment), or whose remote partition has not
        fetched that far. Dropped as if deleted by retention, such a delivery was lost for
        good (the session's cursor is past it): 2 acknowledged publishes of a shared group
        in a churn run of three nodes (bench.churn --cluster 3, a node killed)."""
        link = session.link
        assert link is not None
        session.resend_due = None
        for pid, entry in session.inflight_entries():
            if entry.released:
                link.send(PubRel(pid))
            else:
                self._resend(session, pid, entry)

    def resend_when_readable(self, session: Session) -> None:
        """A partition the session waits on for a resend has new records (its watcher)."""
        due, session.resend_due = session.resend_due, None
        if session.link is None or not due:
            return
        for pid in due:
            entry = session.inflight_entry(pid)
            if entry is not None and not entry.released:
                self._resend(session, pid, entry)

    def _resend(self, session: Session, pid: int, entry: Inflight) -> None:
        rec = self.delivery.read_exact(entry.key, entry.offset)
        if rec is None:
            part = self.delivery.partition(entry.key)
            if entry.offset < part.log.log_start_offset:
                del session.inflight[pid]  # gone by retention: nothing left to deliver
                return
            if session.resend_due is None:
                session.resend_due = []
            session.resend_due.append(pid)
            part.watchers.add(QueueWatcher(session.client_id))
            return
        self.delivery.deliver(
            session,
            rec,
            entry.key,
            entry.qos,
            (),
            entry.consumer,
            retain=entry.retain,
            group=entry.group,
            dup=True,
            packet_id=pid,
        )


def _released(link: Link, packet_id: int, state_offset: int | None) -> None:
    """PUBREL once the released step is stored; if it could not be (a replicated
    ``$sessions`` without a leader), the connection is closed instead: the client resends
    PUBREC on its next connection [MQTT-4.4.0-1]."""
    if not stored(state_offset):
        link.close(ReasonCode.UNSPECIFIED_ERROR, "session state not stored")
    else:
        link.send(PubRel(packet_id))
