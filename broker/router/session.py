"""Session state owned by the router: subscriptions, log positions, in-flight deliveries.

A subscriber is a set of positions in the log, not a queue: nothing is copied per subscriber.
Three kinds of :class:`Consumer` hold positions (one cursor per partition):

- a session's *main* consumer serves all its ordinary subscriptions, so overlapping
  subscriptions see each record once and get it at the highest matching QoS [MQTT-3.3.4-2];
- each ``$replay/<from>/<filter>`` subscription is a consumer of its own, starting where asked;
- each shared subscription group ``$share/<group>/<filter>`` is one consumer whose records are
  spread over the group's member sessions (like a Kafka consumer group).

All of it is plain data, touched only by the owning router's event loop thread.
"""

from __future__ import annotations

import base64
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from broker.commitlog.keys import PartitionKey
from broker.mqtt.packets import Will
from broker.mqtt.properties import decode_properties, encode_properties

#: A session expiry interval that never ends (s3.1.2.11.2; 3.1.1's persistent sessions).
EXPIRY_NEVER = 0xFFFFFFFF

if TYPE_CHECKING:
    from broker.auth.acl import Authorizer
    from broker.router.link import Link

__all__ = [
    "MAIN",
    "NO_ENTRIES",
    "Consumer",
    "Inflight",
    "InflightRun",
    "Match",
    "PartitionKey",
    "RemoteMember",
    "Session",
    "SharedGroup",
    "Subscription",
    "new_inflight",
]

#: Main-consumer name; replay consumers are named by their full ``$replay/...`` filter.
MAIN = ""


@dataclass(slots=True)
class Subscription:
    """One subscription of a session (s3.8.3.1 options), without ``$share``/``$replay``."""

    topic_filter: str
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    identifier: int | None = None


@dataclass(slots=True)
class Consumer:
    """Positions in partitions plus the filters that select records there.

    Invariant: ``cursors[k]`` is the next offset of partition ``k`` not yet examined; records
    below it were delivered (or put in flight) or did not match.
    """

    name: str
    subscriptions: dict[str, Subscription] = field(default_factory=dict)
    cursors: dict[PartitionKey, int] = field(default_factory=dict)
    #: For replay consumers: add mqlog-partition / mqlog-offset user properties (5.0).
    annotate: bool = False
    #: ``$replay/<from>;merge/...``: the partitions' records in timestamp order
    #: (:meth:`broker.router.delivery.Delivery.pump_merged`), not partition by partition.
    merge: bool = False
    #: Shared group name (None for main and replay consumers).
    group: str | None = None
    #: Cache: topic -> how the consumer's subscriptions match it, None when none does.
    match_cache: dict[str, Match | None] = field(default_factory=dict)


#: How a consumer's subscriptions match one topic, ``(qos, identifiers, no_local,
#: retain_as_published)``: overlapping subscriptions deliver once at the highest QoS, with
#: every matching subscription identifier [MQTT-3.3.4-2], [MQTT-3.3.4-3]; ``no_local`` when
#: every matching subscription has it [MQTT-3.8.3-3], ``retain_as_published`` when one has
#: (s3.8.3.1). Cached per topic (:attr:`Consumer.match_cache`). A plain tuple, unpacked by
#: name where it is read: it is unpacked for every record delivered one by one, and CPython
#: unpacks a ``NamedTuple`` on its generic path (~430 more instructions each, measured).
Match = tuple[int, list[int], bool, bool]


class Inflight(NamedTuple):
    """A QoS 1/2 delivery to a client, awaiting PUBACK (QoS 1) or PUBREC/PUBCOMP (QoS 2).

    The record stays in the log and is re-read from there for redelivery [MQTT-4.4.0-1].
    A tuple, not a class: a QoS 1 replay puts one in flight per message, and a slotted
    dataclass built per message was ~30% of the router's time there. The per-message path
    builds it with :data:`new_inflight` (no Python call); a run's deliveries share one
    :class:`InflightRun`. Named, it still costs ~1,000 instructions more per delivery sent
    one by one than a plain tuple did (made and freed without the tuple free list; valgrind,
    a caught-up QoS 1 subscriber).
    """

    key: PartitionKey
    offset: int
    #: The QoS it went out at.
    qos: int
    retain: bool
    #: PUBREC came and PUBREL was sent (s4.3.3).
    released: bool
    #: The shared group it was taken from, or None.
    group: str | None
    #: The consumer's name (:data:`MAIN`, or a ``$replay/...`` filter).
    consumer: str


#: ``new_inflight(Inflight, (key, offset, qos, retain, released, group, consumer))``: an
#: :class:`Inflight` without the NamedTuple constructor's Python call (per message).
new_inflight = tuple.__new__


class InflightRun:
    """The in-flight entries of one run of QoS 1 deliveries (``Delivery.send_run``), sent
    under the consecutive packet ids ``first, first + 1, ...``: one object that each of those
    ids maps to in :attr:`Session.inflight`, read as an :data:`Inflight` by :meth:`entry`
    (QoS 1, not released, of no shared group). A window of 1,000 replayed deliveries built
    and checked 1,000 tuples, ~20% of the broker's time on a QoS 1 replay."""

    __slots__ = ("consumer", "first", "key", "offsets", "retains")

    def __init__(
        self,
        key: PartitionKey,
        first: int,
        offsets: Sequence[int],
        retains: Sequence[bool] | None,
        consumer: str,
    ) -> None:
        self.key = key
        self.first = first
        self.offsets = offsets
        self.retains = retains  # None: none of them retained
        self.consumer = consumer

    def entry(self, packet_id: int) -> Inflight:
        i = packet_id - self.first
        retain = self.retains[i] if self.retains is not None else False
        return new_inflight(
            Inflight, (self.key, self.offsets[i], 1, retain, False, None, self.consumer)
        )


@dataclass(slots=True)
class SharedGroup:
    """``$share/<name>/<filter>`` subscribers: one consumer, records spread over members."""

    name: str
    topic_filter: str
    consumer: Consumer
    members: list[str] = field(default_factory=list)  # client ids, round-robin order
    next_member: int = 0
    #: Deliveries taken back from members that left before acknowledging them.
    orphans: deque[tuple[PartitionKey, int]] = field(default_factory=deque)
    #: Members whose session is on another worker (several workers), by client id: its
    #: memberships (:attr:`RemoteMember.token`), the latest joined last, the one records go
    #: to. A session moved to another worker (or node) may join from there before its leave
    #: from the one it left arrives: each of the two ends with its own leave
    #: (broker.router.shared).
    remote: dict[str, list[RemoteMember]] = field(default_factory=dict)
    #: Whether its starting positions are in ``$sessions``: a new group's first member gets
    #: its SUBACK only then, so that a cluster's next home starts it no later (s4.8.2).
    stored: bool = True
    #: Members waiting for that: (their worker, None here; client id).
    waiting: list[tuple[int | None, str]] = field(default_factory=list)


@dataclass(slots=True)
class RemoteMember:
    """A member of a shared group held here whose session lives on another worker: one
    membership, named by its worker and its token (:attr:`Session.group_token`)."""

    client_id: str
    worker: int
    token: int
    qos: int
    identifier: int | None
    version: int
    #: Records it may have outstanding (its receive quota when it joined).
    window: int
    #: Its ACL read rules (None: no ACL file).
    authz: Authorizer | None = None
    #: Records sent to it and not reported done: they go back to the group if its worker dies.
    outstanding: set[tuple[PartitionKey, int]] = field(default_factory=set)


class _NoEntries(dict[Any, Any]):
    """The empty table an idle session shares (:data:`NO_ENTRIES`) until it holds an entry:
    a publisher's session never does, and three empty dicts were 192 of its bytes.

    Reads work as on any empty dict; an insert raises, so a write path that did not make
    the table the session's own first (``Session.own_*``) fails loudly instead of filling
    a table every session shares.
    """

    __slots__ = ()

    def _shared(self, *_: object, **__: object) -> None:
        raise TypeError("NO_ENTRIES is shared: take the session's own table (Session.own_*)")

    __setitem__ = update = setdefault = __ior__ = _shared  # type: ignore[assignment]


#: The one empty ``consumers`` / ``shared`` / ``inflight`` of every session that has none.
NO_ENTRIES: dict[Any, Any] = _NoEntries()


def _no_entries() -> dict[Any, Any]:
    return NO_ENTRIES


@dataclass(slots=True)
class Session:
    """Everything the broker keeps for one client id, online or not."""

    client_id: str
    version: int = 4
    persistent: bool = False
    expiry_interval: int = 0  # seconds after disconnect; 0xFFFFFFFF never expires
    #: Consumers by name. This and the next two tables are :data:`NO_ENTRIES` until their
    #: first entry, put through :meth:`own_consumers` / :meth:`own_shared` /
    #: :meth:`own_inflight` (reads, deletes and pops of present keys go to them directly).
    consumers: dict[str, Consumer] = field(default_factory=_no_entries)
    #: Shared-subscription keys this session is a member of -> its subscription options.
    shared: dict[str, Subscription] = field(default_factory=_no_entries)
    #: Packet id -> its delivery: an :data:`Inflight`, or the :class:`InflightRun` it was
    #: sent in (read through :meth:`inflight_entry` / :meth:`inflight_entries`).
    inflight: dict[int, Inflight | InflightRun] = field(default_factory=_no_entries)
    #: QoS 2 packet ids received and PUBREC'd, awaiting PUBREL (duplicate detection, s4.3.3).
    #: None until the first (an empty set is 216 bytes: most sessions never use QoS 2).
    incoming_qos2: set[int] | None = None
    #: Of those, the ones whose record is not appended yet (PUBREC still to come), with the
    #: number of resends received meanwhile: each PUBLISH gets its own PUBREC [MQTT-4.3.3-9].
    #: None until the first, as ``incoming_qos2``.
    pending_qos2: dict[int, int] | None = None
    #: Retained messages due on subscribe, not yet sent: (record offset in $retained, qos,
    #: subscription ids). None until there is one (an empty deque takes 760 bytes: two
    #: of them were a third of an idle connection's memory).
    pending_retained: deque[tuple[int, int, list[int]]] | None = None
    #: Records of shared groups held by another worker, sent here for this session and not
    #: delivered yet (its quota was full): (group, partition, offset, qos). None until
    #: there is one.
    group_queue: deque[tuple[str, PartitionKey, int, int]] | None = None
    #: Packet ids of in-flight deliveries not resent on this connection yet: their records
    #: are not readable here yet (a cluster's replica behind the commit, a remote
    #: partition's cache), resent once they are (broker.router.qos). None until there is one.
    resend_due: list[int] | None = None
    will: Will | None = None
    will_due: float | None = None  # monotonic seconds at which to publish the will
    link: Link | None = None
    disconnected_at: float | None = None  # wall seconds, for expiry
    receive_maximum: int = 65535  # the client's (s3.1.2.11.3), bounds our QoS>0 sends
    request_problem_information: bool = True
    #: The user that made the session (None: anonymous): only it may take the client id
    #: over (broker.router.lifecycle). ``owner_known`` is False for a session persisted
    #: before owners were kept; its next login becomes the owner.
    owner: str | None = None
    owner_known: bool = True
    next_packet_id: int = 1
    #: Persisted state changed since last written: set through ``RouterState.mark_dirty``
    #: (the timer writes what it marked), cleared when written.
    dirty: bool = False
    #: Offline: when the timer looks at it next (monotonic; its entry in
    #: ``RouterState.offline_due``), None if it has no entry there.
    _due: float | None = field(default=None, repr=False, compare=False)
    #: Its subscriptions as last added to its router's count (``RouterState.count``).
    _counted: int = field(default=0, repr=False, compare=False)
    #: Its state is in ``$sessions``: its end writes a tombstone (broker.router.lifecycle).
    stored: bool = False
    #: A consumer stopped at the send quota: the next PUBACK pumps (Delivery.pump_acked).
    waiting: bool = False
    #: Names its memberships of shared groups held on other workers, with its worker: set
    #: at its first join here (0: none yet), never persisted, so the same session object
    #: joining again is the same membership and a session moved here a new one
    #: (broker.router.shared).
    group_token: int = 0

    @property
    def main(self) -> Consumer:
        consumer = self.consumers.get(MAIN)
        if consumer is None:
            consumer = self.own_consumers()[MAIN] = Consumer(MAIN)
        return consumer

    def subscription_count(self) -> int:
        """Its subscriptions: each consumer's filters and its shared memberships."""
        return sum(len(c.subscriptions) for c in self.consumers.values()) + len(self.shared)

    def own_consumers(self) -> dict[str, Consumer]:
        """``consumers``, to put an entry in (made on the first)."""
        if self.consumers is NO_ENTRIES:
            self.consumers = {}
        return self.consumers

    def own_shared(self) -> dict[str, Subscription]:
        """``shared``, to put an entry in (made on the first)."""
        if self.shared is NO_ENTRIES:
            self.shared = {}
        return self.shared

    def own_inflight(self) -> dict[int, Inflight | InflightRun]:
        """``inflight``, to put an entry in (made on the first)."""
        if self.inflight is NO_ENTRIES:
            self.inflight = {}
        return self.inflight

    def inflight_entry(self, packet_id: int) -> Inflight | None:
        entry = self.inflight.get(packet_id)
        if isinstance(entry, InflightRun):
            return entry.entry(packet_id)
        return entry

    def inflight_entries(self) -> list[tuple[int, Inflight]]:
        """Every in-flight delivery in the order it was sent (a copy: callers delete)."""
        return [
            (pid, e.entry(pid) if isinstance(e, InflightRun) else e)
            for pid, e in self.inflight.items()
        ]

    def allocate_packet_id(self) -> int:
        """A packet id not in use by an in-flight delivery [MQTT-2.2.1-3]."""
        pid = self.next_packet_id
        inflight = self.inflight
        while pid in inflight:
            pid = pid + 1 if pid < 65535 else 1
        self.next_packet_id = pid + 1 if pid < 65535 else 1
        return pid

    def to_state(self, monotonic_now: float = 0.0) -> dict[str, Any]:
        """The persisted form, written to the ``$sessions`` stream (JSON).

        The will is kept too, so a restart or crash does not lose it (s3.1.2.5: the server
        may defer it to the next start); ``will_left`` is the delay still to run, in seconds,
        or None while the client is connected.
        """
        will = self.will
        return {
            "will": None if will is None else will_state(will),
            "will_left": None if self.will_due is None else max(0.0, self.will_due - monotonic_now),
            "v": 1,
            "version": self.version,
            **({"owner": self.owner} if self.owner_known else {}),
            "expiry": self.expiry_interval,
            "disconnected_at": self.disconnected_at,
            "consumers": {
                name: {
                    "subs": [_sub_state(s) for s in c.subscriptions.values()],
                    "cursors": [[k[0], k[1], off] for k, off in c.cursors.items()],
                    "annotate": c.annotate,
                    **({"merge": True} if c.merge else {}),
                }
                for name, c in self.consumers.items()
            },
            "shared": {key: _sub_state(s) for key, s in self.shared.items()},
            "inflight": [
                [pid, key[0], key[1], offset, qos, retain, released, group, consumer]
                for pid, (
                    key,
                    offset,
                    qos,
                    retain,
                    released,
                    group,
                    consumer,
                ) in self.inflight_entries()
            ],
            "incoming_qos2": sorted(self.incoming_qos2 or ()),
            "next_packet_id": self.next_packet_id,
        }

    @classmethod
    def from_state(cls, client_id: str, state: dict[str, Any]) -> Session:
        s = cls(
            client_id=client_id,
            version=state["version"],
            persistent=True,
            stored=True,
            expiry_interval=state["expiry"],
            disconnected_at=state.get("disconnected_at"),
            owner=state.get("owner"),
            owner_known="owner" in state,
        )
        for name, c in state["consumers"].items():
            consumer = Consumer(
                name, annotate=c.get("annotate", False), merge=c.get("merge", False)
            )
            for sub in c["subs"]:
                consumer.subscriptions[sub["filter"]] = _sub_from_state(sub)
            for stream, part, off in c["cursors"]:
                consumer.cursors[(stream, part)] = off
            s.own_consumers()[name] = consumer
        for key, sub in state.get("shared", {}).items():
            s.own_shared()[key] = _sub_from_state(sub)
        for pid, stream, part, off, qos, retain, released, group, consumer_name in state[
            "inflight"
        ]:
            s.own_inflight()[pid] = Inflight(
                (stream, part), off, qos, retain, released, group, consumer_name
            )
        s.incoming_qos2 = set(state.get("incoming_qos2", ())) or None
        s.next_packet_id = state.get("next_packet_id", 1)
        will = state.get("will")
        if will is not None:
            s.will = will_of(will)
        return s


def will_state(will: Will) -> list[Any]:
    """A will's persisted form (JSON: a session's state, a cluster's will record)."""
    props = base64.b64encode(encode_properties(will.properties)).decode()
    return [will.topic, base64.b64encode(will.payload).decode(), will.qos, will.retain, props]


def will_of(state: list[Any]) -> Will:
    """The will :func:`will_state` wrote."""
    topic, payload, qos, retain, props = state
    return Will(
        topic, base64.b64decode(payload), qos, retain, decode_properties(base64.b64decode(props))
    )


def _sub_state(s: Subscription) -> dict[str, Any]:
    return {
        "filter": s.topic_filter,
        "qos": s.qos,
        "nl": s.no_local,
        "rap": s.retain_as_published,
        "rh": s.retain_handling,
        "id": s.identifier,
    }


def _sub_from_state(d: dict[str, Any]) -> Subscription:
    return Subscription(d["filter"], d["qos"], d["nl"], d["rap"], d["rh"], d["id"])
