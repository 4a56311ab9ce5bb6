"""Shared subscriptions across a cluster of several workers per node (issue 20, item 5): three
real mqlog nodes of two workers each, in network namespaces. A group's members connect to
every node and, on each node, to both workers (SO_REUSEPORT spreads the connections; the
test looks up which worker process serves each one); each record of the group goes to
exactly one of them [MQTT-4.8.2] (broker.workers.cluster_groups: the group is held by the
worker hosting ``$sessions`` on the node leading it; the other workers of each node reach it
through that node's worker hosting ``$sessions``, over the mesh).

- Members on every node and worker, QoS 1, no failure: every record delivered exactly once
  across them, and to members of every worker of every node (before, a group was kept per
  node by the mesh's home worker: each record went to one member on EACH node).
- A worker serving a member that holds records unacknowledged killed (kill -9; the
  supervisor restarts it), on a node other than the home (its ``$sessions`` worker or the
  other) or on the home's node (the worker that is not the home): those records go to the
  other members.
- The home killed, the whole node or its worker hosting ``$sessions``, under QoS 1 load:
  every acknowledged publish reaches a member (duplicates allowed and counted), and the
  members on every node and worker join the new home.
- ``$sessions`` handed over and back under QoS 1 load: every record exactly once.

Needs root, ``ip``, ``nft`` and ``ss``; skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator

import pytest

from tests import netlab
from tests.cluster_lab import MQTT_PORT, Member, MqlogCluster
from tests.integration.clients import Client
from tests.integration.test_cluster_remote import _load
from tests.integration.test_cluster_shared import (
    EXTRA,
    STREAM,
    Collector,
    _leaders,
    _transfer_sessions,
    home,
)
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

NODES = 3
WORKERS = 2
#: Connections a test makes at most on one node to find members on each of its workers.
MAX_TRIES = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MqlogCluster]:
    with Lab(NODES) as lab:
        yield MqlogCluster.started(
            lab, tmp_path_factory.mktemp("sharedw"), workers=WORKERS, extra=EXTRA
        )


def worker_pid(cluster: MqlogCluster, m: Member, c: Client) -> int:
    """The pid of the worker process of ``m`` serving client ``c``'s connection."""
    port = c.paho.socket().getsockname()[1]
    match = f"( sport = :{MQTT_PORT} and dport = :{port} )"
    out = cluster.lab.exec(m.node, "ss", "-Htnp", "state", "established", match)
    found = re.search(r"pid=(\d+)", out)
    assert found, f"no socket of {m.node_id} serves port {port}: {out!r}"
    return int(found.group(1))


def sessions_worker_pid(m: Member) -> int:
    """The pid of the worker of ``m`` hosting ``$sessions`` (the one linked to the other
    nodes for the groups), as its latest start logged it."""
    found = re.findall(r"worker \d+ \(pid (\d+)\): serving .*owns .*\$sessions/0", m.log(10**7))
    assert found, f"{m.node_id}: no worker says it owns $sessions"
    return int(found[-1])


class Spread:
    """Members of one group on every given node, on each of its workers: ``members`` (in the
    order connected) and, for each, (node id, worker pid)."""

    def __init__(self, cluster: MqlogCluster, nodes: list[Member], name: str, **kw: object) -> None:
        self.members: list[Client] = []
        self.where: list[tuple[str, int]] = []
        for m in nodes:
            pids: set[int] = set()
            for k in range(MAX_TRIES):
                c = Client(MQTT_PORT, f"{name}-{m.node_id}-{k}", host=m.addr, **kw)  # type: ignore[arg-type]
                assert c.connect() == 0
                pid = worker_pid(cluster, m, c)
                self.members.append(c)
                self.where.append((m.node_id, pid))
                pids.add(pid)
                if len(pids) == WORKERS and k >= 1:
                    break
            assert len(pids) == WORKERS, f"{MAX_TRIES} connections to {m.node_id}: one worker"

    def on(self, pid: int) -> set[int]:
        """The indexes of the members served by worker process ``pid``."""
        return {i for i, (_, p) in enumerate(self.where) if p == pid}

    def disconnect(self) -> None:
        for c in self.members:
            with contextlib.suppress(Exception):
                c.disconnect()


def test_each_record_goes_to_one_member_across_nodes_and_workers(cluster: MqlogCluster) -> None:
    h = home(cluster)
    spread = Spread(cluster, list(cluster.members), "each")
    pub = Client(MQTT_PORT, "eachw-pub", host=cluster.members[0].addr)
    assert pub.connect() == 0
    collector = Collector(spread.members)
    try:
        for c in spread.members:
            assert c.subscribe(f"$share/eachw/{STREAM}/eachw/#", qos=1) == [1]
        time.sleep(1.0)  # the joins reach the home
        sent = [f"w{i}".encode() for i in range(300)]
        for i, payload in enumerate(sent):
            pub.publish(f"{STREAM}/eachw/{i % 7}", payload, qos=1, wait=i % 50 == 49)
        collector.wait(set(sent))
    finally:
        collector.stop()
        pub.disconnect()
        spread.disconnect()
    payloads = [p for _, _, p in collector.got]
    per_worker: dict[tuple[str, int], int] = {}
    for _, i, _ in collector.got:
        per_worker[spread.where[i]] = per_worker.get(spread.where[i], 0) + 1
    print(
        f"300 records over {len(spread.members)} members on {NODES} nodes x {WORKERS} "
        f"workers (home {h.node_id}): per worker {sorted(per_worker.items())}"
    )
    assert sorted(payloads) == sorted(sent), (
        f"{len(payloads)} deliveries of {len(sent)} records, {len(set(payloads))} distinct"
    )
    assert len(per_worker) == NODES * WORKERS, per_worker  # every worker's members got some


@pytest.mark.parametrize(
    ("at_home", "relay"),
    [(False, False), (False, True), (True, False)],
    ids=["other-worker", "sessions-worker", "home-other-worker"],
)
def test_a_killed_worker_gives_its_members_records_to_the_others(
    cluster: MqlogCluster, at_home: bool, relay: bool
) -> None:
    """On a node, a member that never acknowledges (``taker``) and, on the other worker of
    the same node and on another node, members that do; the taker's worker is killed
    (kill -9) with records unacknowledged there: they reach the other members. The worker
    killed is, on a node other than the home, the one hosting ``$sessions`` (the node's
    links to the home close with it) or the other one (its node's ``$sessions`` worker
    reports it to the home), or, on the home's node, the one that is not the home (the
    home learns it from the mesh)."""
    h = home(cluster)
    other = next(m for m in cluster.members if m is not h)
    a, b = (h, other) if at_home else (other, h)
    takers = Spread(cluster, [a], "taker", manual_ack=True)
    keepers = Spread(cluster, [a, b], "keeper")
    relay_pid = sessions_worker_pid(a)
    k = next(i for i, (_, pid) in enumerate(takers.where) if (pid == relay_pid) == relay)
    victim = takers.where[k][1]
    # Keep one taker, on the victim's worker, and the keepers on the other workers.
    for i, c in enumerate(takers.members):
        if i != k:
            c.disconnect()
    taker = takers.members[k]
    survivors = [c for i, c in enumerate(keepers.members) if keepers.where[i][1] != victim]
    for i, c in enumerate(keepers.members):
        if keepers.where[i][1] == victim:
            c.disconnect()
    pub = Client(MQTT_PORT, "taker-pub", host=b.addr)
    assert pub.connect() == 0
    collector = Collector([taker, *survivors])
    try:
        for c in (taker, *survivors):
            assert c.subscribe(f"$share/taken/{STREAM}/taken/#", qos=1) == [1]
        time.sleep(1.0)
        sent = [f"t{i}".encode() for i in range(60)]
        for i, payload in enumerate(sent):
            pub.publish(f"{STREAM}/taken/{i % 3}", payload, qos=1, wait=i == len(sent) - 1)
        collector.wait(set(sent))
        taken = collector.payloads({0})
        assert taken, "the taker got none of the records"
        held = taken - collector.payloads(set(range(1, len(survivors) + 1)))
        assert held, "the survivors had every record the taker holds already"
        os.kill(victim, signal.SIGKILL)
        collector.wait(set(sent), among=set(range(1, len(survivors) + 1)))
    finally:
        collector.stop()
        taker.drop()
        for c in (*survivors, pub):
            with contextlib.suppress(Exception):
                c.disconnect()
    kept = collector.payloads(set(range(1, len(survivors) + 1)))
    print(
        f"worker {victim} of {a.node_id} ({'$sessions' if relay else 'other'}"
        f"{', the home' if at_home else ''}) killed "
        f"holding {len(held)} unacknowledged records; "
        f"the {len(survivors)} other members got {len(kept & held)} of them"
    )
    assert held <= kept, f"lost with the worker: {sorted(held - kept)[:10]}"
    cluster.wait_all_alive()


@pytest.mark.parametrize("whole", [True, False], ids=["node", "sessions-worker"])
def test_the_home_killed_under_load_loses_nothing(cluster: MqlogCluster, whole: bool) -> None:
    """The home killed (kill -9) under QoS 1 load: the whole node, or only its worker
    hosting ``$sessions`` (the supervisor restarts it; the members on the node's other
    worker stay connected and, once it is back, join the home again through it)."""
    h = home(cluster)
    a, b = [m for m in cluster.members if m is not h]
    spread = Spread(cluster, [a, b, h], "fail")
    victim = sessions_worker_pid(h)
    gone = {
        i
        for i, (node, pid) in enumerate(spread.where)
        if node == h.node_id and (whole or pid == victim)
    }
    on_home = {i for i, (node, _) in enumerate(spread.where) if node == h.node_id}
    kept_on_home = on_home - gone
    elsewhere = set(range(len(spread.members))) - on_home
    collector = Collector(spread.members)
    topic = f"{STREAM}/failw/x"
    later: list[bytes] = []
    try:
        for c in spread.members:
            assert c.subscribe(f"$share/failw/{STREAM}/failw/#", qos=1) == [1]
        time.sleep(1.0)

        async def run() -> list[str]:
            half = asyncio.Event()
            load = asyncio.create_task(_load(a.addr, topic, 400, half, []))
            await half.wait()
            if whole:
                await asyncio.to_thread(cluster.kill, h)
            else:
                os.kill(victim, signal.SIGKILL)
            return await load

        acked = {x.encode() for x in asyncio.run(run())}
        assert len(acked) == 400
        collector.wait(acked, timeout=30)
        new_home = cluster.member(str(_leaders(cluster, a)[("$sessions", 0)]))
        if not whole:  # and later records reach the members on the home's other worker
            home(cluster)
            pub = Client(MQTT_PORT, "failw-pub", host=b.addr)
            assert pub.connect() == 0
            later = [f"after{i}".encode() for i in range(60)]
            for i, payload in enumerate(later):
                pub.publish(topic, payload, qos=1, wait=i == len(later) - 1)
            pub.disconnect()
            collector.wait(set(later))
    finally:
        collector.stop()
        for i, c in enumerate(spread.members):
            if i in gone:
                c.drop()
            else:
                with contextlib.suppress(Exception):
                    c.disconnect()
        if whole:
            cluster.start(h)
    payloads = [p for _, _, p in collector.got]
    lost = (acked | set(later)) - set(payloads)
    duplicates = len(payloads) - len(set(payloads))
    back = collector.payloads(kept_on_home) & set(later)
    away = collector.payloads(elsewhere) & set(later)
    print(
        f"home {h.node_id} killed ({'node' if whole else 'its $sessions worker'}): "
        f"{len(acked)} acknowledged, {len(set(payloads) & acked)} delivered to "
        f"{len(spread.members)} members on {NODES} nodes x {WORKERS} workers, "
        f"{duplicates} duplicates, lost {len(lost)}; new home {new_home.node_id}"
        + (
            ""
            if whole
            else f"; later: {len(back)} of {len(later)} to the home's other worker, "
            f"{len(away)} to the other nodes"
        )
    )
    assert not lost, f"lost: {sorted(lost)[:10]}"
    if whole:
        assert new_home is not h
    else:  # the restarted worker may win the next election: a new home all the same
        assert back, "the members on the home's other worker got nothing after the restart"
        assert away, "the members on the other nodes got nothing after the restart"
        assert sorted(p for p in payloads if p in set(later)) == sorted(later)  # each once


def test_a_planned_hand_over_sends_nothing_twice(cluster: MqlogCluster) -> None:
    """``$sessions``' leadership handed to another node (``mqlog cluster transfer-leader``)
    under QoS 1 load to a group with members on every node and worker, then back: every
    record is delivered exactly once (the old home waits for what it handed out, to members
    on any worker, to be acknowledged and commits its positions before it hands over)."""
    h = home(cluster)
    a, b = [m for m in cluster.members if m is not h]
    spread = Spread(cluster, [a, b, h], "moved")
    collector = Collector(spread.members)
    topic = f"{STREAM}/movedw/x"
    try:
        for c in spread.members:
            assert c.subscribe(f"$share/movedw/{STREAM}/movedw/#", qos=1) == [1]
        time.sleep(1.0)

        async def run() -> list[str]:
            half = asyncio.Event()
            load = asyncio.create_task(_load(a.addr, topic, 600, half, []))
            await half.wait()
            await asyncio.to_thread(_transfer_sessions, cluster, b, a)
            return await load

        acked = {x.encode() for x in asyncio.run(run())}
        collector.wait(acked, timeout=30)
        moved_to = cluster.member(str(_leaders(cluster, b)[("$sessions", 0)]))
        pub = Client(MQTT_PORT, "movedw-pub", host=b.addr)
        assert pub.connect() == 0
        later = [f"m{i}".encode() for i in range(300)]
        for i, payload in enumerate(later):
            pub.publish(topic, payload, qos=1, wait=i % 20 == 19)
            if i == 150:
                _transfer_sessions(cluster, a, h)
        pub.disconnect()
        collector.wait(set(later), timeout=30)
        back = home(cluster)
    finally:
        collector.stop()
        spread.disconnect()
    payloads = [p for _, _, p in collector.got]
    every = acked | set(later)
    lost = every - set(payloads)
    duplicates = len(payloads) - len(set(payloads))
    print(
        f"$sessions handed {h.node_id} -> {moved_to.node_id} -> {back.node_id} under QoS 1 "
        f"load, {len(spread.members)} members on {NODES} nodes x {WORKERS} workers: "
        f"{len(every)} acknowledged, lost {len(lost)}, {duplicates} duplicates"
    )
    assert moved_to is a and back is h
    assert not lost, f"lost: {sorted(lost)[:10]}"
    assert duplicates == 0
