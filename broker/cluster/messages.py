"""What one Raft group's core exchanges with its peers and hands its driver.

Messages are frozen slotted dataclasses, each carrying ``frm``, ``to`` and the sender's ``term``
(Raft s5.1: a higher term in any message makes the receiver a follower of that term; PreVote is
the exception, thesis s9.6). Effects are what the core asks its driver to do, in list order: a
``PersistHardState`` must be durable before the core is told ``hard_state_persisted``; a
``Truncate`` and an ``AppendLog`` are applied to the log before the driver calls into the core
again (a write to the page cache, not yet durable); a ``Flush`` completes later with
``flushed(index)``; ``Send`` goes on the wire; ``Commit`` reports a new commit index.

Entries are opaque to the core except for their term, kind and count: the driver stores them
(``broker.cluster.storage``: one record batch per entry, the term in the batch's leader-epoch
field, a kind other than DATA as a control batch that readers skip). A NOOP entry is what a new
leader appends first (Raft s8, thesis s6.4); proposals are DATA.

Raft index = log offset + 1: index ``i`` is the record at offset ``i - 1``, so a log's last index
is its end offset and the commit index is its high-water mark. An entry covers ``count``
consecutive indexes (a record batch of ``count`` offsets; a control batch has one); its "first
index" and "last index" are the first and last of them. Every index a message names as a
position (``prev_index``, ``match_index``, ``flushed_index``, ``commit``, hints) is an entry's
last index, or 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EntryKind(enum.IntEnum):
    #: Records a client published: what readers of the log see.
    DATA = 0
    #: The entry a new leader appends first, so that counting replicas can commit (Raft s8).
    NOOP = 1


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


Message = PreVote | PreVoteResp | Vote | VoteResp | AppendEntries | AppendResp | TimeoutNow


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
class Send:
    message: Message


@dataclass(frozen=True, slots=True)
class Commit:
    index: int


Effect = PersistHardState | Truncate | AppendLog | Flush | Send | Commit
