"""The simulator's membership, retention and snapshot events (mixed into
:class:`broker.cluster.sim.Sim`): membership changes told to leaders during the faults,
retention that removes a durable committed prefix of whole entries from a node's log, the
driver's side of an installed snapshot, the configuration a restarted node rebuilds from its
log, and the check that no two configurations a leader may be using could form disjoint
majorities."""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable

from broker.cluster.membership import (
    ChangeKind,
    ChangeRefused,
    Configuration,
    Membership,
    overlapping,
)
from broker.cluster.messages import Effect, EntryKind, ResetLog
from broker.cluster.raft import NotLeader, RaftNode, Role
from broker.cluster.simstate import Disk, EntryLog, GroupRecord, Violation
from broker.cluster.terms import TermTable


class MembershipEvents:
    """``Sim`` owns the state declared here and provides the methods stubbed below."""

    rng: random.Random
    n: int
    groups: int
    now: int
    faults: bool
    initial: Configuration
    trace: deque[tuple[int, str]]
    disks: list[list[Disk]]
    records: list[GroupRecord]
    cores: list[list[RaftNode] | None]
    #: Membership changes made and refused, snapshots installed, retention runs.
    counts: Counter[str]

    def at(self, when: int, action: Callable[[], None]) -> None:
        raise NotImplementedError

    def _core(self, node: int, group: int) -> RaftNode:
        raise NotImplementedError

    def _apply(
        self, node: int, g: int, effects: list[Effect], snapshot: EntryLog | None = None
    ) -> None:
        raise NotImplementedError

    def _check_matching(self, node: int, g: int) -> None:
        raise NotImplementedError

    def _check_durable_majority(self, g: int) -> None:
        raise NotImplementedError

    def _membership(self, disk: Disk, terms: TermTable) -> Membership:
        """What the driver rebuilds at restart from the stored log start and the CONFIG entries
        after it; ``terms`` (built from the whole disk) is made to start there too."""
        terms.compact(disk.start + 1)
        first = disk.position(disk.start + 1)
        after = zip(disk.ends[first:], disk.entries[first:], strict=True)
        configs = [
            (i, Configuration.decode(e.payload)) for i, e in after if e.kind is EntryKind.CONFIG
        ]
        return Membership(disk.start_config or self.initial, disk.start, configs)

    def _reset_log(self, node: int, g: int, e: ResetLog, snapshot: EntryLog) -> None:
        """The driver's side of an installed snapshot: the log becomes the data that came with
        it (the sender's entries up to the snapshot), durable up to its last index, which must
        be an entry's end of the snapshot's term."""
        disk = self.disks[node][g]
        there = snapshot.entry_ending_at(e.last_index)
        if snapshot.last_index != e.last_index or there is None or there.term != e.last_term:
            raise Violation(f"n{node} g{g} snapshot at {e.last_index} t{e.last_term} mismatch")
        disk.reset(snapshot, e.last_index)
        disk.start_config = e.configuration
        self.counts["snapshots installed"] += 1
        self._check_matching(node, g)
        self._check_durable_majority(g)

    def _check_configurations(self, core: RaftNode, g: int) -> None:
        """Every configuration in a log but the last was committed before the next was
        appended, so a leader uses the one in force at the committed prefix and at most one
        after it; no two of those may form disjoint majorities (thesis s4.1)."""
        confs = core.membership.since(self.records[g].last_index)
        for i, a in enumerate(confs):
            for b in confs[i + 1 :]:
                if not overlapping(a, b):
                    raise Violation(
                        f"n{core.id} g{g} term {core.term} uses disjoint configurations "
                        f"({a.describe()}) and ({b.describe()})"
                    )

    # -- faults, workload, liveness ----------------------------------------------------------

    def _change(self) -> None:
        """Tell a node that believes it leads a random group to make a membership change, and
        at times a second one straight after (as an operator replacing a member might); the
        refusals (one in progress, not caught up, not the leader) are part of the workload."""
        if not self.faults:
            return
        g = self.rng.randrange(self.groups)
        leads = [c[g] for c in self.cores if c is not None and c[g].role is Role.LEADER]
        if leads:
            core = self.rng.choice(leads)
            if self._change_once(core, g) and self.rng.random() < 0.3:
                self._change_once(core, g)
        self.at(self.now + self.rng.randrange(20, 150), self._change)

    def _change_once(self, core: RaftNode, g: int) -> bool:
        conf = core.configuration
        options = [(ChangeKind.ADD_LEARNER, x) for x in range(self.n) if x not in conf.members]
        options += [(ChangeKind.PROMOTE, x) for x in sorted(conf.learners)] * 2
        options += [(ChangeKind.REMOVE, x) for x in sorted(conf.learners)]
        # Not down to two voters while a replica is damaged (``broker.cluster.simdamage``).
        if len(conf.voters) > 2 + any(self.disks[x][g].damaged for x in range(self.n)):
            options += [(ChangeKind.REMOVE, x) for x in sorted(conf.voters)]
        if not options:
            return False
        kind, node = self.rng.choice(options)
        what = f"n{core.id} g{g} {kind.value} n{node}"
        try:
            effects = core.propose_change(kind, node)
        except (ChangeRefused, NotLeader) as refused:
            self.trace.append((self.now, f"{what} refused: {refused}"))
            self.counts["changes refused"] += 1
            return False
        self.trace.append((self.now, what))
        self.counts[kind.value] += 1
        self._apply(core.id, g, effects)
        return True

    def _retain(self) -> None:
        """Retention on a random node and group: the log loses a random part of its durable,
        committed prefix, and the node keeps the ``LogStart`` the core returns."""
        if not self.faults:
            return
        node, g = self.rng.randrange(self.n), self.rng.randrange(self.groups)
        if self.cores[node] is not None:
            core, disk = self._core(node, g), self.disks[node][g]
            upto = min(core.commit, core.durable_index, disk.durable)
            if upto > disk.start:
                # Whole entries go: the new start is an entry's last index.
                ends = disk.ends[disk.position(disk.start + 1) : disk.position(upto) + 1]
                keep_from = self.rng.choice(ends) + 1
                start = core.compacted(keep_from)
                disk.start, disk.start_config = start.index, start.configuration
                self.trace.append((self.now, f"n{node} g{g} retention: log starts at {keep_from}"))
                self.counts["retention"] += 1
        self.at(self.now + self.rng.randrange(30, 200), self._retain)
