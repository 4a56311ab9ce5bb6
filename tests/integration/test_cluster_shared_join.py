"""A node that joins a formed cluster serves its shared subscribers like any other (issue 20,
item 5; issue 21), on four real mqlog nodes in network namespaces: three form the cluster, a
fourth joins through gossip, with one worker per node and with two. A group's member on a
founder and one on the newcomer; every record published goes to exactly one of them
[MQTT-4.8.2], and the newcomer's member gets its share.

The newcomer holds no replica of most stream partitions (replication factor 3 of 4 nodes) and,
until a leader adds it (broker.cluster.reshape), none of ``$sessions``: it follows the groups'
home by what its remote reads of ``$sessions`` name (the leader and its term,
broker.cluster.fetch, broker.workers.cluster_groups), and reads the records the home hands
its member from their partitions' replicas (broker.workers.remote_partition). On the base,
its member lost every record of a partition the newcomer reads remotely (a record not
fetched yet was taken for one retention deleted, reported done): 78 of 200 here.

How long the newcomer goes without ``$sessions`` is the planner's (0.04 to 3.4 s measured):
the test reports whether the newcomer followed the home before it held ``$sessions`` (it did
in every run) and whether its member was served before. It cannot hold that window open (the
leader's Raft messages and the groups' frames share one link per node pair), and in every run
the member's SUBACK came 0.02 to 0.1 s after the newcomer held ``$sessions``: a CONNECT's claim
is applied from the node's own replica (broker.workers.replicated_sessions), so no client is
connected there before. The following itself is asserted in
tests/unit/workers/test_cluster_groups.py.

Needs root, ``ip`` and ``nft``; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import netlab
from tests.cluster_lab import MQTT_PORT, Member, MqlogCluster
from tests.integration.clients import Client
from tests.integration.test_cluster_shared import Collector
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

STREAM = "sj"
EXTRA = f'[[streams]]\nname = "{STREAM}"\ntopic_filter = "sj/#"\npartitions = 2\n'
#: Records published while the joiner's member is subscribed.
RECORDS = 200


@pytest.fixture(params=[1, 2], ids=["1-worker", "2-workers"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MqlogCluster]:
    with Lab(4) as lab:
        yield MqlogCluster.founded(
            lab,
            tmp_path,
            3,
            extra=EXTRA,
            cluster_extra='join_from = ["10.77.0.0/16"]\n',
            workers=request.param,
        )


def _sessions_role(cluster: MqlogCluster, m: Member) -> str | None:
    """``m``'s role in ``$sessions``: ``remote`` while it holds no replica of it."""
    with contextlib.suppress(OSError):
        for p in cluster.status(m)["partitions"]:
            if (p["stream"], p["partition"]) == ("$sessions", 0):
                return str(p["role"])
    return None


class Roles:
    """Samples ``m``'s role in ``$sessions`` on a thread: the time it first held a replica."""

    def __init__(self, cluster: MqlogCluster, m: Member) -> None:
        self.cluster, self.m = cluster, m
        self.replica_at: float | None = None
        self.seen: list[str | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and self.replica_at is None:
            role = _sessions_role(self.cluster, self.m)
            if not self.seen or self.seen[-1] != role:
                self.seen.append(role)
            if role not in (None, "remote"):
                self.replica_at = time.monotonic()
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_a_joined_nodes_member_gets_its_share(cluster: MqlogCluster) -> None:
    n1, n4 = cluster.member("n1"), cluster.member("n4")
    group = f"$share/j/{STREAM}/j/#"
    keeper = Client(MQTT_PORT, "keeper", host=n1.addr)
    assert keeper.connect() == 0
    assert keeper.subscribe(group, qos=1) == [1]
    pub = Client(MQTT_PORT, "pub", host=n1.addr)
    assert pub.connect() == 0
    cluster.start(n4)
    serving = time.monotonic()
    roles = Roles(cluster, n4)
    joiner = Client(MQTT_PORT, "joiner", host=n4.addr)
    members = [keeper, joiner]
    collector = Collector(members)
    sent = [f"j{i}".encode() for i in range(RECORDS)]
    try:
        assert joiner.connect() == 0
        assert joiner.subscribe(group, qos=1) == [1]
        subscribed = time.monotonic()
        for i, payload in enumerate(sent):
            pub.publish(f"{STREAM}/j/{i % 5}", payload, qos=1, wait=i % 20 == 19)
        collector.wait(set(sent), timeout=20)
    finally:
        roles.stop()
        collector.stop()
        for c in (pub, *members):
            with contextlib.suppress(Exception):
                c.disconnect()
    got: list[tuple[float, int, bytes]] = list(collector.got)
    joiners = [t for t, i, _ in got if i == 1]
    payloads = [p for _, _, p in got]
    replica_at = roles.replica_at
    before = [t for t in joiners if replica_at is None or t < replica_at]
    n4_log = n4.log(10**7)
    followed = n4_log.find("shared groups: held by node")
    replica = n4_log.find("$sessions/0: joined as a replica")
    info: dict[str, Any] = {
        "n4 followed the home before it held $sessions": 0 <= followed < replica,
        "subscribed after serving (s)": round(subscribed - serving, 2),
        "$sessions roles seen at n4": roles.seen,
        "n4 a $sessions replica after (s)": None
        if replica_at is None
        else round(replica_at - serving, 2),
        "to the joiner": len(joiners),
        "of them before n4 held $sessions": len(before),
    }
    print(f"\n{RECORDS} records, keeper on n1, joiner on n4 ({cluster.workers} workers): {info}")
    missing = sorted(int(p[1:]) for p in set(sent) - set(payloads))
    assert sorted(payloads) == sorted(sent), (
        f"{len(payloads)} deliveries of {len(sent)} records, {len(set(payloads))} distinct, "
        f"missing {missing}"
    )
    assert len(joiners) >= RECORDS // 4, f"the joined node's member got {len(joiners)}: {info}"
