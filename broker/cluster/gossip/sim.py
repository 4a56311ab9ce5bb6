"""Deterministic simulation of a gossip group (the FoundationDB / TigerBeetle style of
``broker.cluster.sim``): one seeded ``random.Random``, virtual time in ms, a fake network.

``Scenario`` says what happens: ``members`` cores join through the first one (each a few ms
after the previous), the network delays every packet uniformly in ``delay`` ms and loses each
with probability ``loss``; ``slow`` members (never the first, never the victim) read every
packet late by a uniform [0, ``slow_ms``] while their timers fire on time (a member whose
receive path is starved of CPU: Lifeguard's case, where a slow prober reads acks too late and
suspects healthy members, and reads their refutations too late to withdraw); at ``kill_at`` one
random healthy member stops (kill -9: no goodbye); ``blip`` cuts one member off both ways for
a while (it must be suspected, then refute); with ``rejoin_gap`` the kill waits until every
member holds every other alive again after the blip, and that gap more (the rounds of
``bench/gossip_lab.py``: the previous round's victim is back, with the health score its cut
gave it, when the next is cut off). The run ends ``watch`` ms after the kill.

Measured (``Result``): for each surviving member, the time from the kill until it declares the
victim DEAD (``detect``); every DEAD declaration of a member that was alive (``false_deaths``,
observer-target pairs, split into healthy and slow targets), suspicions of live members, the
time until every member knew every other (``converged``), and datagrams sent. Packets are
passed as objects (the codec's cost and limits are tested on their own; ``Swim`` already builds
packets within ``max_datagram``).

Run: ``python -m broker.cluster.gossip.sim [--members 50 100 200] [--seeds 5] [--loss 0.01]
[--slow 0.1] [--slow-ms 1500] [--suspicion-mult 4] [--suspicion-max-mult 6] [--cut-first
0]``: prints a table, with and without Lifeguard, and one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from broker.cluster.gossip.messages import Addr, Changed, Effect, Packet, Send, State
from broker.cluster.gossip.options import SwimConfig
from broker.cluster.gossip.swim import Swim

__all__ = ["Result", "Scenario", "Sim", "main", "summarize"]

JOIN_SPACING_MS = 20
#: ``--cut-first``: how long the member is cut off, long enough to be declared dead and to
#: declare every other member dead (its health score at the maximum).
CUT_MS = 8000
#: With ``rejoin_gap``: how often the simulator checks that every member is back, and how long
#: it waits for that before it gives up on the kill.
REJOIN_POLL_MS = 50
REJOIN_LIMIT_MS = 120_000


@dataclass(frozen=True, slots=True)
class Scenario:
    members: int = 50
    loss: float = 0.0
    delay: tuple[int, int] = (1, 10)
    slow: int = 0
    slow_ms: int = 0
    kill_at: int | None = 20_000
    watch: int = 60_000
    #: (member index, start ms, duration ms): that member's packets are all lost meanwhile.
    blip: tuple[int, int, int] | None = None
    #: With ``blip``: kill this many ms after every member holds every other alive again
    #: once the blip is over, instead of at ``kill_at``.
    rejoin_gap: int | None = None
    config: SwimConfig = field(default_factory=SwimConfig)


@dataclass(slots=True)
class Result:
    seed: int
    scenario: Scenario
    detect: list[int] = field(default_factory=list)  # ms from the kill, per observer
    undetected: int = 0  # observers that never declared the victim dead
    false_deaths_healthy: int = 0
    false_deaths_slow: int = 0
    false_suspicions: int = 0
    converged: int | None = None
    #: The highest local health score among the members when the victim was killed.
    health_at_kill: int = 0
    sent: int = 0
    ran: int = 0  # ms simulated
    stats: dict[str, int] = field(default_factory=dict)


class Sim:
    def __init__(self, seed: int, scenario: Scenario) -> None:
        self.seed = seed
        self.scenario = s = scenario
        self.rng = random.Random(seed)
        self.now = 0
        self._queue: list[tuple[int, int, Callable[[], None]]] = []
        self._n = 0
        self.addrs: list[Addr] = [
            (f"10.0.{i // 250}.{i % 250 + 1}", 7946) for i in range(s.members)
        ]
        self.index = {addr: i for i, addr in enumerate(self.addrs)}
        self.names = [f"m{i:03d}" for i in range(s.members)]
        self.cores: list[Swim | None] = [None] * s.members
        self.alive = [True] * s.members
        self._next_tick: list[int | None] = [None] * s.members
        candidates = list(range(1, s.members))
        self.rng.shuffle(candidates)
        self.slow = set(candidates[: s.slow])
        healthy = [i for i in candidates[s.slow :] if s.blip is None or i != s.blip[0]]
        self.victim = healthy[0] if s.kill_at is not None and healthy else None
        self.killed_at: int | None = None
        self._end = 0
        self.result = Result(seed, s)
        self._known = [0] * s.members  # how many others each member holds alive

    # -- the event loop ----------------------------------------------------------------------

    def _at(self, t: int, action: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self._queue, (t, self._n, action))

    def run(self) -> Result:
        s = self.scenario
        for i in range(s.members):
            self._at(i * JOIN_SPACING_MS, functools.partial(self._start, i))
        self._end = (s.kill_at or 0) + s.watch
        if self.victim is not None and s.blip is not None and s.rejoin_gap is not None:
            healed = s.blip[1] + s.blip[2]
            self._at(healed, self._await_rejoin)
            self._end = healed + REJOIN_LIMIT_MS
        elif self.victim is not None and s.kill_at is not None:
            self._at(s.kill_at, self._kill)
        while self._queue and self._queue[0][0] <= self._end:
            self.now, _, action = heapq.heappop(self._queue)
            action()
        self.result.ran = self._end
        self._finish()
        return self.result

    def _late(self, i: int) -> int:
        return self.rng.randint(0, self.scenario.slow_ms) if i in self.slow else 0

    def _start(self, i: int) -> None:
        core_rng = random.Random(self.rng.getrandbits(64))
        core = Swim(self.names[i], self.addrs[i], core_rng, self.scenario.config, now=self.now)
        self.cores[i] = core
        self._apply(i, core.join(self.addrs[:1] if i else [], self.now))

    def _kill(self) -> None:
        assert self.victim is not None
        self.alive[self.victim] = False
        self.killed_at = self.now
        self._end = self.now + self.scenario.watch
        self.result.health_at_kill = max(c.health.score for c in self.cores if c is not None)

    def _await_rejoin(self) -> None:
        """Kill ``rejoin_gap`` ms after every member holds every other alive (polled)."""
        back = all(
            m.state is State.ALIVE for core in self.cores if core for m in core.members.values()
        )
        if back:
            self._at(self.now + (self.scenario.rejoin_gap or 0), self._kill)
        else:
            self._at(self.now + REJOIN_POLL_MS, self._await_rejoin)

    def _apply(self, i: int, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Send):
                self._transmit(i, effect.addr, effect.packet)
            else:
                self._observe(i, effect)
        core = self.cores[i]
        assert core is not None
        due = max(core.deadline, self.now)
        if self._next_tick[i] is None or due < self._next_tick[i]:  # type: ignore[operator]
            self._next_tick[i] = due
            self._at(due, lambda: self._tick(i, due))

    def _tick(self, i: int, due: int) -> None:
        core = self.cores[i]
        if self._next_tick[i] != due or not self.alive[i] or core is None:
            return
        self._next_tick[i] = None
        self._apply(i, core.tick(self.now))

    def _cut(self, i: int) -> bool:
        blip = self.scenario.blip
        return blip is not None and blip[0] == i and blip[1] <= self.now < blip[1] + blip[2]

    def _transmit(self, i: int, addr: Addr, packet: Packet) -> None:
        self.result.sent += 1
        j = self.index.get(addr)
        if j is None or self._cut(i) or self.rng.random() < self.scenario.loss:
            return
        low, high = self.scenario.delay
        arrival = self.now + self.rng.randint(low, high) + self._late(j)
        self._at(arrival, lambda: self._deliver(j, self.addrs[i], packet))

    def _deliver(self, j: int, src: Addr, packet: Packet) -> None:
        core = self.cores[j]
        if core is None or not self.alive[j] or self._cut(j):
            return
        self._apply(j, core.receive(src, packet, self.now))

    # -- measuring ---------------------------------------------------------------------------

    def _observe(self, i: int, change: Changed) -> None:
        j = self.index.get(change.addr)
        r = self.result
        if change.state is State.ALIVE and change.previous is None:
            self._known[i] += 1
            if r.converged is None and all(k == self.scenario.members - 1 for k in self._known):
                r.converged = self.now
        if j is None or not self.alive[i]:
            return
        if self.scenario.rejoin_gap is not None and self.killed_at is None:
            return  # the cut's own suspicions and deaths: what it is there for
        if change.state is State.DEAD:
            if j == self.victim and self.killed_at is not None:
                r.detect.append(self.now - self.killed_at)
            elif self.alive[j]:
                if j in self.slow:
                    r.false_deaths_slow += 1
                else:
                    r.false_deaths_healthy += 1
        elif change.state is State.SUSPECT and self.alive[j]:
            r.false_suspicions += 1

    def _finish(self) -> None:
        r = self.result
        if self.victim is not None:
            observers = sum(1 for i, up in enumerate(self.alive) if up and i != self.victim)
            r.undetected = observers - len(r.detect)
        for core in self.cores:
            if core is not None:
                for key, value in core.stats.items():
                    r.stats[key] = r.stats.get(key, 0) + value


def percentile(values: Sequence[int], q: float) -> float:
    """The q-quantile (0-1) by the nearest-rank method; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))])


def summarize(results: Sequence[Result]) -> dict[str, float | int | None]:
    """Pooled over seeds: detection median/p99 (s), counts per run."""
    detect = [d for r in results for d in r.detect]
    period = results[0].scenario.config.probe_interval
    converged = [r.converged for r in results if r.converged is not None]
    return {
        "runs": len(results),
        "detect_median_s": round(statistics.median(detect) / 1000, 2) if detect else None,
        "detect_p99_s": round(percentile(detect, 0.99) / 1000, 2) if detect else None,
        "detect_max_s": round(max(detect) / 1000, 2) if detect else None,
        "detect_median_periods": round(statistics.median(detect) / period, 1) if detect else None,
        "undetected": sum(r.undetected for r in results),
        "false_deaths_healthy": sum(r.false_deaths_healthy for r in results),
        "false_deaths_slow": sum(r.false_deaths_slow for r in results),
        "false_suspicions": sum(r.false_suspicions for r in results),
        "health_at_kill_median": statistics.median(r.health_at_kill for r in results),
        "converged_max_s": round(max(converged) / 1000, 2)
        if len(converged) == len(results)
        else None,
        "datagrams_per_member_s": round(
            sum(r.sent for r in results) / sum(r.scenario.members * r.ran / 1000 for r in results),
            1,
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.cluster.gossip.sim")
    parser.add_argument("--members", type=int, nargs="+", default=[50, 100, 200])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--slow", type=float, default=0.0, help="share of slow members")
    parser.add_argument("--slow-ms", type=int, default=1500)
    parser.add_argument("--watch", type=int, default=60_000)
    parser.add_argument("--suspicion-mult", type=int, default=SwimConfig().suspicion_mult)
    parser.add_argument("--suspicion-max-mult", type=int, default=SwimConfig().suspicion_max_mult)
    parser.add_argument(
        "--cut-first",
        type=int,
        default=None,
        metavar="GAP",
        help=f"cut one member off for {CUT_MS} ms at the kill time, then kill another GAP ms "
        "after every member holds every other alive again",
    )
    args = parser.parse_args(argv)
    cut = None if args.cut_first is None else (1, Scenario().kill_at or 0, CUT_MS)
    header = (
        f"{'members':>7} {'lifeguard':>9} {'detect med':>10} {'p99':>6} {'max':>6} "
        f"{'undet':>5} {'false dead (healthy/slow)':>25} {'false susp':>10} {'conv':>5} "
        f"{'dgram/s':>7} {'cpu s':>6}"
    )
    print(
        f"loss {args.loss:.0%}, slow {args.slow:.0%} (up to {args.slow_ms} ms late), "
        f"suspicion_mult {args.suspicion_mult} (max {args.suspicion_max_mult}x), "
        f"cut first (gap) {args.cut_first}, "
        f"seeds {args.start}..{args.start + args.seeds - 1}"
    )
    print(header)
    rows = []
    for members in args.members:
        for lifeguard in (False, True):
            scenario = Scenario(
                members=members,
                loss=args.loss,
                slow=round(args.slow * members),
                slow_ms=args.slow_ms,
                watch=args.watch,
                blip=cut,
                rejoin_gap=args.cut_first,
                config=replace(
                    SwimConfig(),
                    lifeguard=lifeguard,
                    suspicion_mult=args.suspicion_mult,
                    suspicion_max_mult=args.suspicion_max_mult,
                ),
            )
            began = time.process_time()
            results = [
                Sim(seed, scenario).run() for seed in range(args.start, args.start + args.seeds)
            ]
            row = summarize(results) | {
                "members": members,
                "lifeguard": lifeguard,
                "loss": args.loss,
                "slow": scenario.slow,
                "slow_ms": args.slow_ms,
                "suspicion_mult": args.suspicion_mult,
                "suspicion_max_mult": args.suspicion_max_mult,
                "cut_first": args.cut_first,
                "cpu_s": round(time.process_time() - began, 1),
            }
            rows.append(row)
            false_dead = f"{row['false_deaths_healthy']} / {row['false_deaths_slow']}"
            print(
                f"{members:>7} {'on' if lifeguard else 'off':>9} {row['detect_median_s']!s:>10} "
                f"{row['detect_p99_s']!s:>6} {row['detect_max_s']!s:>6} {row['undetected']:>5} "
                f"{false_dead:>25} "
                f"{row['false_suspicions']:>10} {row['converged_max_s']!s:>5} "
                f"{row['datagrams_per_member_s']:>7} {row['cpu_s']:>6}",
                flush=True,
            )
    print(json.dumps({"gossip_sim": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
