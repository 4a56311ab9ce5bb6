"""The commit index, the part of ``RaftNode`` that moves it and spreads it (mixed into it).

On the leader it moves by counting (:meth:`Commits._maybe_commit`): the highest entry of the
current term that a majority of the voters holds durably (Raft s5.4.2). A follower learns it
from the leader, and commits ``min(leader's commit, the highest index it knows equals the
leader's log)`` (Raft s5.3, figure 2: "min(leaderCommit, index of last new entry)"): an
AppendEntries tells it (entries or a heartbeat, each carrying the commit as it was when it
left), and so does a ``CommitNotice``.

Why notices. An AppendEntries carries the commit index as it was when it left, so the commit
of the entry it carries reaches the follower with the NEXT append or heartbeat: under a
steady stream of proposals that is soon, but after the last one (a will's ``$sessions``
record, the last publish of a burst) it is up to a heartbeat interval, which everything that
waits for a commit applied on a follower pays (a subscriber there, a will fenced through
``$sessions``: broker.workers.will_fence). So at the end of each step that may have moved what
a follower can commit (the commit index, or what it acknowledged: :meth:`_tell_commits`), the
leader sends each follower whose last message carried less than it can now use a notice; a
step that sends that follower an append sends none (the append carries the commit). The host
(``broker.cluster.frames``) keeps at most one notice per group in a frame to a node and folds
it into an AppendEntries or heartbeat of the group the frame carries already, so under load a
notice goes to a follower only in an event-loop iteration that sends it no append of that
group, and it costs a 20-byte record in a frame that leaves anyway (etcd-io/raft carries the
commit on the next MsgApp only; Redpanda's heartbeat manager sends per node heartbeats that
carry each group's commit index).

Safety: a notice is only a number, taken only from the leader of the follower's current term
(an older term's is dropped, a newer term's makes it a follower that matches nothing yet), and
bounded by ``_leader_match``, which only an AppendEntries or snapshot of this leader in this
term raises, and a truncation lowers. So it never commits more than an AppendEntries could
have; duplicated, reordered or lost notices only delay (the next append or heartbeat carries
the commit too).
"""

from __future__ import annotations

from broker.cluster.election import Role
from broker.cluster.membership import Membership
from broker.cluster.messages import Commit, CommitNotice, Effect, Message
from broker.cluster.options import RaftConfig, Variant
from broker.cluster.progress import Progress
from broker.cluster.terms import TermTable


class Commits:
    """``RaftNode`` owns the state declared here and provides the methods stubbed below."""

    id: int
    term: int
    role: Role
    config: RaftConfig
    terms: TermTable
    membership: Membership
    commit: int
    durable_index: int
    leader_commit: int | None
    _leader_match: int
    _progress: dict[int, Progress]
    _out: list[Effect]
    #: As leader, this step: the commit index or a follower's match moved, so a follower may
    #: be able to commit more than it was told (:meth:`_tell_commits` at the step's end).
    _commit_news: bool

    def _become_follower(self, term: int, leader: int | None) -> None:
        raise NotImplementedError

    def _send(self, m: Message) -> None:
        raise NotImplementedError

    # -- leader --------------------------------------------------------------------------------

    def _maybe_commit(self) -> None:
        """Commit the highest entry of this term that a majority of the current voters holds
        durably; learners do not count, nor does a leader that removed itself."""
        self._commit_news = True
        conf = self.membership.current
        voters = conf.voters
        variant = self.config.variant
        if variant is Variant.CORRECT:
            held = [pr.flushed for peer, pr in self._progress.items() if peer in voters]
            if self.id in voters:
                held.append(self.durable_index)
        else:
            counted = self._progress.keys() if variant is Variant.LEARNERS_COUNT else voters
            unflushed = variant is Variant.COMMIT_UNFLUSHED
            ours = self.terms.last_index if unflushed else self.durable_index
            held = [ours] if self.id in voters else []
            held += [
                pr.match if unflushed else pr.flushed
                for peer, pr in self._progress.items()
                if peer in counted
            ]
        held.sort(reverse=True)
        index = held[len(voters) // 2]
        # Raft s5.4.2: count replicas only for an entry of the current term.
        if index > self.commit and self.terms.term_at(index) == self.term:
            self.commit = index
            self._out.append(Commit(index))
            if self.id not in voters and index >= self.membership.last_index:
                self._become_follower(self.term, None)  # thesis s4.2.2: removed, steps down

    def _tell_commits(self) -> None:
        """At the end of a leader's step (module doc): a notice to each follower that can
        commit more than the last commit index sent to it, as far as the leader knows what
        it holds (``match``; what is in flight it cannot commit before it acknowledges)."""
        self._commit_news = False
        if self.role is not Role.LEADER:
            return
        commit = self.commit
        for peer, pr in self._progress.items():
            if pr.commit_sent < min(commit, pr.match):
                pr.commit_sent = commit
                self._send(CommitNotice(self.id, peer, self.term, commit))

    # -- follower ------------------------------------------------------------------------------

    def _on_commit_notice(self, m: CommitNotice) -> None:
        self._become_follower(self.term, m.frm)
        self.leader_commit = m.commit
        known = self._leader_match
        if self.config.variant is Variant.COMMIT_NOTICE_UNCHECKED:
            known = m.commit  # the bug: the leader's word, whatever this log holds
        self._learn_commit(m.commit, known)

    def _learn_commit(self, leader_commit: int, known: int) -> None:
        """The leader of our term committed ``leader_commit`` and our log equals its up to
        ``known``: commit up to the lower of the two (Raft s5.3)."""
        ours = min(leader_commit, known)
        if ours > self.commit:
            self.commit = ours
            self._out.append(Commit(ours))
