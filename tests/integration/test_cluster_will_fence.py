"""A will is published once when its client's node is cut off (broker.workers.will_fence), on
three real nodes in network namespaces.

A client with a will is connected to n1; n1 is cut off from the other nodes (nftables; its
client still reaches it) for longer than gossip takes to declare it dead. The majority's side
adopts n1's sessions (broker.workers.orphans) and publishes the will; during the cut the
client's connection to n1 drops, so n1 finds the will due too. Healed, a subscriber on the
majority's side has exactly one will: n1's will record, of the epoch the adopter's claim
superseded, lost. (Without the fence n1 published it as well, and it arrived twice.)

Needs root, ``ip`` and ``nft``; skipped with the reason otherwise.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netlab
from tests.cluster_lab import MQTT_PORT, MqlogCluster
from tests.integration.clients import V5, Client
from tests.integration.rawclient import RawClient
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

#: Seconds the cut lasts after the majority declared the node dead.
AFTER_DEATH = 4.0
#: Seconds a subscriber waits for wills after the heal.
AFTER_HEAL = 12.0


@pytest.fixture(params=[1, 2], ids=["1-worker", "2-workers"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MqlogCluster]:
    with Lab(3) as lab:
        yield MqlogCluster.started(lab, tmp_path, workers=request.param)


def _dead_on(cluster: MqlogCluster, node_id: str, timeout: float = 30.0) -> None:
    """Until every other member's gossip has ``node_id`` dead."""
    others = [m for m in cluster.members if m.node_id != node_id]
    deadline = time.monotonic() + timeout
    while not all(cluster.gossip_view(m).get(node_id, ("?",))[0] == "dead" for m in others):
        assert time.monotonic() < deadline, f"{node_id} not declared dead in {timeout} s"
        time.sleep(0.1)


def test_a_cut_off_nodes_client_gets_one_will(cluster: MqlogCluster) -> None:
    n1, n2 = cluster.member("n1"), cluster.member("n2")
    watcher = Client(MQTT_PORT, "watcher", V5, host=n2.addr)
    assert watcher.connect() == 0
    assert watcher.subscribe("wills/#", qos=1) == [1]
    clients = []
    for i, version in enumerate((5, 4)):  # a persistent 5.0 session, a 3.1.1 clean session
        c = RawClient(MQTT_PORT, version, host=n1.addr)
        will = (f"wills/{i}", f"gone{i}".encode(), 1, False)
        kw: dict[str, object] = {"clean": False, "session_expiry": 300} if version == 5 else {}
        assert c.connect(f"fenced-{i}", will=will, **kw) == (False, 0)
        clients.append(c)
    time.sleep(2.0)  # the sessions' states committed (the timer persists within 1 s)
    try:
        cluster.lab.isolate(n1.node)
        cut = time.monotonic()
        _dead_on(cluster, "n1")
        declared = time.monotonic() - cut
        time.sleep(AFTER_DEATH / 2)
        for c in clients:
            c.sock.close()  # the connections to the cut-off node drop: their wills are due there
        time.sleep(AFTER_DEATH / 2)
    finally:
        cluster.lab.heal()
    healed = time.monotonic()
    got: list[tuple[str, bytes]] = []
    while (left := healed + AFTER_HEAL - time.monotonic()) > 0:
        try:
            m = watcher.messages.get(timeout=left)
        except queue.Empty:
            break
        got.append((m.topic, m.payload))
    watcher.disconnect()
    print(
        f"n1 declared dead after {declared:.2f} s, healed after {healed - cut:.2f} s; "
        f"wills received: {sorted(got)}"
    )
    assert sorted(got) == [("wills/0", b"gone0"), ("wills/1", b"gone1")], got
