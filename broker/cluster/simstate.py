"""The simulator's records (:mod:`broker.cluster.sim`): one node's fake disk for one group,
what the whole cluster committed in a group, and the exception a broken invariant raises."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.cluster.membership import Configuration
from broker.cluster.messages import Entry, HardState


class Violation(Exception):
    """A safety invariant broke."""


def chain(prev: int, term: int, payload: bytes) -> int:
    """The hash of a log prefix extended by one entry (log matching in O(1) per entry)."""
    return hash((prev, term, payload))


@dataclass(slots=True)
class Disk:
    """One node's storage for one group: the log (``durable`` entries + an unflushed tail)
    and the durable hard state. A crash keeps only what was durable; a hard state whose write
    had not completed is simply never recorded. ``start``: the last index retention removed or
    an installed snapshot covers, where ``start_config`` is in force (the stored ``LogStart``);
    the entries and chains below it stay here for the checks only, the core never reads them."""

    entries: list[Entry] = field(default_factory=list)
    chains: list[int] = field(default_factory=list)
    durable: int = 0
    durable_hard: HardState = field(default_factory=lambda: HardState(0, None))
    start: int = 0
    start_config: Configuration | None = None

    def entries_between(self, first: int, last: int) -> list[Entry]:
        if first <= self.start:
            raise Violation(f"read of {first}..{last} below the log start {self.start}")
        return self.entries[first - 1 : last]

    def chain_at(self, index: int) -> int:
        return self.chains[index - 1] if index else 0

    def durable_chain_at(self, index: int) -> int | None:
        return self.chain_at(index) if index <= self.durable else None


@dataclass(slots=True)
class GroupRecord:
    """What the whole cluster has committed in one group, and who led which term."""

    committed: list[Entry] = field(default_factory=list)
    chains: list[int] = field(default_factory=list)
    #: (term, committed length) each time the record grew: leader completeness is owed by a
    #: leader of term T only for what was committed in earlier terms.
    marks: list[tuple[int, int]] = field(default_factory=list)
    leaders: dict[int, int] = field(default_factory=dict)
    #: (index, term, chain) -> first seen: same index and term must mean same prefix.
    seen: dict[tuple[int, int], int] = field(default_factory=dict)
    votes: dict[tuple[int, int], int] = field(default_factory=dict)
    #: Pending proposals: value -> (node, life, index, term).
    pending: dict[bytes, tuple[int, int, int, int]] = field(default_factory=dict)
    acked: dict[bytes, int] = field(default_factory=dict)
    #: Values proposed after healing, and every value committed so far.
    healed: set[bytes] = field(default_factory=set)
    values: set[bytes] = field(default_factory=set)
    #: The configuration of the leader that last extended ``committed``: a majority of its
    #: voters holds the committed prefix durably (learners never count).
    commit_config: Configuration | None = None

    def chain_at(self, index: int) -> int:
        return self.chains[index - 1] if index else 0

    def committed_before(self, term: int) -> int:
        """How many entries were committed in terms before ``term``."""
        return max((n for t, n in self.marks if t < term), default=0)
