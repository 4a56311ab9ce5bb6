"""The simulator's records (:mod:`broker.cluster.sim`): one node's fake disk for one group,
what the whole cluster committed in a group, and the exception a broken invariant raises.

Both keep whole entries (an entry covers ``count`` indexes, one record batch) with the last
index of each (``ends``) and a hash chain through them, so that positions are looked up by
bisection and prefixes compared in O(1). Positions the checks compare are entry ends.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from broker.cluster.membership import Configuration
from broker.cluster.messages import Entry, HardState


class Violation(Exception):
    """A safety invariant broke."""


def chain(prev: int, term: int, payload: bytes, count: int) -> int:
    """The hash of a log prefix extended by one entry (log matching in O(1) per entry)."""
    return hash((prev, term, payload, count))


@dataclass(slots=True)
class EntryLog:
    """Whole entries, the last index of each, and the chain through each."""

    entries: list[Entry] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    chains: list[int] = field(default_factory=list)

    @property
    def last_index(self) -> int:
        return self.ends[-1] if self.ends else 0

    def add(self, entry: Entry, entry_chain: int) -> None:
        self.entries.append(entry)
        self.ends.append(self.last_index + entry.count)
        self.chains.append(entry_chain)

    def position(self, index: int) -> int:
        """The list position of the entry holding ``index`` (1 <= index <= last_index)."""
        return bisect_left(self.ends, index)

    def chain_at(self, index: int) -> int | None:
        """The chain of the prefix ending at ``index``; None unless an entry ends there."""
        if index == 0:
            return 0
        i = bisect_left(self.ends, index)
        return self.chains[i] if i < len(self.ends) and self.ends[i] == index else None

    def entry_ending_at(self, index: int) -> Entry | None:
        i = bisect_left(self.ends, index)
        return self.entries[i] if i < len(self.ends) and self.ends[i] == index else None

    def cut(self, keep: int) -> None:
        """Keep the first ``keep`` entries."""
        del self.entries[keep:]
        del self.ends[keep:]
        del self.chains[keep:]

    def prefix(self, index: int) -> EntryLog:
        """A copy of the entries up to ``index`` (an entry's last index)."""
        keep = bisect_left(self.ends, index + 1)
        return EntryLog(self.entries[:keep], self.ends[:keep], self.chains[:keep])


@dataclass(slots=True)
class Disk(EntryLog):
    """One node's storage for one group: the log (entries up to index ``durable`` + an
    unflushed tail) and the durable hard state. ``durable`` is always an entry's last index.

    A crash keeps only what was durable; a hard state whose write had not completed is simply
    never recorded. A crash may also leave a torn prefix of the first unflushed entry (part of
    its batch's bytes, ``torn`` records of it): the real storage finds it by the batch CRC at
    recovery and cuts it, so :meth:`recover` ends the log at the last whole durable entry.

    ``start``: the last index retention removed or an installed snapshot covers (an entry's
    last index), where ``start_config`` is in force (the stored ``LogStart``); the entries and
    chains below it stay here for the checks only, the core never reads them."""

    durable: int = 0
    durable_hard: HardState = field(default_factory=lambda: HardState(0, None))
    #: Records of the first unflushed entry that a crash left on disk (0: none).
    torn: int = 0
    #: The index each truncation kept up to, in order (a flush under way covers no more).
    cuts: list[int] = field(default_factory=list)
    start: int = 0
    start_config: Configuration | None = None
    #: First indexes of the entries whose batch is damaged here (unreadable until rewritten).
    damaged: set[int] = field(default_factory=set)

    def entries_between(
        self, first: int, last: int, max_entries: int, max_bytes: int
    ) -> list[Entry]:
        """:meth:`broker.cluster.logview.LogReader.entries`."""
        if first <= self.start:
            raise Violation(f"read of {first}..{last} below the log start {self.start}")
        i = self.position(first)
        if i == len(self.ends) or self.ends[i] - self.entries[i].count + 1 != first:
            raise Violation(f"read from {first}: no entry starts there")
        out: list[Entry] = []
        size = 0
        while i < len(self.entries) and len(out) < max_entries:
            e = self.entries[i]
            if self.ends[i] - e.count >= last or (out and size + len(e.payload) > max_bytes):
                break
            if self.ends[i] - e.count + 1 in self.damaged:
                break  # never handed out: none when the read starts there
            out.append(e)
            size += len(e.payload)
            i += 1
        return out

    def entry_start(self, index: int) -> int:
        if index <= self.start:
            raise Violation(f"entry start of {index}, below the log start {self.start}")
        i = self.position(index)
        return self.ends[i] - self.entries[i].count + 1

    def cut(self, keep: int) -> None:
        """Keep the first ``keep`` entries; damage goes with the entries cut."""
        EntryLog.cut(self, keep)
        self.damaged = {first for first in self.damaged if first <= self.last_index}

    def truncate(self, from_index: int) -> None:
        """Drop every entry from ``from_index`` on, which must be an entry's first index."""
        i = self.position(from_index)
        if i < len(self.ends) and self.ends[i] - self.entries[i].count + 1 != from_index:
            raise Violation(f"truncation from {from_index}, inside an entry")
        self.cut(i)
        self.durable = min(self.durable, self.last_index)
        self.cuts.append(self.last_index)

    def mark_durable(self, index: int) -> int:
        """A flush up to ``index`` completed: durable up to the last entry end <= it."""
        i = bisect_left(self.ends, min(index, self.last_index) + 1)
        self.durable = max(self.durable, self.ends[i - 1] if i else 0)
        return self.durable

    def crash(self, tear: int) -> None:
        """Lose the unflushed tail; keep ``tear`` records of its first entry (torn write)."""
        keep = bisect_left(self.ends, self.durable + 1)
        first = self.entries[keep] if keep < len(self.entries) else None
        self.torn = min(tear, first.count - 1) if first is not None else 0
        self.cut(keep)

    def reset(self, snapshot: EntryLog, last_index: int) -> None:
        """An installed snapshot: the log becomes ``snapshot`` (the leader's log up to
        ``last_index``, its start now), durable; a flush under way covers none of what
        follows."""
        self.entries, self.ends, self.chains = snapshot.entries, snapshot.ends, snapshot.chains
        self.durable = self.start = last_index
        self.damaged = set()
        self.cuts.append(last_index)

    def recover(self) -> int:
        """At restart: cut a torn batch after the last whole entry; return its records."""
        torn, self.torn = self.torn, 0
        return torn

    def durable_chain_at(self, index: int) -> int | None:
        return self.chain_at(index) if index <= self.durable else None


@dataclass(slots=True)
class GroupRecord(EntryLog):
    """What the whole cluster has committed in one group (the entries), and who led which
    term."""

    #: (term, committed index) each time the record grew: leader completeness is owed by a
    #: leader of term T only for what was committed in earlier terms.
    marks: list[tuple[int, int]] = field(default_factory=list)
    leaders: dict[int, int] = field(default_factory=dict)
    #: (index, term) -> (first index, last index, chain) of the entry holding it, first seen:
    #: the same index and term must mean the same entry and the same prefix.
    seen: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    votes: dict[tuple[int, int], int] = field(default_factory=dict)
    #: Pending proposals: value -> (node, life, last index, term).
    pending: dict[bytes, tuple[int, int, int, int]] = field(default_factory=dict)
    #: Values proposed after healing, and every value committed so far.
    healed: set[bytes] = field(default_factory=set)
    values: set[bytes] = field(default_factory=set)
    #: The configuration of the leader that last extended the record: a majority of its
    #: voters holds the committed prefix durably (learners never count).
    commit_config: Configuration | None = None

    def committed_before(self, term: int) -> int:
        """The committed index reached in terms before ``term``."""
        return max((n for t, n in self.marks if t < term), default=0)
