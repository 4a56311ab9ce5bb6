"""The router's shared state: one object every router component reads and writes.

The router (:class:`broker.router.router.Router`) is a front door over components, one per
responsibility (group commit, session lifecycle, publish ingest, QoS flows, subscriptions,
shared groups, delivery, session store), the way rumqttd keeps its router's concerns in
separate files. They share exactly this object: what one component changes, the others see,
and nothing else is shared between them.

Invariants:

- the dictionaries and sets here are created once and never replaced (components keep
  references to them on their hot paths; clear or mutate them, never reassign);
- ``partitions[k]`` is made on first use by :meth:`RouterState.partition` and kept;
- ``dirty`` holds the partitions with records gathered for the next group commit
  (broker.router.commit).

Called only from the owning event loop's thread.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

from broker.auth.acl import Acl, Authorizer
from broker.commitlog import Record, Streams
from broker.commitlog.keys import PartitionKey
from broker.commitlog.streams import RETAINED_STREAM, SESSIONS_STREAM
from broker.config import RouterConfig
from broker.mqtt.topics import filters_overlap, is_wildcard
from broker.router.hooks import WorkerHooks
from broker.router.partition import Partition, PartitionBase
from broker.router.session import EXPIRY_NEVER, Session, SharedGroup

#: The compacted stream of retained messages: one record per topic, the latest wins.
RETAINED: PartitionKey = (RETAINED_STREAM, 0)
#: The compacted stream of session and shared-group state: one record per client id or
#: ``$share/...`` filter, the latest wins; an empty payload deletes.
SESSIONS: PartitionKey = (SESSIONS_STREAM, 0)
#: Seconds the timer waits at least before it looks at an offline session again, and at
#: most (its expiry is reckoned on the wall clock, which may jump).
MIN_WAIT = 0.5
MAX_WAIT = 3600.0


class RouterState:
    """Sessions, groups, partitions, retained messages, clocks, configuration and counters
    of one worker's router. See the module docstring."""

    def __init__(
        self,
        streams: Streams,
        config: RouterConfig,
        *,
        schedule: Callable[[Callable[[], None]], Any],
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        partition_factory: Callable[[PartitionKey], PartitionBase] | None,
        hooks: WorkerHooks,
        acl: Acl | None,
        on_sync_append: Callable[[float], None] | None,
    ) -> None:
        self.streams = streams
        self.config = config
        #: Runs a callable at the end of this event-loop iteration (the group commit).
        self.schedule = schedule
        #: Wall clock (seconds): timestamps, session expiry.
        self.clock = clock
        #: Monotonic clock (seconds): will delays.
        self.monotonic = monotonic
        #: The other workers (broker.router.hooks.SingleWorker when alone).
        self.hooks = hooks
        #: The ACL ([auth] acl_file); None allows everything.
        self.acl = acl
        #: Called with the seconds an fsync=always append (write + fdatasync) took.
        self.on_sync_append = on_sync_append
        self._make_partition = partition_factory

        self.sessions: dict[str, Session] = {}
        #: Shared groups held by this worker, by full ``$share/<name>/<filter>``.
        self.groups: dict[str, SharedGroup] = {}
        self.partitions: dict[PartitionKey, PartitionBase] = {}
        #: Topic -> its record in ``$retained`` (with its offset).
        self.retained: dict[str, Record] = {}
        #: Partitions with records gathered for the next group commit.
        self.dirty: dict[PartitionKey, PartitionBase] = {}
        #: A shared group's position moved since the groups were last persisted.
        self.groups_dirty = False
        #: The sessions the timer writes at its next pass (broker.router.lifecycle's
        #: ``tick``): the ones made dirty since its last, by ``id()`` (an ended session made
        #: dirty late never stands for its successor). A pass costs what they are, not
        #: every session (a fleet's connected, clean sessions are never in it).
        self.timed: dict[int, Session] = {}
        #: Offline sessions by when the timer looks at them next (monotonic), a heap of
        #: (when, order, client id): their wills and expiry (:meth:`wait_offline`). An
        #: entry whose session ended, moved or came back is dropped when it comes up.
        self.offline_due: list[tuple[float, int, str]] = []
        self._due_order = itertools.count()
        #: Per client id: its resolved ACL, from CONNECT until its session ends.
        self.authz: dict[str, Authorizer] = {}
        #: Per client id: the user name it logged in with (a shared group held by another
        #: worker applies that user's ACL rules to it).
        self.usernames: dict[str, str | None] = {}

        # Counters (read by broker.metrics).
        self.connections = 0  # connected clients of this worker
        self.dropped = 0  # QoS 0 records skipped by the slow-subscriber policy
        self.acl_denied = 0  # PUBLISHes dropped and subscriptions refused by the ACL
        self.log_appends = 0  # batches appended (one write each)
        self.records_appended = 0
        #: Subscriptions over the sessions held here, as last counted (:meth:`count`).
        self.subscriptions = 0

    def partition(self, key: PartitionKey) -> PartitionBase:
        """The partition ``key``, made on first use: this worker's own, or (several
        workers) what the partition factory makes (owned, or reached through its owner)."""
        part = self.partitions.get(key)
        if part is None:
            if self._make_partition is not None:
                part = self._make_partition(key)
            else:
                part = Partition(key, self.streams.log(*key))
            self.partitions[key] = part
        return part

    def mark_dirty(self, session: Session) -> None:
        """``session``'s persisted state changed: the timer writes it at its next pass
        (if it is persistent). The per-message paths call this only for a persistent
        session not dirty yet (``if session.persistent and not session.dirty``): once per
        session and pass, and two attribute reads otherwise."""
        session.dirty = True
        self.timed[id(session)] = session

    def changed(self, session: Session) -> None:
        """:meth:`mark_dirty` if ``session`` is persistent and not marked yet."""
        if session.persistent and not session.dirty:
            self.mark_dirty(session)

    def count(self, session: Session) -> None:
        """``session`` is held here and its subscriptions may have changed: count them
        again (``subscriptions`` stays the sum over the sessions held: one that leaves
        takes away what it added, :meth:`uncount`)."""
        n = session.subscription_count()
        self.subscriptions += n - session._counted
        session._counted = n

    def uncount(self, session: Session) -> None:
        """``session`` leaves this router."""
        self.subscriptions -= session._counted
        session._counted = 0

    def wait_offline(self, session: Session, not_before: float = 0.0) -> None:
        """``session`` is offline: the timer looks at it when its will is due or when it
        expires, and hourly at least (:data:`MAX_WAIT`), not before ``not_before``."""
        mono = self.monotonic()
        at = mono + MAX_WAIT
        if session.will_due is not None:
            at = min(at, session.will_due)
        if session.expiry_interval != EXPIRY_NEVER and session.disconnected_at is not None:
            left = session.disconnected_at + session.expiry_interval - self.clock()
            at = min(at, mono + left)
        elif session.will_due is None:
            return  # nothing to wait for
        at = max(at, not_before)
        if session._due is not None and session._due <= at:
            return  # it is looked at sooner already
        session._due = at
        heapq.heappush(self.offline_due, (at, next(self._due_order), session.client_id))

    def now_ms(self) -> int:
        """The wall clock in milliseconds (record timestamps)."""
        return int(self.clock() * 1000)

    def keys_for_filter(self, plain: str) -> list[PartitionKey]:
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
