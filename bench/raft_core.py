"""Raft core costs, in process, no I/O: what consensus itself costs per committed batch.

Three nodes, G groups (1 and 1,000), a loss-free network that delivers in FIFO order, and a
disk whose flushes and hard-state writes complete as soon as the step that asked for them has
been applied. Each proposal stands for one record batch (a 64-byte payload: the core never
looks inside). Measured with ``time.process_time``:

* committed/s and CPU per committed batch: every group's leader gets ``--per-round``
  proposals, the cluster runs until all of them commit on the leaders, ``--rounds`` times
  (100 times more rounds for a single group);
* CPU per idle group per second: nothing proposed, 10 ms ticks (heartbeat every 2 ticks, as
  in the simulator) for ``--idle-seconds`` of virtual time, heartbeats delivered and answered.

There is no reference implementation to run beside it (pysyncobj was measured in issue 19's
filing and has no comparable in-process mode); the figures stand alone. Prints a table and one
JSON line. Run: ``python -m bench.raft_core [--groups 1,1000] [--rounds 20]``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import deque

from broker.cluster.messages import (
    AppendLog,
    Effect,
    Entry,
    Flush,
    Message,
    PersistHardState,
    Send,
    Truncate,
)
from broker.cluster.raft import RaftConfig, RaftNode, Role

NODES = 3
PAYLOAD = bytes(64)
CONFIG = RaftConfig(election_ticks=10, heartbeat_ticks=2)


class Log:
    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Entry] = []

    def entries(self, first: int, last: int, max_entries: int, max_bytes: int) -> list[Entry]:
        # Every entry here covers one index (one proposal = one batch of one count).
        return self.items[first - 1 : min(last, first - 1 + max_entries)]

    def entry_start(self, index: int) -> int:
        return index


class Cluster:
    def __init__(self, groups: int, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.logs = [[Log() for _ in range(groups)] for _ in range(NODES)]
        self.cores = [
            [RaftNode(n, list(range(NODES)), self.logs[n][g], rng, CONFIG) for g in range(groups)]
            for n in range(NODES)
        ]
        self.wire: deque[tuple[int, Message]] = deque()

    def apply(self, node: int, g: int, effects: list[Effect]) -> None:
        core, log = self.cores[node][g], self.logs[node][g]
        done: list[Effect] = []
        for e in effects:
            if isinstance(e, Send):
                self.wire.append((g, e.message))
            elif isinstance(e, AppendLog):
                log.items.extend(e.entries)
            elif isinstance(e, Truncate):
                del log.items[e.from_index - 1 :]
            elif isinstance(e, Flush):
                done += core.flushed(e.index)
            elif isinstance(e, PersistHardState):
                done += core.hard_state_persisted(e.state)
        if done:
            self.apply(node, g, done)

    def pump(self) -> None:
        wire, cores = self.wire, self.cores
        while wire:
            g, m = wire.popleft()
            self.apply(m.to, g, cores[m.to][g].receive(m))

    def tick(self) -> None:
        for n in range(NODES):
            for g, core in enumerate(self.cores[n]):
                self.apply(n, g, core.tick())
        self.pump()

    def leaders(self) -> list[tuple[int, RaftNode]]:
        """(group, its leader) for each group that has one."""
        found = []
        for g in range(len(self.cores[0])):
            lead = next((c[g] for c in self.cores if c[g].role is Role.LEADER), None)
            if lead is not None:
                found.append((g, lead))
        return found


def measure(groups: int, rounds: int, per_round: int, idle_seconds: int) -> dict[str, float]:
    cluster = Cluster(groups)
    while len(cluster.leaders()) < groups:
        cluster.tick()
    for _ in range(5):  # let every no-op commit
        cluster.tick()
    leaders = cluster.leaders()
    base = sum(c.commit for _, c in leaders)
    started = time.process_time()
    for _ in range(rounds):
        for g, lead in leaders:
            for _ in range(per_round):
                cluster.apply(lead.id, g, lead.propose(PAYLOAD))
        cluster.pump()
    busy = time.process_time() - started
    committed = sum(c.commit for _, c in leaders) - base
    assert committed == rounds * per_round * groups, (committed, rounds, per_round, groups)
    ticks = idle_seconds * 100
    started = time.process_time()
    for _ in range(ticks):
        cluster.tick()
    idle = time.process_time() - started
    return {
        "groups": groups,
        "committed": committed,
        "committed_per_s": committed / busy,
        "cpu_us_per_batch": busy / committed * 1e6,
        "idle_cpu_us_per_group_s": idle / idle_seconds / groups * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.raft_core", description=__doc__)
    parser.add_argument("--groups", default="1,1000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--idle-seconds", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for groups in (int(g) for g in args.groups.split(",")):
        # The same work per group would take 1 group no time at all: give it 100x the rounds.
        rounds = args.rounds * max(1, 100 // groups)
        rows.append(measure(groups, rounds, args.per_round, args.idle_seconds))
    head = ("groups", "committed", "committed/s", "CPU/batch", "idle/group/s")
    print("{:>7} {:>10} {:>12} {:>11} {:>13}".format(*head))
    for r in rows:
        print(
            f"{r['groups']:>7} {r['committed']:>10} {r['committed_per_s']:>12,.0f} "
            f"{r['cpu_us_per_batch']:>9.1f}us {r['idle_cpu_us_per_group_s']:>11.1f}us"
        )
    print(json.dumps({"bench": "raft_core", "nodes": NODES, "rows": rows}))


if __name__ == "__main__":
    main()
