"""MultiRaft hosts on a small deterministic network: frames, coalesced heartbeats, quiescence.

``Net`` runs N ``MultiRaft`` hosts in virtual time (one step = one tick of every live host),
over an in-memory network whose delays and drops come from one seeded ``random.Random``, with
partitions, crashes (a host loses its unflushed tails) and restarts. Each step a host's output
is drained once (``ready()``); its fsync round completes right after, and what that releases
leaves with the next step's frames. Every drain asserts at most one frame per peer node.
"""

from __future__ import annotations

import contextlib
import heapq
import random
from collections.abc import Callable

import pytest

from broker.cluster.frames import Ack, Beat, Frame, ack_message, beat_message
from broker.cluster.messages import AppendEntries, AppendResp, Entry, HardState
from broker.cluster.multiraft import MultiRaft
from broker.cluster.raft import NotLeader, RaftConfig, RaftNode, Role
from broker.cluster.terms import TermTable

CONFIG = RaftConfig(election_ticks=10, heartbeat_ticks=2)


class MemLog:
    """One group's log on one node: entries, how many are durable, the durable hard state."""

    def __init__(self) -> None:
        self.items: list[Entry] = []
        self.durable = 0
        self.hard = HardState(0, None)

    def entries(self, first: int, last: int) -> list[Entry]:
        return self.items[first - 1 : last]

    def append(self, first_index: int, entries: tuple[Entry, ...]) -> None:
        assert first_index == len(self.items) + 1, (first_index, len(self.items))
        self.items.extend(entries)

    def truncate(self, from_index: int) -> None:
        del self.items[from_index - 1 :]
        self.durable = min(self.durable, from_index - 1)


class Net:
    def __init__(
        self,
        groups: int,
        nodes: int = 3,
        seed: int = 1,
        quiesce: bool = True,
        drop: float = 0.0,
        max_delay: int = 1,
    ) -> None:
        self.rng = random.Random(seed)
        self.n = nodes
        self.group_ids = range(groups)
        self.quiesce = quiesce
        self.drop = drop
        self.max_delay = max_delay
        self.logs = [[MemLog() for _ in self.group_ids] for _ in range(nodes)]
        self.hosts: list[MultiRaft | None] = [None] * nodes
        self.now = 0
        self._wire: list[tuple[int, int, Frame]] = []
        self._seq = 0
        self.blocked: set[tuple[int, int]] = set()
        #: Beats put on the wire, group messages of any kind, frames.
        self.beats = 0
        self.carried = 0
        self.frames = 0
        #: (group, term) -> the node that led it: at most one leader per term.
        self.leaders: dict[tuple[int, int], int] = {}
        for node in range(nodes):
            self.start(node)

    # -- nodes -------------------------------------------------------------------------------

    def start(self, node: int) -> None:
        host = MultiRaft(
            node, range(self.n), random.Random(self.rng.random()), CONFIG, self.quiesce
        )
        for g in self.group_ids:
            log = self.logs[node][g]
            terms = TermTable.of_terms(e.term for e in log.items)
            host.add_group(g, list(range(self.n)), log, log.hard, terms)
        self.hosts[node] = host

    def crash(self, node: int) -> None:
        self.hosts[node] = None
        for log in self.logs[node]:
            del log.items[log.durable :]

    def host(self, node: int) -> MultiRaft:
        host = self.hosts[node]
        assert host is not None
        return host

    def live(self) -> list[MultiRaft]:
        return [h for h in self.hosts if h is not None]

    def partition(self, node: int) -> None:
        for other in range(self.n):
            if other != node:
                self.blocked |= {(node, other), (other, node)}

    # -- running -----------------------------------------------------------------------------

    def step(self) -> None:
        self.now += 1
        for host in self.live():
            host.tick()
        while self._wire and self._wire[0][0] <= self.now:
            _, _, frame = heapq.heappop(self._wire)
            dest = self.hosts[frame.to]
            if dest is not None and (frame.frm, frame.to) not in self.blocked:
                dest.receive(frame)
        for host in self.live():
            self._drain(host)

    def _drain(self, host: MultiRaft) -> None:
        ready = host.ready()
        dests = [f.to for f in ready.frames]
        assert len(dests) == len(set(dests)), f"n{host.id}: several frames to one node"
        for frame in ready.frames:
            self.frames += 1
            self.beats += len(frame.beats)
            self.carried += len(frame)
            if self.rng.random() < self.drop:
                continue
            self._seq += 1
            due = self.now + self.rng.randint(1, self.max_delay)
            heapq.heappush(self._wire, (due, self._seq, frame))
        logs = self.logs[host.id]
        for g, state in ready.hard_states.items():
            logs[g].hard = state
        for g, index in ready.flushes.items():
            logs[g].durable = max(logs[g].durable, min(index, len(logs[g].items)))
        host.hard_states_persisted(ready.hard_states.items())
        host.flushed(ready.flushes.items())
        for g in ready.commits:
            core = host.core(g)
            if core.role is Role.LEADER:
                first = self.leaders.setdefault((g, core.term), host.id)
                assert first == host.id, f"g{g}: two leaders in term {core.term}"

    def run_until(self, done: Callable[[], bool], limit: int) -> int:
        """Step until ``done()``; the steps it took. Fails past ``limit`` steps."""
        start = self.now
        while not done():
            assert self.now - start < limit, f"not done after {limit} ticks"
            self.step()
        return self.now - start

    def run(self, ticks: int) -> None:
        for _ in range(ticks):
            self.step()

    # -- views -------------------------------------------------------------------------------

    def leader(self, g: int) -> RaftNode | None:
        """The leader every live node follows in its term, if there is one."""
        cores = [h.core(g) for h in self.live()]
        leads = [c for c in cores if c.role is Role.LEADER]
        if len(leads) != 1:
            return None
        lead = leads[0]
        return lead if all(c.term == lead.term and c.leader == lead.id for c in cores) else None

    def leader_among(self, g: int, nodes: tuple[int, ...]) -> RaftNode | None:
        """A leader on one of ``nodes`` that the others of ``nodes`` follow in its term."""
        cores = [self.host(n).core(g) for n in nodes]
        lead = next((c for c in cores if c.role is Role.LEADER), None)
        if lead is None or any(c.term != lead.term or c.leader != lead.id for c in cores):
            return None
        return lead

    def all_led(self) -> bool:
        return all(self.leader(g) is not None for g in self.group_ids)

    def all_quiesced(self) -> bool:
        return all(h.ticking == 0 for h in self.live())

    def elect(self) -> None:
        self.run_until(self.all_led, 200)

    def check_logs(self) -> None:
        """Log matching over what is committed: every node's committed prefix is the same."""
        for g in self.group_ids:
            cores = [(h.core(g), self.logs[h.id][g]) for h in self.live()]
            upto = min(c.commit for c, _ in cores)
            prefixes = {tuple(log.items[:upto]) for _, log in cores}
            assert len(prefixes) == 1, f"g{g}: committed prefixes differ"


def settle(net: Net) -> None:
    net.elect()
    net.run_until(net.all_quiesced, 100)


# -- frames ----------------------------------------------------------------------------------


def test_beats_and_acks_rebuild_the_messages_the_cores_sent() -> None:
    beat = AppendEntries(1, 2, 7, 12, 6, (), 11)
    ack = AppendResp(1, 2, 7, True, 12, 10, 0, None)
    refusal = AppendResp(1, 2, 7, False, 12, 0, 9, 5)
    append = AppendEntries(1, 2, 7, 12, 6, (Entry(7, b"x"),), 11)
    frame = Frame(1, 2)
    for m in (beat, ack, refusal, append):
        frame.put(4, m)
    assert frame.beats == [Beat(4, 7, 11, 12, 6, False)]
    assert beat_message(1, 2, frame.beats[0]) == beat
    assert frame.acks == [Ack(4, 7, 12, 10)]
    assert ack_message(1, 2, frame.acks[0]) == ack
    # Anything else travels whole beside its group.
    assert frame.messages == [(4, refusal), (4, append)]
    assert len(frame) == 4


def test_every_node_pair_gets_one_frame_per_step_carrying_every_group() -> None:
    net = Net(groups=40)
    net.elect()
    for g in net.group_ids:
        lead = net.leader(g)
        assert lead is not None
        for i in range(3):
            net.host(lead.id).propose(g, f"g{g}v{i}".encode())
    before_frames, before_carried = net.frames, net.carried
    net.run(5)
    # 3 nodes, 6 ordered pairs: at most 6 frames a step (each drain asserts one per pair),
    # though each frame carries many groups' messages.
    assert net.frames - before_frames <= 6 * 5
    assert net.carried - before_carried > 4 * (net.frames - before_frames)


def test_proposals_commit_across_many_groups() -> None:
    net = Net(groups=50, seed=3, max_delay=3)
    net.elect()
    want: dict[int, list[bytes]] = {}
    for g in net.group_ids:
        lead = net.leader(g)
        assert lead is not None
        want[g] = [f"g{g}v{i}".encode() for i in range(5)]
        for value in want[g]:
            net.host(lead.id).propose(g, value)

    def committed() -> bool:
        return all(
            [e.payload for e in net.logs[h.id][g].items[: h.core(g).commit] if e.payload] == want[g]
            for h in net.live()
            for g in net.group_ids
        )

    net.run_until(committed, 50)
    net.check_logs()


# -- quiescence ------------------------------------------------------------------------------


def test_idle_groups_quiesce_and_their_heartbeats_stop() -> None:
    net = Net(groups=100)
    settle(net)
    hosts = net.live()
    ticks = [h.stats.group_ticks for h in hosts]
    beats, frames = net.beats, net.frames
    net.run(100)
    # Not one core ticked, not one beat sent; the node pairs still exchange (empty) frames,
    # one per heartbeat interval each way: node liveness.
    assert [h.stats.group_ticks for h in hosts] == ticks
    assert net.beats == beats
    assert net.frames - frames == 6 * 100 // CONFIG.heartbeat_ticks
    assert all(h.core(g).role is not Role.CANDIDATE for h in hosts for g in net.group_ids)
    assert net.all_led()


def test_without_quiescence_every_group_keeps_beating() -> None:
    net = Net(groups=100, quiesce=False)
    net.elect()
    net.run(20)
    beats = net.beats
    net.run(100)
    # Each leader beats to 2 followers every 2 ticks.
    assert net.beats - beats == 100 * 2 * 100 // CONFIG.heartbeat_ticks
    assert all(h.ticking == 100 for h in net.live())


def test_a_proposal_wakes_its_group_alone_and_it_quiesces_again() -> None:
    net = Net(groups=20)
    settle(net)
    lead = net.leader(7)
    assert lead is not None
    host = net.host(lead.id)
    index = host.propose(7, b"wake")
    assert not host.quiesced(7) and host.ticking == 1
    net.run(1)
    assert all(h.ticking <= 1 for h in net.live())
    net.run_until(net.all_quiesced, 20)
    assert all(h.core(7).commit == index for h in net.live())
    assert net.logs[lead.id][7].items[index - 1].payload == b"wake"


def test_a_lost_quiesce_notice_costs_a_wake_up_not_an_election() -> None:
    net = Net(groups=30, seed=5, drop=0.2, max_delay=2)
    net.elect()
    terms = {g: net.leader(g).term for g in net.group_ids}  # type: ignore[union-attr]
    net.run_until(net.all_quiesced, 400)
    net.drop = 0.0
    net.run(50)
    assert net.all_quiesced()
    # Beats dropped on the way to quiescence woke groups again; a few may have re-elected
    # (a follower that heard nothing for an election timeout), never more than one leader per
    # term, and everything committed agrees.
    assert sum(net.leader(g).term != terms[g] for g in net.group_ids) <= 3  # type: ignore[union-attr]
    net.check_logs()


def failover(seed: int, quiesce: bool) -> tuple[Net, int, int]:
    """1,000 groups all led by node 0, idle (quiesced if ``quiesce``); node 0 dies. The ticks
    until the first group, and until every group, has a new leader the other two follow."""
    net = Net(groups=1000, seed=seed, quiesce=quiesce)
    net.elect()
    for g in net.group_ids:
        lead = net.leader(g)
        assert lead is not None
        if lead.id != 0:
            net.host(lead.id).transfer_leadership(g, 0)
    net.run_until(lambda: all(net.host(0).core(g).role is Role.LEADER for g in net.group_ids), 50)
    net.run_until(net.all_quiesced, 50) if quiesce else net.run(20)
    net.crash(0)
    first = net.run_until(lambda: any(net.leader(g) for g in net.group_ids), 100)
    return net, first, first + net.run_until(net.all_led, 300)


def test_a_dead_leader_node_wakes_its_thousand_quiesced_groups_and_they_elect() -> None:
    net, first, every = failover(seed=7, quiesce=True)
    assert all(h.stats.woken_by_silence == 1000 for h in net.live())
    assert {net.leader(g).id for g in net.group_ids} == {1, 2}  # type: ignore[union-attr]
    # Nothing happens until node 0 has been silent for an election timeout; then the groups
    # elect as groups that never quiesced do (same cluster, node 0 killed while they beat):
    # the tail is split votes between the two survivors, re-run after a randomized timeout.
    assert CONFIG.election_ticks <= first <= 3 * CONFIG.election_ticks
    assert every <= 15 * CONFIG.election_ticks


def test_a_partitioned_node_rejoins_and_catches_up() -> None:
    net = Net(groups=30, seed=11, max_delay=2)
    settle(net)
    net.partition(2)
    # Node 2 hears nobody: the groups it led elect on nodes 0 and 1, and its own followers
    # wake and pre-vote in vain (PreVote: they move no term).
    net.run_until(lambda: all(net.leader_among(g, (0, 1)) for g in net.group_ids), 150)
    for g in net.group_ids:
        lead = net.leader_among(g, (0, 1))
        assert lead is not None
        net.host(lead.id).propose(g, f"cut{g}".encode())
    net.run(20)
    net.blocked.clear()
    net.run_until(lambda: net.all_led() and net.all_quiesced(), 150)
    for g in net.group_ids:
        lead = net.leader(g)
        assert lead is not None and lead.id != 2
        assert net.host(2).core(g).commit == lead.commit
        assert net.logs[2][g].items[-1].payload == f"cut{g}".encode()
    net.check_logs()


def test_a_restarted_node_is_caught_up_and_quiesces_again() -> None:
    net = Net(groups=20, seed=13)
    settle(net)
    net.crash(2)
    net.run_until(lambda: all(net.leader_among(g, (0, 1)) for g in net.group_ids), 150)
    for g in net.group_ids:
        lead = net.leader_among(g, (0, 1))
        assert lead is not None
        net.host(lead.id).propose(g, b"while down")
    net.run(10)
    net.start(2)
    net.run_until(lambda: net.all_led() and net.all_quiesced(), 150)
    net.check_logs()
    assert all(net.logs[2][g].items[-1].payload == b"while down" for g in net.group_ids)


@pytest.mark.parametrize("seed", range(4))
def test_under_drops_and_partitions_safety_holds_and_groups_settle(seed: int) -> None:
    net = Net(groups=10, seed=seed, drop=0.1, max_delay=4)
    rng = random.Random(seed)
    for _ in range(20):
        net.run(rng.randrange(5, 25))
        for g in net.group_ids:
            for h in net.live():
                if h.core(g).role is Role.LEADER and rng.random() < 0.5:
                    with contextlib.suppress(NotLeader):  # a leader handing over
                        h.propose(g, f"s{seed}t{net.now}g{g}".encode())
        if rng.random() < 0.3:
            net.blocked.clear()
            net.partition(rng.randrange(3))
        elif rng.random() < 0.5:
            net.blocked.clear()
    net.blocked.clear()
    net.drop = 0.0
    net.run_until(lambda: net.all_led() and net.all_quiesced(), 300)
    net.check_logs()
