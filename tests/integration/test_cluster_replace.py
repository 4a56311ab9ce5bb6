"""Replicas of a dead member re-created on a live node (issue 21 item 3,
broker.cluster.reshape), on four real nodes in network namespaces with replication factor 3:
one node is killed for good; once it has been dead for ``replace_after`` every group it was a
voter of removes it and adds the node that held no copy, which catches up and is promoted;
nothing acknowledged before or after is lost, and every node still serves every partition.
Started again, the dead node is placed again: its replicas move back, and it reads all.

Also with two workers per node: each worker removes the dead member from the groups it leads
once worker 0's gossip tells it the member is gone (broker.cluster.worker_view), and re-creates
its replicas on the node that held no copy, as with one worker (a node outside a group reads
it through the owning worker, broker.workers.remote_relay), in both workers' groups."""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.workers.mesh import owner_of
from tests import netlab
from tests.cluster_lab import MQTT_PORT, MqlogCluster
from tests.integration.clients import Client
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

PARTITIONS = 4
EXTRA = f'[[streams]]\nname = "rp"\ntopic_filter = "rp/#"\npartitions = {PARTITIONS}\n'


@pytest.fixture(params=[1, 2], ids=["1-worker", "2-workers"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MqlogCluster]:
    with Lab(4) as lab:
        yield MqlogCluster.started(
            lab,
            tmp_path,
            extra=EXTRA,
            cluster_extra='replace_after = "2s"\n',
            workers=request.param,
        )


def _groups(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{p['stream']}/{p['partition']}": p for p in view["partitions"]}


def _topic_in(p: int) -> str:
    """A topic of the ``rp`` stream that maps to partition ``p``."""
    return next(t for i in range(10_000) if zlib.crc32((t := f"rp/a/{i}").encode()) % 4 == p)


def _publish(c: Client, topic: str, payloads: list[bytes]) -> None:
    for p in payloads:
        c.publish(topic, p, qos=1)


def test_a_dead_members_replicas_are_re_created_on_a_live_node(cluster: MqlogCluster) -> None:
    n1 = cluster.member("n1")
    survivors = [cluster.member(n) for n in ("n2", "n3", "n4")]
    # n1 holds some partitions of rp (replication factor 3 of 4 nodes); the messages go to one
    # of those.
    view = _groups(cluster.status(survivors[0]))
    held = [k for k, p in view.items() if k.startswith("rp/") and "n1" in p["replicas"]]
    assert held
    topic = _topic_in(int(held[0].split("/")[1]))
    before = [b"b%03d" % i for i in range(30)]
    pub = Client(MQTT_PORT, "before", host=survivors[0].addr)
    assert pub.connect() == 0
    _publish(pub, topic, before)
    pub.disconnect()
    cluster.kill(n1)
    deadline = time.monotonic() + 90
    while True:
        views = [_groups(cluster.status(m)) for m in survivors]
        leaders_view = {}
        for v in views:
            for k, p in v.items():
                if p.get("role") == "leader":
                    leaders_view[k] = p
        logs = "".join(m.log(400_000) for m in survivors)
        # n1 removed, a learner added on another node and promoted (the status lists
        # members, learners included: the promotion is read from the leaders' log lines).
        done = all(
            k in leaders_view
            and "n1" not in leaders_view[k]["replicas"]
            and len(leaders_view[k]["replicas"]) == 3
            and f"{k}: promoting" in logs
            for k in held
        )
        if done:
            break
        assert time.monotonic() < deadline, {k: leaders_view.get(k) for k in held}
        time.sleep(0.5)
    # The replacement went through the groups' own logs: a learner joined, was promoted.
    assert "removing n1" in logs
    assert "joined as a replica" in logs
    # Both workers' groups with two: n1 held every partition of rp.
    assert len(held) == PARTITIONS
    owners = {owner_of(("rp", int(k.split("/")[1])), cluster.workers) for k in held}
    assert owners == set(range(cluster.workers))
    # Every survivor publishes and reads everything, the old messages too.
    after = [b"a%03d" % i for i in range(30)]
    pub = Client(MQTT_PORT, "after", host=survivors[1].addr)
    assert pub.connect() == 0
    _publish(pub, topic, after)
    pub.disconnect()
    for m in survivors:
        reader = Client(MQTT_PORT, f"reader-{m.node_id}", host=m.addr)
        assert reader.connect() == 0
        assert reader.subscribe(f"$replay/earliest/{topic}", qos=1) == [1]
        got = [msg.payload for msg in reader.expect(60, timeout=30)]
        reader.disconnect()
        assert got == before + after, m.node_id
    # The dead member comes back after its replacement: placement over the four wants it
    # again, so each group it held moves back (its stale copy given up first where a leader
    # told it so, else brought up to date as a learner: either way through the group's log),
    # and it reads everything.
    cluster.start(n1)
    deadline = time.monotonic() + 90
    while True:
        views = []
        for m in cluster.members:
            try:
                views.append(_groups(cluster.status(m)))
            except OSError:
                continue
        led = {k: p for v in views for k, p in v.items() if p.get("role") == "leader"}
        if all(k in led and "n1" in led[k]["replicas"] and not led[k]["learners"] for k in held):
            break
        assert time.monotonic() < deadline, {k: led.get(k) for k in held}
        time.sleep(0.5)
    reader = Client(MQTT_PORT, "reader-back", host=n1.addr)
    assert reader.connect() == 0
    assert reader.subscribe(f"$replay/earliest/{topic}", qos=1) == [1]
    got = [msg.payload for msg in reader.expect(60, timeout=30)]
    reader.disconnect()
    assert got == before + after
