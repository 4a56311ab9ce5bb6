"""A cluster that changes shape under QoS 1 load (issue 21's scenario), on real mqlog nodes in
network namespaces (tests/cluster_lab.py), judged by the queue checker (tests/checker.py).

Five nodes form a cluster (replication factor 3, the stream ``chaos`` of ``--partitions``
partitions); QoS 1 publishers (bench/chaos.py's, one message in flight each, resending on the
next node after a failure) publish through the five all along. Then, one after the other, each
awaited until every partition has placement's three voters over the members of the moment (no
learner left) and publishes are acknowledged again:

1. **join**: a sixth node, in nobody's seeds, starts with the first as its only seed (awaited
   until it also leads partitions: the balancers hand it those it is preferred for);
2. **leave**: ``mqlog cluster leave`` on the second node (its replicas move, it exits);
3. **replace**: kill -9 of the third node, whose replicas are re-created elsewhere once it
   has been dead ``replace_after`` (``--replace-after``, 5 s here).

Then the load stops and the sixth node drains ``$replay/earliest/chaos/#``. Reported: the
checker's verdict (acknowledged messages lost: must be 0), the seconds each change took, the
longest time any one publisher waited for a PUBACK from each change's start to the next's
(``gap``: a publisher may still wait once the groups are placed) and the checker's
unavailability after it, and the comparison of the final voters' copies of every
partition (divergent: must be 0).

Run (root): ``python -m bench.reshape_lab`` (about two minutes). Prints a table and one JSON
line (``--json FILE`` appends it). ``--workers 2``: two workers per node (each worker moves
the groups of the partitions it owns; a node outside a group reads it through the owning
worker, broker.workers.remote_relay).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.chaos import History, publisher
from bench.mqttclient import MqttClient
from bench.targets import TOPIC_PREFIX, compare_replicas, read_replica
from broker.cluster.placement import group_id_of, node_id_of, replicas
from tests.checker import Fault, Read, check
from tests.cluster_lab import HTTP_PORT, MQTT_PORT, Member, MqlogCluster
from tests.netlab import Lab, Node

STREAM = "chaos"


class Founders:
    """What ``bench.chaos.publisher`` needs of a target: the nodes it publishes through (the
    five founders; a publisher moves to the next on a failure) and their MQTT address."""

    def __init__(self, nodes: list[Node]) -> None:
        self.lab = self
        self.nodes = nodes

    @staticmethod
    def addr(node: Node) -> tuple[str, int]:
        return node.addr, MQTT_PORT


def leaders_view(cluster: MqlogCluster) -> dict[str, dict[str, Any]]:
    """Each partition's entry as its leader reports it (the running nodes that answer)."""
    out: dict[str, dict[str, Any]] = {}
    for m in cluster.members:
        if not m.running():
            continue
        try:
            view = cluster.status(m, timeout=1.0)
        except (OSError, ValueError):
            continue
        for p in view["partitions"]:
            if p.get("role") == "leader":
                out[f"{p['stream']}/{p['partition']}"] = p
    return out


def placed(view: dict[str, dict[str, Any]], names: list[str], partitions: int, rf: int = 3) -> bool:
    """Every partition of the stream has placement's ``rf`` voters over ``names``."""
    ids = {node_id_of(n): n for n in names}
    for p in range(partitions):
        entry = view.get(f"{STREAM}/{p}")
        if entry is None or entry.get("learners"):
            return False
        want = {ids[i] for i in replicas(group_id_of((STREAM, p)), ids, rf)}
        if set(entry["replicas"]) != want:
            return False
    return True


async def until_placed(
    cluster: MqlogCluster, names: list[str], partitions: int, timeout: float, leader: str = ""
) -> float:
    """Seconds until :func:`placed` holds (and ``leader`` leads a partition, if named)."""
    t0 = time.monotonic()
    while True:
        view = await asyncio.to_thread(leaders_view, cluster)
        leads = not leader or any(e["leader"] == leader for e in view.values())
        if leads and placed(view, names, partitions):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"not placed over {names} within {timeout} s: {view}")
        await asyncio.sleep(0.5)


def longest_gap(hist: History, start: float, end: float) -> float:
    """The longest time one publisher went without a PUBACK between ``start`` and ``end``."""
    return gap_at(hist, start, end)[0]


def gap_at(hist: History, start: float, end: float) -> tuple[float, str, float]:
    """:func:`longest_gap`, with the publisher and the (monotonic) time the gap began."""
    worst = (0.0, "", start)
    by_client: dict[str, list[float]] = {}
    for p in hist.publishes:
        if p.end is not None and start < p.end < end:
            by_client.setdefault(p.client, []).append(p.end)
    for client, times in by_client.items():
        marks = [start, *sorted(times), end]
        gap, at = max((b - a, a) for a, b in itertools.pairwise(marks))
        worst = max(worst, (gap, client, at))
    return worst


async def drain(member: Member, expect: set[str], timeout: float = 120.0) -> list[Read]:
    """Read ``chaos/#`` from the start on ``member`` until every id of ``expect`` came and
    two quiet seconds passed, or ``timeout``."""
    reads: list[Read] = []
    last = [time.monotonic()]

    def on_message(topic: str, payload: bytes) -> None:
        reads.append(Read(payload.decode(errors="replace"), topic))
        last[0] = time.monotonic()

    client = await MqttClient.connect(member.addr, MQTT_PORT, "drain", on_message=on_message)
    try:
        await client.subscribe(f"$replay/earliest/{TOPIC_PREFIX}/#")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if expect <= {r.uid for r in reads} and time.monotonic() - last[0] > 2.0:
                break
            await asyncio.sleep(0.2)
    finally:
        client.close()
    return reads


def leave(cluster: MqlogCluster, m: Member) -> str:
    url = f"http://{m.addr}:{HTTP_PORT}"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker.cli",
            "cluster",
            "leave",
            "--broker",
            url,
            "--timeout",
            "120",
        ],
        capture_output=True,
        text=True,
        env=cluster.env(),
        timeout=180,
    )
    if out.returncode != 0:
        raise RuntimeError(f"leave failed: {out.stdout}{out.stderr}")
    assert m.proc is not None
    m.proc.popen.wait(timeout=30)
    return out.stdout


async def scenario(cluster: MqlogCluster, args: argparse.Namespace) -> dict[str, Any]:
    members = cluster.members
    _, n2, n3, _, _, n6 = members
    founders = members[:5]
    names = [m.node_id for m in founders]
    t0 = time.monotonic()
    await asyncio.to_thread(cluster.start, *founders)
    await asyncio.to_thread(cluster.wait_all_alive, founders)
    await until_placed(cluster, names, args.partitions, 60)
    hist = History()
    stop = asyncio.Event()
    target: Any = Founders([m.node for m in founders])
    tasks = [
        asyncio.create_task(
            publisher(
                k,
                target,
                f"{TOPIC_PREFIX}/{k % args.topics}",
                hist,
                stop,
                args.rate,
                args.ack_timeout,
            )
        )
        for k in range(args.publishers)
    ]
    changes: list[dict[str, Any]] = []

    async def change(kind: str, who: Member, act: Any, after: list[str], leader: str = "") -> None:
        await asyncio.sleep(args.rest)
        start = time.monotonic()
        await asyncio.to_thread(act)
        took = await until_placed(cluster, after, args.partitions, 180, leader)
        end = time.monotonic()
        hist.faults.append(Fault(kind, who.node_id, start, end))
        changes.append(
            {
                "change": f"{kind} {who.node_id}",
                "seconds": round(end - start, 2),
                "placed_after_act_s": round(took, 2),
            }
        )
        print(f"{kind} {who.node_id}: placed after {end - start:.1f} s", flush=True)

    try:
        await asyncio.sleep(args.rest)
        await change("join", n6, lambda: cluster.start(n6), [*names, "n6"], leader="n6")
        leaders = await asyncio.to_thread(leaders_view, cluster)
        led_by_n6 = sum(1 for e in leaders.values() if e["leader"] == "n6")
        after_leave = ["n1", "n3", "n4", "n5", "n6"]
        await change("leave", n2, lambda: leave(cluster, n2), after_leave)
        await change("replace", n3, lambda: cluster.kill(n3), ["n1", "n4", "n5", "n6"])
        await asyncio.sleep(args.rest)
    finally:
        stopped = time.monotonic()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    expect = {p.uid for p in hist.publishes if p.acked}
    reads = await drain(n6, expect)
    report = check(hist.publishes, reads, hist.faults)
    # Each change's gap runs to the next change's start (a publisher may still be waiting
    # when the groups are placed: a session claim, a reconnection).
    ends = [f.start for f in hist.faults[1:]] + [stopped]
    for c, f, until in zip(changes, hist.faults, ends, strict=True):
        gap, client, at = gap_at(hist, f.start, until)
        wall = time.time() - (time.monotonic() - at)
        c["longest_puback_gap_s"] = round(gap, 3)
        c["gap"] = f"{client} from {time.strftime('%H:%M:%S', time.gmtime(wall))}"
    for c, w in zip(changes, report.windows, strict=True):
        c["unavailable_s"] = None if w.unavailable is None else round(w.unavailable, 3)
    final = await asyncio.to_thread(leaders_view, cluster)
    cluster.stop()
    divergent = 0
    for p in range(args.partitions):
        voters = final[f"{STREAM}/{p}"]["replicas"]
        copies = {
            m.node_id: read_replica(m.data_dir / STREAM / str(p))
            for m in members
            if m.node_id in voters
        }
        divergent += len(compare_replicas(copies).get("divergent_replicas") or [])
    return {
        "bench": "reshape_lab",
        "workers": cluster.workers,
        "acked": report.acked,
        "lost": report.lost,
        "unexpected": report.unexpected,
        "duplicates": report.duplicates,
        "order_violations": report.order_violations,
        "divergent_replicas": divergent,
        "n6_leads": led_by_n6,
        "changes": changes,
        "reconnects": hist.reconnects,
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--publishers", type=int, default=6)
    ap.add_argument("--topics", type=int, default=12)
    ap.add_argument("--rate", type=float, default=50.0, help="msg/s per publisher")
    ap.add_argument("--ack-timeout", type=float, default=5.0, help="s before a resend")
    ap.add_argument("--rest", type=float, default=5.0, help="s of load between changes")
    ap.add_argument("--replace-after", default="5s")
    ap.add_argument("--workers", type=int, default=1, help="[router] workers of each node")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--json", type=Path, help="append the JSON line to this file")
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="reshape-lab-"))
    stream = (
        f'[[streams]]\nname = "{STREAM}"\ntopic_filter = ["{TOPIC_PREFIX}/#"]\n'
        f"partitions = {args.partitions}\n"
    )
    with Lab(6) as lab:
        cluster = MqlogCluster(
            lab,
            workdir,
            extra=stream,
            founders=5,
            workers=args.workers,
            cluster_extra=(
                f'replace_after = "{args.replace_after}"\n'
                f'join_from = ["{lab.nodes[0].addr.rsplit(".", 1)[0]}.0/24"]\n'
            ),
        )
        result = asyncio.run(scenario(cluster, args))
    print(f"\n{'change':<12} {'seconds':>8} {'gap s':>7} {'unavail s':>10}")
    for c in result["changes"]:
        print(
            f"{c['change']:<12} {c['seconds']:>8} {c['longest_puback_gap_s']:>7} "
            f"{c.get('unavailable_s')!s:>10}"
        )
    print(
        f"acked {result['acked']}, lost {result['lost']}, divergent "
        f"{result['divergent_replicas']}, n6 leads {result['n6_leads']}; logs in {workdir}"
    )
    line = json.dumps(result)
    print(line)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    return 0 if result["lost"] == 0 and result["divergent_replicas"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
