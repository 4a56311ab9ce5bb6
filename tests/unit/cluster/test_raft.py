"""The Raft core, one message type at a time (etcd-io/raft's table style): votes by term and by
log, stickiness, PreVote, CheckQuorum, AppendEntries accept / reject / truncate, commit over
flushed offsets in the current term only, hard state durable before any reply it governs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from broker.cluster.messages import (
    AppendEntries,
    AppendLog,
    AppendResp,
    Commit,
    CommitNotice,
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
from broker.cluster.raft import NotLeader, RaftConfig, RaftNode, Role
from broker.cluster.terms import TermTable
from tests.unit.test_layers import NETWORK, forbidden_imports

NOOP2 = Entry(2, b"", EntryKind.NOOP)
CONFIG = RaftConfig(election_ticks=10, heartbeat_ticks=1)


class Log:
    """The driver's log: applies AppendLog / Truncate, serves whole entries back."""

    def __init__(self, entries: list[Entry] | None = None) -> None:
        self.items = entries if entries is not None else []

    def starts(self) -> list[int]:
        """The first index of each entry."""
        out, index = [], 1
        for e in self.items:
            out.append(index)
            index += e.count
        return out

    @property
    def last_index(self) -> int:
        return sum(e.count for e in self.items)

    def entries(self, first: int, last: int, max_entries: int, max_bytes: int) -> list[Entry]:
        starts = self.starts()
        i = starts.index(first)
        out: list[Entry] = []
        size = 0
        for start, e in zip(starts[i:], self.items[i:], strict=True):
            if (
                start > last
                or len(out) == max_entries
                or (out and size + len(e.payload) > max_bytes)
            ):
                break
            out.append(e)
            size += len(e.payload)
        return out

    def entry_start(self, index: int) -> int:
        return max(start for start in self.starts() if start <= index)

    def apply(self, effects: list[Effect]) -> list[Message]:
        sent = []
        for e in effects:
            if isinstance(e, AppendLog):
                assert e.first_index == self.last_index + 1
                self.items.extend(e.entries)
            elif isinstance(e, Truncate):
                keep = self.starts().index(e.from_index)  # only ever between entries
                del self.items[keep:]
            elif isinstance(e, Send):
                sent.append(e.message)
        return sent


def make(
    terms: tuple[int, ...] = (),
    state: HardState | None = None,
    node_id: int = 1,
    counts: tuple[int, ...] | None = None,
    config: RaftConfig = CONFIG,
) -> tuple[RaftNode, Log]:
    """A core over a log of entries of these terms, one index each unless ``counts`` says."""
    counts = counts or (1,) * len(terms)
    entries = [
        Entry(t, f"e{i}".encode(), count=c)
        for i, (t, c) in enumerate(zip(terms, counts, strict=True), 1)
    ]
    table = TermTable()
    for e in entries:
        table.append(e.term, e.count)
    log = Log(entries)
    core = RaftNode(node_id, [1, 2, 3], log, random.Random(0), config, state, table)
    return core, log


def sends(effects: list[Effect]) -> list[Message]:
    return [e.message for e in effects if isinstance(e, Send)]


def elect(core: RaftNode, log: Log) -> list[Message]:
    """Drive ``core`` (node 1) to leadership with node 2's votes; the messages it sent last."""
    for _ in range(2 * CONFIG.election_ticks):
        if core.role is Role.PRE_CANDIDATE:
            break
        log.apply(core.tick())
    log.apply(core.receive(PreVoteResp(2, 1, core.term + 1, True)))
    assert core.role is Role.CANDIDATE
    log.apply(core.hard_state_persisted(HardState(core.term, 1)))
    return log.apply(core.receive(VoteResp(2, 1, core.term, True)))


#: The driver, its fsync jobs, its repairs, the transport, the metadata group (pysyncobj's
#: thread and sockets) and the pass that keeps its members (a task on the loop), the gossip
#: membership's driver and formation (the UDP endpoint, name resolution, waiting for worker
#: 0's list) and the operators' leadership moves (a leave's drain waits on the loop): the
#: only modules of broker/cluster with an event loop and sockets. Everything else is sans-IO
#: (core, host, storage, simulator, the repair protocol, the metadata's state machine, the
#: nodes' gossip metadata).
IO_MODULES = {
    "node.py",
    "membership_service.py",
    "formation.py",
    "peers.py",
    "peerlink.py",
    "repairer.py",
    "metadata_group.py",
    "metadata_members.py",
    "leadership.py",
}


def test_cluster_imports_no_network_module_outside_the_driver() -> None:
    root = Path(__file__).resolve().parents[3] / "broker" / "cluster"
    bad = [
        (path.name, found)
        for path in sorted(root.glob("*.py"))
        if path.name not in IO_MODULES and (found := forbidden_imports(path.read_text(), NETWORK))
    ]
    assert not bad
    io = [p.name for p in root.glob("*.py") if forbidden_imports(p.read_text(), NETWORK)]
    assert set(io) <= IO_MODULES and "peers.py" in io  # the rule still sees imports


# -- votes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("terms", "state", "vote", "granted"),
    [
        # A newer term, a log as up to date: granted (Raft s5.2).
        ((1, 1), HardState(1, None), Vote(2, 1, 2, 2, 1), True),
        # Longer log of the same last term: granted; shorter: refused (Raft s5.4.1).
        ((1, 1), HardState(1, None), Vote(2, 1, 2, 3, 1), True),
        ((1, 1), HardState(1, None), Vote(2, 1, 2, 1, 1), False),
        # A higher last term wins over a longer log; a lower one loses.
        ((1, 1, 1), HardState(2, None), Vote(2, 1, 3, 1, 2), True),
        ((1, 2), HardState(2, None), Vote(2, 1, 3, 5, 1), False),
        # Already voted for someone else in this term; again for the same candidate.
        ((), HardState(2, 3), Vote(2, 1, 2, 0, 0), False),
        ((), HardState(2, 2), Vote(2, 1, 2, 0, 0), True),
    ],
)
def test_vote(terms: tuple[int, ...], state: HardState, vote: Vote, granted: bool) -> None:
    core, _ = make(terms, state)
    effects = core.receive(vote)
    kept = state.voted_for if vote.term == state.term else None
    new_state = HardState(vote.term, 2 if granted else kept)
    if new_state != state:
        # Raft figure 2: the vote (or the newer term) is durable before the reply leaves.
        assert effects == [PersistHardState(new_state)]
        effects = core.hard_state_persisted(new_state)
    assert sends(effects) == [VoteResp(1, 2, vote.term, granted)]
    assert (core.term, core.voted_for) == (new_state.term, new_state.voted_for)


def test_vote_of_an_older_term_is_dropped() -> None:
    core, _ = make((), HardState(3, None))
    assert core.receive(Vote(2, 1, 2, 9, 9)) == []
    assert core.term == 3


def test_a_granted_vote_waits_for_its_hard_state_even_across_a_newer_one() -> None:
    core, _ = make()
    assert sends(core.receive(Vote(2, 1, 1, 0, 0))) == []
    # A newer term arrives before the vote is durable: still nothing leaves until the latest
    # state is durable, and then both the vote and the newer reply go.
    assert sends(core.receive(AppendEntries(3, 1, 2, 0, 0, (), 0))) == []
    assert sends(core.hard_state_persisted(HardState(1, 2))) == []
    out = sends(core.hard_state_persisted(HardState(2, None)))
    assert [type(m) for m in out] == [VoteResp, AppendResp]


def test_leader_stickiness_ignores_votes_while_the_leader_is_heard() -> None:
    core, _ = make((1,), HardState(1, None))
    core.receive(AppendEntries(2, 1, 1, 1, 1, (), 0))
    assert core.leader == 2
    # Thesis s4.2.3: within the election timeout of hearing the leader, no (pre)vote, and the
    # term stays.
    assert core.receive(Vote(3, 1, 5, 9, 9)) == []
    assert core.receive(PreVote(3, 1, 5, 9, 9)) == []
    assert core.term == 1


def test_pre_vote_moves_no_term() -> None:
    core, _ = make((1,), HardState(1, None))
    # Granted with the asked term in the answer; no hard state written, term unchanged.
    assert core.receive(PreVote(2, 1, 2, 1, 1)) == [Send(PreVoteResp(1, 2, 2, True))]
    assert (core.term, core.voted_for) == (1, None)
    # Refused for a staler log.
    assert core.receive(PreVote(3, 1, 2, 0, 0)) == [Send(PreVoteResp(1, 3, 1, False))]


def test_an_election_starts_with_pre_votes_then_votes_after_the_hard_state() -> None:
    core, log = make((1,), HardState(1, None))
    sent: list[Message] = []
    for _ in range(2 * CONFIG.election_ticks):
        sent += log.apply(core.tick())
    assert core.role is Role.PRE_CANDIDATE and core.term == 1
    assert sent == [PreVote(1, 2, 2, 1, 1), PreVote(1, 3, 2, 1, 1)]
    effects = core.receive(PreVoteResp(2, 1, 2, True))
    assert core.role is Role.CANDIDATE
    assert effects == [PersistHardState(HardState(2, 1))]
    assert sends(core.hard_state_persisted(HardState(2, 1))) == [
        Vote(1, 2, 2, 1, 1),
        Vote(1, 3, 2, 1, 1),
    ]


def test_a_majority_against_ends_the_pre_vote() -> None:
    core, log = make((1,), HardState(1, None))
    while core.role is not Role.PRE_CANDIDATE:
        log.apply(core.tick())
    core.receive(PreVoteResp(2, 1, 1, False))
    core.receive(PreVoteResp(3, 1, 1, False))
    assert core.role is Role.FOLLOWER and core.term == 1


def test_a_new_leader_appends_and_sends_its_noop() -> None:
    core, log = make((1,), HardState(1, None))
    sent = elect(core, log)
    assert core.role is Role.LEADER and core.term == 2
    assert log.items[-1] == NOOP2
    assert sent == [
        AppendEntries(1, 2, 2, 1, 1, (NOOP2,), 0),
        AppendEntries(1, 3, 2, 1, 1, (NOOP2,), 0),
    ]


def test_check_quorum_steps_a_leader_down() -> None:
    core, log = make()
    elect(core, log)
    for _ in range(CONFIG.election_ticks - 1):
        core.tick()
        core.receive(AppendResp(2, 1, core.term, True, 0, 0, 0, None))
    core.tick()
    assert core.role is Role.LEADER  # node 2 answered this period: 2 of 3
    for _ in range(CONFIG.election_ticks):
        core.tick()
    assert core.role is Role.FOLLOWER and core.leader is None  # nobody did


def test_propose_refused_off_the_leader() -> None:
    core, _ = make()
    with pytest.raises(NotLeader):
        core.propose(b"x")


# -- AppendEntries ---------------------------------------------------------------------------


def test_new_entries_are_acknowledged_once_flushed_and_held_ones_at_once() -> None:
    core, _ = make()
    entries = (Entry(1, b"a"), Entry(1, b"b"))
    effects = core.receive(AppendEntries(2, 1, 1, 0, 0, entries, 0))
    assert PersistHardState(HardState(1, None)) in effects
    assert AppendLog(1, entries) in effects and Flush(2) in effects
    assert sends(effects) == []
    assert sends(core.hard_state_persisted(HardState(1, None))) == []  # nothing durable yet
    # A copy of what it holds, not flushed yet: an answer at once, with what is flushed.
    effects = core.receive(AppendEntries(2, 1, 1, 0, 0, entries, 0))
    assert sends(effects) == [AppendResp(1, 2, 1, True, 2, 0, 0, None)]
    assert sends(core.flushed(2)) == [AppendResp(1, 2, 1, True, 2, 2, 0, None)]


@pytest.mark.parametrize(
    ("terms", "prev_index", "prev_term", "hint_index", "hint_term"),
    [
        ((1, 1), 5, 1, 3, None),  # our log is shorter: hint is our last index + 1
        ((1, 1, 2, 2), 4, 3, 3, 2),  # term 2 conflicts: hint its first index
        ((1, 2, 2, 2), 3, 1, 2, 2),
    ],
)
def test_append_rejected(
    terms: tuple[int, ...], prev_index: int, prev_term: int, hint_index: int, hint_term: int | None
) -> None:
    core, log = make(terms, HardState(3, None))
    out = log.apply(core.receive(AppendEntries(2, 1, 3, prev_index, prev_term, (), 0)))
    assert out == [AppendResp(1, 2, 3, False, prev_index, 0, hint_index, hint_term)]
    assert len(log.items) == len(terms)


def test_conflicting_suffix_is_truncated() -> None:
    core, log = make((1, 1, 2, 2), HardState(3, None))
    new = (Entry(3, b"x"),)
    effects = core.receive(AppendEntries(2, 1, 3, 2, 1, new, 0))
    assert effects[:2] == [Truncate(3), AppendLog(3, new)]
    log.apply(effects)
    assert [e.term for e in log.items] == [1, 1, 3]
    assert core.terms.runs() == [(1, 1), (3, 3)]


def test_matching_entries_are_not_truncated() -> None:
    core, log = make((1, 1, 2), HardState(2, None))
    # A stale, shorter copy of what we hold: nothing to cut, nothing to write.
    effects = core.receive(AppendEntries(2, 1, 2, 0, 0, tuple(log.items[:2]), 0))
    assert not any(isinstance(e, Truncate | AppendLog) for e in effects)
    assert sends(effects) == [AppendResp(1, 2, 2, True, 2, 2, 0, None)]


def test_truncation_below_commit_is_refused() -> None:
    core, log = make((1, 1, 1), HardState(1, None))
    core.receive(AppendEntries(2, 1, 1, 3, 1, (), 3))
    assert core.commit == 3
    core.hard_state_persisted(HardState(2, None))
    effects = core.receive(AppendEntries(3, 1, 2, 1, 1, (Entry(2, b"x"),), 3))
    assert not any(isinstance(e, Truncate | AppendLog | Send) for e in effects)
    assert core.refused and len(log.items) == 3


def test_a_stale_leader_is_told_the_term() -> None:
    core, _ = make((), HardState(4, None))
    out = sends(core.receive(AppendEntries(2, 1, 3, 0, 0, (), 0)))
    assert out == [AppendResp(1, 2, 4, False, 0, 0, 0, None)]


def test_a_leader_steps_down_on_a_newer_term() -> None:
    core, log = make()
    elect(core, log)
    core.receive(AppendResp(2, 1, core.term + 1, False, 0, 0, 0, None))
    assert core.role is Role.FOLLOWER and core.term == 2


def test_rejection_backs_off_past_the_conflicting_term() -> None:
    core, log = make((1, 1, 1, 2, 2), HardState(2, 1))
    log.apply(core.hard_state_persisted(HardState(2, 1)))
    elect(core, log)  # term 3; noop at 6
    core.tick()  # heartbeat: prev_index 5 to both
    # Node 2 holds term 1 where we hold term 2 (index 4 on): hint term 1, first index 1.
    # Our last index of term 1 is 3, so the next AppendEntries starts after it.
    out = log.apply(core.receive(AppendResp(2, 1, 3, False, 5, 0, 1, 1)))
    assert [
        (m.prev_index, m.prev_term, len(m.entries))
        for m in out
        if isinstance(m, AppendEntries) and m.to == 2
    ] == [(3, 1, 3)]
    # A follower shorter than we thought: straight to its end.
    out = log.apply(core.receive(AppendResp(3, 1, 3, False, 6, 0, 2, None)))
    assert [
        (m.prev_index, m.prev_term) for m in out if isinstance(m, AppendEntries) and m.to == 3
    ] == [(1, 1)]


# -- commit ----------------------------------------------------------------------------------


def commits(effects: list[Effect]) -> list[int]:
    return [e.index for e in effects if isinstance(e, Commit)]


def test_commit_waits_for_a_majority_to_flush() -> None:
    core, log = make()
    elect(core, log)  # the noop is index 1
    log.apply(core.propose(b"p"))  # index 2
    # Appended (matched) everywhere, but durable nowhere: no commit.
    assert commits(core.receive(AppendResp(2, 1, 1, True, 2, 0, 0, None))) == []
    assert commits(core.receive(AppendResp(3, 1, 1, True, 2, 0, 0, None))) == []
    # The leader's own flush is one of three: still no commit.
    assert commits(core.flushed(2)) == []
    # A follower's flush makes two of three.
    assert commits(core.receive(AppendResp(2, 1, 1, True, 2, 2, 0, None))) == [2]
    assert core.commit == 2


def test_two_followers_flushed_commit_without_the_leader() -> None:
    core, log = make()
    elect(core, log)
    core.receive(AppendResp(2, 1, 1, True, 1, 1, 0, None))
    assert commits(core.receive(AppendResp(3, 1, 1, True, 1, 1, 0, None))) == [1]


def test_an_older_term_entry_is_not_committed_by_counting() -> None:
    # Raft s5.4.2 (figure 8): index 2 of term 2 is on a majority once node 2 flushes it, but
    # only the new leader's noop (index 3, term 3) may commit by counting.
    core, log = make((1, 2), HardState(2, 1))
    log.apply(core.hard_state_persisted(HardState(2, 1)))
    elect(core, log)
    assert core.term == 3 and log.items[-1] == Entry(3, b"", EntryKind.NOOP)
    core.flushed(3)
    assert commits(core.receive(AppendResp(2, 1, 3, True, 2, 2, 0, None))) == []
    assert commits(core.receive(AppendResp(2, 1, 3, True, 3, 3, 0, None))) == [3]


def test_a_follower_commits_only_what_it_knows_matches() -> None:
    core, _ = make((1, 1, 1, 1), HardState(2, None))
    # The leader says commit 4 but only vouches for the prefix up to 2 in this message.
    core.receive(AppendEntries(2, 1, 2, 2, 1, (), 4))
    assert core.commit == 2


# -- commit notices (broker.cluster.commits) --------------------------------------------------


def test_a_moved_commit_is_told_at_once_to_each_follower_that_can_use_it() -> None:
    core, log = make()
    elect(core, log)  # term 1, the noop at 1
    log.apply(core.propose(b"p"))  # 2
    # Node 2 holds the noop, durably: it gets entry 2, whose append carries commit 0.
    sent = log.apply(core.receive(AppendResp(2, 1, 1, True, 1, 1, 0, None)))
    assert [(type(m), m.to, m.commit) for m in sent] == [(AppendEntries, 2, 0)]  # type: ignore[union-attr]
    # The leader's flush commits the noop: node 2 is told now, not at the next heartbeat;
    # node 3 acknowledged nothing, so it could not commit anything: no notice.
    sent = log.apply(core.flushed(2))
    assert core.commit == 1 and sent == [CommitNotice(1, 2, 1, 1)]
    sent = log.apply(core.receive(AppendResp(2, 1, 1, True, 2, 2, 0, None)))
    assert core.commit == 2 and sent == [CommitNotice(1, 2, 1, 2)]
    # Said once: an acknowledgement that moves nothing sends nothing.
    assert log.apply(core.receive(AppendResp(2, 1, 1, True, 2, 2, 0, None))) == []


def test_no_notice_goes_with_an_append_that_carries_the_commit() -> None:
    core, log = make()
    elect(core, log)
    log.apply(core.flushed(1))
    log.apply(core.receive(AppendResp(2, 1, 1, True, 1, 0, 0, None)))  # node 2 matched 1
    log.apply(core.propose(b"p"))  # 2, sent to node 2 with commit 0
    # Node 2's flush of 1 commits it; the same step sends node 2 nothing new, so a notice.
    sent = log.apply(core.receive(AppendResp(2, 1, 1, True, 1, 1, 0, None)))
    assert sent == [CommitNotice(1, 2, 1, 1)]
    # A proposal's append to node 2 carries the commit: no notice beside it.
    sent = log.apply(core.propose(b"q"))
    assert [(type(m), m.commit) for m in sent] == [(AppendEntries, 1)]  # type: ignore[union-attr]


def test_a_notice_commits_only_what_the_follower_knows_matches_and_gets_no_answer() -> None:
    core, log = make((1, 1, 1, 1), HardState(2, None))
    core.receive(AppendEntries(2, 1, 2, 2, 1, (), 0))  # node 2, leader of term 2, vouches to 2
    assert core.commit == 0
    # Raft s5.3: min(leader's commit, what matches), not the follower's last index (4).
    effects = core.receive(CommitNotice(2, 1, 2, 4))
    assert commits(effects) == [2] and sends(effects) == [] and core.leader_commit == 4
    # An append of term 2 replaces 3..4 with entry 3: a notice may now commit it.
    log.apply(core.receive(AppendEntries(2, 1, 2, 2, 1, (Entry(2, b"x"),), 2)))
    assert commits(core.receive(CommitNotice(2, 1, 2, 4))) == [3]
    # An older term's notice is dropped; a newer term's makes the node a follower of its
    # sender that knows nothing matches yet, so it commits nothing.
    assert core.receive(CommitNotice(3, 1, 1, 9)) == []
    effects = core.receive(CommitNotice(3, 1, 5, 9))
    assert (core.term, core.leader, commits(effects)) == (5, 3, [])


def test_a_notice_from_the_leader_holds_off_an_election() -> None:
    core, _ = make((1,), HardState(1, None))
    core.receive(AppendEntries(2, 1, 1, 1, 1, (), 1))
    for _ in range(3 * CONFIG.election_ticks):
        core.tick()
        core.receive(CommitNotice(2, 1, 1, 1))
    assert core.role is Role.FOLLOWER and core.term == 1


# -- leadership transfer ---------------------------------------------------------------------


def test_transfer_to_an_up_to_date_peer_sends_timeout_now() -> None:
    core, log = make()
    elect(core, log)  # term 1, noop at 1
    log.apply(core.flushed(1))
    core.receive(AppendResp(2, 1, 1, True, 1, 1, 0, None))
    assert core.commit == 1
    assert sends(core.transfer_leadership(2)) == [TimeoutNow(1, 2, 1)]
    with pytest.raises(NotLeader) as refused:
        core.propose(b"x")  # thesis s3.10: no proposals while handing over
    assert refused.value.leader == 2


def test_a_transfer_waits_for_the_whole_log_to_commit() -> None:
    """TimeoutNow once the transferee holds the whole log and it is committed: what was
    proposed before is acknowledged by this leader (no outcome left unknown)."""
    core, log = make()
    elect(core, log)
    core.receive(AppendResp(2, 1, 1, True, 1, 0, 0, None))  # n2 has the noop, not durably
    assert sends(core.transfer_leadership(2)) == []  # up to date, nothing committed
    assert sends(core.receive(AppendResp(2, 1, 1, True, 1, 1, 0, None))) == []
    assert TimeoutNow(1, 2, 1) in sends(core.flushed(1))  # the leader's fsync commits it


def test_transfer_catches_the_peer_up_first_then_gives_up_after_a_timeout() -> None:
    core, log = make()
    elect(core, log)
    log.apply(core.flushed(1))
    out = log.apply(core.transfer_leadership(3))
    assert [type(m) for m in out] == [AppendEntries]
    out = log.apply(core.receive(AppendResp(3, 1, 1, True, 1, 1, 0, None)))
    assert TimeoutNow(1, 3, 1) in out
    for _ in range(CONFIG.election_ticks):
        core.receive(AppendResp(2, 1, 1, True, 1, 1, 0, None))  # keep CheckQuorum content
        core.tick()
    assert core.transferee is None and core.role is Role.LEADER
    log.apply(core.propose(b"x"))


def test_timeout_now_starts_an_election_at_once_that_stickiness_does_not_stop() -> None:
    target, _ = make((1,), HardState(1, None), node_id=2)
    effects = target.receive(TimeoutNow(1, 2, 1))
    assert target.role is Role.CANDIDATE and target.term == 2  # no PreVote round
    assert effects == [PersistHardState(HardState(2, 2))]
    votes = sends(target.hard_state_persisted(HardState(2, 2)))
    assert votes == [Vote(2, 1, 2, 1, 1, True), Vote(2, 3, 2, 1, 1, True)]
    # Node 3 hears the old leader, yet grants the transfer's vote (thesis s4.2.3 exempts it).
    voter, _ = make((1,), HardState(1, None), node_id=3)
    voter.receive(AppendEntries(1, 3, 1, 1, 1, (), 0))
    assert voter.receive(Vote(2, 3, 2, 1, 1, False)) == []
    effects = voter.receive(Vote(2, 3, 2, 1, 1, True))
    assert effects == [PersistHardState(HardState(2, 2))]
    assert sends(voter.hard_state_persisted(HardState(2, 2))) == [VoteResp(3, 2, 2, True)]


# -- entries spanning several indexes (one record batch = one entry) -------------------------


def test_a_proposal_covers_count_indexes_and_travels_whole() -> None:
    core, log = make()
    elect(core, log)  # noop at 1
    log.apply(core.flushed(1))
    for peer in (2, 3):  # both accept the noop: they are replicated to, not probed
        log.apply(core.receive(AppendResp(peer, 1, 1, True, 1, 1, 0, None)))
    assert core.commit == 1
    effects = core.propose(b"batch", count=4)
    entry = Entry(1, b"batch", EntryKind.DATA, 4)
    assert AppendLog(2, (entry,)) in effects and Flush(5) in effects
    assert core.terms.last_index == 5
    # Sent at once, prev on the noop's last index.
    assert log.apply(effects) == [
        AppendEntries(1, 2, 1, 1, 1, (entry,), 1),
        AppendEntries(1, 3, 1, 1, 1, (entry,), 1),
    ]
    assert commits(core.receive(AppendResp(2, 1, 1, True, 5, 5, 0, None))) == []
    assert commits(core.flushed(5)) == [5]  # ours and node 2's


def test_a_follower_appends_skips_and_truncates_by_whole_entries() -> None:
    # Ours: term 1 [1..2], term 2 [3..5]. The leader's: the same term-1 entry, then term 3.
    core, log = make((1, 2), HardState(3, None), counts=(2, 3))
    log.apply(core.hard_state_persisted(HardState(3, None)))
    ours = tuple(log.items)
    new = Entry(3, b"x", count=2)
    effects = core.receive(AppendEntries(2, 1, 3, 0, 0, (ours[0], new), 0))
    assert effects[:2] == [Truncate(3), AppendLog(3, (new,))]
    log.apply(effects)
    assert core.terms.runs() == [(1, 1), (3, 3)] and core.terms.last_index == 4
    assert sends(effects) == []  # acknowledged once flushed
    # A stale copy of what we hold: nothing cut, nothing written, the match is its end.
    effects = core.receive(AppendEntries(2, 1, 3, 0, 0, (ours[0],), 0))
    assert not any(isinstance(e, Truncate | AppendLog) for e in effects)
    assert sends(effects) == [AppendResp(1, 2, 3, True, 4, 2, 0, None)]


def test_a_hint_inside_one_of_the_leaders_entries_moves_to_its_start() -> None:
    # Leader: term 1 [1], term 2 [2..4]; elected in term 4, its noop at 5. The follower holds
    # term 1 [1] and a term-3 entry [2..3] (never committed): it is "shorter" than prev 4 and
    # hints its last index + 1 = 4, inside the leader's term-2 entry.
    core, log = make((1, 2), HardState(3, None), counts=(1, 3))
    log.apply(core.hard_state_persisted(HardState(3, None)))
    elect(core, log)
    assert core.term == 4 and core.terms.last_index == 5
    out = log.apply(core.receive(AppendResp(2, 1, 4, False, 4, 0, 4, None)))
    assert [(m.prev_index, m.prev_term, [e.count for e in m.entries]) for m in out] == [
        (1, 1, [3, 1])
    ]


def test_append_entries_are_capped_by_payload_bytes_but_carry_one_entry() -> None:
    config = RaftConfig(election_ticks=10, heartbeat_ticks=1, max_bytes=10)
    core, log = make((1, 1, 1), HardState(1, None), counts=(2, 1, 3), config=config)
    log.items[:] = [Entry(1, bytes(8), count=2), Entry(1, bytes(8)), Entry(1, bytes(20), count=3)]
    log.apply(core.hard_state_persisted(HardState(1, None)))
    elect(core, log)  # term 2, noop at 7; the follower is behind
    out = log.apply(core.receive(AppendResp(2, 1, 2, False, 6, 0, 1, None)))
    assert [(m.prev_index, len(m.entries)) for m in out] == [(0, 1)]  # 8 bytes; 16 > 10
    # Accepted: the rest streams at once, one entry a message (8 + 20 > 10, 20 alone, and
    # 20 + the noop's 0 bytes > 10).
    out = log.apply(core.receive(AppendResp(2, 1, 2, True, 2, 2, 0, None)))
    assert [(m.prev_index, [e.count for e in m.entries]) for m in out] == [
        (2, [1]),
        (3, [3]),
        (6, [1]),
    ]
    assert out[-1].entries == (Entry(2, b"", EntryKind.NOOP),)


def test_propose_refuses_an_empty_entry() -> None:
    core, log = make()
    elect(core, log)
    with pytest.raises(ValueError, match="count"):
        core.propose(b"x", count=0)
