"""What one Raft group's core exchanges with its peers and hands its driver.

Messages are frozen slotted dataclasses, each carrying ``frm``, ``to`` and the sender's ``term``
(Raft s5.1: a higher term in any message makes the receiver a follower of that term; PreVote is
the exception, thesis s9.6). Effects are what the core asks its driver to do, in list order: a
``PersistHardState`` must be durable before the core is told ``hard_state_persisted``; a
``Truncate`` and an ``AppendLog`` are applied to the log before the driver calls into the core
again (a write to the page cache, not yet durable); a ``Flush`` completes later with
``flushed(index)``; ``Send`` goes on the wire; ``Commit`` reports a new commit index; a
``ResetLog`` replaces the whole log by an installed snapshot, durably, before the driver calls
into the core again.

Snapshots (the driver's contract). A leader whose log no longer holds what a follower needs
(retention or compaction removed the prefix; the driver tells the core with
``RaftNode.compacted(first_index)`` and stores the ``LogStart`` it returns beside the log) sends
``InstallSnapshot``. The driver that puts it on the wire attaches the data that stands for the
log up to ``last_index``: for a compacted partition, its compacted segments up to there; for
plain retention, nothing (the records are gone everywhere by design). The receiving driver,
told ``ResetLog``, discards the whole log, writes that data, and records ``LogStart(last_index,
last_term, configuration)`` as the log's start, all durably; at restart it gives the core that
start and the CONFIG entries after it.

Entries are opaque to the core except for their term, kind and count: the driver stores them
(``broker.cluster.storage``: one record batch per entry, the term in the batch's leader-epoch
field, a kind other than DATA as a control batch that readers skip). A NOOP entry is what a new
leader appends first (Raft s8, thesis s6.4); proposals are DATA; a CONFIG entry carries a group
configuration (``broker.cluster.membership``, whose module docstring gives the payload's
encoding). NOOP and CONFIG entries cover one index each.

Raft index = log offset + 1: index ``i`` is the record at offset ``i - 1``, so a log's last index
is its end offset and the commit index is its high-water mark. An entry covers ``count``
consecutive indexes (a record batch of ``count`` offsets; a control batch has one); its "first
index" and "last index" are the first and last of them. Every index a message names as a
position (``prev_index``, ``match_index``, ``flushed_index``, ``commit``, hints, a snapshot's
``last_index``, a log start) is an entry's last index, or 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from broker.cluster.membership import Configuration


class EntryKind(enum.IntEnum):
    #: Records a client published: what readers of the log see.
    DATA = 0
    #: The entry a new leader appends first, so that counting replicas can commit (Raft s8).
    NOOP = 1
    #: A configuration (``membership.Configuration.encode``), in force from when it is
    #: appended (thesis s4.1).
    CONFIG = 2


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a Raft log: ``count`` (>= 1) consecutive indexes written as one unit (one
    record batch). For DATA, ``payload`` is the encoded batch; for the others, the control
    body (empty for NOOP)."""

    term: int
    payload: bytes
    kind: EntryKind = EntryKind.DATA
    count: int = 1


@dataclass(frozen=True, slots=True)
class HardState:
    """What must survive a crash (Raft figure 2, "persistent state"): the log aside."""

    term: int
    voted_for: int | None


@dataclass(frozen=True, slots=True)
class PreVote:
    """ "Would you vote for me in ``term``?" sent with the sender's term + 1, which it does not
    adopt (thesis s9.6): a partitioned node rejoining cannot disrupt a live leader."""

    frm: int
    to: int
    term: int
    last_index: int
    last_term: int


@dataclass(frozen=True, slots=True)
class PreVoteResp:
    frm: int
    to: int
    term: int
    granted: bool


@dataclass(frozen=True, slots=True)
class Vote:
    """RequestVote (Raft s5.2). ``transfer``: the candidate campaigns because the leader told
    it to (TimeoutNow), so a voter's leader stickiness does not apply (thesis s3.10, s4.2.3)."""

    frm: int
    to: int
    term: int
    last_index: int
    last_term: int
    transfer: bool = False


@dataclass(frozen=True, slots=True)
class VoteResp:
    frm: int
    to: int
    term: int
    granted: bool


@dataclass(frozen=True, slots=True)
class AppendEntries:
    """AppendEntries (Raft s5.3); with no entries, the heartbeat."""

    frm: int
    to: int
    term: int
    prev_index: int
    prev_term: int
    entries: tuple[Entry, ...]
    commit: int


@dataclass(frozen=True, slots=True)
class AppendResp:
    """A follower's answer. On success ``match_index`` is the highest index known to equal the
    leader's log and ``flushed_index`` (<= ``match_index``) the highest of those that is durable:
    the leader counts only the latter towards commit. On rejection ``match_index`` is the
    ``prev_index`` refused, and ``hint_index`` and
    ``hint_term`` let the leader skip a whole conflicting term at once (Raft s5.3, the
    optimisation at the end of the section): ``hint_term`` is None when the follower's log is
    shorter than the leader's ``prev_index``, and ``hint_index`` is then its last index + 1."""

    frm: int
    to: int
    term: int
    success: bool
    match_index: int
    flushed_index: int
    hint_index: int
    hint_term: int | None


@dataclass(frozen=True, slots=True)
class TimeoutNow:
    """The leader hands over (thesis s3.10): the receiver, whose log the leader has checked
    is as up to date as its own, starts an election at once, without PreVote."""

    frm: int
    to: int
    term: int


@dataclass(frozen=True, slots=True)
class InstallSnapshot:
    """The leader's log starts after ``last_index`` (of ``last_term``, where ``configuration``
    is in force) and the follower needs entries before that: it takes the snapshot, whose data
    the driver attaches, and answers with an AppendResp. Everything up to ``last_index`` is
    committed (only a committed prefix is ever compacted)."""

    frm: int
    to: int
    term: int
    last_index: int
    last_term: int
    configuration: Configuration


@dataclass(frozen=True, slots=True)
class CommitNotice:
    """The leader's commit index, told at once when it moves (``broker.cluster.commits``):
    no entries, no anchor, no answer. The follower commits ``min(commit, the highest index
    it knows equals this leader's log)`` (Raft s5.3, "min(leaderCommit, index of last new
    entry)"), so a notice can never make it commit what it lacks or holds differently."""

    frm: int
    to: int
    term: int
    commit: int


Message = (
    PreVote
    | PreVoteResp
    | Vote
    | VoteResp
    | AppendEntries
    | AppendResp
    | TimeoutNow
    | InstallSnapshot
    | CommitNotice
)


@dataclass(frozen=True, slots=True)
class PersistHardState:
    state: HardState


@dataclass(frozen=True, slots=True)
class Truncate:
    """Drop every entry at ``from_index`` and above (never at or below the commit index)."""

    from_index: int


@dataclass(frozen=True, slots=True)
class AppendLog:
    """Write ``entries`` at ``first_index``..., right after the log's current last entry."""

    first_index: int
    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class Flush:
    """Make the log durable up to ``index``; answer with ``flushed(index)``."""

    index: int


@dataclass(frozen=True, slots=True)
class LogStart:
    """Where a log begins after retention, compaction or a snapshot removed its prefix: the
    last index removed, its term, and the configuration in force there."""

    index: int
    term: int
    configuration: Configuration


@dataclass(frozen=True, slots=True)
class ResetLog:
    """Replace the whole log by the snapshot that came with an InstallSnapshot: empty after
    ``last_index`` (of ``last_term``), durable before the driver calls into the core again."""

    last_index: int
    last_term: int
    configuration: Configuration


@dataclass(frozen=True, slots=True)
class Send:
    message: Message


@dataclass(frozen=True, slots=True)
class Commit:
    index: int


Effect = PersistHardState | Truncate | AppendLog | Flush | Send | Commit | ResetLog
