"""The Raft core's tunables (``RaftConfig``) and the known-bad variants the simulator's tests
switch on (``Variant``): nothing but tests and the simulator may set a variant."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Variant(enum.Enum):
    """Known-bad behaviours, for the tests of the simulator only."""

    CORRECT = "correct"
    #: The leader counts offsets replicas merely appended (itself included), not flushed.
    COMMIT_UNFLUSHED = "commit-unflushed"
    #: A follower accepts AppendEntries without comparing the term at ``prev_index``.
    NO_PREV_TERM_CHECK = "no-prev-term-check"
    #: A vote leaves before the hard state that records it is durable.
    VOTE_BEFORE_PERSIST = "vote-before-persist"
    #: A follower drops its whole suffix past each AppendEntries' last entry (a stale, reordered
    #: message then cuts committed entries) and the never-below-commit guard is off.
    TRUNCATE_BELOW_COMMIT = "truncate-below-commit"
    #: A leader proposes a membership change while another is still uncommitted.
    CONCURRENT_CHANGES = "concurrent-changes"
    #: The leader counts learners towards commit and CheckQuorum.
    LEARNERS_COUNT = "learners-count"
    #: A follower takes a commit notice's index as its commit, not bounded by what it knows
    #: equals the leader's log (Raft s5.3: "min(leaderCommit, index of last new entry)").
    COMMIT_NOTICE_UNCHECKED = "commit-notice-unchecked"


@dataclass(frozen=True, slots=True)
class RaftConfig:
    #: Ticks without a leader before a follower starts a (pre-)election: randomized in
    #: [election_ticks, 2 * election_ticks) (Raft s5.2). Also the CheckQuorum period.
    election_ticks: int = 10
    heartbeat_ticks: int = 1
    #: Most entries in one AppendEntries.
    max_batch: int = 64
    #: Most payload bytes in one AppendEntries (at least one entry goes, whatever its size).
    max_bytes: int = 1 << 20
    #: Most AppendEntries in flight to one follower in the replicate state.
    max_inflight: int = 8
    variant: Variant = Variant.CORRECT
