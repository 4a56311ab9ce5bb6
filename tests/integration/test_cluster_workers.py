"""A three-node cluster whose nodes run two worker processes each (``router.workers = 2``).

Each worker hosts the Raft groups of the partitions it owns, on ``raft_port + index``
(broker.workers.replicated). What is asserted: the node's status (``GET /api/v1/cluster``)
shows every partition once, from both workers; a QoS 1 publish to every partition through
every node is acknowledged and reaches a subscriber on every node (across workers and
nodes); a leadership transfer asked of worker 0 moves a partition another worker hosts; after
a kill -9 of a whole node (the supervisor and its workers at once) the others elect new
leaders and nothing acknowledged is lost; a node started with another worker count is
refused, and both sides say why.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.ports import cluster_port
from tests.integration.clients import Client
from tests.integration.conftest import BrokerProcess
from tests.integration.test_cluster import Cluster, _publish_all

WORKERS = 2
PARTITIONS = 4
#: The partition an operator hands to another node (test_transfer_leader_...): worker 1
#: hosts it (``broker.workers.mesh.owner_of``). The balancers leave it where it was put
#: for minutes (``OPERATOR_HOLD_SECONDS``): the tests after that one wait for the others.
MOVED = ("devices", 1)


def topic_for(partition: int, name: str = "k") -> str:
    """A topic of stream ``devices`` that lands in ``partition`` (the broker's map); each
    test its own ``name``."""
    i = 0
    while True:
        topic = f"devices/{name}{i}/t"
        if zlib.crc32(topic.encode()) % PARTITIONS == partition:
            return topic
        i += 1


def publish_resending(b: BrokerProcess, topic: str, payloads: list[bytes], client_id: str) -> int:
    """Publish QoS 1 one at a time as a client does across failovers: a publish whose
    connection the broker closed (its outcome unknown: a leadership change, or its worker
    died) is sent again on a new connection. Returns the resends; every payload ends up
    acknowledged (or the test fails)."""
    resends = 0
    client: Client | None = None
    try:
        for p in payloads:
            for _attempt in range(10):
                if client is None:
                    client = Client(b.port, client_id)
                    assert client.connect() == 0
                info = client.paho.publish(topic, p, qos=1)
                with contextlib.suppress(RuntimeError):  # not connected any more
                    info.wait_for_publish(timeout=5)
                if info.is_published():
                    break
                resends += 1
                client.disconnect()
                client = None
            else:
                raise AssertionError(f"{p!r} to {topic} never acknowledged")
    finally:
        if client is not None:
            client.disconnect()
    return resends


def read_back(b: BrokerProcess, topic: str, expect: list[bytes], timeout: float = 10.0) -> None:
    """``$replay/earliest/<topic>`` through ``b`` gives every payload of ``expect``, in its
    order (a resent one may come twice: QoS 1 allows the duplicate [MQTT-4.3.2-1]),
    and nothing else."""
    client = Client(b.port, f"replay-{time.monotonic_ns()}")
    assert client.connect() == 0
    client.subscribe(f"$replay/earliest/{topic}", qos=1)
    firsts: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(firsts) < len(expect) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            payload = client.messages.get(timeout=max(0.01, deadline - time.monotonic())).payload
            if payload not in firsts:
                firsts.append(payload)
    time.sleep(0.2)
    while not client.messages.empty():
        assert client.messages.get().payload in firsts  # a duplicate, nothing new
    client.disconnect()
    assert firsts == expect, (b.data_dir, topic)


def kill_node(b: BrokerProcess) -> None:
    """kill -9 of the node: its supervisor and every worker at once (not one after the
    other, as PR_SET_PDEATHSIG would)."""
    assert b.proc is not None
    pid = b.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for p in [pid, *map(int, children)]:
        os.kill(p, signal.SIGKILL)
    b.kill()  # reaps the supervisor, waits until the data directory is unlocked


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster-workers"), partitions=PARTITIONS, workers=WORKERS)
    try:
        c.start()
        c.wait_balanced()
        yield c
    finally:
        c.stop()


def test_the_status_shows_every_partition_once_from_both_workers(cluster: Cluster) -> None:
    leaders = cluster.wait_leaders(cluster.nodes)
    assert len(leaders) == PARTITIONS + 3  # devices, default, $retained and $sessions
    view = cluster.status(cluster.nodes[0])
    assert view["workers"] == WORKERS
    assert [n["state"] for n in view["nodes"]].count("connected") == 2
    keys = [(p["stream"], p["partition"]) for p in view["partitions"]]
    assert sorted(keys) == sorted(leaders) and len(set(keys)) == len(keys)
    for p in view["partitions"]:
        assert p["replicas"] == ["n1", "n2", "n3"]
    # mqlog cluster status says the same.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker.cli",
            "cluster",
            "status",
            "--broker",
            cluster.nodes[0].http_url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"node n1: 3 nodes, {WORKERS} workers" in out
    for stream, partition in keys:
        assert f"{stream}/{partition}" in out
    # Both workers host groups: each logged its share.
    text = cluster.nodes[0].log()
    for i in range(WORKERS):
        assert f"cluster: node n1 worker {i} of {WORKERS} holds" in text


def test_every_partition_through_every_node_reaches_every_node(cluster: Cluster) -> None:
    # Its publishers do not resend: no balancer transfer may give one an unknown outcome.
    cluster.wait_balanced()
    subs = []
    for i, b in enumerate(cluster.nodes):
        sub = Client(b.port, f"sub{i}")
        assert sub.connect() == 0
        assert sub.subscribe("devices/+/t", qos=1) == [1]
        subs.append(sub)
    sent: dict[str, list[bytes]] = {}
    for p in range(PARTITIONS):
        topic = topic_for(p)
        for i, b in enumerate(cluster.nodes):
            payloads = [f"p{p}-n{i}-{k}".encode() for k in range(5)]
            assert _publish_all(b, topic, payloads, f"pub{p}-{i}") == payloads
            sent.setdefault(topic, []).extend(payloads)
    total = sum(len(v) for v in sent.values())
    for sub in subs:
        got: dict[str, list[bytes]] = {}
        for m in sub.expect(total):
            got.setdefault(m.topic, []).append(m.payload)
        assert got == sent  # every message, in order per topic, on every node
        sub.disconnect()


def test_transfer_leader_of_a_partition_another_worker_hosts(cluster: Cluster) -> None:
    leaders = cluster.wait_leaders(cluster.nodes)
    b = cluster.nodes[0]
    # Partitions hosted by worker 1 of n1: n1's worker 0 answers the HTTP API.
    own = next(line for line in b.log().splitlines() if "worker 1 (pid" in line)
    key = MOVED
    assert f"{key[0]}/{key[1]}" in own.split("owns", 1)[1].strip().split(", ")
    target = next(n for n in ("n1", "n2", "n3") if n != leaders[key])
    moved = f"cluster: {key[0]}/{key[1]}: leader {target} in term"
    before = b.log().count(moved)
    req = urllib.request.Request(
        f"{b.http_url}/api/v1/cluster/partitions/{key[0]}/{key[1]}/leader",
        data=json.dumps({"node": target}).encode(),
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200, r.read()
        assert target in json.loads(r.read())["message"]
    # Its leader changes to the target (the balancer may hand it back to its preferred
    # replica a moment later: the log line is the witness).
    deadline = time.monotonic() + 10
    while b.log().count(moved) == before:
        assert time.monotonic() < deadline, f"{key} not moved to {target}"
        time.sleep(0.1)


def test_kill_9_of_a_node_fails_over_and_nothing_acknowledged_is_lost(cluster: Cluster) -> None:
    leaders = cluster.wait_leaders(cluster.nodes)
    # A node leading partitions of both workers, if the balancer placed one so.
    led = {name: [k for k, v in leaders.items() if v == name] for name in ("n1", "n2", "n3")}
    victim_name = max(led, key=lambda n: len(led[n]))
    victim = cluster.nodes[int(victim_name[1:]) - 1]
    via = next(b for b in cluster.nodes if b is not victim)
    topics = [topic_for(p, "kill") for p in range(PARTITIONS)]
    sent = {t: [f"{t}-before{i}".encode() for i in range(10)] for t in topics}
    for t in topics:
        publish_resending(via, t, sent[t], "kb")
    kill_node(victim)
    live = [b for b in cluster.nodes if b is not victim]
    new = cluster.wait_leaders(live, timeout=20)
    assert victim_name not in new.values()
    for t in topics:
        after = [f"{t}-after{i}".encode() for i in range(5)]
        publish_resending(via, t, after, "ka")
        sent[t] += after
    for b in live:
        for t in topics:
            read_back(b, t, sent[t])
    cluster.start([victim])  # it comes back and catches up
    cluster.wait_leaders(cluster.nodes)
    for t in topics:
        read_back(victim, t, sent[t])


def test_a_node_with_another_worker_count_is_refused(cluster: Cluster) -> None:
    # The node killed before is back: the balancers hand it its leaderships again, and its
    # publisher does not resend.
    cluster.wait_balanced(skip={MOVED})
    odd = cluster.node("n4", cluster_port(3), cluster.gossip_ports, workers=3)
    thread = threading.Thread(target=lambda: _start_quietly(odd))
    thread.start()
    try:
        want_here = "node 'n4' runs 3 worker(s) per node and this node 2"
        want_there = "runs 2 worker(s) per node and this node 3"
        deadline = time.monotonic() + 15
        while want_here not in cluster.nodes[0].log() or want_there not in odd.log():
            assert time.monotonic() < deadline, odd.log()[-2000:]
            time.sleep(0.1)
        assert "router.workers / --workers" in odd.log()
        view = cluster.status(cluster.nodes[0])
        assert sorted(n["id"] for n in view["nodes"]) == ["n1", "n2", "n3"]
        assert view["transport"]["incompatible"] >= 1
        # The cluster keeps serving.
        assert _publish_all(cluster.nodes[1], topic_for(0, "odd"), [b"still"], "p") == [b"still"]
    finally:
        if odd.alive():
            kill_node(odd)
        thread.join()


def _start_quietly(b: BrokerProcess) -> None:
    with contextlib.suppress(RuntimeError):  # it never forms: what the test wants
        b.start(timeout=15)


def _retained(b: BrokerProcess, pattern: str, want: list[tuple[str, bytes]]) -> None:
    """Until a new subscription through ``b`` gets ``want`` as its retained messages, on
    each of several connections (the kernel spreads them over the workers)."""
    deadline = time.monotonic() + 15
    while True:
        subs = [Client(b.port, f"r-{time.monotonic_ns()}-{i}") for i in range(4)]
        for sub in subs:
            assert sub.connect() == 0
            sub.subscribe(pattern, qos=1)
        time.sleep(0.3)  # what the subscription brings (no event marks its end)
        seen = []
        for sub in subs:
            sub.disconnect()
            got = []
            while not sub.messages.empty():
                m = sub.messages.get()
                if m.retain:
                    got.append((m.topic, m.payload))
            seen.append(got)
        if all(got == want for got in seen):
            return
        assert time.monotonic() < deadline, seen


def test_retained_messages_reach_every_worker_of_every_node(cluster: Cluster) -> None:
    cluster.wait_balanced(skip={MOVED})  # its publisher does not resend
    pub = Client(cluster.nodes[0].port, "retainer")
    assert pub.connect() == 0
    pub.publish("devices/ret/a", b"on", qos=1, retain=True)
    pub.publish("devices/ret/b", b"gone", qos=1, retain=True)
    pub.publish("devices/ret/b", b"", qos=1, retain=True)  # cleared [MQTT-3.3.1-10]
    pub.disconnect()
    for b in cluster.nodes:
        _retained(b, "devices/ret/+", [("devices/ret/a", b"on")])


def test_kill_9_of_one_worker_it_comes_back_and_serves_its_partitions(cluster: Cluster) -> None:
    cluster.wait_leaders(cluster.nodes)
    b = cluster.nodes[1]
    started = [line for line in b.log().splitlines() if "worker 1: started, pid" in line]
    victim = int(started[-1].rsplit(" ", 1)[1])
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    # The supervisor restarts it; it rejoins its groups and serves again.
    while "worker 1 (pid" not in b.log().split(f"(pid {victim}) was killed", 1)[-1]:
        assert time.monotonic() < deadline, b.log()[-3000:]
        time.sleep(0.1)
    cluster.wait_leaders(cluster.nodes)
    view = cluster.status(b)
    assert len(view["partitions"]) == PARTITIONS + 3
    for p in range(PARTITIONS):
        topic = topic_for(p, "wk")
        payloads = [f"{topic}-{i}".encode() for i in range(5)]
        publish_resending(b, topic, payloads, f"wk{p}")
        read_back(b, topic, payloads)
