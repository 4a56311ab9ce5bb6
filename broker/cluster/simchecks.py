"""The simulator's safety checks (mixed into :class:`broker.cluster.sim.Sim`; the invariants
are listed in its module docstring): log matching over every index an entry covers, a durable
majority of the committing configuration's voters under every committed prefix, commits that
never go back nor land inside an entry and agree with the record, acknowledged proposals at
their index, one leader per term, leader completeness, terms that never go back."""

from __future__ import annotations

from broker.cluster.raft import Role
from broker.cluster.simmembers import MembershipEvents
from broker.cluster.simstate import GroupRecord, Violation


class SafetyChecks(MembershipEvents):
    """``Sim`` owns the state declared here and in ``MembershipEvents``."""

    life: list[int]
    max_sent_term: list[list[int]]
    last_commit: list[list[int]]

    def _check_matching(self, node: int, g: int) -> None:
        """The entry just appended (the disk's last), at every index it covers."""
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
        conf = record.commit_config or self.initial
        keep = [v for v in conf.voters if self.disks[v][g].durable_chain_at(n) == want]
        if len(keep) < conf.quorum:
            raise Violation(
                f"g{g}: committed index {n} durable on voters {keep} only of {conf.describe()}"
            )

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
            if core.role is Role.LEADER:
                record.commit_config = core.configuration
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
                        # The record only grows and at <= index <= its last index now: one
                        # look when acknowledged holds for every event after.
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
            self._check_configurations(core, g)
