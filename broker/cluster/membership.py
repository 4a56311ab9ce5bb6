"""A group's configuration (who votes, who only replicates) and its history in the log.

Single-server changes (Raft thesis s4.1): a configuration differs from the one before it by one
server, so any majority of the old and any majority of the new overlap, and no two leaders can be
elected by disjoint majorities. A configuration travels in an ``EntryKind.CONFIG`` entry and a
server uses the LATEST one in its log, committed or not (thesis s4.1); if that entry is truncated
the server falls back to the one before. Learners (etcd-io/raft) receive entries but never vote,
campaign, count towards commit or keep a leader in office under CheckQuorum; a new server joins
as a learner and is promoted to voter once caught up (thesis s4.2.1).

The payload of a CONFIG entry (``Configuration.encode``), all integers big-endian unsigned:
``version:u8 (=1) | voters:u16 | learners:u16 | voter ids:u32... | learner ids:u32...``, each id
list ascending. ``decode`` refuses anything else with a ``ValueError`` naming what is wrong.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

ENCODING_VERSION = 1
_HEAD = struct.Struct(">BHH")


class ChangeKind(enum.Enum):
    ADD_LEARNER = "add-learner"
    PROMOTE = "promote"
    REMOVE = "remove"


class ChangeRefused(Exception):
    """A membership change the leader will not propose now (or ever, for ``InvalidChange``)."""


class ChangeInProgress(ChangeRefused):
    """Another change is in the log and not committed yet, or no entry of the leader's term has
    committed yet (thesis s4.1, the errata to the single-server algorithm: otherwise a change
    made by a previous leader and lost could combine with this one into disjoint majorities)."""


class NotCaughtUp(ChangeRefused):
    """A learner is promoted only once it is caught up (thesis s4.2.1)."""


class InvalidChange(ChangeRefused):
    """The change makes no sense for the current configuration (adding a member, promoting a
    voter, removing a stranger or the last voter)."""


@dataclass(frozen=True, slots=True)
class Configuration:
    """Invariant: ``voters`` and ``learners`` are disjoint."""

    voters: frozenset[int]
    learners: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def of(cls, voters: Iterable[int], learners: Iterable[int] = ()) -> Configuration:
        v, lrn = frozenset(voters), frozenset(learners)
        if v & lrn:
            raise ValueError(f"nodes {sorted(v & lrn)} are both voters and learners")
        return cls(v, lrn)

    @property
    def members(self) -> frozenset[int]:
        return self.voters | self.learners

    @property
    def quorum(self) -> int:
        """Voters needed for a majority."""
        return len(self.voters) // 2 + 1

    def changed(self, kind: ChangeKind, node: int) -> Configuration:
        """The configuration after one single-server change; ``InvalidChange`` if it is none."""
        if kind is ChangeKind.ADD_LEARNER:
            if node in self.members:
                raise InvalidChange(f"node {node} is already a member ({self.describe()})")
            return Configuration(self.voters, self.learners | {node})
        if kind is ChangeKind.PROMOTE:
            if node not in self.learners:
                raise InvalidChange(f"node {node} is not a learner ({self.describe()})")
            return Configuration(self.voters | {node}, self.learners - {node})
        if node not in self.members:
            raise InvalidChange(f"node {node} is not a member ({self.describe()})")
        if self.voters == {node}:
            raise InvalidChange(f"node {node} is the last voter")
        return Configuration(self.voters - {node}, self.learners - {node})

    def describe(self) -> str:
        return f"voters {sorted(self.voters)}, learners {sorted(self.learners)}"

    def encode(self) -> bytes:
        voters, learners = sorted(self.voters), sorted(self.learners)
        head = _HEAD.pack(ENCODING_VERSION, len(voters), len(learners))
        return head + struct.pack(f">{len(voters) + len(learners)}I", *voters, *learners)

    @classmethod
    def decode(cls, payload: bytes) -> Configuration:
        if len(payload) < _HEAD.size:
            raise ValueError(f"configuration entry of {len(payload)} bytes: too short")
        version, nv, nl = _HEAD.unpack_from(payload)
        if version != ENCODING_VERSION:
            raise ValueError(f"configuration entry version {version}, expected {ENCODING_VERSION}")
        if len(payload) != _HEAD.size + 4 * (nv + nl):
            raise ValueError(
                f"configuration entry of {len(payload)} bytes for {nv} voters and {nl} learners"
            )
        ids = struct.unpack_from(f">{nv + nl}I", payload, _HEAD.size)
        return cls.of(ids[:nv], ids[nv:])


def overlapping(a: Configuration, b: Configuration) -> bool:
    """True if every majority of ``a``'s voters meets every majority of ``b``'s. Two disjoint
    majorities would take as many voters as the shared ones can give after each side has used
    its own first."""
    shared = len(a.voters & b.voters)
    need_a = max(0, a.quorum - len(a.voters - b.voters))
    need_b = max(0, b.quorum - len(b.voters - a.voters))
    return need_a + need_b > shared


class Membership:
    """The configurations in one log: ``base`` in force at ``base_index`` (the log's start, 0
    for a new group, or the start a snapshot or retention left), then each CONFIG entry after
    it as ``(index, configuration)``, ascending. ``current`` is the latest (thesis s4.1)."""

    __slots__ = ("_entries", "base", "base_index")

    def __init__(
        self,
        base: Configuration,
        base_index: int = 0,
        entries: Iterable[tuple[int, Configuration]] = (),
    ) -> None:
        self.base_index = base_index
        self.base = base
        self._entries = sorted(entries, key=lambda e: e[0])
        if self._entries and self._entries[0][0] <= base_index:
            raise ValueError(f"configuration entry at {self._entries[0][0]} <= log start")

    @property
    def current(self) -> Configuration:
        return self._entries[-1][1] if self._entries else self.base

    @property
    def last_index(self) -> int:
        """The index of the latest CONFIG entry (``base_index`` if none is in the log)."""
        return self._entries[-1][0] if self._entries else self.base_index

    def at(self, index: int) -> Configuration:
        """The configuration in force at ``index`` (>= base_index)."""
        found = self.base
        for i, conf in self._entries:
            if i > index:
                break
            found = conf
        return found

    def since(self, index: int) -> list[Configuration]:
        """The configuration in force at ``index`` and every later one."""
        return [self.at(index)] + [c for i, c in self._entries if i > index]

    def append(self, index: int, conf: Configuration) -> None:
        self._entries.append((index, conf))

    def truncate_from(self, index: int) -> None:
        """Entries at ``index`` and above are gone: their configurations with them."""
        while self._entries and self._entries[-1][0] >= index:
            self._entries.pop()

    def compact(self, first_index: int) -> None:
        """The log now starts at ``first_index``: fold the earlier entries into the base."""
        self.base = self.at(first_index - 1)
        self.base_index = max(self.base_index, first_index - 1)
        self._entries = [(i, c) for i, c in self._entries if i >= first_index]

    def reset(self, index: int, conf: Configuration) -> None:
        """An installed snapshot: the log is empty after ``index``, where ``conf`` is in force."""
        self.base, self.base_index, self._entries = conf, index, []
