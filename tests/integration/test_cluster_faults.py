"""Faults on a three-node mqlog cluster in network namespaces (tests/netlab.py), judged by the
queue checker (tests/checker.py) and by comparing the nodes' copies of the data.

- A short chaos run (bench/chaos.py's ``run_chaos`` on bench/targets.py's
  ``MqlogClusterTarget``): eight faults, each kind aimed at the leader and at a follower of
  the one Raft group the ``chaos/#`` topics go to (kill -9 and restart, SIGSTOP/SIGCONT, a
  full partition, a one-way partition), under QoS 1 load with ``fsync = "always"``. Asserted:
  no acknowledged publish lost, none invented, no per-topic reordering, publishes
  acknowledged again after every fault; then, every node caught up and stopped, the three
  copies of the partition hold the same records at the same offsets (0 divergent replicas).
- An isolated leader: the publish it holds when it steps down (CheckQuorum) is not
  acknowledged (a device-path PUBLISH once was: its PUBACK went out on OUTCOME_UNKNOWN,
  and the record was overwritten by the new leader: an acknowledged message lost).
- A torn tail: a follower killed with kill -9 gets garbage appended to its active segment
  (half of a batch, as a write cut by a crash leaves it); restarted, it recovers, rejoins,
  catches up, and nothing acknowledged is lost on any copy.

Needs root, ``ip`` and ``nft``; skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from bench.chaos import Step, run_chaos
from bench.mqttclient import MqttClient
from bench.targets import MqlogClusterTarget
from broker.commitlog.batch import BATCH_HEADER_SIZE, read_header
from tests import netlab
from tests.netlab import Lab, Node

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

T = TypeVar("T")
#: Seconds the replicas have to report the group caught up once the faults are over.
CONVERGE_TIMEOUT = 60.0
#: No fault may keep publishes unacknowledged longer than this (a stuck group would).
MAX_UNAVAILABLE = 20.0


def test_short_chaos_run_loses_nothing_and_replicas_agree(tmp_path: Path) -> None:
    # salt picks the follower (salt % 2) and, for a cut, its direction ((salt >> 1) & 1:
    # 1 = the aimed node's packets to the other are lost, 0 = the other's to it)
    steps = [
        Step("kill", "leader", 2.0, 0.5, 0, 0),
        Step("pause", "follower", 2.0, 0.5, 0, 1),
        Step("isolate", "leader", 2.5, 0.5, 0, 0),
        Step("cut", "leader", 2.5, 0.5, 0, 2),
        Step("kill", "follower", 2.0, 0.5, 0, 0),
        Step("pause", "leader", 2.5, 0.5, 0, 1),
        Step("isolate", "follower", 2.0, 0.5, 0, 1),
        Step("cut", "follower", 2.0, 0.5, 0, 0),
    ]
    with Lab(MqlogClusterTarget.size) as lab:
        target = MqlogClusterTarget(lab, tmp_path)
        res = asyncio.run(
            run_chaos(lab, target, steps, publishers=4, topics=2, rate=50, log=lambda s: None)
        )
    r = res.report
    logs = f"{r.table()}\nnode logs: {tmp_path}/n*.log"
    assert r.faults == len(steps)
    assert r.acked > 500, logs
    assert r.lost == 0, logs
    assert r.unexpected == 0 and r.order_violations == 0, logs
    assert r.never_available == 0, logs
    assert r.unavailable_max is not None and r.unavailable_max < MAX_UNAVAILABLE, logs
    assert {w.kind for w in r.windows} == {"kill", "pause", "isolate", "cut"}
    assert {w.target.split(":")[0] for w in r.windows} == {"leader", "follower"}
    replicas = res.replicas
    assert replicas is not None
    assert replicas["converged_s"] is not None, replicas
    assert replicas["divergent_replicas"] == 0, replicas
    assert replicas["behind"] == [], replicas
    counts = set(replicas["records"].values())
    assert len(counts) == 1 and counts.pop() >= r.acked, replicas


async def _publish(target: MqlogClusterTarget, node: Node, prefix: str, n: int) -> list[str]:
    """``n`` QoS 1 publishes through ``node``, one at a time, each resent (DUP) on a new
    connection until PUBACKed, as a client does [MQTT-4.4.0-1] when a leadership change
    leaves its outcome unknown; returns their ids in order."""
    uids = [f"{prefix}-{i}" for i in range(n)]
    client: MqttClient | None = None
    deadline = time.monotonic() + 60
    try:
        for i, uid in enumerate(uids):
            dup = False
            while True:
                assert time.monotonic() < deadline, f"{uid} not acknowledged through {node}"
                try:
                    if client is None or client.is_closed:
                        client = await MqttClient.connect(
                            *target.addr(node), f"torn-{prefix}", timeout=5
                        )
                    await asyncio.wait_for(
                        client.publish(f"chaos/{i % 2}", uid.encode(), dup=dup), 5
                    )
                    break
                except (OSError, ConnectionError, TimeoutError):
                    if client is not None:
                        client.close()
                    client, dup = None, True
                    await asyncio.sleep(0.1)
        return uids
    finally:
        if client is not None:
            client.close()


def test_an_isolated_leader_acknowledges_nothing_it_did_not_commit(tmp_path: Path) -> None:
    """One client publishes to one topic (after the first, each PUBLISH takes the device
    path, broker.net.transport) through the leader, one at a time; the leader is isolated
    from the other nodes (not from the client). Whatever it is sent from then on it cannot
    commit: that publish must end with the connection closed (outcome unknown), never with
    a PUBACK; and every publish acknowledged before is on every replica."""

    async def run(target: MqlogClusterTarget, leader: Node) -> tuple[list[str], str, str]:
        client = await MqttClient.connect(*target.addr(leader), "iso", timeout=10)
        acked: list[str] = []
        try:
            for i in range(100):
                uid = f"m{i}"
                await asyncio.wait_for(client.publish("chaos/0", uid.encode()), 10)
                acked.append(uid)
            target.lab.isolate(leader)
            try:
                await asyncio.wait_for(client.publish("chaos/0", b"after"), 30)
            except ConnectionError as e:
                return acked, "refused", str(e)
            return acked, "acknowledged", ""
        finally:
            client.close()

    with Lab(MqlogClusterTarget.size) as lab:
        target = MqlogClusterTarget(lab, tmp_path)
        target.start_all()
        leader = _wait(target.leader, 30)
        acked, outcome, detail = asyncio.run(run(target, leader))
        lab.heal()
        assert target.converge(CONVERGE_TIMEOUT) is not None
        replicas = target.check_replicas()
        copies = {m.node_id: target.replica(m.node) for m in target.cluster.members}
    assert outcome == "refused", "the isolated leader acknowledged a publish it never committed"
    assert replicas["divergent_replicas"] == 0 and replicas["behind"] == [], replicas
    # Every copy is the same: what was acknowledged, then "after" or not. Its outcome was
    # unknown, not refused: if the heal comes before the other two elect a leader, the old
    # leader's log is the longest, it may win the next election and commit "after" then.
    seen = {name: [r[3].decode() for r in copy] for name, copy in copies.items()}
    assert len({tuple(v) for v in seen.values()}) == 1, seen
    assert next(iter(seen.values())) in (acked, [*acked, "after"]), (seen, detail)


def _tear(segment: Path) -> int:
    """Append the first half of the segment's first batch to its end, as a ``write()`` cut by
    a crash leaves a batch; returns the bytes appended."""
    data = segment.read_bytes()
    header = read_header(data)
    torn = data[: max(BATCH_HEADER_SIZE + 1, header.batch_length // 2)]
    with open(segment, "ab") as f:
        f.write(torn)
    return len(torn)


def test_torn_tail_on_a_follower_recovers_rejoins_and_catches_up(tmp_path: Path) -> None:
    with Lab(MqlogClusterTarget.size) as lab:
        target = MqlogClusterTarget(lab, tmp_path)
        target.start_all()
        leader = _wait(target.leader, 30)
        acked = asyncio.run(_publish(target, leader, "before", 200))
        assert target.converge(CONVERGE_TIMEOUT) is not None
        follower = next(n for n in lab.nodes if n != target.leader())
        target.kill(follower)
        part = target.member(follower).data_dir / target.STREAM / "0"
        segment = max(part.glob("*.log"))
        size = segment.stat().st_size
        torn = _tear(segment)
        # The two others go on committing while it is down.
        leader = _wait(target.leader, 30)
        acked += asyncio.run(_publish(target, leader, "down", 200))
        target.start(follower)
        caught_up = target.converge(CONVERGE_TIMEOUT)
        assert caught_up is not None, target.partition_views(target.STREAM, 0)
        # It serves everything, in the leader's order, from its own copy.
        acked += asyncio.run(_publish(target, follower, "after", 50))
        assert target.converge(CONVERGE_TIMEOUT) is not None
        replicas = target.check_replicas()
        copy = target.replica(follower)
    log = target.member(follower).log()
    assert replicas["divergent_replicas"] == 0, replicas
    assert replicas["behind"] == [], replicas
    assert f"{segment}: truncating {torn} bytes at position {size}" in log, log
    assert list(dict.fromkeys(r[3].decode() for r in copy)) == acked, log


def _wait(fn: Callable[[], T | None], timeout: float) -> T:
    """``fn()`` once it is not None, trying every 0.1 s for ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value is not None:
            return value
        assert time.monotonic() < deadline, f"{fn.__name__}: nothing after {timeout}s"
        time.sleep(0.1)
