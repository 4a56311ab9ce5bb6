"""What a follower waits for a commit: will latency and publish-to-delivery on followers.

A follower applies an entry once it learns the leader committed it. Before commit notices
(``broker.cluster.commits``) it learnt that from the leader's next append or heartbeat, up to
a heartbeat interval (100 ms) later. Two measures on three mqlog nodes in the network lab
(tests/netlab.py, tests/cluster_lab.py: ``fsync = "always"``, one worker each, default
timings, every topic in the ``default`` stream's one partition):

- **will**: ``--wills`` clients with a QoS 1 will connect to a node W that does not lead
  ``$sessions`` (so the will record's commit must reach W as a follower,
  broker.workers.will_fence); a watcher on another node S subscribes to ``wills/#``. Each
  client's socket is closed (no DISCONNECT: the will is due) one at a time; the figure is the
  time from the close to the will's arrival at the watcher.
- **publish-to-delivery**: a publisher on the partition's leader sends ``--messages`` QoS 1
  publishes, each carrying its send time, spaced by a random 20-80 ms (so they fall at every
  phase of the heartbeat); a subscriber on the leader and one on a follower timestamp each
  delivery; ``follower_later_ms`` is, per message, how much later the follower's subscriber
  had it than the leader's (what the follower waits to learn the commit, free of the load
  this machine puts on both).

``--trees`` names the source trees to compare, each run by the same code here, interleaved
over ``--rounds`` (round 1: each tree in turn, then round 2...), so a slow spell of this
shared machine hits them alike; e.g. the code before a change, extracted with ``git archive
BASE | tar -x -C /tmp/base`` (plus the built ``broker/net/_devicelane*.so``), against this
checkout. Each run prints one JSON line (medians, p90, max, where the leaders were, and the
frames, heartbeats and commit notices the nodes sent since they started); the end a table of
the medians over the runs.

Usage (root): ``python -m bench.commit_latency --trees before=/tmp/base,after=.
[--rounds 2] [--wills 20] [--messages 100]``.
"""

from __future__ import annotations

import argparse
import json
import random
import select
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from broker.cluster.placement import node_ids, replicas
from tests.cluster_lab import MQTT_PORT, Member, MqlogCluster
from tests.integration.rawclient import RawClient
from tests.mqttbytes import PUBACK, PUBLISH
from tests.netlab import Lab

#: Seconds a will client's session has to be committed before its connection drops (the
#: session timer persists within 1 s, tests/integration/test_cluster_will_fence.py).
SESSION_SETTLE = 2.0
#: Seconds the nodes have to serve and see each other alive.
START_TIMEOUT = 120.0


def settle(cluster: MqlogCluster, timeout: float = 60.0) -> dict[str, str]:
    """Until every node names, for every partition, the replica placement prefers as its
    leader (the balancer moves leadership there a few seconds after the start); the leaders
    by "stream/partition"."""
    names = node_ids(m.node_id for m in cluster.members)
    deadline = time.monotonic() + timeout
    while True:
        try:
            views = [cluster.status(m)["partitions"] for m in cluster.members]
        except OSError:
            views = []
        if views and all(
            p["leader"] == names[replicas(p["group"], names, len(names))[0]]
            for view in views
            for p in view
        ):
            return {f"{p['stream']}/{p['partition']}": p["leader"] for p in views[0]}
        if time.monotonic() > deadline:
            raise RuntimeError(f"leaders not on their preferred replicas after {timeout}s")
        time.sleep(0.2)


def _arrival(client: RawClient, deadline: float) -> tuple[float, bytes]:
    """The monotonic time a PUBLISH reaches ``client`` (acknowledged at QoS 1) and its
    payload."""
    while True:
        for p in list(client.backlog):
            if p.type == PUBLISH:
                client.backlog.remove(p)
                return _delivered(client, p)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no delivery")
        select.select([client.sock], [], [], left)
        now = time.monotonic()
        p = client.read_packet(max(0.001, deadline - now))
        if p.type == PUBLISH:
            return now, _delivered(client, p)[1]
        client.backlog.append(p)


def _delivered(client: RawClient, p: Any) -> tuple[float, bytes]:
    d = client.decode_publish(p)
    if d.qos:
        client.ack(PUBACK, d.packet_id)
    return time.monotonic(), d.payload


def measure_wills(w: Member, s: Member, n: int) -> list[float]:
    """Milliseconds from each will client's close on ``w`` to its will at a watcher on ``s``."""
    watcher = RawClient(MQTT_PORT, 4, host=s.addr)
    assert watcher.connect("will-watcher") == (False, 0)
    assert watcher.subscribe("wills/#", 1) == [1]
    clients = []
    for i in range(n):
        c = RawClient(MQTT_PORT, 4, host=w.addr)
        will = (f"wills/{i}", f"gone{i}".encode(), 1, False)
        assert c.connect(f"will-{i}", will=will) == (False, 0)
        clients.append(c)
    time.sleep(SESSION_SETTLE)
    out = []
    for i, c in enumerate(clients):
        time.sleep(random.uniform(0.1, 0.3))
        closed = time.monotonic()
        c.close()
        at, payload = _arrival(watcher, closed + 10.0)
        assert payload == f"gone{i}".encode(), payload
        out.append((at - closed) * 1000)
    watcher.disconnect()
    return out


def measure_deliveries(leader: Member, follower: Member, n: int) -> dict[str, list[float]]:
    """Milliseconds from each publish on ``leader`` to its delivery to a subscriber on the
    leader and to one on ``follower``."""
    subs = {}
    for where, m in (("leader", leader), ("follower", follower)):
        sub = RawClient(MQTT_PORT, 4, host=m.addr)
        assert sub.connect(f"lat-sub-{where}") == (False, 0)
        assert sub.subscribe("lat/#", 1) == [1]
        subs[where] = sub
    pub = RawClient(MQTT_PORT, 4, host=leader.addr)
    assert pub.connect("lat-pub") == (False, 0)
    out: dict[str, list[float]] = {where: [] for where in subs}
    for i in range(n):
        time.sleep(random.uniform(0.02, 0.08))
        sent = time.monotonic()
        pub.publish("lat/x", struct.pack(">d", sent), 1, packet_id=i % 60000 + 1)
        for where, sub in subs.items():
            at, payload = _arrival(sub, sent + 10.0)
            assert struct.unpack(">d", payload)[0] == sent
            out[where].append((at - sent) * 1000)
        pub.expect(PUBACK)
    for c in (*subs.values(), pub):
        c.disconnect()
    return out


def _summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {
        "median": round(statistics.median(ordered), 1),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 1),
        "max": round(ordered[-1], 1),
    }


def run(tree: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mqlog-commit-latency-") as tmp, Lab(3) as lab:
        cluster = MqlogCluster(lab, Path(tmp), root=root)
        try:
            cluster.start(timeout=START_TIMEOUT)  # this shared machine may be very busy
            cluster.wait_all_alive(timeout=START_TIMEOUT)
            leaders = settle(cluster)
            by_id = {m.node_id: m for m in cluster.members}
            sessions = by_id[leaders["$sessions/0"]]
            data = by_id[leaders["default/0"]]
            # The will's node follows $sessions; the watcher is on another node that
            # follows the data partition where it can (so both waits are a follower's).
            w = next(m for m in cluster.members if m is not sessions)
            s = next(
                (m for m in cluster.members if m not in (w, data)),
                next(m for m in cluster.members if m is not w),
            )
            follower = next(m for m in cluster.members if m is not data)
            wills = measure_wills(w, s, args.wills)
            deliveries = measure_deliveries(data, follower, args.messages)
            hosts = [cluster.status(m).get("host", {}) for m in cluster.members]
        finally:
            cluster.stop()
    return {
        "tree": tree,
        "leaders": {"$sessions": sessions.node_id, "default/0": data.node_id},
        "will_node": w.node_id,
        "watcher_node": s.node_id,
        "follower_node": follower.node_id,
        "will_ms": _summary(wills),
        "delivery_leader_ms": _summary(deliveries["leader"]),
        "delivery_follower_ms": _summary(deliveries["follower"]),
        # Per message: what the follower's subscriber waits more than the leader's (the load
        # of this machine moves both alike).
        "follower_later_ms": _summary(
            [f - ld for f, ld in zip(deliveries["follower"], deliveries["leader"], strict=True)]
        ),
        # Since each node started (the trees before commit notices have none).
        "frames_sent": sum(h.get("frames_sent", 0) for h in hosts),
        "beats_sent": sum(h.get("beats_sent", 0) for h in hosts),
        "commit_notices_sent": sum(h.get("notices_sent", 0) for h in hosts),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=".", help="name=path,... (a bare path is its own name)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--wills", type=int, default=20)
    ap.add_argument("--messages", type=int, default=100)
    args = ap.parse_args(argv)
    trees = [t.partition("=")[::2] if "=" in t else (t, t) for t in args.trees.split(",")]
    rows: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        for name, path in trees:
            row = run(name, Path(path).resolve(), args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(
        f"{'tree':<10} {'will p50':>9} {'leader p50':>11} {'follower p50':>13} "
        f"{'follower later p50':>19}  (ms, medians of the runs)"
    )
    for name, _ in trees:
        mine = [r for r in rows if r["tree"] == name]

        def med(key: str, rows: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[key]["median"] for r in rows)

        print(
            f"{name:<10} {med('will_ms'):>9.1f} {med('delivery_leader_ms'):>11.1f} "
            f"{med('delivery_follower_ms'):>13.1f} {med('follower_later_ms'):>19.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
