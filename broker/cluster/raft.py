"""The sans-IO Raft core of one group (etcd-io/raft's shape: inputs in, effects out).

Inputs: ``tick()`` (the driver's clock, one call per tick), ``receive(message)``,
``propose(payload, count)``, ``propose_change(kind, node)``, ``compacted(first_index)``;
completions: ``flushed(index)`` (the entries now at indexes <= index are durable) and
``hard_state_persisted(state)``. Each returns the effects to apply, in order (see
``broker.cluster.messages``). The driver applies ``Truncate``/``AppendLog``/``ResetLog`` to its
log before calling in again; the core reads entries back through ``LogReader``
(``broker.cluster.logview``, which also serves what this step appended) to send them.

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
peer up to date, waits for the log to commit, then sends it TimeoutNow; abandoned after an
election timeout.
A leader that cannot read one of its own uncommitted entries back to send it (damaged on its
disk) hands over the same way and holds its candidacy a while (``broker.cluster.election``).

Membership (``broker.cluster.membership``): ``propose_change(kind, node)`` appends a CONFIG
entry; every node uses the latest configuration in its log (thesis s4.1). Only voters campaign,
vote-count, count towards commit and keep a leader in office under CheckQuorum; a leader that
removed itself leads until that change commits, not counting itself, then steps down (thesis
s4.2.2). Each follower's replication is a ``progress.Progress`` (probe / replicate with a window
of in-flight messages / snapshot).

Snapshots (``broker.cluster.snapshots``): ``compacted(first_index)`` tells the core the
driver's log now starts there (an entry's first index); a follower that needs what went gets
InstallSnapshot, whose ``last_index`` is an entry's last index (the contract is in
``broker.cluster.messages``).

Commits (``broker.cluster.commits``): the leader counts durable replicas and, at the end of a
step that moved its commit index or a follower's match, tells each follower that can use it
with a ``CommitNotice`` unless an AppendEntries of the step carried it already.

Idle groups: ``idle`` says when a leader has nothing left to do; quiescing such groups (no
ticks, no heartbeats) is the host's business (``broker.cluster.multiraft``), not the core's.
``Variant`` switches on known-bad behaviours so that tests can show the simulator catches them;
nothing but tests and the simulator may set it.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable

from broker.cluster.commits import Commits
from broker.cluster.election import Elections, Role
from broker.cluster.logview import LogReader, LogView
from broker.cluster.membership import (
    ChangeInProgress,
    ChangeKind,
    Configuration,
    Membership,
    NotCaughtUp,
)
from broker.cluster.messages import (
    AppendEntries,
    AppendLog,
    AppendResp,
    CommitNotice,
    Effect,
    Entry,
    EntryKind,
    Flush,
    HardState,
    InstallSnapshot,
    Message,
    PreVote,
    PreVoteResp,
    Send,
    TimeoutNow,
    Truncate,
    Vote,
)
from broker.cluster.options import RaftConfig, Variant
from broker.cluster.progress import Progress, ProgressState
from broker.cluster.snapshots import Snapshots
from broker.cluster.terms import TermTable

__all__ = ["LogReader", "NotLeader", "RaftConfig", "RaftNode", "Role", "Variant"]


class NotLeader(Exception):
    def __init__(self, leader: int | None) -> None:
        super().__init__(f"not the leader (leader: {leader})")
        self.leader = leader


class RaftNode(Elections, Snapshots, Commits):
    """One member of one group. Not thread-safe: one caller at a time."""

    def __init__(
        self,
        node_id: int,
        peers: Iterable[int],
        log: LogReader,
        rng: random.Random,
        config: RaftConfig | None = None,
        hard_state: HardState | None = None,
        terms: TermTable | None = None,
        membership: Membership | None = None,
    ) -> None:
        """``hard_state``, ``terms`` and ``membership`` are what was durable at start (all of
        it is durable): ``membership`` the configuration at the log's start and the CONFIG
        entries after it; without it, ``peers`` (this node included or not) are the voters of
        a group whose log holds no CONFIG entry."""
        self.id = node_id
        self.membership = membership or Membership(Configuration.of({node_id, *peers}))
        self.config = config or RaftConfig()
        #: The driver's log, and the entries this step handed out that it has not written yet.
        self._log = LogView(log)
        self._rng = rng
        state = hard_state or HardState(0, None)
        self.term = state.term
        self.voted_for = state.voted_for
        self._persisted = state
        self.terms = terms or TermTable()
        self.durable_index = self.terms.last_index
        # Only a committed prefix is ever removed from the log.
        self.commit = self.terms.start
        self.role = Role.FOLLOWER
        self.leader: int | None = None
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
        #: As a follower: the commit index the leader last sent (None: nothing heard yet).
        self.leader_commit: int | None = None
        self._held: list[Message] = []
        self._hold = 0
        #: As leader, this step: one of our uncommitted entries could not be read to send.
        self._unreadable = False
        self._commit_news = False
        #: Requests refused because obeying them would break safety (a bug somewhere).
        self.refused: list[str] = []
        self._out: list[Effect] = []

    @property
    def configuration(self) -> Configuration:
        """The latest configuration in the log, committed or not (thesis s4.1)."""
        return self.membership.current

    @property
    def peers(self) -> list[int]:
        """The other members (voters and learners): whom this node replicates to as leader."""
        return sorted(self.membership.current.members - {self.id})

    @property
    def progress(self) -> dict[int, Progress]:
        """As leader: each peer's replication progress (to read, for status views)."""
        return self._progress

    # -- inputs ------------------------------------------------------------------------------

    def tick(self) -> list[Effect]:
        self._election_elapsed += 1
        if self.role is Role.LEADER:
            learners = self.membership.current.learners
            if learners:
                for learner in learners & self._progress.keys():
                    self._progress[learner].tick_round(self.config.election_ticks)
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
        elif self._election_due():
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
        for peer in self._progress:
            self._fill(peer)
        return self._take()

    def propose_change(self, kind: ChangeKind, node: int) -> list[Effect]:
        """Append a configuration that differs from the current one by ``node`` (thesis s4.1).
        Raises ``NotLeader`` (as ``propose``), ``ChangeInProgress`` while an earlier change is
        uncommitted or before an entry of this term has committed, ``NotCaughtUp`` to promote a
        learner that is not, and ``InvalidChange`` for a change that makes no sense."""
        if self.role is not Role.LEADER:
            raise NotLeader(self.leader)
        if self.transferee is not None:
            raise NotLeader(self.transferee)
        if self.config.variant is not Variant.CONCURRENT_CHANGES:
            if self.membership.last_index > self.commit:
                pending = self.membership.last_index
                raise ChangeInProgress(f"the change at {pending} is not committed yet")
            if self.terms.term_at(self.commit) != self.term:
                raise ChangeInProgress(f"no entry of term {self.term} has committed yet")
        new = self.membership.current.changed(kind, node)
        if kind is ChangeKind.PROMOTE and not self._progress[node].caught_up:
            raise NotCaughtUp(
                f"learner {node} is not caught up (match {self._progress[node].match})"
            )
        self._append_local((Entry(self.term, new.encode(), EntryKind.CONFIG),))
        for peer in self._progress:
            self._fill(peer)
        return self._take()

    def transfer_leadership(self, peer: int) -> list[Effect]:
        """Hand leadership to ``peer`` (thesis s3.10). Raises ``NotLeader``."""
        if self.role is not Role.LEADER:
            raise NotLeader(self.leader)
        if peer not in self._progress or peer not in self.configuration.voters:
            raise ValueError(f"{peer} is not a voter of {self.id}'s group")
        self.transferee = peer
        self._transfer_elapsed = 0
        if self._progress[peer].match == self.terms.last_index:
            self._hand_over()
        else:
            self._send_append(peer)
        return self._take()

    def _hand_over(self) -> None:
        """TimeoutNow to the transferee once it holds the whole log (thesis s3.10) and the
        whole log is committed. The second condition is ours: every entry proposed before
        the transfer began is then acknowledged by this leader, so no publisher is left not
        knowing whether its publish was stored (broker.workers.replicated closes such a
        connection so that the client resends); no proposal is taken meanwhile, so the log
        stops growing and its end commits within a round of fsyncs."""
        peer = self.transferee
        if peer is not None and self._progress[peer].match == self.terms.last_index == self.commit:
            self._send(TimeoutNow(self.id, peer, self.term))

    def flushed(self, index: int) -> list[Effect]:
        self.durable_index = max(self.durable_index, min(index, self.terms.last_index))
        if self.role is Role.LEADER:
            self._maybe_commit()
            self._hand_over()
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

    @property
    def idle(self) -> bool:
        """A leader with nothing left to do: every follower holds and has flushed its whole
        log, all of it is committed and durable here, no message waits for a hard state, no
        transfer runs. Read-only; what a host needs to quiesce the group."""
        return self.idle_without(())

    def idle_without(self, down: Collection[int]) -> bool:
        """:attr:`idle` over the followers not in ``down`` (nodes the host has not heard
        from for an election timeout), provided the voters left, this leader included, are
        a majority: CockroachDB quiesces over the live replicas only, so a dead node does not
        keep every group it is a replica of ticking. Read-only."""
        last = self.terms.last_index
        if not (
            self.role is Role.LEADER
            and self.transferee is None
            and self.commit == last == self.durable_index
            and not self._held
        ):
            return False
        voters = self.configuration.voters
        if down and sum(v not in down for v in voters) * 2 <= len(voters):
            return False
        return all(p.match == p.flushed == last for n, p in self._progress.items() if n not in down)

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
                leads = isinstance(m, AppendEntries | InstallSnapshot | CommitNotice)
                self._become_follower(m.term, m.frm if leads else None)
        elif m.term < self.term:
            # Tell a stale leader or pre-candidate our term; everything else stale is dropped.
            if isinstance(m, AppendEntries | InstallSnapshot):
                self._send(AppendResp(self.id, m.frm, self.term, False, 0, 0, 0, None))
            elif isinstance(m, PreVote):
                self._send(PreVoteResp(self.id, m.frm, self.term, False))
            return self._take()
        if isinstance(m, AppendEntries):
            self._on_append(m)
        elif isinstance(m, CommitNotice):
            self._on_commit_notice(m)
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
        elif isinstance(m, InstallSnapshot):
            self._on_snapshot(m)
        elif isinstance(m, TimeoutNow):
            if self.role is not Role.LEADER and self._is_voter():
                self._campaign(transfer=True)
        elif self.role is Role.CANDIDATE:
            self._tally(m.frm, m.granted, self._become_leader)
        return self._take()

    def _become_leader(self) -> None:
        self.role = Role.LEADER
        self.leader = self.id
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        # Raft s8 / thesis s6.4: only an entry of our own term can commit by counting, and it
        # commits every earlier entry with it.
        self._append_local((Entry(self.term, b"", EntryKind.NOOP),))
        self._progress = {}
        self._track_members()
        for peer in self._progress:
            self._send_append(peer)

    def _track_members(self) -> None:
        """Keep a progress for each other member of the current configuration, and only them:
        a new one is probed from the leader's last entry; a removed one is no longer sent to."""
        members = self.membership.current.members - {self.id}
        for gone in self._progress.keys() - members:
            del self._progress[gone]
            if gone == self.transferee:
                self.transferee = None
        last = self.terms.last_index
        # Probed from our last entry's first index (``next`` - 1 is always an entry boundary).
        first = self._log.entry_start(last) if last > self.terms.start else last + 1
        for new in members - self._progress.keys():
            self._progress[new] = Progress(next=first, round_end=last)

    # -- replication -------------------------------------------------------------------------

    def _append_local(self, entries: tuple[Entry, ...]) -> None:
        first = self.terms.last_index + 1
        for e in entries:
            self.terms.append(e.term, e.count)
        self._log.add(first, entries)
        self._out.append(AppendLog(first, entries))
        self._out.append(Flush(self.terms.last_index))
        self._note_configs(first, entries)

    def _note_configs(self, first: int, entries: tuple[Entry, ...]) -> None:
        """A CONFIG entry is in force as soon as it is in the log (thesis s4.1)."""
        changed = False
        index = first
        for e in entries:
            if e.kind is EntryKind.CONFIG:
                self.membership.append(index, Configuration.decode(e.payload))
                changed = True
            index += e.count
        if changed and self.role is Role.LEADER:
            self._track_members()

    def _send_append(self, peer: int) -> bool:
        """Whole entries from ``next`` (an entry's first index, so ``prev`` is a batch
        boundary), up to ``max_batch`` entries and ``max_bytes`` payload bytes. False, and
        nothing sent, when the log cannot hand out the entry at ``next`` now (a damaged batch,
        ``LogReader.entries``): committed, it is being repaired, heartbeats go on and each
        retries; uncommitted, this leader steps down when the step ends (``_step_down``)."""
        pr = self._progress[peer]
        if pr.next <= self.terms.start:
            self._send_snapshot(peer)  # what it needs next is no longer in our log
            return True
        prev = pr.next - 1
        prev_term = self.terms.term_at(prev)
        assert prev_term is not None, "next is at most last_index + 1"
        if prev < self.terms.last_index:
            config = self.config
            entries, last = self._log.entries(
                pr.next, self.terms.last_index, config.max_batch, config.max_bytes
            )
            if not entries:
                self._unreadable |= pr.next > self.commit
                return False
        else:
            entries, last = (), prev
        pr.sent(last)
        pr.commit_sent = self.commit
        self._send(AppendEntries(self.id, peer, self.term, prev, prev_term, entries, self.commit))
        return True

    def _fill(self, peer: int) -> None:
        """Send ``peer`` what it lacks, as far as its progress state lets us (one probe, or
        up to the in-flight window)."""
        pr = self._progress[peer]
        while pr.next <= self.terms.last_index and pr.can_send(self.config.max_inflight):
            if not self._send_append(peer):
                break

    def _heartbeat(self) -> None:
        """An AppendEntries to each follower. If something is in flight and nothing was
        acknowledged for a whole heartbeat interval, the follower is probed again from
        ``match`` (lost, or the follower lost an unflushed tail); otherwise the heartbeat
        carries no entries and is anchored at ``match`` (or our log's start, if later), which
        the follower holds, so it is never refused for a gap. A snapshot unanswered for an
        election timeout is sent again."""
        for peer, pr in self._progress.items():
            if pr.state is ProgressState.SNAPSHOT:
                pr.snapshot_ticks += self.config.heartbeat_ticks
                if pr.snapshot_ticks >= self.config.election_ticks:
                    self._send_snapshot(peer)
                    continue
            elif not pr.acked and pr.waiting():
                pr.probe(pr.match + 1)
            if not (
                pr.next <= self.terms.last_index
                and pr.can_send(self.config.max_inflight)
                and self._send_append(peer)
            ):
                anchor = max(pr.match, self.terms.start)
                prev_term = self.terms.term_at(anchor)
                assert prev_term is not None, "match is at most last_index"
                beat = AppendEntries(self.id, peer, self.term, anchor, prev_term, (), self.commit)
                pr.commit_sent = self.commit
                self._send(beat)
            pr.acked = False

    def _on_append(self, m: AppendEntries) -> None:
        self._become_follower(self.term, m.frm)
        self.leader_commit = m.commit
        if m.prev_index < self.terms.start:
            clipped = self._clip_to_start(m)
            if clipped is None:
                return
            m = clipped
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
        self._learn_commit(m.commit, self._leader_match)
        if not new:
            # New entries are acknowledged once flushed (:meth:`flushed`): Raft's figure 2
            # persists them "before responding to RPCs", as etcd-io/raft answers MsgApp
            # after persisting. The leader counts only flushed entries, so an answer on
            # receipt would cost it a frame and a step and let it commit nothing.
            self._send(self._ack(m.frm))

    def _truncate(self, index: int) -> bool:
        if index <= self.commit and self.config.variant is not Variant.TRUNCATE_BELOW_COMMIT:
            self.refused.append(f"truncation from {index} at or below commit {self.commit}")
            return False
        self.terms.truncate_from(index)
        before = self.membership.current
        self.membership.truncate_from(index)
        if self.role is Role.LEADER and self.membership.current != before:
            self._track_members()
        self._log.truncate(index)
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
        pr = self._progress.get(m.frm) if self.role is Role.LEADER else None
        if pr is None:
            return
        pr.active = True
        if m.success:
            pr.acknowledged(m.match_index, m.flushed_index)
            if m.frm in self.membership.current.learners:
                pr.end_round_if_reached(self.terms.last_index, self.config.election_ticks)
            self._maybe_commit()
            if self.role is not Role.LEADER:
                return  # it removed itself and the removal committed
            self._hand_over()
            if pr.next <= self.terms.last_index:
                self._fill(m.frm)
            return
        if pr.state is ProgressState.SNAPSHOT:
            return  # an answer to something sent before the snapshot
        if pr.state is ProgressState.REPLICATE and m.match_index < pr.match:
            return  # stale: it has since accepted more
        # Rejected: back off past the whole conflicting term (Raft s5.3). A follower that lost
        # an unflushed tail in a crash may now hold less than it once acknowledged.
        if m.hint_term is None:
            next_index = m.hint_index
        else:
            ours = self.terms.last_index_of_term(m.hint_term)
            next_index = ours + 1 if ours is not None else m.hint_index
        # Never past the index refused, whatever the hint says; and on one of our entries'
        # first index (a hint is a boundary of the follower's log, module doc).
        next_index = max(1, min(next_index, m.match_index, self.terms.last_index + 1))
        if self.terms.start < next_index <= self.terms.last_index:
            next_index = self._log.entry_start(next_index)
        pr.probe(next_index)
        pr.match = min(pr.match, pr.next - 1)
        self._send_append(m.frm)

    # -- output ------------------------------------------------------------------------------

    def _send(self, m: Message) -> None:
        if self._persisted == HardState(self.term, self.voted_for):
            self._out.append(Send(m))
        else:
            self._held.append(m)

    def _take(self) -> list[Effect]:
        if self._unreadable:
            self._unreadable = False
            self._step_down()  # at the end of the step: not while iterating over followers
        if self._commit_news:
            self._tell_commits()
        self._log.written()
        out, self._out = self._out, []
        return out
