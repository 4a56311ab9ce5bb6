"""The cluster's metadata: stream definitions and desired placement, as a state machine.

This module is the state machine only (sans-IO, no thread, no socket); the replicated group
that feeds it committed commands, on pysyncobj, is ``broker.cluster.metadata_group``.

What it holds:

* **stream definitions**: per stream its topic filters, partitions, replication factor (the
  effective one: the stream's own, else ``[cluster] replication_factor``) and whether it is
  compacted, and the node whose config defined it first;
* **desired placement**: per Raft group (a stream partition), the node names that should hold
  it, as ``broker.cluster.placement`` computed them on the node that recorded it.

Invariants:

1. **Desired state only.** Each data group's membership is authoritative in its own Raft log
   (its CONFIG entries, ``broker.cluster.membership``); the metadata never adds or removes a
   replica by itself. So a stale metadata copy, or a metadata change lost with its journal,
   can never lose data: at worst a group is placed as it already is, or a definition is
   proposed again.
2. **First committed wins; only the replication factor changes after.**
   :meth:`MetadataState.define` records a stream only if it is absent; the same definition
   again is a no-op, another one is refused and answered with the committed definition.
   :meth:`MetadataState.set_replication` (``mqlog cluster set-replication``) is the one
   command that alters a definition, and only its ``replication_factor``
   (:data:`MUTABLE_KEYS`); definitions are never removed. So any prefix of the committed
   commands (a node's local copy, replayed from its journal before it hears a leader)
   already holds the final ``topic_filter``, ``partitions`` and ``compacted`` of every
   stream it names: a conflict there is a real one at once; one in ``replication_factor``
   is final only once the node caught up with a leader (the factor may have changed while
   it was down).
3. Applying a command is deterministic and depends only on the state and the command (the
   proposing node's name travels in the command), so every replica applies the same log to the
   same state.

Why only the replication factor: it says how many copies of a partition exist, which the
data groups change one replica at a time with no effect on what a reader sees
(``broker.cluster.reshape``'s learner, catch-up, promote, remove), as Kafka's partition
reassignment does. The others say what the stream *is*: ``partitions`` decides which
partition a topic's messages go to (``crc32(topic) % partitions``), so a new count sends a
topic's next messages to another partition than its earlier ones, and a subscriber reading
the stream in order (per partition) could see them before the earlier ones: the per-topic
order MQTT promises [MQTT-4.6.0-5] would break across the change (Kafka allows adding
partitions and warns that keyed order breaks; here it would break every session's replay);
``topic_filter`` decides which messages the stream takes, so changing it re-files no
history; ``compacted`` is not a key of a user stream in this release.

Why a command (``mqlog cluster set-replication STREAM N``) rather than a config rolled out:
a Kafka operator changes a topic's replicas with one cluster-wide admin operation
(``kafka-reassign-partitions``), and an EMQX operator changes cluster config at runtime from
one node (``emqx ctl conf``, the dashboard), neither restarting brokers; a rolled-out config
would also pass through a state where nodes disagree, each restarted one proposing its
value, with no rule for which is meant. The nodes' ``[[streams]]`` entries then say the old
factor: a node restarted with it refuses to start as for any conflict, its line naming the
command and the node it ran on, until its config says the new one (the cluster's state wins
over a node's file, as in Kafka).

Why a node whose config disagrees refuses to start (rather than serve the committed
definition and warn): a stream's partition count decides which partition a topic's messages
go to (``crc32(topic) % partitions``) and its filters decide which messages it takes, so two
definitions of one stream are two different streams sharing a name; serving the committed one
would leave the node's config file lying about what it runs. In Kafka a topic's definition is
cluster state that no broker's config can override, and a broker whose stored cluster id
disagrees with the cluster's refuses to start (``InconsistentClusterIdException``) rather than
serve; an operator expects the same here: the node stops with one line naming the stream, the
key, both values, its config file and the node whose definition was committed first. A stream
the cluster defines but this node's config lacks is only a warning (a config change rolled
out one node at a time passes through that state).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.config import Config

#: The keys of a definition, named as in a ``[[streams]]`` entry (``compacted`` has no key of
#: its own there: only the internal streams are compacted in this release).
DEFINITION_KEYS = ("topic_filter", "partitions", "replication_factor", "compacted")
#: The keys a committed definition may change (invariant 2), by ``mqlog cluster`` commands.
MUTABLE_KEYS = ("replication_factor",)


@dataclass(frozen=True, slots=True)
class StreamDefinition:
    """What every node must agree on about one stream."""

    name: str
    topic_filter: tuple[str, ...]
    partitions: int
    replication_factor: int
    compacted: bool = False

    def as_data(self) -> dict[str, Any]:
        """Plain data (what a command carries and the dump stores)."""
        return {
            "name": self.name,
            "topic_filter": list(self.topic_filter),
            "partitions": self.partitions,
            "replication_factor": self.replication_factor,
            "compacted": self.compacted,
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> StreamDefinition:
        return cls(
            name=str(data["name"]),
            topic_filter=tuple(data["topic_filter"]),
            partitions=int(data["partitions"]),
            replication_factor=int(data["replication_factor"]),
            compacted=bool(data["compacted"]),
        )

    def differences(self, other: StreamDefinition) -> list[tuple[str, Any, Any]]:
        """``(key, ours, theirs)`` for every key of :data:`DEFINITION_KEYS` that differs."""
        return [
            (key, _shown(getattr(self, key)), _shown(getattr(other, key)))
            for key in DEFINITION_KEYS
            if getattr(self, key) != getattr(other, key)
        ]


def _shown(value: Any) -> Any:
    """A value as the config file writes it (a list of filters, not a tuple)."""
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True, slots=True)
class LocalStreams:
    """This node's stream definitions and the config file they come from (named in errors)."""

    definitions: tuple[StreamDefinition, ...] = ()
    source: str = "<config>"

    @classmethod
    def of(cls, config: Config) -> LocalStreams:
        """The user streams of ``config`` (``default`` included, as the broker opens it);
        the internal ``$`` streams are the broker's own, identical on every node."""
        return cls(
            tuple(
                StreamDefinition(
                    name=spec.name,
                    topic_filter=spec.topic_filters,
                    partitions=spec.partitions,
                    replication_factor=config.replication_factor(spec),
                    compacted=spec.log.compacted,
                )
                for spec in config.stream_specs()
                if not spec.name.startswith("$")
            ),
            str(config.path) if config.path is not None else "<config>",
        )


@dataclass(frozen=True, slots=True)
class Conflict:
    """A stream this node's config defines otherwise than the committed definition."""

    stream: str
    key: str
    ours: Any
    theirs: Any
    node: str  # this node
    source: str  # this node's config file
    defined_by: str  # the node whose definition was committed
    changed_by: str | None = None  # the node whose command last changed this key, if any

    @property
    def final(self) -> bool:
        """Final in a node's local copy (invariant 2): a key that never changes."""
        return self.key not in MUTABLE_KEYS

    def __str__(self) -> str:
        since = (
            f", set by mqlog cluster set-replication on node {self.changed_by} since"
            if self.changed_by is not None
            else ""
        )
        return (
            f"{self.source}: streams[{self.stream}].{self.key} = {self.ours!r} on node "
            f"{self.node}, but the cluster's definition of stream {self.stream!r} (committed "
            f"first, from node {self.defined_by}'s config{since}) has "
            f"{self.key} = {self.theirs!r}"
        )


class MetadataState:
    """The replicated state (module docstring). Mutated only by applying committed
    commands, on the metadata group's thread; the caller serializes readers with it."""

    __slots__ = ("changed", "placement", "streams")

    def __init__(self) -> None:
        #: Stream name -> (its committed definition, the node whose config defined it).
        self.streams: dict[str, tuple[StreamDefinition, str]] = {}
        #: Stream name -> the node whose command last changed its replication factor.
        self.changed: dict[str, str] = {}
        #: Raft group id -> the node names that should hold it (placement order).
        self.placement: dict[int, tuple[str, ...]] = {}

    # -- commands (applied in log order on every replica) -------------------------------------

    def define(self, data: Mapping[str, Any], node: str) -> tuple[dict[str, Any], str]:
        """Record the stream ``data`` describes, as defined by ``node``, unless it is already
        defined (first committed wins, invariant 2); returns the committed definition and
        the node that defined it, for the proposer to compare with its own."""
        definition = StreamDefinition.from_data(data)
        committed, by = self.streams.setdefault(definition.name, (definition, node))
        return committed.as_data(), by

    def set_replication(
        self, stream: str, factor: int, node: str
    ) -> tuple[dict[str, Any], str] | None:
        """Set ``stream``'s replication factor, as ``node`` asked (invariant 2); the
        committed definition after and the node that defined it, or None if the stream is
        not defined or ``factor`` is below 1 (checked by the proposer too)."""
        committed = self.streams.get(stream)
        if committed is None or factor < 1:
            return None
        definition, by = committed
        if definition.replication_factor != factor:
            self.streams[stream] = (replace(definition, replication_factor=factor), by)
            self.changed[stream] = node
        return self.streams[stream][0].as_data(), by

    def place(self, groups: Mapping[int, Iterable[str]]) -> int:
        """Record each group's desired replicas unless it already has some; returns how many
        groups were new."""
        new = 0
        for group, nodes in groups.items():
            if int(group) not in self.placement:
                self.placement[int(group)] = tuple(nodes)
                new += 1
        return new

    # -- queries -------------------------------------------------------------------------------

    def conflicts(self, local: LocalStreams, node: str) -> list[Conflict]:
        """Every key where ``local`` (node ``node``'s config) disagrees with a committed
        definition."""
        found = []
        for ours in local.definitions:
            committed = self.streams.get(ours.name)
            if committed is None:
                continue
            theirs, by = committed
            for key, a, b in ours.differences(theirs):
                changed = self.changed.get(ours.name) if key in MUTABLE_KEYS else None
                found.append(Conflict(ours.name, key, a, b, node, local.source, by, changed))
        return found

    def absent(self, local: LocalStreams) -> list[StreamDefinition]:
        """``local``'s streams not defined yet (to propose)."""
        return [d for d in local.definitions if d.name not in self.streams]

    def unknown_to(self, local: LocalStreams) -> list[tuple[str, str]]:
        """``(stream, defined by)`` for every committed stream ``local`` does not define."""
        names = {d.name for d in local.definitions}
        return sorted((s, by) for s, (_, by) in self.streams.items() if s not in names)

    # -- the dump (pysyncobj's full dump file) ----------------------------------------------

    def to_data(self) -> dict[str, Any]:
        """Plain data only (no class of ours is pickled into the dump)."""
        return {
            "streams": {n: [d.as_data(), by] for n, (d, by) in self.streams.items()},
            "placement": {g: list(nodes) for g, nodes in self.placement.items()},
            "changed": dict(self.changed),
        }

    def load(self, data: Mapping[str, Any]) -> None:
        """Replace the state with a dump's (:meth:`to_data`)."""
        self.streams = {
            n: (StreamDefinition.from_data(d), str(by)) for n, (d, by) in data["streams"].items()
        }
        self.placement = {int(g): tuple(nodes) for g, nodes in data["placement"].items()}
        self.changed = {str(n): str(by) for n, by in data.get("changed", {}).items()}
