"""The simulator's disk damage (mixed into :class:`broker.cluster.sim.Sim`): during the faults,
an entry a node has not seen committed becomes unreadable on its disk (its batch fails its
CRC: ``LogReader.entries`` hands out nothing from it), a leader's own entry more often than
not. A leader that meets it steps down (``broker.cluster.election``); the entry is then
overwritten by the next leader's log, or committed with the damaged copy kept. A damaged entry
the node has seen committed is rewritten from a replica after a while (the repairer,
``broker.cluster.repair``): it becomes readable again.

At most one replica of a group is damaged at a time, and only while every node is up and sees
three voters at least, none of which is removed until the damage is gone (``simmembers``):
with every copy of an entry damaged no leader could send it; with two voters, the one without
the entry cannot be elected without the vote of the damaged one, whose longer log refuses it,
and neither can tell whether the entry committed. Such a group stalls until an operator acts,
as it did before leaders stepped down; the simulator does not make it."""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable

from broker.cluster.raft import RaftNode, Role
from broker.cluster.simstate import Disk

#: How often a damage event comes (ms, drawn uniformly), and how long a repair takes.
DAMAGE_EVERY_MS = (100, 600)
REPAIR_MS = (20, 200)
#: How often the damaged node is a leader of the group, when there is one.
LEADER_SHARE = 0.7


class DamageEvents:
    """``Sim`` owns the state declared here and provides the methods stubbed below."""

    rng: random.Random
    n: int
    groups: int
    now: int
    faults: bool
    trace: deque[tuple[int, str]]
    disks: list[list[Disk]]
    cores: list[list[RaftNode] | None]
    counts: Counter[str]

    def at(self, when: int, action: Callable[[], None]) -> None:
        raise NotImplementedError

    def on_node(self, node: int, delay: int, what: str, action: Callable[[], None]) -> None:
        raise NotImplementedError

    def _damage(self) -> None:
        if not self.faults:
            return
        g = self.rng.randrange(self.groups)
        leaders = [c[g].id for c in self.cores if c is not None and c[g].role is Role.LEADER]
        if leaders and self.rng.random() < LEADER_SHARE:
            node = self.rng.choice(leaders)
        else:
            node = self.rng.randrange(self.n)
        cores = self.cores[node]
        if self._may_damage(g) and cores is not None:
            disk = self.disks[node][g]
            commit = cores[g].commit
            firsts = [
                end - e.count + 1
                for e, end in zip(disk.entries, disk.ends, strict=True)
                if end - e.count >= max(commit, disk.start)
            ]
            if firsts:
                first = self.rng.choice(firsts)
                disk.damaged.add(first)
                self.counts["damaged entries"] += 1
                self.trace.append((self.now, f"n{node} g{g} entry at {first} damaged"))
        self.at(self.now + self.rng.randrange(*DAMAGE_EVERY_MS), self._damage)

    def _may_damage(self, g: int) -> bool:
        """No replica of ``g`` is damaged, every node is up and every one's latest
        configuration has three voters at least (module doc)."""
        if any(self.disks[node][g].damaged for node in range(self.n)):
            return False
        return all(c is not None and len(c[g].configuration.voters) >= 3 for c in self.cores)

    def _repair_committed(self, node: int, g: int, commit: int) -> None:
        """``node`` committed up to ``commit``: its damaged entries there get rewritten."""
        disk = self.disks[node][g]
        for first in sorted(disk.damaged):
            if first > commit:
                continue

            def rewrite(first: int = first) -> None:
                if first in disk.damaged:
                    disk.damaged.discard(first)
                    self.counts["repaired entries"] += 1

            self.on_node(node, self.rng.randrange(*REPAIR_MS), f"g{g} repairs {first}", rewrite)
