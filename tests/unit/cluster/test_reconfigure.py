"""Groups moved to new replicas one single-server change at a time (broker.cluster.reconfigure),
on MultiRaft hosts (test_multiraft's deterministic network): a node that was never a replica
joins as a learner when a leader replicates to it (``MultiRaft.join_group``), catches up, is
promoted, and the replica placement no longer wants is removed, while proposals go on; a dead
replica is removed before its replacement is added. After every step: at most one leader per
term, and nothing committed is ever lost or changed (the harness checks both)."""

from __future__ import annotations

import random

import pytest

from broker.cluster.membership import ChangeKind, ChangeRefused, Configuration
from broker.cluster.multiraft import MultiRaft
from broker.cluster.raft import NotLeader, RaftNode, Role
from broker.cluster.reconfigure import Step, next_step, take
from tests.unit.cluster.test_multiraft import CONFIG, MemLog, Net


class MovingNet(Net):
    """``Net`` whose groups start on ``first`` (not on every node): the other nodes host a
    group only once a leader replicates it to them."""

    def __init__(self, groups: int, nodes: int, first: list[int], seed: int) -> None:
        self.first = first
        super().__init__(groups=groups, nodes=nodes, seed=seed)

    def step(self, tick: bool = True) -> None:
        super().step(tick)
        # At most one leader per term, over the hosts of each group.
        for host in self.live():
            for g in host.groups:
                core = host.core(g)
                if core.role is Role.LEADER:
                    first = self.leaders.setdefault((g, core.term), host.id)
                    assert first == host.id, f"g{g}: two leaders in term {core.term}"

    def start(self, node: int) -> None:
        host = MultiRaft(node, range(self.n), random.Random(self.rng.random()), CONFIG)
        if node in self.first:
            for g in self.group_ids:
                host.add_group(g, list(self.first), self.logs[node][g])
        host.on_unknown_group = lambda g, leader, host=host, node=node: (
            host.join_group(g, leader, self.logs[node][g]) and None
        )
        self.hosts[node] = host

    def majority(self, host: MultiRaft, g: int, index: int, nodes: list[int]) -> bool:
        """A majority of the voters of the configuration in force at ``index`` on the node
        that committed it (thesis s4.1: each entry is committed under the configuration its
        leader used then)."""
        conf = host.core(g).membership.at(index)
        return len(conf.voters & set(nodes)) >= conf.quorum

    def members(self, g: int) -> Configuration | None:
        """The configuration every live host of the group agrees on, committed by its
        leader; None while they differ or a change is in flight."""
        lead = self.leader_of(g)
        if lead is None or lead.membership.last_index > lead.commit:
            return None
        conf = lead.configuration
        for n in conf.members:
            host = self.hosts[n]
            if host is None or g not in host.groups or host.core(g).configuration != conf:
                return None
        return conf

    def leader_of(self, g: int) -> RaftNode | None:
        """The live leader of the highest term among the hosts of ``g``."""
        leads = [h.core(g) for h in self.live() if g in h.groups and h.core(g).role is Role.LEADER]
        return max(leads, key=lambda c: c.term, default=None)

    def drive(self, desired: list[int], live: set[int], propose: bool = True) -> list[Step]:
        """One planner pass over the groups' leaders (and a proposal to each); the steps
        taken."""
        taken = []
        for g in self.group_ids:
            lead = self.leader_of(g)
            if lead is None:
                continue
            host = self.host(lead.id)
            if propose:
                try:
                    host.propose(g, f"v{self.now}-{g}".encode())
                except NotLeader:
                    continue
            step = next_step(lead, desired, live)
            if step is None:
                continue
            try:
                take(host, g, step)
            except (ChangeRefused, NotLeader):
                continue
            taken.append(step)
        return taken

    def settled(self, voters: set[int]) -> bool:
        return all(
            (conf := self.members(g)) is not None and conf.voters == voters and not conf.learners
            for g in self.group_ids
        )

    def committed_equal(self, nodes: list[int]) -> None:
        """Every node of ``nodes`` holds the same committed prefix of every group, and it
        is the longest any node ever reported committed."""
        for g in self.group_ids:
            cores = [self.host(n).core(g) for n in nodes]
            upto = min(c.commit for c in cores)
            prefixes = {tuple(self.logs[n][g].prefix(upto)) for n in nodes}
            assert len(prefixes) == 1, f"g{g}: committed prefixes differ"
            assert sum(e.count for e in self.committed[g]) == max(c.commit for c in cores)


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_groups_move_to_a_node_that_never_held_them_while_proposals_go_on(seed: int) -> None:
    net = MovingNet(groups=6, nodes=4, first=[0, 1, 2], seed=seed)
    net.run_until(lambda: all(net.leader_of(g) for g in net.group_ids), 200)
    assert net.host(3).groups == []
    desired, steps = [1, 2, 3], []
    for _ in range(600):
        steps += net.drive(desired, live={0, 1, 2, 3})
        net.step()
        if net.settled({1, 2, 3}):
            break
    assert net.settled({1, 2, 3}), [net.members(g) for g in net.group_ids]
    # Add before remove (node 0 was live): learner, promotion, then 0 removed; where node 0
    # led, it handed the lead to a wanted voter first.
    for g in net.group_ids:
        assert net.leader_of(g).id in {1, 2, 3}  # type: ignore[union-attr]
    kinds = [s.kind for s in steps]
    assert kinds.count(ChangeKind.ADD_LEARNER) == 6 and kinds.count(ChangeKind.PROMOTE) == 6
    assert kinds.count(ChangeKind.REMOVE) == 6
    assert net.host(3).stats.joined == 6
    net.run(30)
    net.committed_equal([1, 2, 3])
    # What was proposed before node 3 joined is in its log (it caught up from index 1).
    for g in net.group_ids:
        assert net.logs[3][g].items[:3] == net.logs[1][g].items[:3]


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_a_dead_replica_is_removed_before_its_replacement_is_added(seed: int) -> None:
    net = MovingNet(groups=4, nodes=4, first=[0, 1, 2], seed=seed)
    net.run_until(lambda: all(net.leader_of(g) for g in net.group_ids), 200)
    net.crash(0)
    net.run_until(lambda: all(net.leader_of(g) for g in net.group_ids), 300)
    firsts: dict[int, Step] = {}
    for _ in range(600):
        for step in net.drive([1, 2, 3], live={1, 2, 3}):
            firsts.setdefault(len(firsts), step)
        net.step()
        if net.settled({1, 2, 3}):
            break
    assert net.settled({1, 2, 3})
    # Every group's first step removed the dead voter (its majority needed 1 and 2 anyway).
    assert all(s == Step(ChangeKind.REMOVE, 0) for s in list(firsts.values())[:4])
    net.run(30)
    net.committed_equal([1, 2, 3])


def test_a_wanted_node_that_is_not_live_is_waited_for_and_nothing_shrinks() -> None:
    net = MovingNet(groups=2, nodes=4, first=[0, 1, 2], seed=7)
    net.run_until(lambda: all(net.leader_of(g) for g in net.group_ids), 200)
    for _ in range(50):
        assert net.drive([1, 2, 3], live={0, 1, 2}) == []
        net.step()
    assert all(net.members(g) == Configuration.of({0, 1, 2}) for g in net.group_ids)


def _led_by(voters: set[int], leader: int) -> RaftNode:
    """The core of ``leader``, leading a group of ``voters`` with an entry of its term
    committed (what the planner waits for)."""
    net = MovingNet(groups=1, nodes=5, first=sorted(voters), seed=11)
    net.run_until(lambda: net.leader_of(0) is not None and net.members(0) is not None, 300)
    lead = net.leader_of(0)
    assert lead is not None
    if lead.id != leader:
        net.host(lead.id).transfer_leadership(0, leader)

    def ready() -> bool:
        core = net.leader_of(0)
        return (
            core is not None
            and core.id == leader
            and core.terms.term_at(core.commit) == core.term
            and all(pr.match == core.terms.last_index for pr in core.progress.values())
        )

    net.run_until(ready, 300)
    return net.host(leader).core(0)


@pytest.mark.parametrize(
    ("voters", "desired", "live", "expected"),
    [
        # a dead unwanted voter goes first
        ({0, 1, 2}, [1, 2, 3], {1, 2, 3}, Step(ChangeKind.REMOVE, 0)),
        # a live unwanted voter stays until its replacement votes: add first
        ({0, 1, 2}, [1, 2, 3], {0, 1, 2, 3}, Step(ChangeKind.ADD_LEARNER, 3)),
        # placement order decides which missing node comes first
        ({0, 1, 2}, [1, 4, 3], {0, 1, 2, 3, 4}, Step(ChangeKind.ADD_LEARNER, 4)),
        # a missing node that is not live is not added; nothing shrinks meanwhile
        ({0, 1, 2}, [1, 2, 3], {0, 1, 2}, None),
        # nothing to do
        ({0, 1, 2}, [0, 1, 2], {0, 1, 2}, None),
        # every wanted node votes: the unwanted live one is removed
        ({0, 1, 2, 3}, [0, 1, 2], {0, 1, 2, 3}, Step(ChangeKind.REMOVE, 3)),
        # the unwanted one leads: it hands over to the most caught-up wanted voter (all are)
        ({0, 1, 2, 3}, [0, 2, 3], {0, 1, 2, 3}, Step(None, 0)),
    ],
)
def test_the_planners_order(
    voters: set[int], desired: list[int], live: set[int], expected: Step | None
) -> None:
    assert next_step(_led_by(voters, leader=1), desired, live) == expected


def test_a_node_joins_only_on_a_leaders_replication_and_as_a_learner() -> None:
    host = MultiRaft(3, range(4), random.Random(1), CONFIG)
    logs: dict[int, MemLog] = {}
    host.on_unknown_group = lambda g, leader: None
    core = host.join_group(9, 0, logs.setdefault(9, MemLog()))
    assert core.configuration == Configuration.of({0}, {3})
    for _ in range(10 * CONFIG.election_ticks):
        host.tick()
    assert core.role is Role.FOLLOWER and core.term == 0  # a learner never campaigns
    assert not host.ready().frames or all(not f.messages for f in host.ready().frames)
    assert host.stats.joined == 1


def test_an_idle_groups_learner_slow_to_catch_up_is_still_promoted() -> None:
    """A learner whose first round of catch-up took longer than an election timeout is not
    caught up yet (thesis s4.2.1); its next round must be able to end. The group takes no
    proposals, so it would quiesce: a group with a learner never quiesces."""
    net = MovingNet(groups=2, nodes=4, first=[0, 1, 2], seed=9)
    net.run_until(lambda: all(net.members(g) for g in net.group_ids), 300)
    net.run(CONFIG.election_ticks)  # each term's first entry committed
    net.blocked |= {(n, 3) for n in range(3)}  # its catch-up stalls past an election timeout
    for g in net.group_ids:
        lead = net.leader_of(g)
        assert lead is not None
        net.host(lead.id).propose_change(g, ChangeKind.ADD_LEARNER, 3)
    net.run(3 * CONFIG.election_ticks)
    net.blocked.clear()
    for _ in range(400):
        net.drive([0, 1, 2, 3], live={0, 1, 2, 3}, propose=False)
        net.step()
        if net.settled({0, 1, 2, 3}):
            break
    assert net.settled({0, 1, 2, 3}), [net.members(g) for g in net.group_ids]
