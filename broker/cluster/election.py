"""Elections, the half of ``RaftNode`` that chooses leaders (mixed into it): PreVote (thesis
s9.6), votes persisted before they leave (Raft figure 2), leader stickiness (thesis s4.2.3),
CheckQuorum (thesis s6.2). Only the voters of the latest configuration in the log campaign and
count (thesis s4.1); a learner or a removed server never starts an election.

A leader that cannot lead steps down and holds its candidacy (:meth:`Elections._step_down`):
the case is a leader whose own uncommitted entry cannot be read back to send (damaged on its
disk, ``LogReader.entries``). Nobody repairs an uncommitted entry (``broker.cluster.repair``
rewrites committed ranges only), so as leader it could never send it, nor anything after it,
and the group would stall. Stepping aside lets a replica that holds the entry intact, or lacks
it, lead: the first keeps it (and the damaged copy, once committed, is repaired from it), the
second overwrites it here (Raft s5.3; never at or below the commit index). It hands over at
once (TimeoutNow to its most caught-up voter, thesis s3.10) and does not stand again for
:meth:`Elections.hold_ticks` or until it hears a leader: its log, the longest, would win it the
election back. Safety does not depend on any of it: it only withholds this node's candidacy.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable

from broker.cluster.membership import Membership
from broker.cluster.messages import (
    Effect,
    HardState,
    Message,
    PersistHardState,
    PreVote,
    Send,
    TimeoutNow,
    Vote,
    VoteResp,
)
from broker.cluster.options import RaftConfig, Variant
from broker.cluster.progress import Progress
from broker.cluster.terms import TermTable


class Role(enum.Enum):
    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre-candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


class Elections:
    """The election state machine; ``RaftNode`` owns the state declared here and provides
    ``_become_leader`` and ``_send``."""

    id: int
    config: RaftConfig
    membership: Membership
    terms: TermTable
    term: int
    voted_for: int | None
    role: Role
    leader: int | None
    transferee: int | None
    _rng: random.Random
    _election_elapsed: int
    _timeout: int
    _votes: dict[int, bool]
    _leader_match: int
    _progress: dict[int, Progress]
    _out: list[Effect]
    #: Ticks left before this node may stand for election again (``_step_down``).
    _hold: int

    @property
    def quorum(self) -> int:
        return self.membership.current.quorum

    def _become_leader(self) -> None:
        raise NotImplementedError

    def _send(self, m: Message) -> None:
        raise NotImplementedError

    @property
    def hold_ticks(self) -> int:
        """How long a node that stepped down holds its candidacy: the longest randomized
        election timeout, so that each follower's timer, started by the last heartbeat, fires
        before this node may stand again."""
        return 2 * self.config.election_ticks

    def _step_down(self) -> None:
        """As leader: hand leadership to the most caught-up other voter, become a follower and
        hold its candidacy (module doc). Nothing happens off the leader or in a group where
        this node is the only voter (nobody else could lead)."""
        others = self._other_voters()
        if self.role is Role.LEADER and others:
            progress = self._progress
            successor = max(others, key=lambda v: (progress[v].match, -v))
            self._become_follower(self.term, None)
            self._hold = self.hold_ticks
            self._send(TimeoutNow(self.id, successor, self.term))

    def _election_due(self) -> bool:
        """On a follower's tick: its election timeout passed, it is a voter and it does not
        hold its candidacy."""
        if self._hold:
            self._hold -= 1
            return False
        return self._election_elapsed >= self._timeout and self._is_voter()

    def _is_voter(self) -> bool:
        return self.id in self.membership.current.voters

    def _other_voters(self) -> list[int]:
        return sorted(self.membership.current.voters - {self.id})

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
        if leader is not None:
            self._hold = 0  # a leader is heard: the group has one again
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
        for peer in self._other_voters():
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
        for peer in self._other_voters():
            last_index, last_term = self.terms.last_index, self.terms.last_term
            self._send(Vote(self.id, peer, self.term, last_index, last_term, transfer))

    def _tally(self, voter: int, granted: bool, win: Callable[[], None]) -> bool:
        """Record a (pre-)vote; on a majority of the voters for, call ``win``; on a majority
        against, fall back to follower. True if the election ended. Learners do not count."""
        voters = self.membership.current.voters
        if voter not in voters:
            return False
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

    def _check_quorum(self) -> None:
        """CheckQuorum (thesis s6.2): step down unless a majority was heard from this period."""
        counted: frozenset[int] = self.membership.current.voters
        if self.config.variant is Variant.LEARNERS_COUNT:
            counted = frozenset(self._progress)
        active = self._is_voter() + sum(
            pr.active for peer, pr in self._progress.items() if peer in counted
        )
        for pr in self._progress.values():
            pr.active = False
        if active < self.quorum:
            self._become_follower(self.term, None)
