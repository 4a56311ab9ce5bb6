"""Membership changes, learners, snapshots and the probe/replicate progress of the Raft core,
one rule per test (etcd-io/raft's table style): each assertion fails if its rule is broken."""

from __future__ import annotations

import random

import pytest

from broker.cluster.membership import (
    ChangeInProgress,
    ChangeKind,
    Configuration,
    InvalidChange,
    Membership,
    NotCaughtUp,
    overlapping,
)
from broker.cluster.messages import (
    AppendEntries,
    AppendResp,
    Commit,
    Entry,
    EntryKind,
    HardState,
    InstallSnapshot,
    LogStart,
    Message,
    PreVote,
    PreVoteResp,
    ResetLog,
    VoteResp,
)
from broker.cluster.progress import ProgressState
from broker.cluster.raft import NotLeader, RaftConfig, RaftNode, Role
from broker.cluster.terms import TermTable
from tests.unit.cluster.test_raft import Log, commits, sends

CONFIG = RaftConfig(election_ticks=10, heartbeat_ticks=1, max_batch=4, max_inflight=3)
VOTERS = Configuration.of({1, 2, 3})


def config_entry(term: int, conf: Configuration) -> Entry:
    return Entry(term, conf.encode(), EntryKind.CONFIG)


def node(
    node_id: int = 1,
    log: Log | None = None,
    conf: Configuration = VOTERS,
    state: HardState | None = None,
) -> tuple[RaftNode, Log]:
    log = log or Log()
    terms = TermTable()
    for e in log.items:
        terms.append(e.term, e.count)
    configs = [
        (i, Configuration.decode(e.payload))
        for i, e in zip(log.starts(), log.items, strict=True)
        if e.kind is EntryKind.CONFIG
    ]
    membership = Membership(conf, 0, configs)
    core = RaftNode(node_id, conf.voters, log, random.Random(0), CONFIG, state, terms, membership)
    return core, log


def elect(core: RaftNode, log: Log) -> list[Message]:
    """Node 1 wins with node 2's (pre)votes; returns what it sent on winning."""
    for _ in range(3 * CONFIG.election_ticks):
        if core.role is Role.PRE_CANDIDATE:
            break
        log.apply(core.tick())
    log.apply(core.receive(PreVoteResp(2, 1, core.term + 1, True)))
    log.apply(core.hard_state_persisted(HardState(core.term, 1)))
    sent = log.apply(core.receive(PreVoteResp(2, 1, core.term, True)))  # stale: ignored
    sent += log.apply(core.receive(VoteResp(2, 1, core.term, True)))
    assert core.role is Role.LEADER
    return sent


def ack(
    core: RaftNode, log: Log, frm: int, match: int, flushed: int | None = None
) -> list[Message]:
    flushed = match if flushed is None else flushed
    return log.apply(core.receive(AppendResp(frm, 1, core.term, True, match, flushed, 0, None)))


def leader(conf: Configuration = VOTERS, log: Log | None = None) -> tuple[RaftNode, Log]:
    """A leader (node 1) whose no-op is committed, durable on itself and node 2."""
    core, log = node(1, log, conf)
    elect(core, log)
    last = core.terms.last_index
    log.apply(core.flushed(last))
    ack(core, log, 2, last)
    assert core.commit == last
    return core, log


# -- the configuration and its encoding -------------------------------------------------------


def test_configuration_encoding_round_trips_and_rejects_garbage() -> None:
    conf = Configuration.of({3, 1, 2}, {7})
    assert Configuration.decode(conf.encode()) == conf
    assert conf.encode()[:5] == bytes([1, 0, 3, 0, 1])
    with pytest.raises(ValueError, match="version 9"):
        Configuration.decode(bytes([9, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="for 3 voters"):
        Configuration.decode(conf.encode()[:-1])
    with pytest.raises(ValueError, match="both voters and learners"):
        Configuration.of({1}, {1})


@pytest.mark.parametrize(
    ("a", "b", "overlap"),
    [
        ({0, 1, 2}, {0, 1, 2, 3}, True),  # one added
        ({0, 1, 2}, {1, 2}, True),  # one removed
        ({0, 1, 2}, {0, 1, 2, 3, 4}, False),  # two added: {0, 1} and {2, 3, 4}
        ({0, 1, 2}, {1, 2, 3}, False),  # one replaced in one step: {0, 1} and {2, 3}
    ],
)
def test_overlapping_majorities(a: set[int], b: set[int], overlap: bool) -> None:
    assert overlapping(Configuration.of(a), Configuration.of(b)) is overlap
    assert overlapping(Configuration.of(b), Configuration.of(a)) is overlap


def test_membership_history_truncates_compacts_and_resets() -> None:
    c1, c2 = Configuration.of({1, 2}), Configuration.of({1, 2, 3})
    m = Membership(VOTERS, 0, [(4, c1), (9, c2)])
    assert (m.current, m.at(3), m.at(4), m.at(8)) == (c2, VOTERS, c1, c1)
    m.truncate_from(9)
    assert m.current == c1  # thesis s4.1: the entry went, so did its configuration
    m.compact(6)
    assert (m.base_index, m.base, m.current) == (5, c1, c1)
    m.reset(20, c2)
    assert (m.base_index, m.current, m.last_index) == (20, c2, 20)


# -- proposing changes -----------------------------------------------------------------------


def test_a_change_is_in_force_when_appended_and_refused_while_one_is_pending() -> None:
    core, log = leader()
    sent = log.apply(core.propose_change(ChangeKind.ADD_LEARNER, 4))
    assert core.configuration == Configuration.of({1, 2, 3}, {4})  # thesis s4.1: uncommitted
    assert log.items[-1].kind is EntryKind.CONFIG
    # Node 2 replicates; node 3 never answered the no-op's probe, so it waits (PROBE); the
    # learner is probed from the change's own index.
    assert sorted(m.to for m in sent if isinstance(m, AppendEntries)) == [2, 4]
    with pytest.raises(ChangeInProgress, match="not committed yet"):
        core.propose_change(ChangeKind.REMOVE, 3)
    index = core.terms.last_index
    log.apply(core.flushed(index))
    ack(core, log, 2, index)
    assert core.commit == index
    log.apply(core.propose_change(ChangeKind.REMOVE, 3))
    assert core.configuration == Configuration.of({1, 2}, {4})


def test_no_change_before_an_entry_of_the_term_commits() -> None:
    core, log = node()
    elect(core, log)
    assert core.commit == 0
    with pytest.raises(ChangeInProgress, match="no entry of term 1"):
        core.propose_change(ChangeKind.ADD_LEARNER, 4)


@pytest.mark.parametrize(
    ("kind", "who", "error"),
    [
        (ChangeKind.ADD_LEARNER, 2, "already a member"),
        (ChangeKind.PROMOTE, 2, "not a learner"),
        (ChangeKind.REMOVE, 9, "not a member"),
    ],
)
def test_changes_that_make_no_sense_are_refused(kind: ChangeKind, who: int, error: str) -> None:
    core, _ = leader()
    with pytest.raises(InvalidChange, match=error):
        core.propose_change(kind, who)


def test_the_last_voter_cannot_be_removed_and_a_follower_proposes_nothing() -> None:
    core, _ = leader(Configuration.of({1}))
    with pytest.raises(InvalidChange, match="last voter"):
        core.propose_change(ChangeKind.REMOVE, 1)
    follower, _ = node(2)
    with pytest.raises(NotLeader):
        follower.propose_change(ChangeKind.ADD_LEARNER, 4)


# -- learners --------------------------------------------------------------------------------


def test_a_learner_receives_entries_but_never_counts_for_commit() -> None:
    core, log = leader(Configuration.of({1, 2, 3}, {4}))
    log.apply(core.propose(b"x"))
    index = core.terms.last_index
    log.apply(core.flushed(index))
    # The leader and the learner hold it durably: 1 voter of 3, no commit.
    assert commits(core.receive(AppendResp(4, 1, core.term, True, index, index, 0, None))) == []
    assert commits(core.receive(AppendResp(3, 1, core.term, True, index, index, 0, None))) == [
        index
    ]


def test_a_learner_does_not_keep_a_leader_in_office() -> None:
    core, log = leader(Configuration.of({1, 2, 3}, {4}))
    for _ in range(2 * CONFIG.election_ticks):
        core.receive(AppendResp(4, 1, core.term, True, 1, 1, 0, None))
        log.apply(core.tick())
    assert core.role is Role.FOLLOWER  # CheckQuorum heard only the learner


@pytest.mark.parametrize("conf", [Configuration.of({1, 2, 3}, {4}), Configuration.of({1, 2, 3})])
def test_a_learner_or_a_removed_node_never_campaigns(conf: Configuration) -> None:
    core, log = node(4, conf=conf)
    sent = []
    for _ in range(5 * CONFIG.election_ticks):
        sent += log.apply(core.tick())
    assert core.role is Role.FOLLOWER and core.term == 0 and sent == []


def test_a_learners_vote_is_not_counted() -> None:
    core, log = node(1, conf=Configuration.of({1, 2, 3}, {4}))
    sent = []
    while core.role is not Role.PRE_CANDIDATE:
        sent += log.apply(core.tick())
    assert sorted(m.to for m in sent if isinstance(m, PreVote)) == [2, 3]
    core.receive(PreVoteResp(4, 1, core.term + 1, True))
    assert core.role is Role.PRE_CANDIDATE


def test_a_learner_is_promoted_only_once_caught_up() -> None:
    core, log = leader()
    log.apply(core.propose_change(ChangeKind.ADD_LEARNER, 4))
    index = core.terms.last_index
    log.apply(core.flushed(index))
    ack(core, log, 2, index)
    # Slow: the learner's first round (up to the change's index) takes more than an election
    # timeout (thesis s4.2.1).
    for _ in range(CONFIG.election_ticks + 1):
        ack(core, log, 2, index)
        log.apply(core.tick())
    ack(core, log, 4, index)
    with pytest.raises(NotCaughtUp, match="learner 4"):
        core.propose_change(ChangeKind.PROMOTE, 4)
    # The next round (nothing new to send) ends at once: caught up.
    ack(core, log, 4, index)
    log.apply(core.propose_change(ChangeKind.PROMOTE, 4))
    assert core.configuration == Configuration.of({1, 2, 3, 4})


# -- configurations follow the log -------------------------------------------------------------


def test_a_follower_uses_a_configuration_once_appended_and_reverts_it_when_truncated() -> None:
    core, log = node(2)
    added = Configuration.of({1, 2, 3}, {4})
    log.apply(core.receive(AppendEntries(1, 2, 1, 0, 0, (config_entry(1, added),), 0)))
    assert core.configuration == added
    # A leader of term 2 holds something else at index 1: the entry goes, and with it the
    # configuration.
    log.apply(core.hard_state_persisted(HardState(1, None)))
    log.apply(core.receive(AppendEntries(3, 2, 2, 0, 0, (Entry(2, b"y"),), 0)))
    assert core.configuration == VOTERS and len(log.items) == 1


def test_a_restarted_node_takes_the_latest_configuration_in_its_log() -> None:
    log = Log()
    log.items = [Entry(1, b"a"), config_entry(1, Configuration.of({1, 2}, {3}))]
    core, _ = node(3, log, VOTERS)
    assert core.configuration == Configuration.of({1, 2}, {3})
    assert core.peers == [1, 2]


def test_a_leader_that_removes_itself_steps_down_once_the_removal_commits() -> None:
    core, log = leader()
    log.apply(core.propose_change(ChangeKind.REMOVE, 1))
    index = core.terms.last_index
    log.apply(core.flushed(index))
    ack(core, log, 2, index)
    # Thesis s4.2.2: it leads on but does not count itself: one of {2, 3} is not a majority.
    assert core.role is Role.LEADER and core.commit < index
    ack(core, log, 3, index)
    assert core.commit == index and core.role is Role.FOLLOWER
    for _ in range(5 * CONFIG.election_ticks):
        log.apply(core.tick())
    assert core.role is Role.FOLLOWER  # no longer a voter: it never campaigns


# -- snapshots -------------------------------------------------------------------------------


def long_log(n: int, term: int = 1) -> Log:
    log = Log()
    log.items = [Entry(term, f"e{i}".encode()) for i in range(1, n + 1)]
    return log


def test_compaction_is_refused_above_commit_and_returns_the_log_start() -> None:
    core, _ = leader(log=long_log(6))
    with pytest.raises(ValueError, match="commit is 7"):
        core.compacted(9)
    assert core.compacted(6) == LogStart(5, 1, VOTERS)
    assert core.terms.term_at(4) is None and core.terms.term_at(5) == 1


def test_a_follower_behind_the_log_start_gets_a_snapshot_then_entries() -> None:
    core, log = leader(log=long_log(6))  # no-op at 7, committed
    core.compacted(6)
    # Node 3 has nothing: probed at 7, it asks for index 1, which is gone.
    out = log.apply(core.receive(AppendResp(3, 1, core.term, False, 6, 0, 1, None)))
    assert out == [InstallSnapshot(1, 3, core.term, 5, 1, VOTERS)]
    assert core._progress[3].state is ProgressState.SNAPSHOT
    # A heartbeat while the snapshot is in flight carries no entries.
    beats = [m for m in log.apply(core.tick()) if m.to == 3]
    assert [(type(m), len(getattr(m, "entries", ()))) for m in beats] == [(AppendEntries, 0)]
    # The follower took it: the leader streams what follows.
    out = ack(core, log, 3, 5, 5)
    assert [(m.prev_index, len(m.entries)) for m in out if isinstance(m, AppendEntries)] == [(5, 2)]


def test_a_snapshot_replaces_a_log_that_does_not_match() -> None:
    log = Log()
    log.items = [Entry(1, b"a"), Entry(1, b"b")]
    core, _ = node(2, log)
    conf = Configuration.of({1, 2, 3}, {4})
    effects = core.receive(InstallSnapshot(1, 2, 2, 5, 2, conf))
    assert ResetLog(5, 2, conf) in effects and Commit(5) in effects
    log.items = [Entry(2, b"snapshot")] * 5  # the driver's part: the snapshot's data
    log.apply(core.hard_state_persisted(HardState(2, None)))
    assert core.commit == 5 and core.configuration == conf
    assert (core.terms.start, core.terms.last_index, core.durable_index) == (5, 5, 5)
    log.apply(core.receive(AppendEntries(1, 2, 2, 5, 2, (Entry(2, b"f"),), 6)))
    assert log.apply(core.flushed(6))[-1] == AppendResp(2, 1, 2, True, 6, 6, 0, None)


def test_a_snapshot_keeps_matching_entries_beyond_it() -> None:
    core, log = node(2, long_log(8), state=HardState(1, None))
    effects = core.receive(InstallSnapshot(1, 2, 1, 5, 1, VOTERS))
    assert not any(isinstance(e, ResetLog) for e in effects)
    assert core.commit == 5 and len(log.items) == 8 and core.terms.last_index == 8


def test_a_snapshot_below_commit_changes_nothing() -> None:
    core, _ = node(2, long_log(8), state=HardState(1, None))
    core.receive(AppendEntries(1, 2, 1, 8, 1, (), 7))
    effects = core.receive(InstallSnapshot(1, 2, 1, 5, 9, VOTERS))
    assert not any(isinstance(e, ResetLog | Commit) for e in effects)
    assert core.commit == 7


def test_a_follower_compacted_past_prev_index_accepts_what_follows_its_start() -> None:
    core, _ = node(2, long_log(8), state=HardState(1, None))
    core.receive(AppendEntries(1, 2, 1, 8, 1, (), 8))
    core.compacted(7)
    new = (Entry(1, b"e4"), Entry(1, b"e5"), Entry(1, b"e6"), Entry(1, b"e7"), Entry(1, b"x"))
    # prev_index 3 is below our start (6): the entries up to 6 are committed, hence equal.
    out = sends(core.receive(AppendEntries(1, 2, 1, 3, 1, new, 8)))
    assert out == [AppendResp(2, 1, 1, True, 8, 8, 0, None)]
    out = sends(core.receive(AppendEntries(1, 2, 1, 2, 1, (), 8)))
    assert out == [AppendResp(2, 1, 1, True, 8, 8, 0, None)]


def counted_log() -> Log:
    """Term 1: entries of 3, 1 and 4 records ([1..3], [4], [5..8]), then a CONFIG at 9."""
    counts = (3, 1, 4)
    log = Log([Entry(1, f"b{i}".encode(), count=c) for i, c in enumerate(counts, 1)])
    log.items.append(config_entry(1, VOTERS))
    return log


def test_snapshots_and_log_starts_fall_between_multi_record_entries() -> None:
    core, log = leader(log=counted_log())  # no-op at 10, committed
    assert core.membership.last_index == 9
    assert core.compacted(5) == LogStart(4, 1, VOTERS)  # [1..3] and [4] gone
    assert core.terms.term_at(4) == 1 and core.terms.term_at(3) is None
    # Node 3 asks for index 1: it gets the snapshot at 4, an entry's last index ...
    out = log.apply(core.receive(AppendResp(3, 1, core.term, False, 9, 0, 1, None)))
    assert out == [InstallSnapshot(1, 3, core.term, 4, 1, VOTERS)]
    # ... then whole entries from 5: [5..8], the CONFIG at 9, the no-op at 10.
    out = ack(core, log, 3, 4, 4)
    sent = [m for m in out if isinstance(m, AppendEntries)]
    assert [(m.prev_index, [e.count for e in m.entries]) for m in sent] == [(4, [4, 1, 1])]
    # Refused at 9 (say it lost its tail) with a hint inside [5..8], a boundary of its own
    # log: the leader probes from the start of its entry holding it.
    out = log.apply(core.receive(AppendResp(3, 1, core.term, False, 9, 0, 7, None)))
    assert [(m.prev_index, m.entries[0].count) for m in out] == [(4, 4)]


def test_a_follower_clips_whole_entries_below_its_start_and_refuses_one_across_it() -> None:
    core, log = node(2, counted_log(), state=HardState(1, None))
    core.receive(AppendEntries(1, 2, 1, 9, 1, (), 9))
    core.compacted(5)  # starts after index 4
    entries = tuple(log.items)
    # prev 0: [1..3] and [4] are below the start and skipped; [5..8] and 9 are held.
    out = sends(core.receive(AppendEntries(1, 2, 1, 0, 0, entries, 9)))
    assert out == [AppendResp(2, 1, 1, True, 9, 9, 0, None)] and not core.refused
    # An entry [3..6] across the start can only come from a bug: refused, not answered.
    across = (Entry(1, b"x", count=3), Entry(1, b"y", count=4))
    assert sends(core.receive(AppendEntries(1, 2, 1, 0, 0, across, 9))) == []
    assert core.refused == ["an entry across our log's start 4 from 1"]


# -- progress: probe and replicate -------------------------------------------------------------


def batches(sent: list[Message], to: int) -> list[tuple[int, int]]:
    return [
        (m.prev_index, len(m.entries)) for m in sent if isinstance(m, AppendEntries) and m.to == to
    ]


def test_a_far_behind_follower_is_streamed_a_window_at_a_time() -> None:
    core, log = leader(log=long_log(30))  # no-op at 31; node 3 has nothing
    # Probe: one message at a time.
    assert core._progress[3].state is ProgressState.PROBE
    out = log.apply(core.receive(AppendResp(3, 1, core.term, False, 30, 0, 1, None)))
    assert batches(out, 3) == [(0, 4)]
    # Its acceptance makes it REPLICATE: three batches (the window) leave without waiting.
    out = ack(core, log, 3, 4, 0)
    assert core._progress[3].state is ProgressState.REPLICATE
    assert batches(out, 3) == [(4, 4), (8, 4), (12, 4)]
    # Each acknowledgement frees the slots it covers and refills them.
    assert batches(ack(core, log, 3, 12, 0), 3) == [(16, 4), (20, 4)]
    # A full window does not hold back a heartbeat: node 2 and node 3 both get one.
    out = log.apply(core.tick())
    assert sorted(m.to for m in out) == [2, 3]
    assert batches(out, 3) == [(12, 0)]  # anchored at what node 3 acknowledged


def test_a_rejection_sends_a_replicating_follower_back_to_probe() -> None:
    core, log = leader(log=long_log(30))
    log.apply(core.receive(AppendResp(3, 1, core.term, False, 30, 0, 1, None)))
    ack(core, log, 3, 4, 0)
    # It lost its tail (a crash): the next rejection probes from its hint.
    out = log.apply(core.receive(AppendResp(3, 1, core.term, False, 16, 0, 3, None)))
    assert core._progress[3].state is ProgressState.PROBE
    assert batches(out, 3) == [(2, 4)]
    # A rejection older than what it acknowledged since is ignored in REPLICATE.
    ack(core, log, 3, 6, 0)
    assert core._progress[3].state is ProgressState.REPLICATE
    assert log.apply(core.receive(AppendResp(3, 1, core.term, False, 4, 0, 3, None))) == []


def test_a_removed_server_that_missed_its_removal_cannot_disrupt() -> None:
    """Thesis s4.2.3: node 3 was removed but never got the entry, so it still campaigns. A
    voter that hears the leader ignores it (stickiness); one that does not refuses it for its
    older log (PreVote, thesis s9.6); either way no term moves."""
    removal = config_entry(1, Configuration.of({1, 2}))
    log = Log()
    log.items = [Entry(1, b"a"), removal]
    core, _ = node(2, log, state=HardState(1, None))
    core.receive(AppendEntries(1, 2, 1, 2, 1, (), 2))
    assert core.configuration.voters == {1, 2}
    assert core.receive(PreVote(3, 2, 2, 1, 1)) == []
    for _ in range(CONFIG.election_ticks):
        core.tick()
    assert sends(core.receive(PreVote(3, 2, 2, 1, 1))) == [PreVoteResp(2, 3, 1, False)]
    assert core.term == 1
