"""The sans-IO Raft core of one group (etcd-io/raft's shape: inputs in, effects out).

Inputs: ``tick()`` (the driver's clock, one call per tick), ``receive(message)``,
``propose(payload, count)``; completions: ``flushed(index)`` (the entries now at indexes <=
index are durable) and ``hard_state_persisted(state)``. Each returns the effects to apply, in order
(see ``broker.cluster.messages``). The driver applies ``Truncate``/``AppendLog`` to its log
before calling in again; the core reads entries back through ``LogReader`` to send them.

Indexes are log offsets + 1 and an entry covers ``count`` indexes (one record batch; see
``broker.cluster.messages``): ``terms.last_index`` is the log's end offset and the commit index
its high-water mark. Every position the core sends, stores or compares (``prev_index``,
``next`` - 1, ``match``, ``flushed``, ``commit``, a follower's ``_leader_match``) is an entry's
last index, so whole entries travel and the log is only ever cut between batches. Why the
positions stay on boundaries: entries of a term are all made by that term's one leader, which
numbers them once, so two logs holding the same (index, term) hold the same entry there, with
the same boundaries, and the same prefix (Log Matching, Raft s5.3). A follower's positions come
from what it matched (``prev_index`` whose term matched, plus whole entries); its hints are a
run's first index (the end of the previous run + 1) or its last index + 1, boundaries of ITS log;
the leader may hold a different entry there, so it moves such a hint down to the start of the
entry holding it in its own log (``LogReader.entry_start``) before sending from it.

Invariants the core keeps (the simulator, ``broker.cluster.sim``, checks them from outside):
- No message leaves while the current hard state (term, voted_for) is not yet durable: a vote
  and any reply in a newer term wait for ``hard_state_persisted`` (Raft figure 2, "updated on
  stable storage before responding to RPCs").
- The commit index is the highest index of the current term that a majority holds DURABLY
  (the leader counts its own log only once flushed; followers report ``flushed_index``), and
  entries of earlier terms commit only under it (Raft s5.4.2).
- The log is never truncated at or below the commit index: such an AppendEntries is refused
  (dropped unanswered) and described in ``refused``, which a driver reports as a bug.

Leadership transfer (thesis s3.10): ``transfer_leadership(peer)`` stops proposals, brings the
peer up to date, then sends it TimeoutNow; abandoned after an election timeout.

Not in this step: membership changes, snapshots, quiescence of idle groups.
``Variant`` switches on known-bad behaviours so that tests can show the simulator catches them;
nothing but tests and the simulator may set it.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from broker.cluster.messages import (
    AppendEntries,
    AppendLog,
    AppendResp,
    Commit,
    Effect,
    Entry,
    EntryKind,
    Flush,
    HardState,
    Message,
    PersistHardState,
    PreVote,
    PreVoteResp,
    Send,
    TimeoutNow,
    Truncate,
    Vote,
    VoteResp,
)
from broker.cluster.terms import TermTable


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


class Role(enum.Enum):
    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre-candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


class NotLeader(Exception):
    def __init__(self, leader: int | None) -> None:
        super().__init__(f"not the leader (leader: {leader})")
        self.leader = leader


class LogReader(Protocol):
    """The driver's log as the core reads it back (durable or not, as appended)."""

    def entries(self, first: int, last: int, max_entries: int, max_bytes: int) -> list[Entry]:
        """Whole entries in order from the one starting at ``first`` (always an entry's first
        index) through the one ending at ``last`` (an entry's last index), stopping after
        ``max_entries`` or before the entry that would take the payload bytes past
        ``max_bytes``; at least one entry."""

    def entry_start(self, index: int) -> int:
        """The first index of the entry holding ``index`` (1 <= index <= the last index)."""


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
    variant: Variant = Variant.CORRECT


@dataclass(slots=True)
class Progress:
    """The leader's view of one follower. ``next`` is optimistic (entries sent, not yet
    acknowledged); ``match`` is what the follower said equals our log; ``flushed`` what it said
    is durable among those, the only figure commit counts. ``active``: heard from in this
    CheckQuorum period; ``acked``: a success came since the last heartbeat."""

    next: int
    match: int = 0
    flushed: int = 0
    active: bool = False
    acked: bool = False


class RaftNode:
    """One member of one group. Not thread-safe: one caller at a time."""

    def __init__(
        self,
        node_id: int,
        peers: list[int],
        log: LogReader,
        rng: random.Random,
        config: RaftConfig | None = None,
        hard_state: HardState | None = None,
        terms: TermTable | None = None,
    ) -> None:
        """``hard_state`` and ``terms`` are what was durable at start (all of it is durable)."""
        self.id = node_id
        self.peers = [p for p in peers if p != node_id]
        self.config = config or RaftConfig()
        self._log = log
        self._rng = rng
        state = hard_state or HardState(0, None)
        self.term = state.term
        self.voted_for = state.voted_for
        self._persisted = state
        self.terms = terms or TermTable()
        self.durable_index = self.terms.last_index
        self.commit = 0
        self.role = Role.FOLLOWER
        self.leader: int | None = None
        self.quorum = (len(self.peers) + 1) // 2 + 1
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._timeout = self._random_timeout()
        self._votes: dict[int, bool] = {}
        self._progress: dict[int, Progress] = {}
        #: As a leader handing over: to whom, and for how many ticks it has been trying.
        self.transferee: int | None = None
        self._transfer_elapsed = 0
        #: As a follower: the highest index known to equal the current leader's log.
        self._leader_match = 0
        self._held: list[Message] = []
        #: Entries handed out in this step's AppendLog, which the driver has not written yet
        #: (it does before calling in again): the first one's index, and the entries.
        self._unwritten_first = 0
        self._unwritten: list[Entry] = []
        #: Requests refused because obeying them would break safety (a bug somewhere).
        self.refused: list[str] = []
        self._out: list[Effect] = []

    # -- inputs ------------------------------------------------------------------------------

    def tick(self) -> list[Effect]:
        self._election_elapsed += 1
        if self.role is Role.LEADER:
            if self.transferee is not None:
                self._transfer_elapsed += 1
                if self._transfer_elapsed >= self.config.election_ticks:
                    self.transferee = None  # thesis s3.10: give up, take proposals again
            if self._election_elapsed >= self.config.election_ticks:
                self._election_elapsed = 0
                self._check_quorum()
            if self.role is Role.LEADER:
                self._heartbeat_elapsed += 1
                if self._heartbeat_elapsed >= self.config.heartbeat_ticks:
                    self._heartbeat_elapsed = 0
                    self._heartbeat()
        elif self._election_elapsed >= self._timeout:
            self._start_pre_vote()
        return self._take()

    def propose(self, payload: bytes, count: int = 1) -> list[Effect]:
        """Append ``payload`` as a new DATA entry of this term covering ``count`` indexes (a
        record batch of ``count`` offsets, encoded with base offset ``terms.last_index`` and
        leader epoch ``term`` as read before the call); its last index is
        ``terms.last_index`` afterwards. Raises ``NotLeader`` off the leader, and on a leader
        handing over (naming the peer it hands over to)."""
        if self.role is not Role.LEADER:
            raise NotLeader(self.leader)
        if self.transferee is not None:
            raise NotLeader(self.transferee)
        if count < 1:
            raise ValueError(f"an entry covers at least one index, got count={count}")
        self._append_local((Entry(self.term, payload, EntryKind.DATA, count),))
        first = self.terms.last_index - count + 1
        for peer in self.peers:
            if self._progress[peer].next == first:
                self._send_append(peer)
        return self._take()

    def transfer_leadership(self, peer: int) -> list[Effect]:
        """Hand leadership to ``peer`` (thesis s3.10). Raises ``NotLeader``."""
        if self.role is not Role.LEADER:
            raise NotLeader(self.leader)
        if peer not in self._progress:
            raise ValueError(f"{peer} is not a peer of {self.id}")
        self.transferee = peer
        self._transfer_elapsed = 0
        if self._progress[peer].match == self.terms.last_index:
            self._send(TimeoutNow(self.id, peer, self.term))
        else:
            self._send_append(peer)
        return self._take()

    def flushed(self, index: int) -> list[Effect]:
        self.durable_index = max(self.durable_index, min(index, self.terms.last_index))
        if self.role is Role.LEADER:
            self._maybe_commit()
        elif self.leader is not None and self._leader_match:
            self._send(self._ack(self.leader))
        return self._take()

    def hard_state_persisted(self, state: HardState) -> list[Effect]:
        self._persisted = state
        if state == HardState(self.term, self.voted_for):
            # A later state covers the earlier ones: once term T is durable, no vote of an
            # earlier term can ever be contradicted, so what was held for it may leave too.
            self._out.extend(Send(m) for m in self._held)
            self._held.clear()
        return self._take()

    def receive(self, m: Message) -> list[Effect]:
        if m.term > self.term:
            sticky = isinstance(m, PreVote) or (isinstance(m, Vote) and not m.transfer)
            if sticky and self._in_lease():
                # Leader stickiness (thesis s4.2.3): we heard from a live leader within the
                # minimum election timeout, so this candidate cannot be needed. No reply.
                return self._take()
            if isinstance(m, PreVote) or (isinstance(m, PreVoteResp) and m.granted):
                pass  # a pre-vote moves no term (thesis s9.6)
            else:
                self._become_follower(m.term, m.frm if isinstance(m, AppendEntries) else None)
        elif m.term < self.term:
            # Tell a stale leader or pre-candidate our term; everything else stale is dropped.
            if isinstance(m, AppendEntries):
                self._send(AppendResp(self.id, m.frm, self.term, False, 0, 0, 0, None))
            elif isinstance(m, PreVote):
                self._send(PreVoteResp(self.id, m.frm, self.term, False))
            return self._take()
        if isinstance(m, AppendEntries):
            self._on_append(m)
        elif isinstance(m, AppendResp):
            self._on_append_resp(m)
        elif isinstance(m, PreVote):
            granted = m.term > self.term and self._up_to_date(m.last_index, m.last_term)
            self._send(PreVoteResp(self.id, m.frm, m.term if granted else self.term, granted))
        elif isinstance(m, Vote):
            self._on_vote(m)
        elif isinstance(m, PreVoteResp):
            # Granted answers carry the term asked for; refusals the refuser's (ours).
            asked = self.term + 1 if m.granted else self.term
            if self.role is Role.PRE_CANDIDATE and m.term == asked:
                self._tally(m.frm, m.granted, self._campaign)
        elif isinstance(m, TimeoutNow):
            if self.role is not Role.LEADER:
                self._campaign(transfer=True)
        elif self.role is Role.CANDIDATE:
            self._tally(m.frm, m.granted, self._become_leader)
        return self._take()

    # -- elections ---------------------------------------------------------------------------

    def _random_timeout(self) -> int:
        return self.config.election_ticks + self._rng.randrange(self.config.election_ticks)

    def _in_lease(self) -> bool:
        return self.leader is not None and self._election_elapsed < self.config.election_ticks

    def _up_to_date(self, last_index: int, last_term: int) -> bool:
        """Raft s5.4.1: the candidate's log is at least as up to date as ours."""
        ours = self.terms.last_term
        return last_term > ours or (last_term == ours and last_index >= self.terms.last_index)

    def _set_hard_state(self, term: int, voted_for: int | None) -> None:
        self.term, self.voted_for = term, voted_for
        # One write per step: a newer term and a vote in it, learnt together, go as one.
        self._out = [e for e in self._out if not isinstance(e, PersistHardState)]
        self._out.append(PersistHardState(HardState(term, voted_for)))

    def _become_follower(self, term: int, leader: int | None) -> None:
        if term > self.term:
            self._set_hard_state(term, None)
            self._leader_match = 0
        self.role = Role.FOLLOWER
        self.leader = leader
        self.transferee = None
        self._election_elapsed = 0
        self._timeout = self._random_timeout()

    def _start_pre_vote(self) -> None:
        self.role = Role.PRE_CANDIDATE
        self.leader = None
        self._election_elapsed = 0
        self._timeout = self._random_timeout()
        self._votes = {self.id: True}
        if self._tally(self.id, True, self._campaign):
            return
        for peer in self.peers:
            pre = PreVote(self.id, peer, self.term + 1, self.terms.last_index, self.terms.last_term)
            self._send(pre)

    def _campaign(self, transfer: bool = False) -> None:
        self.role = Role.CANDIDATE
        self._set_hard_state(self.term + 1, self.id)
        self._leader_match = 0
        self._election_elapsed = 0
        self._timeout = self._random_timeout()
        self._votes = {self.id: True}
        if self._tally(self.id, True, self._become_leader):
            return
        for peer in self.peers:
            last_index, last_term = self.terms.last_index, self.terms.last_term
            self._send(Vote(self.id, peer, self.term, last_index, last_term, transfer))

    def _tally(self, voter: int, granted: bool, win: Callable[[], None]) -> bool:
        """Record a (pre-)vote; on a majority for, call ``win``; on a majority against, fall
        back to follower. True if the election ended."""
        self._votes[voter] = granted
        yes = sum(self._votes.values())
        if yes >= self.quorum:
            win()
            return True
        if len(self._votes) - yes >= self.quorum:
            self._become_follower(self.term, None)
            return True
        return False

    def _on_vote(self, m: Vote) -> None:
        granted = self.voted_for in (None, m.frm) and self._up_to_date(m.last_index, m.last_term)
        if granted:
            if self.voted_for is None:
                self._set_hard_state(self.term, m.frm)
            self._election_elapsed = 0
        reply = VoteResp(self.id, m.frm, self.term, granted)
        if self.config.variant is Variant.VOTE_BEFORE_PERSIST:
            self._out.append(Send(reply))
        else:
            self._send(reply)

    def _become_leader(self) -> None:
        self.role = Role.LEADER
        self.leader = self.id
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        last = self.terms.last_index
        self._progress = {p: Progress(next=last + 1) for p in self.peers}
        # Raft s8 / thesis s6.4: only an entry of our own term can commit by counting, and it
        # commits every earlier entry with it.
        self._append_local((Entry(self.term, b"", EntryKind.NOOP),))
        for peer in self.peers:
            self._send_append(peer)

    def _check_quorum(self) -> None:
        """CheckQuorum (thesis s6.2): step down unless a majority was heard from this period."""
        active = 1 + sum(p.active for p in self._progress.values())
        for p in self._progress.values():
            p.active = False
        if active < self.quorum:
            self._become_follower(self.term, None)

    # -- replication -------------------------------------------------------------------------

    def _append_local(self, entries: tuple[Entry, ...]) -> None:
        first = self.terms.last_index + 1
        for e in entries:
            self.terms.append(e.term, e.count)
        if not self._unwritten:
            self._unwritten_first = first
        self._unwritten.extend(entries)
        self._out.append(AppendLog(first, entries))
        self._out.append(Flush(self.terms.last_index))

    def _send_append(self, peer: int) -> None:
        """Whole entries from ``next`` (an entry's first index, so ``prev`` is a batch
        boundary), up to ``max_batch`` entries and ``max_bytes`` payload bytes."""
        pr = self._progress[peer]
        prev = pr.next - 1
        prev_term = self.terms.term_at(prev)
        assert prev_term is not None, "next is at most last_index + 1"
        if prev < self.terms.last_index:
            entries, last = self._entries(pr.next, self.terms.last_index)
        else:
            entries, last = (), prev
        pr.next = last + 1
        self._send(AppendEntries(self.id, peer, self.term, prev, prev_term, entries, self.commit))

    def _heartbeat(self) -> None:
        """An AppendEntries to each follower. If entries are in flight and none was
        acknowledged for a whole heartbeat interval, they are sent again from ``match`` (lost,
        or the follower lost an unflushed tail); otherwise the heartbeat carries no entries and
        is anchored at ``match``, which the follower holds, so it is never refused for a gap."""
        for peer in self.peers:
            pr = self._progress[peer]
            if pr.next > pr.match + 1 and not pr.acked:
                pr.next = pr.match + 1
            if pr.next <= self.terms.last_index and pr.next == pr.match + 1:
                self._send_append(peer)
            else:
                prev_term = self.terms.term_at(pr.match)
                assert prev_term is not None, "match is at most last_index"
                beat = AppendEntries(self.id, peer, self.term, pr.match, prev_term, (), self.commit)
                self._send(beat)
            pr.acked = False

    def _on_append(self, m: AppendEntries) -> None:
        self._become_follower(self.term, m.frm)
        term_there = self.terms.term_at(m.prev_index)
        if term_there is None:
            hint = self.terms.last_index + 1
            self._send(AppendResp(self.id, m.frm, self.term, False, m.prev_index, 0, hint, None))
            return
        if term_there != m.prev_term and self.config.variant is not Variant.NO_PREV_TERM_CHECK:
            # Raft s5.3: refuse, and name the first index of the conflicting term so that the
            # leader can skip it whole.
            hint = max(self.terms.first_index_of_run(m.prev_index), self.commit + 1)
            resp = AppendResp(self.id, m.frm, self.term, False, m.prev_index, 0, hint, term_there)
            self._send(resp)
            return
        # Skip the entries we hold: the same term at an entry's first index means the same
        # entry (module doc), so ``index`` stays on our boundaries too.
        index = m.prev_index + 1
        held = 0
        for e in m.entries:
            if self.terms.term_at(index) != e.term:
                break
            index += e.count
            held += 1
        new = m.entries[held:]
        end = index - 1
        if new:
            end += sum([e.count for e in new])
        bad = self.config.variant is Variant.TRUNCATE_BELOW_COMMIT
        if bad and m.entries and not new and end < self.terms.last_index:
            self._truncate(end + 1)
        if new:
            if index <= self.terms.last_index and not self._truncate(index):
                return
            self._append_local(new)
        self._leader_match = max(self._leader_match, end)
        if min(m.commit, self._leader_match) > self.commit:
            self.commit = min(m.commit, self._leader_match)
            self._out.append(Commit(self.commit))
        self._send(self._ack(m.frm))

    def _entries(self, first: int, last: int) -> tuple[tuple[Entry, ...], int]:
        """Whole entries from the one starting at ``first`` through the one ending at
        ``last``, within ``max_batch`` entries and ``max_bytes`` payload bytes (at least one):
        from the driver's log, then this step's unwritten entries; and the last one's last
        index."""
        room, budget = self.config.max_batch, self.config.max_bytes
        split = self._unwritten_first if self._unwritten else last + 1
        found: list[Entry] = []
        reached = first - 1
        if first < split:
            found = self._log.entries(first, min(last, split - 1), room, budget)
            reached += sum([e.count for e in found])
            assert found and reached < split, f"log lacks entries {first}..{last}"
            if reached < split - 1 or last < split:
                return tuple(found), reached
            room -= len(found)
            budget -= sum([len(e.payload) for e in found])
        index = split
        for e in self._unwritten:
            if room <= 0 or index > last:
                break
            if index >= first:
                if found and len(e.payload) > budget:
                    break
                found.append(e)
                room -= 1
                budget -= len(e.payload)
                reached = index + e.count - 1
            index += e.count
        assert found, f"no entry starts at {first}"
        return tuple(found), reached

    def _entry_start(self, index: int) -> int:
        """The first index of our entry holding ``index`` (<= last_index)."""
        if self._unwritten and index >= self._unwritten_first:
            start = self._unwritten_first
            for e in self._unwritten:
                if index < start + e.count:
                    return start
                start += e.count
        return self._log.entry_start(index)

    def _truncate(self, index: int) -> bool:
        if index <= self.commit and self.config.variant is not Variant.TRUNCATE_BELOW_COMMIT:
            self.refused.append(f"truncation from {index} at or below commit {self.commit}")
            return False
        self.terms.truncate_from(index)
        if self._unwritten and index < self._unwritten_first + len(self._unwritten):
            del self._unwritten[max(0, index - self._unwritten_first) :]
        self.durable_index = min(self.durable_index, index - 1)
        self._leader_match = min(self._leader_match, index - 1)
        self.commit = min(self.commit, index - 1)
        self._out.append(Truncate(index))
        return True

    def _ack(self, leader: int) -> AppendResp:
        match = self._leader_match
        flushed = min(self.durable_index, match)
        return AppendResp(self.id, leader, self.term, True, match, flushed, 0, None)

    def _on_append_resp(self, m: AppendResp) -> None:
        if self.role is not Role.LEADER:
            return
        pr = self._progress[m.frm]
        pr.active = True
        if m.success:
            pr.acked = True
            pr.match = max(pr.match, m.match_index)
            pr.flushed = max(pr.flushed, m.flushed_index)
            pr.next = max(pr.next, pr.match + 1)
            self._maybe_commit()
            if m.frm == self.transferee and pr.match == self.terms.last_index:
                self._send(TimeoutNow(self.id, m.frm, self.term))
            if pr.next <= self.terms.last_index:
                self._send_append(peer=m.frm)
            return
        # Rejected: back off past the whole conflicting term (Raft s5.3). A follower that lost
        # an unflushed tail in a crash may now hold less than it once acknowledged.
        if m.hint_term is None:
            next_index = m.hint_index
        else:
            ours = self.terms.last_index_of_term(m.hint_term)
            next_index = ours + 1 if ours is not None else m.hint_index
        # Never past the index refused, whatever the hint says; and on one of our entries'
        # first index (a hint is a boundary of the follower's log, module doc).
        pr.next = max(1, min(next_index, m.match_index, self.terms.last_index + 1))
        if pr.next <= self.terms.last_index:
            pr.next = self._entry_start(pr.next)
        pr.match = min(pr.match, pr.next - 1)
        self._send_append(m.frm)

    def _maybe_commit(self) -> None:
        if self.config.variant is Variant.COMMIT_UNFLUSHED:
            held = [self.terms.last_index] + [p.match for p in self._progress.values()]
        else:
            held = [self.durable_index] + [p.flushed for p in self._progress.values()]
        index = sorted(held, reverse=True)[self.quorum - 1]
        # Raft s5.4.2: count replicas only for an entry of the current term.
        if index > self.commit and self.terms.term_at(index) == self.term:
            self.commit = index
            self._out.append(Commit(index))

    # -- output ------------------------------------------------------------------------------

    def _send(self, m: Message) -> None:
        if self._persisted == HardState(self.term, self.voted_for):
            self._out.append(Send(m))
        else:
            self._held.append(m)

    def _take(self) -> list[Effect]:
        self._unwritten.clear()
        out, self._out = self._out, []
        return out
