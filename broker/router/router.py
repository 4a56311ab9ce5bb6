"""The router: sessions, subscriptions, offsets and QoS flows over the partition logs.

Connections are stateless (the rumqttd design): they hand the router validated packets and
the router answers through their :class:`~broker.router.link.Link`. The router is synchronous
logic with an injected clock; I/O lives at the edges (the transport writes bytes, the log
writes files).

Data path, per event-loop iteration:

1. ``publish`` turns each PUBLISH into a :class:`Record` gathered by its partition
   (broker.router.ingest);
2. ``flush`` (scheduled once per iteration) appends each partition's batch with one write,
   then acknowledges publishers (PUBACK / PUBREC only after the append [MQTT-4.3.2-2]) and
   wakes the consumers reading that partition (broker.router.commit);
3. a consumer reads from its cursor: from memory when caught up, from the log when behind,
   and stops when its client has no send quota or its output buffer is full, to resume when
   the client acknowledges or the buffer drains (broker.router.delivery).

:class:`Router` is the front door over one component per responsibility, all sharing one
:class:`~broker.router.state.RouterState`:

===========================  ===================================================
broker.router.commit         group commit, acknowledgements after the append
broker.router.lifecycle      CONNECT, takeover, DISCONNECT, wills, expiry, timers
broker.router.ingest         PUBLISH into the partitions, the ACL's write rule
broker.router.qos            PUBACK / PUBREC / PUBREL / PUBCOMP, resends on resume
broker.router.subscriptions  SUBSCRIBE / UNSUBSCRIBE, replay starts, retained due
broker.router.shared         shared groups, here and across workers
broker.router.delivery       pump, run-send and deliver (the per-message path)
broker.router.store          $sessions / $retained: persist, load, hand over
===========================  ===================================================

Its public methods are the components' own, bound in :meth:`Router.__init__`: a call to the
router costs what a call to the component does. What differs with several workers is passed
in as :class:`~broker.router.hooks.WorkerHooks`; every partition's state is reached through
:meth:`~broker.router.state.RouterState.partition` (the partition factory decides).

Called only from the owning event loop's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from broker.auth.acl import Acl
from broker.commitlog import Streams
from broker.commitlog.keys import PartitionKey
from broker.config import RouterConfig
from broker.router.commit import GroupCommit
from broker.router.delivery import Delivery
from broker.router.hooks import SingleWorker, WorkerHooks
from broker.router.ingest import Ingest
from broker.router.lifecycle import TOPIC_ALIAS_MAXIMUM, Lifecycle
from broker.router.partition import PartitionBase
from broker.router.qos import QosFlows
from broker.router.session import EXPIRY_NEVER
from broker.router.shared import SharedGroups
from broker.router.state import RouterState
from broker.router.store import SessionStore
from broker.router.subscriptions import Subscriptions

__all__ = ["EXPIRY_NEVER", "TOPIC_ALIAS_MAXIMUM", "PartitionKey", "Router"]


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
        hooks: WorkerHooks | None = None,
        acl: Acl | None = None,
        on_sync_append: Callable[[float], None] | None = None,
        load: bool = True,
    ) -> None:
        """``schedule`` runs a callable at the end of this event-loop iteration;
        ``partition_factory`` makes the partition objects (one worker of several: owned
        or remote ones); ``hooks``: the other workers (default: none, :class:`SingleWorker`);
        ``acl``: the ACL file's rules (None allows everything); ``on_sync_append`` is
        called with the seconds an fsync=always append took; ``load=False`` defers
        :meth:`load` (a worker first learns where its peers' sessions are)."""
        state = self.state = RouterState(
            streams,
            config,
            schedule=schedule,
            clock=clock,
            monotonic=monotonic,
            partition_factory=partition_factory,
            hooks=hooks if hooks is not None else SingleWorker(),
            acl=acl,
            on_sync_append=on_sync_append,
        )
        commit = GroupCommit(state)
        store = SessionStore(state, commit)
        delivery = Delivery(state, commit)
        shared = SharedGroups(state, delivery)
        qos = QosFlows(state, commit, store, delivery, shared)
        ingest = Ingest(state, commit)
        subscriptions = Subscriptions(state, store, shared, delivery)
        lifecycle = Lifecycle(state, commit, store, ingest, shared, delivery, qos)
        # The calls that go the other way round.
        commit.wake = delivery.wake
        commit.apply_retained = store.apply_retained
        commit.persist = store.persist
        delivery.pump_group = shared.pump_group
        delivery.send_group_queue = shared.send_group_queue
        delivery.resend_when_readable = qos.resend_when_readable
        delivery.group_done = shared.group_done
        delivery.connection_lost = lifecycle.connection_lost
        store.connection_lost = lifecycle.connection_lost
        store.done_positions = shared.done_positions
        store.stored_ack = shared.stored_ack
        shared.restore_group = store.restore_group
        shared.persist_group = store.persist_group

        # What the edges read (the same objects as the state's, never replaced).
        self.streams = streams
        self.config = config
        self.clock = clock  # the transport stamps device publishes with it
        self.monotonic = monotonic
        self.sessions = state.sessions
        self.groups = state.groups
        self.partitions = state.partitions
        #: The compiled device path (broker.net._devicelane) gathers into partitions itself.
        self.dirty = state.dirty
        self.retained = state.retained

        # The front door: each component's methods, bound (no call added per message).
        # Partitions and the group commit.
        self.partition = state.partition
        #: A session's persisted state changed: written at the timer's next pass.
        self.mark_dirty = state.mark_dirty
        self.flush = commit.flush
        self.flush_soon = commit.flush_soon
        self.append_forwarded = commit.append_forwarded
        self.append_forwarded_batch = commit.append_forwarded_batch
        #: Committed ``$retained`` records to the retained index (a replicated ``$retained``
        #: applies what each commit brings, on every node).
        self.apply_retained = store.apply_retained
        self.wake = delivery.wake
        # Connections and sessions.
        self.connect = lifecycle.connect
        self.disconnect = lifecycle.disconnect
        self.connection_lost = lifecycle.connection_lost
        self.tick = lifecycle.tick
        self.release_link = lifecycle.release_link
        self.attach_handed = lifecycle.attach_handed
        self.send_will = lifecycle.send_will
        # Publishing.
        self.publish = ingest.publish
        self.publish_run = ingest.publish_run
        self.plain_route = ingest.plain_route
        self.publish_plain = ingest.publish_plain
        self.publish_broker = ingest.publish_broker
        # Acknowledgements.
        self.puback = qos.puback
        self.puback_run = qos.puback_run
        self.pubrec = qos.pubrec
        self.pubrel = qos.pubrel
        self.pubcomp = qos.pubcomp
        # Subscriptions and delivery.
        self.subscribe = subscriptions.subscribe
        self.unsubscribe = subscriptions.unsubscribe
        self.pump_session = delivery.pump_session
        self.pump_acked = delivery.pump_acked
        # Shared groups across workers.
        self.remote_join = shared.remote_join
        self.remote_leave = shared.remote_leave
        self.remote_done = shared.remote_done
        self.remote_deliver = shared.remote_deliver
        self.worker_left = shared.worker_left
        self.rejoin_groups = shared.rejoin_groups
        self.rehome_groups = shared.rehome
        self.group_joined = shared.group_joined
        self.freeze_groups = shared.freeze
        self.groups_drained = shared.drained
        self.store_groups = store.store_groups
        # Persistence.
        self.load = store.load
        self.close = store.close
        self.apply_retained = store.apply_retained
        self.restore_sessions = store.restore_sessions
        self.adopt = store.adopt
        self.hand_over = store.hand_over
        self.after_written = store.after_written
        if load:
            self.load()

    @property
    def acl(self) -> Acl | None:
        """The ACL ([auth] acl_file); None allows everything."""
        return self.state.acl

    @acl.setter
    def acl(self, acl: Acl | None) -> None:
        self.state.acl = acl

    # Counters, for broker.metrics.

    @property
    def connections(self) -> int:
        """Clients connected to this worker."""
        return self.state.connections

    @property
    def subscriptions(self) -> int:
        """Subscriptions over the sessions held here (shared memberships included)."""
        return self.state.subscriptions

    @property
    def dropped(self) -> int:
        """QoS 0 records skipped by the slow-subscriber policy."""
        return self.state.dropped

    @property
    def acl_denied(self) -> int:
        """PUBLISHes dropped and subscriptions refused by the ACL."""
        return self.state.acl_denied

    @property
    def log_appends(self) -> int:
        """Batches appended (one write each)."""
        return self.state.log_appends

    @property
    def records_appended(self) -> int:
        return self.state.records_appended
