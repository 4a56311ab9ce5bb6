"""Deterministic simulation of Raft groups (FoundationDB / TigerBeetle style).

One seeded ``random.Random`` decides everything: virtual time in milliseconds, a network that
delays, drops, duplicates and reorders messages and partitions nodes (both ways or one way), a
disk per node whose appends land in an unflushed tail that a crash loses (as it loses a hard
state whose write had not completed), crashes that may leave a torn prefix of the first
unflushed batch (which recovery cuts) and restarts that rebuild each core from what was
durable, pauses, leadership transfers, damaged (unreadable) entries
(``broker.cluster.simdamage``), clock-rate skew (each node's tick interval scaled by a
factor in [0.9, 1.1]), retention that removes a durable committed prefix of whole entries from
a random node's log (so that leaders send snapshots), a workload of proposals with unique
values, each an entry of 1-5 records (indexes; index = log offset + 1), and membership changes
during the faults: each group starts with 3 voters among up to 5 nodes, and a node that believes
it leads is told at random to add a learner, promote one, or remove a learner or a voter (itself
too), so members are replaced one at a time. After every event the invariants below
(``broker.cluster.simchecks``) are checked; a failing seed prints itself and its last events,
and running that seed again replays it exactly.

Safety (checked throughout): at most one leader per term; log matching (two logs holding the
same index with the same term hold the same entry there, same boundaries, and the same prefix up
to it, checked by a hash chain for every index an entry covers); leader completeness (a leader
holds every committed entry); no committed entry lost or changed (a majority of the voters of
the configuration that committed it keeps it durably, so a learner never counts, and every
commit index a node reports is an entry's end and covers the same entries); the commit index
never moves back during a node's life; a node never acts in a term lower than one it has spoken
in and never grants two votes in one term, across restarts; every acknowledged proposal is
committed at the index it was acknowledged at; no two configurations a leader may be using at
once (the one in force at the commit index and any later one in its log) could form disjoint
majorities; nothing reads, truncates or commits inside an entry or below a log's start.

Liveness (after the faults heal and the last pause ends): every group elects a leader that
every node follows, and proposals made then all commit (one whose leader lost office first is
made again, as a client would retry), within ``LIVENESS_MS``; otherwise the seed is "stuck".
A node that is not a member of the leader's configuration need not follow it.

Run: ``python -m broker.cluster.sim --seeds N [--start S] [--nodes 3] [--groups 8] [--jobs J]``
(``--jobs``: seeds run on J processes; the output is the same as on one).
"""

from __future__ import annotations

import argparse
import heapq
import multiprocessing
import random
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.cluster.membership import Configuration
from broker.cluster.messages import (
    AppendLog,
    Commit,
    Effect,
    Entry,
    Flush,
    HardState,
    InstallSnapshot,
    Message,
    PersistHardState,
    PreVote,
    PreVoteResp,
    ResetLog,
    Send,
    Truncate,
    VoteResp,
)
from broker.cluster.raft import RaftConfig, RaftNode, Role, Variant
from broker.cluster.simchecks import SafetyChecks
from broker.cluster.simdamage import DamageEvents
from broker.cluster.simstate import Disk, EntryLog, GroupRecord, Violation, chain
from broker.cluster.terms import TermTable

__all__ = ["Outcome", "Sim", "Stuck", "Violation", "main", "run_seeds"]

TICK_MS = 10
FAULT_MS = 3_000
LIVENESS_MS = 5_000
PROPOSE_EVERY_MS = 15
HEALED_PROPOSALS = 3
TRACE = 30
INITIAL_VOTERS = 3
#: Records (indexes) of one proposal: 1 to this many.
MAX_PROPOSAL_RECORDS = 5


class Sim(SafetyChecks, DamageEvents):
    def __init__(
        self, seed: int, nodes: int = 3, groups: int = 8, variant: Variant = Variant.CORRECT
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.n = nodes
        self.groups = groups
        self.config = RaftConfig(election_ticks=10, heartbeat_ticks=2, variant=variant)
        self.initial = Configuration.of(range(min(INITIAL_VOTERS, nodes)))
        self.now = 0
        self.events = 0
        self._queue: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = 0
        self.trace: deque[tuple[int, str]] = deque(maxlen=TRACE)
        self.disks = [[Disk() for _ in range(groups)] for _ in range(nodes)]
        self.records = [GroupRecord() for _ in range(groups)]
        self.cores: list[list[RaftNode] | None] = [None] * nodes
        self.life = [0] * nodes
        self.paused_until = [0] * nodes
        self.max_sent_term = [[0] * groups for _ in range(nodes)]
        self.last_commit = [[0] * groups for _ in range(nodes)]
        self.blocked: set[tuple[int, int]] = set()
        self.faults = True
        self.drop = self.rng.choice((0.0, 0.02, 0.1))
        self.dup = self.rng.choice((0.0, 0.02, 0.05))
        self.max_delay = self.rng.choice((5, 15, 40))
        #: How long a hard-state write takes (temp file, fsync, rename, directory fsync).
        self.persist_ms = self.rng.choice((2, 10, 30))
        self.value = 0
        self.healed_at: int | None = None
        #: Each node's tick interval as a multiple of TICK_MS (clock-rate skew).
        self.skew = [self.rng.uniform(0.9, 1.1) for _ in range(nodes)]
        self.counts: Counter[str] = Counter()
        for node in range(nodes):
            self._start(node)

    # -- scheduling --------------------------------------------------------------------------

    def at(self, when: int, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (when, self._seq, action))

    def on_node(self, node: int, delay: int, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` on ``node`` after ``delay`` if it is still in the same life; a paused
        node runs it when the pause ends."""
        life = self.life[node]

        def run() -> None:
            if self.life[node] != life or self.cores[node] is None:
                return
            if self.paused_until[node] > self.now:
                self.at(self.paused_until[node], run)
                return
            self.trace.append((self.now, f"n{node} {what}"))
            action()

        self.at(self.now + delay, run)

    def run(self) -> int:
        """Run to the end; return the events processed. Raises ``Violation`` or ``Stuck``."""
        for node in range(self.n):
            self._schedule_tick(node)
        self.at(self.rng.randrange(50, 300), self._fault)
        self.at(PROPOSE_EVERY_MS, self._workload)
        self.at(self.rng.randrange(50, 300), self._change)
        self.at(self.rng.randrange(50, 300), self._retain)
        self.at(self.rng.randrange(50, 300), self._damage)
        self.at(FAULT_MS, self._heal)
        while self._queue:
            when, _, action = heapq.heappop(self._queue)
            self.now = when
            self.events += 1
            action()
            if self.healed_at is not None and self._done():
                return self.events
            if self.healed_at is not None and self.now > self.healed_at + LIVENESS_MS:
                raise Stuck(self._stuck_reason())
        raise Stuck("the event queue ran dry")

    # -- nodes -------------------------------------------------------------------------------

    def _start(self, node: int) -> None:
        cores = []
        for g in range(self.groups):
            disk = self.disks[node][g]
            torn = disk.recover()
            if torn:
                self.trace.append((self.now, f"n{node} g{g} cuts a torn batch ({torn} records)"))
            terms = TermTable()
            for e in disk.entries:
                terms.append(e.term, e.count)
            core = RaftNode(
                node,
                self.initial.voters,
                _Reader(disk),
                self.rng,
                self.config,
                disk.durable_hard,
                terms,
                self._membership(disk, terms),
            )
            cores.append(core)
            self.last_commit[node][g] = 0
        self.cores[node] = cores
        self.trace.append((self.now, f"n{node} start (life {self.life[node]})"))

    def _crash(self, node: int) -> None:
        self.life[node] += 1
        self.cores[node] = None
        self.trace.append((self.now, f"n{node} crash"))
        for g, disk in enumerate(self.disks[node]):
            disk.crash(tear=self.rng.randrange(MAX_PROPOSAL_RECORDS))
            self._check_durable_majority(g)

    def _schedule_tick(self, node: int) -> None:
        """Ticks every ``TICK_MS * skew`` ms of virtual time (rounded), from a random phase."""
        life = self.life[node]
        first = self.now + self.rng.randrange(1, TICK_MS + 1)
        interval = TICK_MS * self.skew[node]
        count = [0]

        def tick() -> None:
            if self.life[node] != life:
                return
            if self.paused_until[node] <= self.now and self.cores[node] is not None:
                for g in range(self.groups):
                    self._apply(node, g, self._core(node, g).tick())
            count[0] += 1
            self.at(max(self.now + 1, first + round(count[0] * interval)), tick)

        self.at(first, tick)

    def _core(self, node: int, group: int) -> RaftNode:
        cores = self.cores[node]
        assert cores is not None
        return cores[group]

    # -- effects -----------------------------------------------------------------------------

    def _apply(
        self, node: int, g: int, effects: list[Effect], snapshot: EntryLog | None = None
    ) -> None:
        disk = self.disks[node][g]
        record = self.records[g]
        for e in effects:
            if isinstance(e, Send):
                self._send(node, g, e.message)
            elif isinstance(e, AppendLog):
                if e.first_index != disk.last_index + 1:
                    raise Violation(f"n{node} g{g} append at {e.first_index}, log ends elsewhere")
                for entry in e.entries:
                    prev = disk.chains[-1] if disk.chains else 0
                    disk.add(entry, chain(prev, entry.term, entry.payload, entry.count))
                    self._check_matching(node, g)
            elif isinstance(e, Truncate):
                if e.from_index <= disk.start:
                    raise Violation(f"n{node} g{g} truncation from {e.from_index}, below its start")
                disk.truncate(e.from_index)
                self._check_durable_majority(g)
            elif isinstance(e, Flush):
                self._flush(node, g, e.index)
            elif isinstance(e, PersistHardState):
                self._persist(node, g, e.state)
            elif isinstance(e, Commit):
                self._on_commit(node, g, e.index, record)
                self._repair_committed(node, g, e.index)
            elif isinstance(e, ResetLog):
                assert snapshot is not None, "ResetLog answers an InstallSnapshot"
                self._reset_log(node, g, e, snapshot)
        self._check_node(node, g)

    def _flush(self, node: int, g: int, index: int) -> None:
        disk = self.disks[node][g]
        cuts = len(disk.cuts)

        def done() -> None:
            # An fsync covers what was written before it began: not what a truncation or an
            # installed snapshot since replaced (an honest driver reports no more).
            reached = disk.mark_durable(min([index, *disk.cuts[cuts:]]))
            self._apply(node, g, self._core(node, g).flushed(reached))

        self.on_node(node, self.rng.randrange(1, 20), f"g{g} flushed {index}", done)

    def _persist(self, node: int, g: int, state: HardState) -> None:
        disk = self.disks[node][g]

        def done() -> None:
            if state.term < disk.durable_hard.term:
                raise Violation(f"n{node} g{g} hard state term went back to {state.term}")
            disk.durable_hard = state
            self._apply(node, g, self._core(node, g).hard_state_persisted(state))

        # The same delay for every write keeps them in order (renames land in order).
        self.on_node(node, self.persist_ms, f"g{g} persisted {state}", done)

    def _send(self, node: int, g: int, m: Message) -> None:
        if not isinstance(m, PreVote | PreVoteResp):
            self.max_sent_term[node][g] = max(self.max_sent_term[node][g], m.term)
        if isinstance(m, VoteResp) and m.granted:
            voted = self.records[g].votes.setdefault((node, m.term), m.to)
            if voted != m.to:
                raise Violation(f"n{node} g{g} voted for n{voted} and n{m.to} in term {m.term}")
        data: EntryLog | None = None
        if isinstance(m, InstallSnapshot):
            data = self.disks[node][g].prefix(m.last_index)
        copies = 1
        if self.faults:
            if self.rng.random() < self.drop:
                return
            if self.rng.random() < self.dup:
                copies = 2
        for _ in range(copies):
            delay = self.rng.randrange(1, self.max_delay + 1)
            self.at(self.now + delay, lambda: self._deliver(g, m, data))

    def _deliver(self, g: int, m: Message, data: EntryLog | None) -> None:
        if (m.frm, m.to) in self.blocked:
            return
        name = type(m).__name__
        self.on_node(
            m.to,
            0,
            f"g{g} <- n{m.frm} {name} t{m.term}",
            lambda: self._apply(m.to, g, self._receive(m.to, g, m), data),
        )

    def _receive(self, node: int, g: int, m: Message) -> list[Effect]:
        core = self._core(node, g)
        effects = core.receive(m)
        if core.refused:
            raise Violation(f"n{node} g{g} refused: {core.refused[-1]}")
        return effects

    def _fault(self) -> None:
        if not self.faults:
            return
        node = self.rng.randrange(self.n)
        kind = self.rng.choice(("crash", "partition", "one-way", "pause", "crash", "transfer"))
        heal_after = self.rng.randrange(100, 800)
        if kind == "crash" and self.cores[node] is not None:
            self._crash(node)
            self.at(self.now + heal_after, lambda: self._restart(node))
        elif kind == "partition":
            cut = {(a, b) for a in range(self.n) for b in (node,) if a != b}
            cut |= {(b, a) for a, b in cut}
            self._block(cut, heal_after, f"partition n{node}")
        elif kind == "one-way":
            other = self.rng.choice([o for o in range(self.n) if o != node])
            self._block({(node, other)}, heal_after, f"one-way n{node} -> n{other}")
        elif kind == "transfer":
            g = self.rng.randrange(self.groups)
            leads = [c[g] for c in self.cores if c is not None and c[g].role is Role.LEADER]
            core = self.rng.choice(leads) if leads else None
            others = sorted(core.configuration.voters - {core.id}) if core else []
            if core is not None and others:
                to = self.rng.choice(others)
                self.trace.append((self.now, f"n{core.id} g{g} transfers leadership to n{to}"))
                self._apply(core.id, g, core.transfer_leadership(to))
        elif kind == "pause":
            self.paused_until[node] = max(self.paused_until[node], self.now + heal_after)
            self.trace.append((self.now, f"n{node} paused for {heal_after} ms"))
        self.at(self.now + self.rng.randrange(50, 400), self._fault)

    def _block(self, cut: set[tuple[int, int]], heal_after: int, what: str) -> None:
        new = cut - self.blocked
        self.blocked |= new
        self.trace.append((self.now, what))

        def heal() -> None:
            self.blocked -= new
            self.trace.append((self.now, f"healed {what}"))

        self.at(self.now + heal_after, heal)

    def _restart(self, node: int) -> None:
        if self.cores[node] is None:
            self._start(node)
            self._schedule_tick(node)

    def _heal(self) -> None:
        """No new fault from now on; partitions heal and crashed nodes restart at once, and
        the liveness clock starts when the last pause ends (a paused node's deferred inputs
        only arrive then)."""
        self.faults = False
        self.blocked.clear()
        for node in range(self.n):
            self._restart(node)
        self.trace.append((self.now, "healing"))

        def healed() -> None:
            self.healed_at = self.now
            self.trace.append((self.now, "healed all"))

        self.at(max(self.now, *self.paused_until), healed)

    def _leader_of(self, g: int) -> RaftNode | None:
        """The leader every live node follows in its term, if there is one."""
        cores = [c[g] for c in self.cores if c is not None]
        leaders = [c for c in cores if c.role is Role.LEADER]
        if len(leaders) != 1:
            return None
        lead = leaders[0]
        members = [c for c in cores if c.id in lead.configuration.members]
        if all(c.term == lead.term and c.leader == lead.id for c in members):
            return lead
        return None

    def _workload(self) -> None:
        for g in range(self.groups):
            record = self.records[g]
            if self.healed_at is None:
                # Under faults, any node that believes it leads (a stale one too).
                cores = [c[g] for c in self.cores if c is not None]
                leads = [c for c in cores if c.role is Role.LEADER]
                lead = self.rng.choice(leads) if leads else None
            elif len(record.healed) < HEALED_PROPOSALS or self._orphans(g):
                lead = self._leader_of(g)
            else:
                continue
            if lead is None or lead.transferee is not None:
                continue
            # After healing, a proposal whose leader lost office before committing it is made
            # again (its entry may have been cut): the client's retry, which must commit.
            orphans = self._orphans(g) if self.healed_at is not None else []
            if orphans:
                value = orphans[0]
            else:
                self.value += 1
                value = f"s{self.seed}v{self.value}".encode()
            effects = lead.propose(value, self.rng.randint(1, MAX_PROPOSAL_RECORDS))
            record.pending[value] = (lead.id, self.life[lead.id], lead.terms.last_index, lead.term)
            if self.healed_at is not None:
                record.healed.add(value)
            self._apply(lead.id, g, effects)
        self.at(self.now + PROPOSE_EVERY_MS, self._workload)

    def _orphans(self, g: int) -> list[bytes]:
        return [v for v in sorted(self.records[g].healed) if self._orphan(g, v)]

    def _orphan(self, g: int, value: bytes) -> bool:
        record = self.records[g]
        if value in record.values:
            return False
        pending = record.pending.get(value)
        if pending is None:
            return True
        node, life, _, term = pending
        cores = self.cores[node]
        core = cores[g] if cores is not None and self.life[node] == life else None
        return core is None or core.role is not Role.LEADER or core.term != term

    def _done(self) -> bool:
        return all(len(r.healed) >= HEALED_PROPOSALS and r.healed <= r.values for r in self.records)

    def _stuck_reason(self) -> str:
        for g, r in enumerate(self.records):
            if self._leader_of(g) is None:
                return f"g{g} has no leader {LIVENESS_MS} ms after healing"
            lost = sorted(r.healed - r.values)
            if lost or len(r.healed) < HEALED_PROPOSALS:
                return f"g{g} proposals not committed after healing: {lost}"
        return "?"

    def report(self) -> str:
        return "\n".join(f"  {t:>7} ms  {what}" for t, what in self.trace)


class Stuck(Exception):
    """Liveness failed after the faults healed."""


class _Reader:
    __slots__ = ("disk",)

    def __init__(self, disk: Disk) -> None:
        self.disk = disk

    def entries(self, first: int, last: int, max_entries: int, max_bytes: int) -> list[Entry]:
        return self.disk.entries_between(first, last, max_entries, max_bytes)

    def entry_start(self, index: int) -> int:
        return self.disk.entry_start(index)


@dataclass(slots=True)
class Outcome:
    seeds: int = 0
    events: int = 0
    violations: list[int] = field(default_factory=list)
    stuck: list[int] = field(default_factory=list)
    #: How often the membership events happened (``MembershipEvents.counts``), summed.
    counts: Counter[str] = field(default_factory=Counter)


#: One seed's result: its events, its counts, and its failure ("violation" or "stuck", and
#: the report to print) if it failed.
SeedResult = tuple[int, Counter[str], str | None, str]


def run_seed(seed: int, nodes: int, groups: int, variant: Variant) -> SeedResult:
    sim = Sim(seed, nodes, groups, variant)
    failure: str | None = None
    report = ""
    try:
        sim.run()
    except Violation as e:
        failure = "violation"
        report = f"seed {seed}: VIOLATION at {sim.now} ms: {e}\n{sim.report()}"
    except Stuck as e:
        failure = "stuck"
        report = f"seed {seed}: STUCK: {e}\n{sim.report()}"
    return sim.events, sim.counts, failure, report


def _run_seed_args(args: tuple[int, int, int, Variant]) -> SeedResult:
    return run_seed(*args)


def run_seeds(
    seeds: range,
    nodes: int = 3,
    groups: int = 8,
    variant: Variant = Variant.CORRECT,
    out: Callable[[str], None] | None = None,
    stop_at_first: bool = False,
    jobs: int = 1,
) -> Outcome:
    """Run ``seeds`` in order; with ``jobs`` > 1 on that many processes, the results still
    taken (and printed) in seed order, so the output does not depend on ``jobs``."""
    outcome = Outcome()
    work = [(seed, nodes, groups, variant) for seed in seeds]
    pool = multiprocessing.Pool(jobs) if jobs > 1 else None
    try:
        results = pool.imap(_run_seed_args, work) if pool else map(_run_seed_args, work)
        for (seed, *_), (events, counts, failure, report) in zip(work, results, strict=True):
            outcome.seeds += 1
            outcome.events += events
            outcome.counts += counts
            if failure is not None:
                failed = outcome.violations if failure == "violation" else outcome.stuck
                failed.append(seed)
                if out:
                    out(report)
                if stop_at_first:
                    break
    finally:
        if pool is not None:
            pool.terminate()
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.cluster.sim", description=__doc__)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=3, choices=(3, 4, 5))
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--variant", default="correct", choices=[v.value for v in Variant])
    parser.add_argument("--jobs", type=int, default=1, help="processes to run seeds on")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    started = time.monotonic()
    outcome = run_seeds(
        range(args.start, args.start + args.seeds),
        args.nodes,
        args.groups,
        Variant(args.variant),
        out=print,
        jobs=args.jobs,
    )
    print(f"time: {time.monotonic() - started:.1f} s", file=sys.stderr)
    print(", ".join(f"{k}: {v}" for k, v in sorted(outcome.counts.items())), file=sys.stderr)
    print(
        f"seeds: {outcome.seeds}, events: {outcome.events}, "
        f"violations: {len(outcome.violations)}, stuck: {len(outcome.stuck)}"
    )
    return 1 if outcome.violations or outcome.stuck else 0


if __name__ == "__main__":
    sys.exit(main())
