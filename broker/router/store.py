"""The session store: session, shared-group and retained state in the compacted streams.

``$sessions`` holds one record per client id (its :meth:`~broker.router.session.Session.to_state`,
JSON) or ``$share/...`` filter (the group's positions); an empty payload deletes. In a cluster
it also holds each client id's ownership record (key: :data:`OWNERSHIP` + the client id),
which is not loaded as a session. ``$retained``
holds one record per topic. Both are written through the group commit (broker.router.commit)
and read back whole at start (:meth:`SessionStore.load`). With several workers a session
moves between workers as its state (:meth:`SessionStore.hand_over`, :meth:`SessionStore.adopt`).

Called only from the owning event loop's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import orjson

from broker.commitlog import Record
from broker.commitlog.keys import PartitionKey
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import ReasonCode
from broker.mqtt.topics import parse_shared
from broker.router.commit import AckCallback, GroupCommit, stored
from broker.router.partition import GroupWatcher, SessionWatcher
from broker.router.session import Consumer, Session, SharedGroup, Subscription
from broker.router.state import RETAINED, SESSIONS, RouterState

#: The first character of the ``$sessions`` keys that are no client id nor group: a
#: cluster's ownership records (broker.workers.replicated_sessions). An MQTT string never
#: contains U+0000 [MQTT-1.5.4-2].
OWNERSHIP = "\0"
#: How many times a tombstone is appended before it is given up (one attempt per pass of
#: the timer, about a second apart: a dead worker owning ``$sessions`` is back in less).
TOMBSTONE_ATTEMPTS = 10

log = logging.getLogger("broker.router")


class SessionStore:
    """Persistence and loading of one router's sessions, groups and retained messages. See
    the module docstring."""

    # Set by the router (the lifecycle calls into the store too):
    #: The link of a session closed (broker.router.lifecycle).
    connection_lost: Callable[..., None]
    #: A group's positions done (broker.router.shared.SharedGroups.done_positions).
    done_positions: Callable[[SharedGroup], dict[PartitionKey, int]]
    #: What a write of a group's positions calls (broker.router.shared.SharedGroups.stored_ack).
    stored_ack: Callable[[str, SharedGroup], AckCallback | None]

    def __init__(self, state: RouterState, commit: GroupCommit) -> None:
        self.state = state
        self.commit = commit
        self.sessions = state.sessions
        self.partitions = state.partitions
        self.partition = state.partition
        #: Per client id: the ``$sessions`` records written here whose append has not
        #: answered yet, and what waits for them (:meth:`after_written`).
        self._unanswered: dict[str, int] = {}
        self._waiting: dict[str, list[Callable[[], None]]] = {}
        #: Per client id with records in flight: how many it had written here (a tombstone
        #: not stored is written again only while it is the last, :meth:`_deleted`).
        self._written_count: dict[str, int] = {}
        #: Tombstones not stored, to write again at the timer's next pass: client id, the
        #: number of the record, attempts left.
        self._deletes_again: list[tuple[str, int, int]] = []

    def load(self, skip: Iterable[str] = ()) -> list[str]:
        """Load retained messages and the sessions this worker is home to, except those in
        ``skip`` (held by another worker); returns the client ids loaded."""
        self._load_retained()
        return self._load_sessions(skip=set(skip))

    def apply_retained(self, records: Iterable[Record]) -> None:
        """Committed ``$retained`` records update the retained index [MQTT-3.3.1-5]; an
        empty payload removes the topic's message [MQTT-3.3.1-10]."""
        retained = self.state.retained
        for rec in records:
            if rec.payload:
                retained[rec.topic] = rec
            else:
                retained.pop(rec.topic, None)

    def forget(self, session: Session) -> None:
        """Take ``session`` out of this router: its cursors stop watching partitions."""
        for consumer in session.consumers.values():
            for key in consumer.cursors:
                part = self.partitions.get(key)
                if part is not None:
                    part.watchers.discard(SessionWatcher(session.client_id, consumer.name))
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
            self.state.uncount(session)
            self.state.authz.pop(session.client_id, None)
            self.state.usernames.pop(session.client_id, None)

    def persist(self, session: Session, ack: AckCallback | None = None) -> None:
        """Write the session's state to the compacted ``$sessions`` stream; ``ack`` is
        called once it is in the log."""
        if session.persistent:
            self.write(session, ack)

    def write(self, session: Session, ack: AckCallback | None = None) -> None:
        """Write the session's state, persistent or not (:meth:`persist`; a clean session
        with a will: broker.router.lifecycle)."""
        session.dirty = False
        session.stored = True
        state = self.state
        payload = orjson.dumps(session.to_state(state.monotonic()))
        record = Record(-1, state.now_ms(), session.client_id, payload)
        self._count(session.client_id)
        self.commit.enqueue(record, partial(self._written, session, ack), SESSIONS)

    def _count(self, client_id: str) -> int:
        """One more record of ``client_id`` in flight from here; returns its number."""
        self._unanswered[client_id] = self._unanswered.get(client_id, 0) + 1
        number = self._written_count[client_id] = self._written_count.get(client_id, 0) + 1
        return number

    def delete(self, client_id: str) -> None:
        """Delete the state of ``client_id`` 's session (a tombstone: it ended)."""
        self._append_tombstone(client_id, self._count(client_id), TOMBSTONE_ATTEMPTS)

    def _append_tombstone(self, client_id: str, number: int, attempts: int) -> None:
        tombstone = Record(-1, self.state.now_ms(), client_id, b"")
        answer = partial(self._deleted, client_id, number, attempts - 1)
        self.commit.enqueue(tombstone, answer, SESSIONS)

    def _deleted(self, client_id: str, number: int, attempts: int, offset: int | None) -> None:
        """A tombstone's append answered. Not stored (``$sessions`` ' owner worker dead, its
        forward refused; no leader in a cluster; or not known to be: a second one deletes
        nothing more) while it is still the last record of the
        client id written here, it is written again at the timer's next pass, and counts as
        unanswered until then: the state it deletes would otherwise stay in the log, and a
        restart or a worker's death would bring back a session that ended (a clean start's
        [MQTT-3.1.2-4]). Not blindly: a session that leaves this worker (or whose end is told
        to its home) waits for its records here to be answered (:meth:`after_written`), so
        no other worker has written a newer state of the client id meanwhile; a newer
        record written here replaces the tombstone."""
        if not stored(offset) and self._written_count.get(client_id) == number:
            if attempts > 0:
                self._deletes_again.append((client_id, number, attempts))
                return
            log.error(
                "%s: its session's tombstone was not stored after %d attempts; "
                "its last state stays in $sessions",
                client_id,
                TOMBSTONE_ATTEMPTS,
            )
        self._answered(client_id)

    def delete_again(self) -> None:
        """Write again the tombstones not stored (:meth:`_deleted`; the timer's pass)."""
        again, self._deletes_again = self._deletes_again, []
        for client_id, number, attempts in again:
            if self._written_count.get(client_id) == number:
                self._append_tombstone(client_id, number, attempts)
            else:
                self._answered(client_id)

    def after_written(self, client_id: str, then: Callable[[], None]) -> None:
        """Call ``then`` once every ``$sessions`` record of ``client_id`` written here has
        been answered (stored or not); now if none is in flight.

        With several workers, two workers' records of one client id reach ``$sessions`` ' owner
        on two sockets, in no order between them: the record of a connection that ended
        here (its tombstone, its state with the will sent) could be appended after the state
        the client's next connection wrote on another worker, and would undo it (its will,
        its subscriptions lost at that worker's death). So a session leaves this worker, and
        its end is told to its home, only once its records are answered
        (broker.workers.sessions)."""
        if client_id in self._unanswered:
            self._waiting.setdefault(client_id, []).append(then)
        else:
            then()

    def _answered(self, client_id: str, offset: int | None = None) -> None:
        left = self._unanswered[client_id] - 1
        if left:
            self._unanswered[client_id] = left
            return
        del self._unanswered[client_id]
        del self._written_count[client_id]
        for then in self._waiting.pop(client_id, ()):
            then()

    def _written(self, session: Session, ack: AckCallback | None, offset: int | None) -> None:
        """The append of ``session`` 's state answered. Not stored (``$sessions`` ' owner
        worker dead, its forward refused; a failed append), a persistent session still held
        here is written again at the timer's next pass, as if it had changed: nothing else
        would write it before its next change, and a worker dying meanwhile left whoever
        restored the session an older state (a subscription acknowledged since missing).
        Then ``ack``."""
        state = self.state
        try:
            if (
                not stored(offset)
                and session.persistent
                and state.sessions.get(session.client_id) is session
            ):
                state.changed(session)
            if ack is not None:
                ack(offset)
        finally:
            # Whatever the ack did: a count left behind would keep every later release of
            # the session waiting (broker.workers.sessions).
            self._answered(session.client_id)

    def persist_groups(self) -> None:
        """Each group's positions: ``cursors``, the next record to hand out, and ``done``,
        the first record not yet done, where the group continues when it is held again
        (:meth:`load`; a cluster's new home too)."""
        self.state.groups_dirty = False
        for full, group in self.state.groups.items():
            self.persist_group(full, group, self.stored_ack(full, group))

    def store_groups(self, then: Callable[[bool], None]) -> None:
        """Write every group's positions now; ``then(True)`` once all are in the log,
        ``then(False)`` if one is not (broker.workers.cluster_groups' hand-over)."""
        groups = list(self.state.groups.items())
        outcomes: list[bool] = []
        if not groups:
            then(True)

        def ack_of(full: str, group: SharedGroup) -> AckCallback:
            stored_ack = self.stored_ack(full, group)

            def ack(offset: int | None) -> None:
                if stored_ack is not None:
                    stored_ack(offset)
                outcomes.append(stored(offset))
                if len(outcomes) == len(groups):
                    then(all(outcomes))

            return ack

        self.state.groups_dirty = False
        for full, group in groups:
            self.persist_group(full, group, ack_of(full, group))

    def persist_group(self, full: str, group: SharedGroup, ack: AckCallback | None) -> None:
        """Write the positions of ``group`` (:meth:`persist_groups`); ``ack`` is called once
        they are in the log."""
        cursors = [[k[0], k[1], off] for k, off in group.consumer.cursors.items()]
        done = [[k[0], k[1], off] for k, off in self.done_positions(group).items()]
        payload = orjson.dumps({"cursors": cursors, "done": done})
        self.commit.enqueue(Record(-1, self.state.now_ms(), full, payload), ack, SESSIONS)

    def close(self) -> None:
        """Persist every session and flush: called on shutdown."""
        for session in self.sessions.values():
            if session.persistent:
                if session.link is not None:
                    session.disconnected_at = self.state.clock()
                self.persist(session)
        self.persist_groups()
        self.commit.flush()

    def _load_retained(self) -> None:
        self.apply_retained(self._read_all(RETAINED))

    def _session_states(self) -> dict[str, bytes]:
        """The latest ``$sessions`` record per key (client id or group filter)."""
        states: dict[str, bytes] = {}
        for rec in self._read_all(SESSIONS):
            states[rec.topic] = rec.payload
        return states

    def _load_sessions(self, skip: set[str]) -> list[str]:
        """Sessions and shared groups from ``$sessions`` (those this worker is home to, but
        not in ``skip``); returns the client ids of the sessions loaded."""
        loaded = []
        is_home = self.state.hooks.is_home
        for name, payload in self._session_states().items():
            if payload and name not in skip and is_home(name) and name[:1] != OWNERSHIP:
                if name.startswith("$share/"):
                    # From the first record not done, at least once [MQTT-4.8.2]: from where
                    # it had handed out to (its cursors), what its members had then and did
                    # not keep (a clean session's deliveries; records given back to a home
                    # killed since, which drops them; those its stop's ended sessions gave
                    # back) was never delivered again. A persistent member may get again a
                    # record it still had in flight.
                    self.restore_group(name, orjson.loads(payload), True)
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
            if name in wanted and payload and name[:1] != OWNERSHIP:
                self._restore_session(name, orjson.loads(payload))
                found.append(name)
        return found

    def restore_group(self, full: str, state: dict[str, Any], from_done: bool = False) -> None:
        """Hold group ``full`` from its persisted state: at its ``cursors``, or at its
        ``done`` positions (:meth:`persist_groups`) if ``from_done`` and it has them."""
        name, plain = parse_shared(full)
        assert name is not None
        consumer = Consumer(full, group=name)
        consumer.subscriptions[plain] = Subscription(plain, 2)
        positions = state.get("done", state["cursors"]) if from_done else state["cursors"]
        for stream, p, off in positions:
            consumer.cursors[(stream, p)] = off
            self.partition((stream, p)).watchers.add(GroupWatcher(full))
        self.state.groups[full] = SharedGroup(name, plain, consumer)

    def _restore_session(
        self, client_id: str, state: dict[str, Any], lost_at: float | None = None
    ) -> Session:
        """A session from its persisted (or handed over) state, registered as offline. One
        whose client was connected when the state was written lost its connection at
        ``lost_at`` (wall seconds; None: now)."""
        session = Session.from_state(client_id, state)
        now = self.state.clock()
        lost = now if lost_at is None else min(lost_at, now)
        if session.disconnected_at is None:
            session.disconnected_at = lost
        if session.will is not None:
            # A will still pending at shutdown keeps its remaining delay; one of a client
            # that was connected when the broker died is due as for an abnormal close,
            # deferred to this start as s3.1.2.5 allows. tick() publishes it. A cluster's
            # adopter of a dead node's session counts the delay from when that node lost
            # the connection, if it wrote that down (its clock), not from its death.
            left = state.get("will_left")
            if left is None or lost_at is not None:
                delay = session.will.properties.get(PropertyId.WILL_DELAY_INTERVAL, 0)
                since = max(0.0, now - session.disconnected_at)  # (clocks differ)
                left = max(0.0, min(delay, session.expiry_interval) - since)
            session.will_due = self.state.monotonic() + left
        self.sessions[client_id] = session
        self.state.wait_offline(session)  # its will and its expiry
        self.state.count(session)
        for consumer in session.consumers.values():
            for key in consumer.cursors:
                self.partition(key).watchers.add(SessionWatcher(client_id, consumer.name))
        return session

    def adopt(self, client_id: str, state: bytes, lost_at: float | None = None) -> None:
        """The session of ``client_id``, handed over by the worker that held it, is held
        here now (offline until :meth:`connect`); ``lost_at``: see :meth:`_restore_session`
        (a cluster adopting the sessions of a dead node passes the time of its death)."""
        self._restore_session(client_id, orjson.loads(state), lost_at)

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
        state = orjson.dumps(session.to_state(self.state.monotonic()))
        self.forget(session)
        return state

    def _read_all(self, key: PartitionKey) -> Iterable[Record]:
        """Every record of a compacted stream's partition, from its start."""
        part = self.partition(key)
        offset = part.log.log_start_offset
        while offset < part.end_offset:
            recs = part.log.read(offset, max_records=1000)
            if not recs:
                break
            yield from recs
            offset = recs[-1].offset + 1
