"""Gossip membership on real mqlog nodes in network namespaces (tests/cluster_lab.py), the
node-level targets of issue 21:

1. detection: kill -9 of one node, the seconds until each other member's gossip view shows it
   dead (polled every 50 ms), over ``--kills`` kills (a different victim each time, restarted
   and seen alive everywhere before the next); target: within 5 s everywhere;
2. no false death under loss: ``--loss`` percent of the packets between one node and every
   other lost at random, both ways (nftables, the lab's ``drop``), for ``--minutes`` minutes;
   every member's view is polled every 0.5 s and any member seen dead (or left) counts;
   target: none. The suspicions and refutations the loss caused are read from the gossip
   counters (``GET /api/v1/cluster``), summed over the nodes.

Run (root): ``python -m bench.gossip_lab --kills 5 --minutes 10`` (the issue's figures; about
12 minutes). ``--minutes 0`` or ``--kills 0`` skips a part; ``--cluster-extra`` adds
``[cluster]`` keys (e.g. ``'suspicion_mult = 3'``). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.cluster_lab import Member, MqlogCluster
from tests.netlab import Lab


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _counters(cluster: MqlogCluster) -> dict[str, int]:
    """The gossip counters summed over the running nodes."""
    total: dict[str, int] = {}
    for m in cluster.members:
        if m.running():
            for name, value in cluster.status(m)["gossip"].items():
                total[name] = total.get(name, 0) + int(value)
    return total


def _health(cluster: MqlogCluster) -> dict[str, int]:
    """Each running node's Lifeguard health score (0 = healthy; probes every score + 1 s)."""
    scores: dict[str, int] = {}
    for m in cluster.members:
        try:
            scores[m.node_id] = int(cluster.status(m)["gossip"].get("health", 0))
        except OSError:
            continue
    return scores


def detection(cluster: MqlogCluster, kills: int, isolate: bool = False) -> dict[str, Any]:
    """kill -9 (or, with ``isolate``, a full partition: no connection closes, so no probe is
    brought forward, plain SWIM) of one node per round, timed on every other. Each round
    prints the health scores the members had when it began (a rejoined victim's is high)."""
    times: list[float] = []
    per_kill: list[float] = []
    worst_health: list[int] = []
    what = "isolation" if isolate else "kill"
    for k in range(kills):
        victim = cluster.members[1 + k % (len(cluster.members) - 1)]
        health = _health(cluster)
        worst_health.append(max(health.values(), default=0))
        seen = cluster.kill_and_time_death(victim, isolate=isolate)
        times += seen.values()
        per_kill.append(max(seen.values()))
        print(
            f"{what} {k + 1}: {victim.node_id} dead everywhere after {max(seen.values()):.2f} s "
            f"({', '.join(f'{n} {t:.2f}' for n, t in sorted(seen.items()))}); health before "
            f"{' '.join(f'{n}={h}' for n, h in sorted(health.items()))}",
            flush=True,
        )
        if isolate:
            cluster.lab.heal()
        else:
            cluster.start(victim)
        cluster.wait_all_alive(timeout=90)
    return {
        "kills": kills,
        "observations": len(times),
        "p50_s": round(statistics.median(times), 2),
        "p99_s": round(_percentile(times, 0.99), 2),
        "max_s": round(max(times), 2),
        "worst_kill_s": [round(t, 2) for t in per_kill],
        "worst_health_before": worst_health,
    }


def loss(cluster: MqlogCluster, lossy: Member, percent: int, minutes: float) -> dict[str, Any]:
    before = _counters(cluster)
    cluster.lab.drop(lossy.node, percent)
    false_deaths: list[str] = []
    suspect_seen = 0
    worst_health = 0
    end = time.monotonic() + minutes * 60
    next_line = time.monotonic() + 60
    try:
        while time.monotonic() < end:
            for m in cluster.members:
                try:
                    status = cluster.status(m, timeout=2.0)
                except OSError:
                    continue  # the lossy node's own HTTP answers may be lost: not a death
                worst_health = max(worst_health, int(status["gossip"].get("health", 0)))
                for e in status["members"]:
                    if e["state"] in ("dead", "left"):
                        false_deaths.append(f"{m.node_id} saw {e['id']} {e['state']}")
                    elif e["state"] == "suspect":
                        suspect_seen += 1
            if time.monotonic() >= next_line:
                next_line += 60
                left = (end - time.monotonic()) / 60
                print(f"  ... {left:.1f} min left, false deaths so far: {len(false_deaths)}")
            time.sleep(0.5)
    finally:
        cluster.lab.heal()
    after = _counters(cluster)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {
        "lossy_node": lossy.node_id,
        "loss_percent": percent,
        "minutes": minutes,
        "false_deaths": len(false_deaths),
        "false_death_samples": sorted(set(false_deaths))[:10],
        "suspect_samples": suspect_seen,
        "suspicions": delta.get("suspect", 0),
        "suspicions_refuted": delta.get("suspicions_refuted", 0),
        "refuted_by_suspect": delta.get("refuted", 0),
        "probes": delta.get("probes", 0),
        "probe_failures": delta.get("probe_failures", 0),
        "indirect_probes": delta.get("indirect_probes", 0),
        "worst_health_score": worst_health,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--kills", type=int, default=5, help="kill -9 rounds (0: skip)")
    ap.add_argument(
        "--isolations", type=int, default=0, help="full-partition rounds: plain SWIM (0: skip)"
    )
    ap.add_argument("--minutes", type=float, default=10.0, help="loss phase length (0: skip)")
    ap.add_argument("--loss", type=int, default=10, help="percent of packets lost")
    ap.add_argument("--cluster-extra", default="", help="TOML lines added to [cluster]")
    args = ap.parse_args()
    out: dict[str, Any] = {"nodes": args.nodes, "cluster_extra": args.cluster_extra}
    with tempfile.TemporaryDirectory(prefix="gossip-lab-") as tmp, Lab(args.nodes) as lab:
        cluster = MqlogCluster(lab, Path(tmp), cluster_extra=args.cluster_extra)
        cluster.start()
        cluster.wait_all_alive()
        if args.kills:
            out["detection"] = d = detection(cluster, args.kills)
            print(
                f"\ndetection over {d['kills']} kills ({d['observations']} observations): "
                f"p50 {d['p50_s']} s, p99 {d['p99_s']} s, max {d['max_s']} s"
            )
        if args.isolations:
            out["isolation"] = d = detection(cluster, args.isolations, isolate=True)
            print(
                f"\ndetection of an isolated node over {d['kills']} rounds "
                f"({d['observations']} observations): "
                f"p50 {d['p50_s']} s, p99 {d['p99_s']} s, max {d['max_s']} s"
            )
        if args.minutes:
            lossy = cluster.members[len(cluster.members) // 2]
            print(f"\n{args.loss}% loss on {lossy.node_id} for {args.minutes} min ...", flush=True)
            out["loss"] = r = loss(cluster, lossy, args.loss, args.minutes)
            print(
                f"false deaths {r['false_deaths']}, suspicions {r['suspicions']} "
                f"(refuted {r['suspicions_refuted']}), probes {r['probes']} "
                f"(indirect {r['indirect_probes']}, failed {r['probe_failures']}), "
                f"worst health score {r['worst_health_score']}"
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
