"""What one node sends another in one step: a frame carrying every group's traffic between them.

A ``Frame`` holds four lists. ``beats`` are the groups' heartbeats, coalesced (etcd's and
CockroachDB's coalesced heartbeats): a core's heartbeat is an AppendEntries without entries, and
only its group, term, commit and anchor travel, with a flag asking the follower to quiesce.
``acks`` are the successful AppendResps (every heartbeat's answer among them), likewise reduced
to their group, term, match and flushed indexes. ``notices`` are the groups' ``CommitNotice``s
(``broker.cluster.commits``), reduced to their group, term and commit index. ``messages`` is
every other message, whole, beside its group. The sender and receiver of each beat, ack and
notice are the frame's ``frm`` and ``to`` (a group's replica ids are node ids).

The reduction is lossless: ``beat_message`` and ``ack_message`` rebuild exactly the message the
core sent (a test holds them to it), so a receiving core sees what it would have seen without
coalescing.

Why a beat carries its anchor (``prev_index``, ``prev_term``) and not only (group, term,
commit): the core anchors a heartbeat at the follower's ``match``, so that a follower that lost
an unflushed tail in a crash refuses it and the leader sends the entries again; etcd's heartbeat
carries none because etcd persists before acknowledging, which this core does not (it
acknowledges appended entries and counts only flushed ones towards commit).

Commit notices coalesce: a frame carries at most one per group, and none for a group whose
AppendEntries (entries or heartbeat) it carries already: the notice's commit index goes into
that message instead, raised if it is higher (the follower commits ``min(commit, what it
matched)`` either way, so the result is what the message followed by the notice would give).
A frame is what one event-loop iteration sends a node (``broker.cluster.node``), so a group's
followers get at most one notice per iteration, and none in an iteration that sends them an
append of the group.

An empty frame is still sent once per heartbeat interval to each peer: frames are node
liveness (``broker.cluster.multiraft``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from broker.cluster.messages import AppendEntries, AppendResp, CommitNotice, Message


class Beat(NamedTuple):
    """A heartbeat of one group: the AppendEntries ``(term, prev_index, prev_term, (),
    commit)`` from the frame's sender, its leader; ``quiesce``: the leader stops ticking the
    group, and asks the follower to do the same."""

    group: int
    term: int
    commit: int
    prev_index: int
    prev_term: int
    quiesce: bool


class Ack(NamedTuple):
    """A successful AppendResp of one group: ``(term, True, match, flushed, 0, None)``."""

    group: int
    term: int
    match: int
    flushed: int


class Notice(NamedTuple):
    """A ``CommitNotice`` of one group: ``(term, commit)`` from the frame's sender, its
    leader."""

    group: int
    term: int
    commit: int


@dataclass(slots=True)
class Frame:
    frm: int
    to: int
    beats: list[Beat] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    messages: list[tuple[int, Message]] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    #: While the frame is built: group -> where its last AppendEntries is (True: in
    #: ``beats``, False: in ``messages``; and the position), and where its notice is.
    _appends: dict[int, tuple[bool, int]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    _notices: dict[int, int] = field(default_factory=dict, init=False, compare=False, repr=False)

    def put(self, group: int, m: Message, quiesce: bool = False) -> None:
        """Add ``m`` (of ``group``, from ``frm`` to ``to``): as a beat, an ack, a notice
        (coalesced, module doc), or whole."""
        if isinstance(m, AppendEntries):
            if m.entries:
                self._appends[group] = (False, len(self.messages))
                self.messages.append((group, m))
            else:
                self._appends[group] = (True, len(self.beats))
                self.beats.append(Beat(group, m.term, m.commit, m.prev_index, m.prev_term, quiesce))
            if self._notices:
                self._fold_notice(group, m.term)
        elif isinstance(m, AppendResp) and m.success:
            self.acks.append(Ack(group, m.term, m.match_index, m.flushed_index))
        elif isinstance(m, CommitNotice):
            self._put_notice(Notice(group, m.term, m.commit))
        else:
            self.messages.append((group, m))

    def _put_notice(self, n: Notice) -> None:
        where = self._appends.get(n.group)
        if where is not None and self._carry(where, n):
            return
        i = self._notices.get(n.group)
        if i is None:
            self._notices[n.group] = len(self.notices)
            self.notices.append(n)
        elif (n.term, n.commit) > self.notices[i][1:]:
            self.notices[i] = n

    def _carry(self, where: tuple[bool, int], n: Notice) -> bool:
        """Whether the AppendEntries at ``where`` carries ``n`` (raised to its commit if
        lower); False if it is of another term (a notice of a newer term goes alone)."""
        beat, i = where
        if beat:
            b = self.beats[i]
            if b.term != n.term:
                return False
            if b.commit < n.commit:
                self.beats[i] = b._replace(commit=n.commit)
            return True
        group, m = self.messages[i]
        assert isinstance(m, AppendEntries)
        if m.term != n.term:
            return False
        if m.commit < n.commit:
            self.messages[i] = (group, replace(m, commit=n.commit))
        return True

    def _fold_notice(self, group: int, term: int) -> None:
        """An AppendEntries of ``group`` in ``term`` was just put: the group's notice, if
        any of that term, goes into it."""
        i = self._notices.get(group)
        if i is None or self.notices[i].term != term:
            return
        n = self.notices[i]
        last = self.notices.pop()
        if i < len(self.notices):  # ``n`` was not the last one: the last takes its place
            self.notices[i] = last
            self._notices[last.group] = i
        del self._notices[group]
        self._carry(self._appends[group], n)

    def __len__(self) -> int:
        """How many group messages the frame carries (0: a node heartbeat only)."""
        return len(self.beats) + len(self.acks) + len(self.messages) + len(self.notices)


def beat_message(frm: int, to: int, b: Beat) -> AppendEntries:
    return AppendEntries(frm, to, b.term, b.prev_index, b.prev_term, (), b.commit)


def ack_message(frm: int, to: int, a: Ack) -> AppendResp:
    return AppendResp(frm, to, a.term, True, a.match, a.flushed, 0, None)


def notice_message(frm: int, to: int, n: Notice) -> CommitNotice:
    return CommitNotice(frm, to, n.term, n.commit)
