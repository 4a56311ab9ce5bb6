"""Shared subscription groups: ``$share/<name>/<filter>`` [MQTT-4.8.2].

A group is one consumer (positions in partitions) whose records are spread round robin over
its member sessions, each record to exactly one member (like a Kafka consumer group), at the
minimum of its QoS and that member's subscription QoS [MQTT-3.8.4-8], never as retained.

With several workers a group is held by one worker, its *home* (the ``group_peers`` of
:class:`~broker.router.hooks.WorkerHooks`): members whose sessions are elsewhere join it
through the mesh (``remote_*`` here are the home's and the member's side of those calls).
In a cluster the home is the worker hosting ``$sessions`` on the node leading it
(broker.workers.cluster_groups), and :meth:`SharedGroups.rehome` follows it when it moves.
With one worker every group is held here.

Called only from the owning event loop's thread.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from broker.auth.acl import Authorizer
from broker.commitlog import Record
from broker.commitlog.keys import PartitionKey
from broker.mqtt.packets import SubAck
from broker.mqtt.topics import parse_shared, topic_matches
from broker.router.commit import AckCallback, stored
from broker.router.delivery import Delivery
from broker.router.link import Link
from broker.router.partition import GroupWatcher, QueueWatcher
from broker.router.session import Consumer, RemoteMember, Session, SharedGroup, Subscription
from broker.router.state import RouterState


class SharedGroups:
    """The shared groups of one router, and its side of groups held elsewhere. See the
    module docstring."""

    #: Set by the router: hold group ``full`` from its persisted state (from the positions
    #: done when the flag is set; broker.router.store.SessionStore.restore_group).
    restore_group: Callable[[str, dict[str, Any], bool], None]
    #: Set by the router: write a group's positions to ``$sessions``, then call the ack
    #: (broker.router.store.SessionStore.persist_group).
    persist_group: Callable[[str, SharedGroup, AckCallback | None], None]

    def __init__(self, state: RouterState, delivery: Delivery) -> None:
        self.state = state
        self.sessions = state.sessions
        self.groups = state.groups
        self.partition = state.partition
        self.deliver = delivery.deliver
        self.can_send = delivery.can_send
        self.read = delivery.read
        self.read_exact = delivery.read_exact
        #: Client id -> its SUBACKs held until the shared groups named joined it (in order:
        #: the link they are for, the packet, the groups still to answer).
        self.subacks: dict[str, list[tuple[Link, SubAck, set[str]]]] = {}
        #: While set, no group held here hands out a record (:meth:`freeze`).
        self.frozen = False
        #: The sessions' :attr:`~broker.router.session.Session.group_token`: counted from the
        #: time this process started, so a worker restarted never reuses one that a home
        #: may still hold a membership of (until it learns of the restart).
        self.tokens = itertools.count(time.time_ns())

    def group(self, full: str) -> SharedGroup:
        """The shared group ``full`` held here, created at the end of its partitions."""
        group = self.groups.get(full)
        if group is None:
            name, plain = parse_shared(full)
            assert name is not None
            consumer = Consumer(full, group=name)
            consumer.subscriptions[plain] = Subscription(plain, 2)
            group = self.groups[full] = SharedGroup(name, plain, consumer, stored=False)
            for key in self.state.keys_for_filter(plain):
                consumer.cursors[key] = self.partition(key).end_offset
                self.partition(key).watchers.add(GroupWatcher(full))
            self.persist_group(full, group, self.stored_ack(full, group))
        return group

    def stored_ack(self, full: str, group: SharedGroup) -> AckCallback | None:
        """What a write of the positions of ``group`` (held here) calls once it is in the
        log: while the group is new, it is then stored and its waiting members joined it.
        Its positions are where it starts, here or at a cluster's next home: a member may
        be told it is subscribed only once they are (a record published after its SUBACK
        is delivered: the subscription exists once its SUBACK left, s3.8.4, s4.8.2)."""
        if group.stored:
            return None

        def ack(offset: int | None) -> None:
            if self.groups.get(full) is not group or group.stored:
                return  # dropped meanwhile (its home moved): its members join the next
            if not stored(offset):
                self.state.groups_dirty = True  # written again at the next tick
                return
            group.stored = True
            waiting, group.waiting = group.waiting, []
            for worker, client_id in waiting:
                self._joined(worker, full, client_id)

        return ack

    def _joined(self, worker: int | None, full: str, client_id: str) -> None:
        """Tell a member of group ``full`` (held here, stored) it joined it."""
        peers = self.state.hooks.group_peers
        if worker is None:
            self.group_joined(full, client_id)
        elif peers is not None:
            peers.joined(worker, full, client_id)

    def hold_suback(self, session: Session, packet: SubAck, groups: set[str]) -> None:
        """Send ``packet`` to the session's client once each of ``groups`` joined it."""
        assert session.link is not None
        held = self.subacks.setdefault(session.client_id, [])
        held.append((session.link, packet, groups))

    def group_joined(self, full: str, client_id: str) -> None:
        """Group ``full`` (held here or elsewhere) has ``client_id`` as a member, stored: the
        SUBACKs held for it leave, in the order of their SUBSCRIBEs."""
        held = self.subacks.get(client_id)
        if held is None:
            return
        session = self.sessions.get(client_id)
        link = session.link if session is not None else None
        for _, _, groups in held:
            groups.discard(full)
        while held and (held[0][0] is not link or not held[0][2]):
            was, packet, groups = held.pop(0)
            if was is link:
                link.send(packet)
        if not held:
            del self.subacks[client_id]

    def group_home(self, full: str) -> int | None:
        """The worker holding group ``full``; None when it is this one (always, alone)."""
        peers = self.state.hooks.group_peers
        return None if peers is None else peers.home(full)

    def join_group(self, session: Session, full: str) -> bool:
        """The session joins group ``full``; False if it is not told yet that it did:
        :meth:`group_joined` follows (the group's home answers, or stored it)."""
        if session.link is None:
            return True
        home = self.group_home(full)
        if home is not None:
            peers = self.state.hooks.group_peers
            assert peers is not None
            sub = session.shared[full]
            window = min(session.receive_maximum, self.state.config.max_inflight)
            peers.join(
                home,
                full,
                session.client_id,
                self.token_of(session),
                sub.qos,
                sub.identifier,
                session.version,
                window,
                self.state.usernames.get(session.client_id),
            )
            return False
        group = self.group(full)
        if session.client_id not in group.members:
            group.members.append(session.client_id)
        if not group.stored:
            group.waiting.append((None, session.client_id))
        return group.stored

    def leave_group(self, session: Session, full: str, *, orphan_inflight: bool = False) -> None:
        """Remove a member. Its unacknowledged deliveries go to other members when the
        session is ending (s4.8.2); a persistent session keeps them for its return."""
        self.group_joined(full, session.client_id)  # a SUBACK held for it leaves
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
        home = self.group_home(full)
        if home is not None:
            peers = self.state.hooks.group_peers
            assert peers is not None
            peers.leave(home, full, session.client_id, session.group_token, orphans)
            return
        group = self.groups.get(full)
        if group is None:
            return
        if session.client_id in group.members and session.client_id not in group.remote:
            group.members.remove(session.client_id)
        group.orphans.extend(orphans)
        if group.orphans and group.members:
            self.pump_group(group)

    # ------------------------------------------------ groups across workers

    def token_of(self, session: Session) -> int:
        """The token naming ``session``'s memberships of groups held elsewhere."""
        if not session.group_token:
            session.group_token = next(self.tokens)
        return session.group_token

    def remote_join(
        self,
        worker: int,
        full: str,
        client_id: str,
        token: int,
        qos: int,
        identifier: int | None,
        version: int,
        window: int,
        username: str | None,
    ) -> None:
        """A session on ``worker`` is a member of group ``full``, held here, by the
        membership ``token`` names there; ``username`` selects its ACL rules, applied here
        as for a member of this worker."""
        group = self.group(full)
        acl = self.state.acl
        authz = Authorizer(acl.rules_for(username, client_id)) if acl is not None else None
        memberships = group.remote.setdefault(client_id, [])
        member = _find(memberships, worker, token)
        if member is None:
            member = RemoteMember(client_id, worker, token, qos, identifier, version, window)
        else:
            # The same membership joining again: the members of a node join a new home when
            # they learn of it, and the node relays a join it got a moment earlier (a
            # hand-over), or a connection took the session over on its worker. What it has
            # outstanding is its session's still, done there; given to another member it
            # would go out twice.
            memberships.remove(member)
            member.qos, member.identifier, member.version = qos, identifier, version
            member.window = window
        member.authz = authz
        memberships.append(member)  # the latest joined: the one records go to
        if client_id not in group.members:
            group.members.append(client_id)
        if group.stored:
            self._joined(worker, full, client_id)
        else:
            group.waiting.append((worker, client_id))
        self.pump_group(group)

    def remote_leave(
        self,
        worker: int,
        full: str,
        client_id: str,
        token: int,
        orphans: list[tuple[PartitionKey, int]],
    ) -> None:
        """The membership of ``client_id`` that ``token`` names on ``worker`` ended (or gave
        records back): ``orphans`` go to the others. Only that one: the session may be a
        member from another worker already (moved there, its join arrived first)."""
        group = self.groups.get(full)
        if group is None:
            return
        member = _find(group.remote.get(client_id, []), worker, token)
        if member is not None:
            self._end(group, member)
        group.orphans.extend(orphans)
        if group.orphans and group.members:
            self.pump_group(group)

    def _end(self, group: SharedGroup, member: RemoteMember) -> None:
        """``member``'s membership of ``group`` ends (what it had outstanding is the
        caller's); the client id stays a member while another membership holds it, or its
        session here."""
        client_id = member.client_id
        memberships = group.remote[client_id]
        memberships.remove(member)
        if memberships:
            return
        del group.remote[client_id]
        session = self.sessions.get(client_id)
        full = group.consumer.name
        here = session is not None and session.link is not None and full in session.shared
        if not here and client_id in group.members:
            group.members.remove(client_id)

    def remote_done(self, full: str, client_id: str, key: PartitionKey, offset: int) -> None:
        """A member elsewhere completed a delivery: room for the next one. Done by its
        client, whichever of its memberships it was sent to (a persistent session's
        deliveries move with it)."""
        group = self.groups.get(full)
        memberships = group.remote.get(client_id) if group is not None else None
        if group is not None and memberships:
            for member in memberships:
                member.outstanding.discard((key, offset))
            self.state.groups_dirty = True  # its done position may move (done_positions)
            self.pump_group(group)

    def worker_left(self, worker: int) -> None:
        """``worker`` died: its members leave every group held here, and what they had
        outstanding goes to the other members (at least once: a persistent session restored
        elsewhere may deliver it again)."""
        for group in list(self.groups.values()):
            gone = [m for ms in group.remote.values() for m in ms if m.worker == worker]
            for member in gone:
                self._end(group, member)
                group.orphans.extend(sorted(member.outstanding))
            if gone and group.orphans and group.members:
                self.pump_group(group)

    def rejoin_groups(self, worker: int) -> None:
        """``worker`` (re)started: the members here of the groups it holds join again."""
        for session in list(self.sessions.values()):
            for full in session.shared:
                if self.group_home(full) == worker:
                    self.join_group(session, full)

    def remote_deliver(
        self, full: str, client_id: str, token: int, key: PartitionKey, offset: int, qos: int
    ) -> None:
        """The worker holding group ``full`` sent this record for ``client_id`` here, to its
        membership ``token`` names; one that ended here gives it back, and ends there."""
        session = self.sessions.get(client_id)
        if session is None or session.link is None or full not in session.shared:
            home = self.group_home(full)
            peers = self.state.hooks.group_peers
            if home is not None and peers is not None:
                peers.leave(home, full, client_id, token, [(key, offset)])
            return
        if session.group_queue is None:
            session.group_queue = deque()
        session.group_queue.append((full, key, offset, qos))
        self.send_group_queue(session)

    def send_group_queue(self, session: Session) -> None:
        """Deliver the records groups elsewhere sent for ``session``, as its quota allows."""
        queue = session.group_queue
        while queue:
            full, key, offset, qos = queue[0]
            if not self.can_send(session, qos):
                return
            # The group's home read it, so it is committed, even if the owner's mark has
            # not reached this worker yet; a cluster's replica here learns it a round later
            # (and there the partition waits for that: the home may be another node).
            part = self.partition(key)
            part.committed_through(offset)
            readable, rec = self._record(key, offset)
            if offset >= part.end_offset or not readable:
                part.watchers.add(QueueWatcher(session.client_id))
                return
            queue.popleft()
            sub = session.shared.get(full)
            if rec is not None and sub is not None:
                ids = [sub.identifier] if sub.identifier and session.version == 5 else []
                self.deliver(session, rec, key, qos, ids, full, group=full)
            if qos == 0 or rec is None or session.link is None:
                self.group_done(session, full, key, offset)

    def _record(self, key: PartitionKey, offset: int) -> tuple[bool, Record | None]:
        """Whether the record at ``offset`` can be read here now, and the record (None:
        gone: deleted by retention, compacted away, damaged). A partition this node reads
        remotely may not have fetched it yet: the read starts the fetch, whose answer wakes
        the partition's watchers (broker.workers.remote_partition); taken for gone, it
        would be counted done and lost to the group."""
        part = self.partition(key)
        if offset >= part.end_offset:
            return False, None
        start = part.log.log_start_offset
        if part.fetched_remotely and offset >= start and not part.read(offset, 1):
            return False, None
        return True, self.read_exact(key, offset)

    def group_done(self, session: Session, full: str, key: PartitionKey, offset: int) -> None:
        """A delivery of group ``full`` is complete; its home, if elsewhere, is told."""
        home = self.group_home(full)
        peers = self.state.hooks.group_peers
        if home is not None and peers is not None:
            peers.done(home, full, session.client_id, key, offset)
        elif full in self.groups:
            self.state.groups_dirty = True  # its done position may move (done_positions)

    def done_positions(self, group: SharedGroup) -> dict[PartitionKey, int]:
        """Per partition, the group's first record not yet done: below it every record was
        sent at QoS 0 or acknowledged. A new home continuing from these positions (a
        cluster's, broker.workers.cluster_groups) delivers every other record at least once
        [MQTT-4.8.2]: those in flight again, to whichever member."""
        done = dict(group.consumer.cursors)
        held = [off for ms in group.remote.values() for m in ms for off in m.outstanding]
        held.extend(group.orphans)
        for client_id in group.members:
            session = self.sessions.get(client_id)
            if session is not None:
                held.extend(
                    (key, offset)
                    for _, (key, offset, _, _, _, taken_from, _) in session.inflight_entries()
                    if taken_from == group.consumer.name
                )
        for key, offset in held:
            if key in done and offset < done[key]:
                done[key] = offset
        return done

    def rehome(self, held: dict[str, dict[str, Any]] | None, frozen: bool = False) -> None:
        """Every group's home moved (a cluster's: broker.workers.cluster_groups): the groups
        held here are dropped; with ``held`` (group -> its persisted state) they are held
        here from now on, from the positions their last home persisted; then the members
        here join wherever their groups now are. ``frozen``: the groups held here hand out
        nothing until :meth:`freeze` (False), so that the members elsewhere join first."""
        for full, group in self.groups.items():
            for key in group.consumer.cursors:
                self.partition(key).watchers.discard(GroupWatcher(full))
        self.groups.clear()
        self.state.groups_dirty = False
        self.frozen = frozen
        for full, state in (held or {}).items():
            self.restore_group(full, state, True)
        for session in list(self.sessions.values()):
            for full in session.shared:
                self.join_group(session, full)
        for group in list(self.groups.values()):
            self.pump_group(group)

    def freeze(self, frozen: bool) -> None:
        """Stop (or start again) handing out the records of the groups held here: a
        cluster's home about to hand them over waits for what it handed out to be done
        (:meth:`drained`), so that the next home, from the positions stored then, sends
        nothing twice (broker.workers.cluster_groups)."""
        self.frozen = frozen
        if not frozen:
            for group in list(self.groups.values()):
                self.pump_group(group)

    def drained(self) -> bool:
        """Whether every record the groups held here handed out is done."""
        return all(
            self.done_positions(group) == group.consumer.cursors for group in self.groups.values()
        )

    def pump_group(self, group: SharedGroup) -> None:
        """Spread the group's records over members that can take them, round robin.

        Each record goes to exactly one member, at the minimum of its QoS and that member's
        subscription QoS [MQTT-3.8.4-8], never as retained (s4.8.2).
        """
        if self.frozen:
            return
        while group.orphans:
            key, offset = group.orphans[0]
            readable, rec = self._record(key, offset)
            if not readable:
                return  # woken when it is (the group watches its partitions)
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
                records = self.read(part, cursor)
                if records is None:
                    cursor = part.log.log_start_offset
                    continue
                if not records:
                    break  # nothing readable yet (a damaged range, a remote fetch): woken later
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
                        self.state.groups_dirty = True
                        return
                    self._group_send(group, *chosen, rec, key)
                    cursor = rec.offset + 1
            group.consumer.cursors[key] = cursor
            self.state.groups_dirty = True

    def _may_read(self, session: Session, topic: str) -> bool:
        """The ACL's read rule for ``topic`` (a deny inside an allowed filter applies)."""
        if self.state.acl is None:
            return True
        authz = self.state.authz.get(session.client_id)
        return authz is None or authz.can_read(topic)

    def _group_may_read(self, group: SharedGroup, topic: str) -> bool:
        """False only when the group has members and the ACL lets none of them read
        ``topic``: then the record is skipped. With no members the group keeps its
        position for the next one, as a consumer group does."""
        if self.state.acl is None or not group.members:
            return True
        remote = (m for ms in group.remote.values() for m in ms)
        if any(m.authz is None or m.authz.can_read(topic) for m in remote):
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
            peers = self.state.hooks.group_peers
            assert peers is not None
            member.outstanding.add((key, rec.offset))
            peers.deliver(member.worker, full, member.client_id, member.token, key, rec.offset, qos)
        else:
            self.deliver(member, rec, key, qos, ids, full, group=full)

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
            memberships = group.remote.get(group.members[idx])
            if memberships:
                remote = memberships[-1]
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
            if self.can_send(session, qos):
                group.next_member = idx + 1
                ids = [sub.identifier] if sub is not None and sub.identifier else []
                return session, qos, ids if session.version == 5 else []
        return None


def _find(memberships: list[RemoteMember], worker: int, token: int) -> RemoteMember | None:
    """The membership of ``worker`` that ``token`` names, if held."""
    return next((m for m in memberships if m.worker == worker and m.token == token), None)
