"""Snapshots, the part of ``RaftNode`` that deals with a log whose prefix is gone (mixed into
it): the driver's ``compacted(first_index)`` after retention or compaction, the
``InstallSnapshot`` a leader sends a follower that needs what went, the follower's side of it,
and an AppendEntries reaching below a follower's own log start. The driver's contract is in
``broker.cluster.messages``.

Entries are whole record batches (``broker.cluster.messages``): a log starts after an entry's
last index (``TermTable.start``), so a snapshot's ``last_index`` is one too, and whole entries
are removed.
"""

from __future__ import annotations

from dataclasses import replace

from broker.cluster.logview import LogView
from broker.cluster.membership import Membership
from broker.cluster.messages import (
    AppendEntries,
    AppendResp,
    Commit,
    Effect,
    InstallSnapshot,
    LogStart,
    Message,
    ResetLog,
)
from broker.cluster.progress import Progress
from broker.cluster.terms import TermTable


class Snapshots:
    """``RaftNode`` owns the state declared here and provides the methods stubbed below."""

    id: int
    term: int
    terms: TermTable
    membership: Membership
    commit: int
    durable_index: int
    refused: list[str]
    _log: LogView
    _progress: dict[int, Progress]
    _leader_match: int
    _out: list[Effect]

    def _become_follower(self, term: int, leader: int | None) -> None:
        raise NotImplementedError

    def _send(self, m: Message) -> None:
        raise NotImplementedError

    def _ack(self, leader: int) -> AppendResp:
        raise NotImplementedError

    @property
    def log_start(self) -> LogStart:
        return LogStart(self.terms.start, self.terms.start_term, self.membership.base)

    def compacted(self, first_index: int) -> LogStart:
        """The driver's log now starts at ``first_index`` (retention or compaction removed the
        entries before it, which must be committed and durable): returns the ``LogStart`` the
        driver stores with the log. A follower that needs the removed entries gets a snapshot.
        ``first_index`` is an entry's first index (whole record batches go)."""
        last_removed = first_index - 1
        if last_removed > min(self.commit, self.durable_index):
            raise ValueError(
                f"cannot remove entries up to {last_removed}: commit is {self.commit}, "
                f"durable {self.durable_index}"
            )
        if last_removed > self.terms.start:
            self.terms.compact(first_index)
            self.membership.compact(first_index)
        return self.log_start

    def _send_snapshot(self, peer: int) -> None:
        start = self.terms.start
        self._progress[peer].snapshot(start)
        conf = self.membership.base
        self._send(InstallSnapshot(self.id, peer, self.term, start, self.terms.start_term, conf))

    def _on_snapshot(self, m: InstallSnapshot) -> None:
        """Take the leader's snapshot unless what we hold already covers it: an entry of ours at
        ``last_index`` with ``last_term`` means our log equals the leader's up to there (log
        matching), and what follows it is kept; only a log that does not match is replaced."""
        self._become_follower(self.term, m.frm)
        if m.last_index > self.commit:
            if self.terms.term_at(m.last_index) != m.last_term:
                self.terms.reset(m.last_index, m.last_term)
                self.membership.reset(m.last_index, m.configuration)
                self._log.written()  # nothing handed out in this step is to be written
                self.durable_index = m.last_index
                self._leader_match = m.last_index
                self._out.append(ResetLog(m.last_index, m.last_term, m.configuration))
            self.commit = m.last_index
            self._out.append(Commit(self.commit))
        # Our committed prefix is in every later leader's log (leader completeness).
        self._leader_match = max(self._leader_match, self.commit)
        self._send(self._ack(m.frm))

    def _clip_to_start(self, m: AppendEntries) -> AppendEntries | None:
        """``m`` (whose ``prev_index`` is below our log's start) without the entries up to our
        start, anchored there. What we removed is committed, so equal to the leader's (leader
        completeness), and so are its entries' boundaries; None (and ``refused``) for an entry
        across our start, which only a bug elsewhere can send."""
        start = self.terms.start
        index, skip = m.prev_index, 0
        for e in m.entries:
            if index >= start:
                break
            index += e.count
            skip += 1
        if index > start:
            self.refused.append(f"an entry across our log's start {start} from {m.frm}")
            return None
        return replace(
            m, prev_index=start, prev_term=self.terms.start_term, entries=m.entries[skip:]
        )
