"""Deterministic simulation of Raft groups (FoundationDB / TigerBeetle style).

One seeded ``random.Random`` decides everything: virtual time in milliseconds, a network that
delays, drops, duplicates and reorders messages and partitions nodes (both ways or one way), a
disk per node whose appends land in an unflushed tail that a crash loses (as it loses a hard
state whose write had not completed), crashes and restarts that rebuild each core from what was
durable (optionally leaving a torn prefix of the first unflushed batch, which recovery cuts),
pauses, leadership transfers, and a workload of proposals with unique values, each an entry of
1-5 records (indexes; index = log offset + 1). After
every event the invariants below are checked; a failing seed prints itself and its last
events, and running that seed again replays it exactly.

Safety (checked throughout): at most one leader per term; log matching (two logs holding the same
index with the same term hold the same entry there, same boundaries, and the same prefix up to
it, checked by a hash chain for every index an entry covers); leader
completeness (a leader holds every committed entry); no committed entry lost or changed (a
majority keeps it durably, and every commit index a node reports covers the same entries); the
commit index never moves back during a node's life; a node never acts in a term lower than one
it has spoken in and never grants two votes in one term, across restarts; every acknowledged
proposal is committed at the index it was acknowledged at.

Liveness (after the faults heal and the last pause ends): every group elects a leader that
every node follows, and proposals made then all commit (one whose leader lost office first is
made again, as a client would retry), within ``LIVENESS_MS``; otherwise the seed is "stuck".

Not simulated yet: clock-rate skew, membership changes.

Run: ``python -m broker.cluster.sim --seeds N [--start S] [--nodes 3] [--groups 8]``.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.cluster.messages import (
    AppendLog,
    Commit,
    Effect,
    Entry,
    Flush,
    HardState,
    Message,
    PersistHardState,
    PreVote,
    PreVoteResp,
    Send,
    Truncate,
    VoteResp,
)
from broker.cluster.raft import RaftConfig, RaftNode, Role, Variant
from broker.cluster.simstate import Disk, GroupRecord, Violation, chain
from broker.cluster.terms import TermTable

TICK_MS = 10
FAULT_MS = 3_000
LIVENESS_MS = 5_000
PROPOSE_EVERY_MS = 15
HEALED_PROPOSALS = 3
TRACE = 30
#: Records (indexes) of one proposal: 1 to this many.
MAX_PROPOSAL_RECORDS = 5


class Sim:
    def __init__(
        self, seed: int, nodes: int = 3, groups: int = 8, variant: Variant = Variant.CORRECT
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.n = nodes
        self.groups = groups
        self.config = RaftConfig(election_ticks=10, heartbeat_ticks=2, variant=variant)
        self.quorum = nodes // 2 + 1
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
                list(range(self.n)),
                _Reader(disk),
                self.rng,
                self.config,
                disk.durable_hard,
                terms,
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
        life = self.life[node]

        def tick() -> None:
            if self.life[node] != life:
                return
            if self.paused_until[node] <= self.now and self.cores[node] is not None:
                for g in range(self.groups):
                    self._apply(node, g, self._core(node, g).tick())
            self.at(self.now + TICK_MS, tick)

        self.at(self.now + self.rng.randrange(1, TICK_MS + 1), tick)

    def _core(self, node: int, group: int) -> RaftNode:
        cores = self.cores[node]
        assert cores is not None
        return cores[group]

    # -- effects -----------------------------------------------------------------------------

    def _apply(self, node: int, g: int, effects: list[Effect]) -> None:
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
                disk.truncate(e.from_index)
                self._check_durable_majority(g)
            elif isinstance(e, Flush):
                self._flush(node, g, e.index)
            elif isinstance(e, PersistHardState):
                self._persist(node, g, e.state)
            elif isinstance(e, Commit):
                self._on_commit(node, g, e.index, record)
        self._check_node(node, g)

    def _flush(self, node: int, g: int, index: int) -> None:
        disk = self.disks[node][g]
        cuts = len(disk.cuts)

        def done() -> None:
            # An fsync covers what was written before it began: not what a truncation since
            # replaced (an honest driver reports no more).
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
        copies = 1
        if self.faults:
            if self.rng.random() < self.drop:
                return
            if self.rng.random() < self.dup:
                copies = 2
        for _ in range(copies):
            delay = self.rng.randrange(1, self.max_delay + 1)
            self.at(self.now + delay, lambda: self._deliver(g, m))

    def _deliver(self, g: int, m: Message) -> None:
        if (m.frm, m.to) in self.blocked:
            return
        name = type(m).__name__
        self.on_node(
            m.to,
            0,
            f"g{g} <- n{m.frm} {name} t{m.term}",
            lambda: self._apply(m.to, g, self._receive(m.to, g, m)),
        )

    def _receive(self, node: int, g: int, m: Message) -> list[Effect]:
        core = self._core(node, g)
        effects = core.receive(m)
        if core.refused:
            raise Violation(f"n{node} g{g} refused: {core.refused[-1]}")
        return effects

    # -- invariants --------------------------------------------------------------------------

    def _check_matching(self, node: int, g: int) -> None:
        """The entry just appended, at every index it covers."""
        disk = self.disks[node][g]
        entry, last = disk.entries[-1], disk.last_index
        mine = (last - entry.count + 1, last, disk.chains[-1])
        seen = self.records[g].seen
        for index in range(mine[0], last + 1):
            first = seen.setdefault((index, entry.term), mine)
            if first != mine:
                raise Violation(
                    f"log matching: n{node} g{g} index {index} term {entry.term}: entry "
                    f"{mine[0]}..{mine[1]} here, {first[0]}..{first[1]} elsewhere or differs"
                )

    def _check_durable_majority(self, g: int) -> None:
        record = self.records[g]
        n = record.last_index
        want = record.chain_at(n)
        keep = sum(1 for node in range(self.n) if self.disks[node][g].durable_chain_at(n) == want)
        if keep < self.quorum:
            raise Violation(f"g{g}: committed index {n} durable on {keep} nodes only")

    def _on_commit(self, node: int, g: int, index: int, record: GroupRecord) -> None:
        disk = self.disks[node][g]
        if index < self.last_commit[node][g]:
            raise Violation(f"n{node} g{g} commit went back to {index}")
        self.last_commit[node][g] = index
        if index > disk.last_index:
            raise Violation(f"n{node} g{g} commit {index} past its log")
        if disk.chain_at(index) is None:
            raise Violation(f"n{node} g{g} commit {index} inside an entry")
        known = record.last_index
        upto = min(index, known)
        if disk.chain_at(upto) != record.chain_at(upto):
            raise Violation(f"n{node} g{g} committed prefix to {upto} differs from the record")
        if index > known:
            for i in range(disk.position(known + 1), disk.position(index) + 1):
                record.add(disk.entries[i], disk.chains[i])
                record.values.add(disk.entries[i].payload)
        core = self._core(node, g)
        if index > known:
            if record.marks and record.marks[-1][0] == core.term:
                record.marks[-1] = (core.term, index)
            else:
                record.marks.append((core.term, index))
            self._check_durable_majority(g)
        if core.role is Role.LEADER:
            for value, (owner, life, at, term) in list(record.pending.items()):
                if owner == node and life == self.life[node] and at <= index:
                    del record.pending[value]
                    if core.terms.term_at(at) == term:
                        record.acked[value] = at
        for value, at in record.acked.items():
            if at <= record.last_index:
                there = record.entry_ending_at(at)
                if there is None or there.payload != value:
                    raise Violation(f"g{g} acknowledged {value!r} at {at} is not there")

    def _check_node(self, node: int, g: int) -> None:
        if self.cores[node] is None:
            return
        core = self._core(node, g)
        record = self.records[g]
        if core.term < self.max_sent_term[node][g]:
            raise Violation(f"n{node} g{g} at term {core.term} after speaking in a later term")
        if core.role is Role.LEADER:
            leader = record.leaders.setdefault(core.term, node)
            if leader != node:
                raise Violation(f"g{g} two leaders in term {core.term}: n{leader} and n{node}")
            n = record.committed_before(core.term)
            if n > core.terms.last_index or self.disks[node][g].chain_at(n) != record.chain_at(n):
                raise Violation(f"leader completeness: n{node} g{g} lacks committed {n}")

    # -- faults, workload, liveness ----------------------------------------------------------

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
            if leads:
                core = self.rng.choice(leads)
                to = self.rng.choice(core.peers)
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
        if all(c.term == lead.term and c.leader == lead.id for c in cores):
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


def run_seeds(
    seeds: range,
    nodes: int = 3,
    groups: int = 8,
    variant: Variant = Variant.CORRECT,
    out: Callable[[str], None] | None = None,
    stop_at_first: bool = False,
) -> Outcome:
    outcome = Outcome()
    for seed in seeds:
        sim = Sim(seed, nodes, groups, variant)
        outcome.seeds += 1
        try:
            sim.run()
        except Violation as e:
            outcome.violations.append(seed)
            if out:
                out(f"seed {seed}: VIOLATION at {sim.now} ms: {e}\n{sim.report()}")
        except Stuck as e:
            outcome.stuck.append(seed)
            if out:
                out(f"seed {seed}: STUCK: {e}\n{sim.report()}")
        outcome.events += sim.events
        if stop_at_first and (outcome.violations or outcome.stuck):
            break
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.cluster.sim", description=__doc__)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=3, choices=(3, 4, 5))
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--variant", default="correct", choices=[v.value for v in Variant])
    args = parser.parse_args(argv)
    started = time.monotonic()
    outcome = run_seeds(
        range(args.start, args.start + args.seeds),
        args.nodes,
        args.groups,
        Variant(args.variant),
        out=print,
    )
    print(f"time: {time.monotonic() - started:.1f} s", file=sys.stderr)
    print(
        f"seeds: {outcome.seeds}, events: {outcome.events}, "
        f"violations: {len(outcome.violations)}, stuck: {len(outcome.stuck)}"
    )
    return 1 if outcome.violations or outcome.stuck else 0


if __name__ == "__main__":
    sys.exit(main())
