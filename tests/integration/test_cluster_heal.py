"""A node cut off past its death declaration, once healed, takes no live node's clients, and
every member sees it alive again within seconds; on three real nodes in network namespaces.

n1 is cut off from the other nodes (nftables; the host still reaches it) until the others
have declared it dead and it has declared both of them dead. Subscribers with persistent
sessions are connected to n2 and n3 meanwhile. Healed, n1's gossip must learn both of them
alive again (and they n1) within :data:`REJOIN_BOUND` seconds, and neither subscriber may lose
its connection: their sessions stay where they are (broker.workers.orphans: only the
``$sessions`` leader adopts a gone member's sessions, and not those of a member it hears
from). Before, n1, holding n2 dead but n3 alive, had "a majority alive" with itself the lowest
live name, and adopted n2's sessions: n2 closed its subscriber with DISCONNECT 0x8E.

Needs root, ``ip`` and ``nft``; skipped with the reason otherwise.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netlab
from tests.cluster_lab import MQTT_PORT, Member, MqlogCluster
from tests.integration.clients import V5, Client
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

#: Seconds the cut lasts once both sides hold each other dead.
AFTER_DEATHS = 3.0
#: Seconds after the heal within which every member sees every other alive.
REJOIN_BOUND = 8.0
#: Seconds after the heal the subscribers must stay connected.
WATCH = 20.0


@pytest.fixture(params=[1, 2], ids=["1-worker", "2-workers"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MqlogCluster]:
    with Lab(3) as lab:
        yield MqlogCluster.started(lab, tmp_path, workers=request.param)


def _holds_dead(cluster: MqlogCluster, viewer: Member, dead: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(cluster.gossip_view(viewer).get(n, ("?",))[0] == "dead" for n in dead):
        assert time.monotonic() < deadline, f"{viewer.node_id} did not declare {dead} dead"
        time.sleep(0.1)


def _all_alive(cluster: MqlogCluster) -> bool:
    want = {m.node_id for m in cluster.members}
    for m in cluster.members:
        view = cluster.gossip_view(m)
        if {n for n, (state, _) in view.items() if state == "alive"} != want:
            return False
    return True


def test_a_healed_node_takes_no_live_nodes_clients(cluster: MqlogCluster) -> None:
    n1, n2, n3 = (cluster.member(n) for n in ("n1", "n2", "n3"))
    subscribers = []
    for m in (n2, n3):
        c = Client(MQTT_PORT, f"sub-{m.node_id}", V5, host=m.addr, clean=False, session_expiry=300)
        assert c.connect() == 0
        assert c.subscribe("heal/#", qos=1) == [1]
        subscribers.append(c)
    time.sleep(2.0)  # the sessions' states committed
    try:
        cluster.lab.isolate(n1.node)
        _holds_dead(cluster, n2, ["n1"], 30.0)
        _holds_dead(cluster, n3, ["n1"], 30.0)
        _holds_dead(cluster, n1, ["n2", "n3"], 30.0)
        time.sleep(AFTER_DEATHS)
    finally:
        cluster.lab.heal()
    healed = time.monotonic()
    rejoined = None
    while (elapsed := time.monotonic() - healed) < WATCH:
        if rejoined is None and _all_alive(cluster):
            rejoined = elapsed
        time.sleep(0.1)
    views = {m.node_id: cluster.gossip_view(m) for m in cluster.members}
    lost = {c.paho._client_id.decode(): list(c.disconnects.queue) for c in subscribers}
    print(f"every member alive again after {rejoined} s; disconnects: {lost}; views: {views}")
    assert all(not reasons for reasons in lost.values()), lost  # no 0x8E: not taken over
    subscribers[0].publish("heal/after", b"still here", qos=1)
    for c in subscribers:
        [m] = c.expect(1)
        assert (m.topic, m.payload) == ("heal/after", b"still here")
        with pytest.raises(queue.Empty):
            c.disconnects.get_nowait()
        c.disconnect()
    assert rejoined is not None and rejoined <= REJOIN_BOUND, (rejoined, views)
