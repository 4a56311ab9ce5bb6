"""Raft costs, in process, no I/O: what consensus itself costs per committed batch, and what an
idle group costs per second.

Three nodes, G groups, a loss-free network that delivers in FIFO order, and a disk whose
flushes and hard-state writes complete as soon as the step that asked for them has been
applied. Each proposal stands for one record batch (a 64-byte payload: the core never looks
inside). Measured with ``time.process_time``, for three ways of running the groups:

* ``core``: bare cores, every message on its own (issue 19's first step; what the simulator
  does), every group ticking and heartbeating;
* ``host``: a ``MultiRaft`` per node (``broker.cluster.multiraft``): one frame per node pair per
  step, heartbeats and their answers coalesced, with quiescence off (every group ticks and
  beats);
* ``quiet``: the same with quiescence on: an idle group stops ticking and beating, and the
  hosts exchange one (empty) frame per node pair per heartbeat interval as node liveness;
* ``down``: ``quiet`` with the third node down (idle run only): once the survivors have not
  heard it for an election timeout and the groups it led elected again, they quiesce over
  the live replicas (``CPU/node`` is then over the two live nodes).

Two measurements:

* busy: every group's leader gets ``--per-round`` proposals, the cluster runs until all of
  them commit on the leaders, ``--rounds`` times (100 times more rounds for a single group):
  committed/s and CPU per committed batch;
* idle: nothing proposed, 10 ms ticks (heartbeat every 2 ticks, election timeout 10, as in the
  simulator) for ``--idle-seconds`` of virtual time (scaled down where it would take minutes:
  the cost is linear in time): CPU per idle group per second (its three replicas together),
  and ``CPU/node``, the share of one core each node spends on all its idle groups. Heartbeats
  sent during the idle run are counted.

In process, a ``host`` beat costs more than a ``core`` one: the receiver rebuilds each beat and
ack into the message the core sent (two more objects per round trip), which over a wire takes
the place of decoding it. What coalescing saves on a wire (one frame per node pair per step
instead of a message per group) is not measured here: there is no wire.

There is no reference implementation to run beside it (pysyncobj was measured in issue 19's
filing and has no comparable in-process mode); the modes are each other's reference. Prints a
table and one JSON line. Run: ``python -m bench.raft_core [--groups 1,1000] [--idle 1000,10000]
[--runs 3]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque
from collections.abc import Iterable

from broker.cluster.messages import (
    AppendEntries,
    AppendLog,
    Effect,
    Entry,
    Flush,
    Message,
    PersistHardState,
    Send,
    Truncate,
)
from broker.cluster.multiraft import MultiRaft
from broker.cluster.raft import RaftConfig, RaftNode, Role

NODES = 3
PAYLOAD = bytes(64)
CONFIG = RaftConfig(election_ticks=10, heartbeat_ticks=2)
TICKS_PER_S = 100
MODES = ("core", "host", "quiet", "down")
#: Most group-ticks an idle run spends with every group ticking (about 10 s of CPU here).
IDLE_BUDGET = 1_500_000


class Log:
    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Entry] = []

    def entries(self, first: int, last: int, max_entries: int, max_bytes: int) -> list[Entry]:
        # Every entry here covers one index (one proposal = one batch of one count).
        return self.items[first - 1 : min(last, first - 1 + max_entries)]

    def entry_start(self, index: int) -> int:
        return index

    def append(self, first_index: int, entries: tuple[Entry, ...]) -> None:
        self.items.extend(entries)

    def truncate(self, from_index: int) -> None:
        del self.items[from_index - 1 :]


class CoreCluster:
    """Bare cores, one message at a time."""

    def __init__(self, groups: int, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.logs = [[Log() for _ in range(groups)] for _ in range(NODES)]
        self.cores = [
            [RaftNode(n, list(range(NODES)), self.logs[n][g], rng, CONFIG) for g in range(groups)]
            for n in range(NODES)
        ]
        self.wire: deque[tuple[int, Message]] = deque()
        self.beats = 0

    def apply(self, node: int, g: int, effects: list[Effect]) -> None:
        core, log = self.cores[node][g], self.logs[node][g]
        done: list[Effect] = []
        for e in effects:
            if isinstance(e, Send):
                self.wire.append((g, e.message))
                if isinstance(e.message, AppendEntries) and not e.message.entries:
                    self.beats += 1
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

    def propose(self, node: int, g: int, payload: bytes) -> None:
        self.apply(node, g, self.cores[node][g].propose(payload))

    def group_cores(self, g: int) -> Iterable[RaftNode]:
        return (c[g] for c in self.cores)

    def quiet(self) -> bool:
        return True


class HostCluster:
    """A ``MultiRaft`` per node."""

    def __init__(self, groups: int, quiesce: bool, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.hosts = [MultiRaft(n, range(NODES), rng, CONFIG, quiesce) for n in range(NODES)]
        for host in self.hosts:
            for g in range(groups):
                host.add_group(g, list(range(NODES)), Log())
        self.beats = 0
        #: Nodes that are down: not ticked, their frames and frames to them lost.
        self.down: set[int] = set()

    def pump(self) -> None:
        hosts = self.hosts
        busy = True
        while busy:
            busy = False
            frames = []
            for host in hosts:
                if host.id in self.down:
                    continue
                ready = host.ready()
                if not ready:
                    continue
                busy = True
                frames += ready.frames
                if ready.hard_states:
                    host.hard_states_persisted(ready.hard_states.items())
                if ready.flushes:
                    host.flushed(ready.flushes.items())
            for frame in frames:
                self.beats += len(frame.beats)
                if frame.to not in self.down:
                    hosts[frame.to].receive(frame)

    def tick(self) -> None:
        for host in self.hosts:
            if host.id not in self.down:
                host.tick()
        self.pump()

    def propose(self, node: int, g: int, payload: bytes) -> None:
        self.hosts[node].propose(g, payload)

    def group_cores(self, g: int) -> Iterable[RaftNode]:
        return (h.core(g) for h in self.hosts if h.id not in self.down)

    def quiet(self) -> bool:
        live = [h for h in self.hosts if h.id not in self.down]
        return all(h.ticking == 0 for h in live) or not self.hosts[0].quiesce


Cluster = CoreCluster | HostCluster


def make(mode: str, groups: int) -> Cluster:
    if mode == "core":
        return CoreCluster(groups)
    return HostCluster(groups, quiesce=mode in ("quiet", "down"))


def leaders(cluster: Cluster, groups: int) -> list[tuple[int, RaftNode]]:
    """(group, its leader) for each group that has one."""
    found = []
    for g in range(groups):
        lead = next((c for c in cluster.group_cores(g) if c.role is Role.LEADER), None)
        if lead is not None:
            found.append((g, lead))
    return found


def settle(cluster: Cluster, groups: int) -> list[tuple[int, RaftNode]]:
    """Tick until every group has a leader and its no-op committed (and, quiesced, is quiet)."""
    while len(leaders(cluster, groups)) < groups:
        cluster.tick()
    for _ in range(5):
        cluster.tick()
    for _ in range(100):
        if cluster.quiet():
            break
        cluster.tick()
    return leaders(cluster, groups)


def measure_busy(mode: str, groups: int, rounds: int, per_round: int) -> dict[str, float]:
    cluster = make(mode, groups)
    found = settle(cluster, groups)
    base = sum(c.commit for _, c in found)
    started = time.process_time()
    for _ in range(rounds):
        for g, lead in found:
            for _ in range(per_round):
                cluster.propose(lead.id, g, PAYLOAD)
        cluster.pump()
    busy = time.process_time() - started
    committed = sum(c.commit for _, c in found) - base
    assert committed == rounds * per_round * groups, (committed, rounds, per_round, groups)
    return {
        "committed": committed,
        "committed_per_s": committed / busy,
        "cpu_us_per_batch": busy / committed * 1e6,
    }


def measure_idle(mode: str, groups: int, seconds: float) -> dict[str, float]:
    cluster = make(mode, groups)
    settle(cluster, groups)
    live = NODES
    if mode == "down":
        assert isinstance(cluster, HostCluster)
        cluster.down.add(NODES - 1)
        live -= 1
        settle(cluster, groups)  # the groups it led elect on the others, then all quiesce
    if mode not in ("quiet", "down"):  # every group ticks on every node: keep the run within budget
        seconds = min(seconds, IDLE_BUDGET / (groups * NODES * TICKS_PER_S))
    ticks = max(1, round(seconds * TICKS_PER_S))
    seconds = ticks / TICKS_PER_S
    beats = cluster.beats
    started = time.process_time()
    for _ in range(ticks):
        cluster.tick()
    idle = time.process_time() - started
    per_group = idle / seconds / groups
    return {
        "idle_seconds": seconds,
        "idle_cpu_us_per_group_s": per_group * 1e6,
        "idle_core_share": per_group * groups / live,
        "idle_beats_per_group_s": (cluster.beats - beats) / seconds / groups,
    }


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.raft_core", description=__doc__)
    parser.add_argument("--groups", default="1,1000", help="group counts for the busy run")
    parser.add_argument("--idle", default="1000,10000", help="group counts for the idle run")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--idle-seconds", type=float, default=5)
    parser.add_argument("--runs", type=int, default=3, help="medians of this many runs")
    args = parser.parse_args()
    modes = args.modes.split(",")
    busy, idle = [], []
    for mode in modes:
        for groups in (int(g) for g in args.groups.split(",")) if mode != "down" else ():
            # The same work per group would take 1 group no time at all: 100x the rounds.
            rounds = args.rounds * max(1, 100 // groups)
            runs = [measure_busy(mode, groups, rounds, args.per_round) for _ in range(args.runs)]
            busy.append({"mode": mode, "groups": groups, **median_of(runs)})
        for groups in (int(g) for g in args.idle.split(",")):
            runs = [measure_idle(mode, groups, args.idle_seconds) for _ in range(args.runs)]
            idle.append({"mode": mode, "groups": groups, **median_of(runs)})
    print(f"busy, {NODES} nodes, medians of {args.runs}")
    print(
        "{:>6} {:>7} {:>10} {:>12} {:>11}".format(
            "mode", "groups", "committed", "committed/s", "CPU/batch"
        )
    )
    for r in busy:
        print(
            f"{r['mode']:>6} {r['groups']:>7} {r['committed']:>10.0f} "
            f"{r['committed_per_s']:>12,.0f} {r['cpu_us_per_batch']:>9.1f}us"
        )
    print(f"idle, {NODES} nodes, 10 ms ticks, medians of {args.runs}")
    head = ("mode", "groups", "virtual s", "CPU/group/s", "beats/group/s", "CPU/node")
    print("{:>6} {:>7} {:>10} {:>13} {:>14} {:>11}".format(*head))
    for r in idle:
        print(
            f"{r['mode']:>6} {r['groups']:>7} {r['idle_seconds']:>10.2f} "
            f"{r['idle_cpu_us_per_group_s']:>11.2f}us {r['idle_beats_per_group_s']:>14.1f} "
            f"{r['idle_core_share']:>10.3%}"
        )
    print(json.dumps({"bench": "raft_core", "nodes": NODES, "busy": busy, "idle": idle}))


if __name__ == "__main__":
    main()
