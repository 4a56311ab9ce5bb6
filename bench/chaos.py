"""Chaos runs against a broker in the network lab (tests/netlab.py), judged by the queue
checker (tests/checker.py).

A run: start the target's nodes in the lab's namespaces; QoS 1 publishers (asyncio, on the
host) each send unique ids (``p<k>-<seq>``) one at a time through whichever node answers: on a
lost connection or a PUBACK later than ``--ack-timeout`` they move to the next node and resend
the same id (DUP set), as an MQTT client resends an unacknowledged QoS 1 publish [MQTT-4.4.0-1].
Meanwhile a nemesis applies a fault schedule drawn from ``--seed``: kill -9 (then restart),
SIGSTOP/SIGCONT, a full partition, a one-way partition, random packet drops, each aimed at
the current leader or at a follower when the target can tell which node leads; after each it
heals and waits for publishes to be acknowledged again. At the end everything is healed, the
dead restarted, and one subscriber drains what the broker kept; the checker compares it with
what was acknowledged.

Targets (``--target``), each a small adapter (a ``Target`` subclass in bench/targets.py):

- ``nats``: NATS 2.9 (Debian ``nats-server``), three nodes, MQTT on JetStream with
  ``stream_replicas: 3``, cluster routes between the three. The drain is a persistent
  session (clean session off) subscribed to ``chaos/#`` at QoS 1 before the first publish.
- ``mqlog``: one mqlog node in one namespace with ``fsync = "always"``; faults kill -9 and
  restart it, or pause it. The drain subscribes to ``$replay/earliest/chaos/#``.
- ``mqlog-cluster``: three mqlog nodes with a ``[cluster]`` section (every partition a Raft
  group of three replicas, ``fsync = "always"``); ``chaos/#`` is one stream of one partition,
  so the faults aim at the leader of that one group (``GET /api/v1/cluster``). The drain
  subscribes to ``$replay/earliest/chaos/#``. After it, the replicas are compared: once
  every node reports the group caught up, the nodes stop and each node's copy of the
  partition is read from its data directory; copies that differ at an offset are
  **divergent** (must be 0), copies that end early are **behind** (``replicas`` in the
  JSON line; a divergent replica fails the run like a lost message).

Usage (root; the lab needs ``ip`` and ``nft``)::

    python -m bench.chaos --target nats --faults 40 --seed 1
    python -m bench.chaos --target mqlog --faults 20 --seed 1
    python -m bench.chaos --target mqlog-cluster --faults 100 --seed 1

Prints the checker's table, one line per fault, and a JSON line (``--json FILE`` appends it);
the whole history (every publish, read and fault) goes to ``<workdir>/history.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.mqttclient import MqttClient
from bench.targets import TARGETS, TOPIC_PREFIX, MqlogClusterTarget, MqlogTarget, Target
from tests.checker import Fault, Publish, Read, Report, check, dumps
from tests.netlab import Lab, Node

# ============================================================== workload


@dataclass
class History:
    publishes: list[Publish] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    last_ack: float = 0.0
    reconnects: int = 0


async def publisher(
    k: int,
    target: Target,
    topic: str,
    hist: History,
    stop: asyncio.Event,
    rate: float,
    ack_timeout: float,
) -> None:
    """One QoS 1 publisher, one message in flight: resend the same id on the next node
    after a failure, until it is acknowledged or the run stops."""
    nodes = target.lab.nodes
    at = k % len(nodes)
    client: MqttClient | None = None
    seq = 0
    pending: tuple[str, float] | None = None
    sent = 0.0
    period = 1.0 / rate if rate > 0 else 0.0
    next_t = time.monotonic()
    try:
        while not stop.is_set():
            if client is None or client.is_closed:
                try:
                    client = await MqttClient.connect(
                        *target.addr(nodes[at]), f"chaos-p{k}", timeout=ack_timeout
                    )
                except (OSError, ConnectionError, TimeoutError):
                    client = None
                    at = (at + 1) % len(nodes)
                    hist.reconnects += 1
                    await asyncio.sleep(0.05)
                    continue
            dup = pending is not None
            if pending is None:
                pending = (f"p{k}-{seq}", time.monotonic())
                seq += 1
            uid, start = pending
            sent = time.monotonic()
            try:
                end = await asyncio.wait_for(
                    client.publish(topic, uid.encode(), dup=dup), ack_timeout
                )
            except (ConnectionError, TimeoutError):
                client.close()
                client = None
                at = (at + 1) % len(nodes)
                hist.reconnects += 1
                continue
            hist.publishes.append(Publish(uid, f"p{k}", topic, 1, start, sent, end))
            hist.last_ack = max(hist.last_ack, end)
            pending = None
            if period:
                next_t = max(next_t + period, end - 1.0)
                if next_t > end:
                    await asyncio.sleep(next_t - end)
    finally:
        if pending is not None:
            uid, start = pending
            hist.publishes.append(Publish(uid, f"p{k}", topic, 1, start, sent, None))
        if client is not None:
            client.close()


# ============================================================== nemesis

KINDS_CLUSTER = ("kill", "pause", "isolate", "cut", "drop")
KINDS_SINGLE = ("kill", "pause")


@dataclass(frozen=True)
class Step:
    """One fault of the schedule: what, aimed at which role, held how long, then a rest."""

    kind: str
    role: str  # "leader" or "follower"
    hold: float
    rest: float
    percent: int
    salt: int


def schedule(seed: int, n: int, size: int) -> list[Step]:
    """``n`` faults drawn from ``seed`` (the same seed gives the same schedule). A fault is
    held 2-10 s: long enough, past an election timeout, for a cluster to fail over."""
    rng = random.Random(seed)
    kinds = KINDS_CLUSTER if size > 1 else KINDS_SINGLE
    steps = [
        Step(
            kind=rng.choice(kinds),
            role=rng.choice(("leader", "follower")) if size > 1 else "leader",
            hold=round(rng.uniform(2.0, 10.0), 2),
            rest=round(rng.uniform(1.0, 3.0), 2),
            percent=rng.choice((10, 20, 30, 50)),
            salt=rng.randrange(1 << 30),
        )
        for _ in range(n)
    ]
    if size == 1:  # a lone node killed restarts at once: down longer measures nothing
        steps = [dataclasses.replace(s, hold=0.0) if s.kind == "kill" else s for s in steps]
    return steps


def pick(target: Target, role: str, salt: int) -> Node:
    nodes = target.lab.nodes
    lead = target.leader()
    if lead is None:
        return nodes[salt % len(nodes)]
    if role == "leader":
        return lead
    others = [m for m in nodes if m != lead]
    return others[salt % len(others)]


async def apply(target: Target, step: Step, node: Node) -> Callable[[], Awaitable[None]]:
    """Start the fault; return what heals it."""
    lab = target.lab
    if step.kind == "kill":
        await asyncio.to_thread(target.kill, node)
        return lambda: asyncio.to_thread(target.start, node)
    if step.kind == "pause":
        target.pause(node)

        async def resume() -> None:
            target.resume(node)

        return resume
    if step.kind == "isolate":
        lab.isolate(node)
    elif step.kind == "cut":
        other = lab.peers(node)[step.salt % (len(lab.nodes) - 1)]
        if (step.salt >> 1) & 1:
            lab.cut(node, other)
        else:
            lab.cut(other, node)
    elif step.kind == "drop":
        lab.drop(node, step.percent)
    else:
        raise ValueError(f"unknown fault kind {step.kind!r}")

    async def heal() -> None:
        lab.heal()

    return heal


async def nemesis(
    target: Target, steps: list[Step], hist: History, log: Callable[[str], None]
) -> None:
    """Each step: wait until publishes are acknowledged again (at most 60 s) and rest,
    apply the fault, hold it, heal it."""
    t0 = time.monotonic()
    for i, step in enumerate(steps):
        mark = time.monotonic()
        while hist.last_ack < mark and time.monotonic() - mark < 60:
            await asyncio.sleep(0.05)
        await asyncio.sleep(step.rest)
        node = await asyncio.to_thread(pick, target, step.role, step.salt)
        start = time.monotonic()
        heal = await apply(target, step, node)
        await asyncio.sleep(step.hold)
        await heal()
        end = time.monotonic()
        what = step.kind + (f" {step.percent}%" if step.kind == "drop" else "")
        hist.faults.append(Fault(what, f"{step.role}:{node.name}", start, end))
        log(f"fault {i + 1}/{len(steps)} at {start - t0:7.2f}s: {what} {step.role} {node.name}")


# ============================================================== one run


@dataclass
class RunResult:
    target: str
    seed: int
    report: Report
    seconds: float
    reconnects: int
    workdir: str
    #: ``Target.check_replicas()`` after the drain (None: the target cannot compare).
    replicas: dict[str, Any] | None = None
    #: Worker processes per node (None: not an mqlog target).
    workers: int | None = None

    @property
    def ok(self) -> bool:
        """The checker's verdict, and no divergent replica where the target can tell."""
        return self.report.ok and not (self.replicas or {}).get("divergent_replicas")

    def summary(self) -> dict[str, Any]:
        r = self.report
        return {
            "bench": "chaos",
            "target": self.target,
            "seed": self.seed,
            "workers": self.workers,
            "faults": r.faults,
            "acked": r.acked,
            "lost": r.lost,
            "unacked_seen": r.unacked_seen,
            "duplicates": r.duplicates,
            "unexpected": r.unexpected,
            "order_violations": r.order_violations,
            "unavailable_median_s": r.unavailable_median,
            "unavailable_max_s": r.unavailable_max,
            "never_available": r.never_available,
            "reconnects": self.reconnects,
            "unavailable_by_fault": by_kind(r),
            "replicas": self.replicas,
            "seconds": round(self.seconds, 1),
        }


async def run_chaos(
    lab: Lab,
    target: Target,
    steps: list[Step],
    *,
    publishers: int = 6,
    topics: int = 3,
    rate: float = 100.0,
    ack_timeout: float = 2.0,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> RunResult:
    """One chaos run on a lab already holding ``target.size`` nodes."""
    t0 = time.monotonic()
    await asyncio.to_thread(target.start_all)
    await target.before_run()
    hist = History()
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(
            publisher(k, target, f"{TOPIC_PREFIX}/{k % topics}", hist, stop, rate, ack_timeout)
        )
        for k in range(publishers)
    ]
    try:
        await nemesis(target, steps, hist, log)
        mark = time.monotonic()  # a last stretch of load after the last fault
        while hist.last_ack < mark + 1.0 and time.monotonic() - mark < 60:
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        lab.heal()
        for node in lab.nodes:
            if target.alive(node):
                target.resume(node)
            else:
                await asyncio.to_thread(target.start, node)
    expect = {p.uid for p in hist.publishes if p.acked}
    reads = await target.drain(expect, quiet=2.0, timeout=120.0)
    replicas = await asyncio.to_thread(target.check_replicas)
    # times from the start of the run, for the report
    pubs = [
        dataclasses.replace(
            p, start=p.start - t0, sent=p.sent - t0, end=None if p.end is None else p.end - t0
        )
        for p in hist.publishes
    ]
    faults = [dataclasses.replace(f, start=f.start - t0, end=f.end - t0) for f in hist.faults]
    report = check(pubs, reads, faults)
    write_history(target.workdir / "history.jsonl", t0, pubs, reads, faults)
    return RunResult(
        target.name,
        seed,
        report,
        time.monotonic() - t0,
        hist.reconnects,
        str(target.workdir),
        replicas,
        getattr(target, "workers", None),
    )


def write_history(
    path: Path, t0: float, pubs: list[Publish], reads: list[Read], faults: list[Fault]
) -> None:
    """The run's history, to locate a loss afterwards: a first line with the wall-clock time
    of t = 0 (to match broker logs), then one JSON array per record: ``["p", uid, client,
    topic, start, sent, end]``, ``["r", uid, topic]`` in read order, ``["f", kind, target,
    start, end]``; times in seconds from t = 0."""
    wall0 = time.time() - (time.monotonic() - t0)
    with open(path, "w") as f:
        f.write(
            json.dumps(
                {"t0_wall": wall0, "t0_utc": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall0))}
            )
            + "\n"
        )
        for p in pubs:
            f.write(json.dumps(["p", p.uid, p.client, p.topic, p.start, p.sent, p.end]) + "\n")
        for r in reads:
            f.write(json.dumps(["r", r.uid, r.topic]) + "\n")
        for x in faults:
            f.write(json.dumps(["f", x.kind, x.target, x.start, x.end]) + "\n")


def run(
    target_name: str,
    faults: int,
    seed: int,
    *,
    workdir: Path | None = None,
    workers: int | None = None,
    log: Callable[[str], None] = print,
    **kw: Any,
) -> RunResult:
    """Build the lab, run, tear the lab down (always). ``workers``: worker processes per
    mqlog node (None: the target's default, one)."""
    cls = TARGETS[target_name]
    base = workdir or Path(tempfile.mkdtemp(prefix=f"chaos-{target_name}-"))
    base.mkdir(parents=True, exist_ok=True)
    with Lab(cls.size) as lab:
        target: Target
        if workers is None:
            target = cls(lab, base)
        elif issubclass(cls, (MqlogTarget, MqlogClusterTarget)):
            target = cls(lab, base, workers=workers)
        else:
            raise ValueError(f"{target_name}: no worker count to set")
        steps = schedule(seed, faults, cls.size)
        return asyncio.run(run_chaos(lab, target, steps, seed=seed, log=log, **kw))


def by_kind(report: Report) -> dict[str, dict[str, Any]]:
    """Per fault kind and role: count, median and max unavailability (s; None: never)."""
    groups: dict[str, list[float | None]] = {}
    for w in report.windows:
        groups.setdefault(f"{w.kind} {w.target.split(':')[0]}", []).append(w.unavailable)
    out: dict[str, dict[str, Any]] = {}
    for key, vals in sorted(groups.items()):
        finite = [v for v in vals if v is not None]
        out[key] = {
            "n": len(vals),
            "median_s": round(statistics.median(finite), 2) if finite else None,
            "max_s": round(max(finite), 2) if finite else None,
            "never": len(vals) - len(finite),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), required=True)
    ap.add_argument("--faults", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1, help="seeds seed, seed+1, ...")
    ap.add_argument("--publishers", type=int, default=6)
    ap.add_argument("--topics", type=int, default=3)
    ap.add_argument("--rate", type=float, default=100.0, help="msg/s per publisher")
    ap.add_argument("--ack-timeout", type=float, default=2.0, help="s before a resend")
    ap.add_argument("--workdir", type=Path, help="logs and data (default: a new temp dir)")
    ap.add_argument(
        "--workers",
        type=int,
        help="worker processes per mqlog node (default 1; 2 is the shipped default on two "
        "cores: publishes forwarded between workers, device connections handed over)",
    )
    ap.add_argument("--json", type=Path, help="append each run's JSON line to this file")
    args = ap.parse_args(argv)
    if args.workers is not None and (args.target == "nats" or args.workers < 1):
        ap.error("--workers takes a count of 1 or more, for the mqlog targets")
    results = []
    for i in range(args.runs):
        seed = args.seed + i
        wd = args.workdir / f"{args.target}-{seed}" if args.workdir else None
        res = run(
            args.target,
            args.faults,
            seed,
            workdir=wd,
            workers=args.workers,
            publishers=args.publishers,
            topics=args.topics,
            rate=args.rate,
            ack_timeout=args.ack_timeout,
        )
        print(res.report.table())
        if res.replicas is not None:
            print(f"replicas: {json.dumps(res.replicas)}")
        print(f"logs, data and history.jsonl: {res.workdir}")
        line = {**res.summary(), "report": json.loads(dumps(res.report))}
        print(json.dumps(res.summary()))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")
        results.append(res)
    if len(results) > 1:
        print(
            f"\n{'seed':>5} {'faults':>6} {'acked':>7} {'lost':>5} {'dups':>5} "
            f"{'p50 s':>6} {'max s':>6}"
        )
        for r in results:
            s = r.summary()
            print(
                f"{s['seed']:>5} {s['faults']:>6} {s['acked']:>7} {s['lost']:>5} "
                f"{s['duplicates']:>5} {_f(s['unavailable_median_s'])} "
                f"{_f(s['unavailable_max_s'])}"
            )
        meds = [r.report.unavailable_median for r in results if r.report.unavailable_median]
        if meds:
            print(f"median of medians {statistics.median(meds):.2f} s")
    return 0 if all(r.ok for r in results) else 1


def _f(x: float | None) -> str:
    return f"{x:6.2f}" if x is not None else " never"


if __name__ == "__main__":
    raise SystemExit(main())
