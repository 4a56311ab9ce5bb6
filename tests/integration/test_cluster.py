"""A three-node cluster on this host: real ``mqlog serve`` processes on 127.0.0.1, each with
its own MQTT, HTTP and Raft ports and data directory, replicating every partition (RF=3).

What is asserted: the nodes form and agree on each partition's leader; a QoS 1 publish through
any node is acknowledged once committed and delivered to subscribers of every node; after the
kill -9 of a partition's leader, a new leader is elected, publishes are accepted again and
every message acknowledged before the kill is still there (read back with ``$replay``); a
node with the wrong secret is refused and counted. The faults that need separate addresses
(partitions, packet loss) are in test_cluster_faults.py, on network namespaces.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

from bench.ports import cluster_port, gossip_port
from tests.integration.clients import Client
from tests.integration.conftest import BrokerProcess

SECRET = b"0123456789abcdef-test-cluster-secret"


class Cluster:
    """``n`` nodes replicating every partition of stream ``devices``, each node running
    ``workers`` worker processes (test_cluster_workers.py runs two)."""

    def __init__(self, tmp: Path, n: int = 3, partitions: int = 4, workers: int = 1) -> None:
        secret = tmp / "cluster.key"
        secret.write_bytes(SECRET)
        secret.chmod(0o600)
        self.tmp = tmp
        self.secret = secret
        self.partitions = partitions
        self.workers = workers
        self.raft_ports = [cluster_port(workers) for _ in range(n)]
        self.gossip_ports = [gossip_port() for _ in range(n)]
        self.nodes = [
            self.node(
                f"n{i + 1}",
                self.raft_ports[i],
                self.gossip_ports[:i] + self.gossip_ports[i + 1 :],
                gossip=self.gossip_ports[i],
            )
            for i in range(n)
        ]

    def node(
        self,
        name: str,
        raft_port: int,
        seeds: list[int],
        workers: int | None = None,
        gossip: int | None = None,
    ) -> BrokerProcess:
        """A node of this cluster, not started. ``seeds``: the other nodes' gossip ports;
        ``workers``: the cluster's unless given."""
        listed = ", ".join(f'"127.0.0.1:{p}"' for p in seeds)
        gossip = gossip or gossip_port()
        extra = (
            f'[[streams]]\nname = "devices"\ntopic_filter = ["devices/#"]\n'
            f"partitions = {self.partitions}\n"
            f'[cluster]\nnode_id = "{name}"\nbind = "127.0.0.1"\n'
            f"raft_port = {raft_port}\ngossip_port = {gossip}\nseeds = [{listed}]\n"
            f'secret_file = "{self.secret}"\nelection_timeout = "500ms"\n'
            f'heartbeat_interval = "50ms"\n'
        )
        return BrokerProcess(
            self.tmp / name, extra, fsync="always", workers=workers or self.workers
        )

    def start(self, nodes: list[BrokerProcess] | None = None) -> None:
        """Start ``nodes`` (all) together: each waits for the others to form."""
        errors: list[BaseException] = []

        def run(b: BrokerProcess) -> None:
            try:
                b.start(timeout=40)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(b,)) for b in nodes or self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def status(self, b: BrokerProcess) -> dict:
        with urllib.request.urlopen(f"{b.http_url}/api/v1/cluster", timeout=5) as r:
            return json.loads(r.read())

    def leaders(self, b: BrokerProcess) -> dict[tuple[str, int], str | None]:
        return {(p["stream"], p["partition"]): p["leader"] for p in self.status(b)["partitions"]}

    def wait_leaders(self, among: list[BrokerProcess], timeout: float = 20.0) -> dict:
        """Until every live node names the same leader, among the live ones, for every
        partition."""
        names = {f"n{self.nodes.index(b) + 1}" for b in among}
        deadline = time.monotonic() + timeout
        while True:
            views = [self.leaders(b) for b in among]
            first = views[0]
            if all(v == first for v in views) and all(v in names for v in first.values()):
                return first
            if time.monotonic() > deadline:
                raise AssertionError(f"no agreed leaders after {timeout}s: {views}")
            time.sleep(0.05)

    def wait_balanced(self, timeout: float = 20.0, skip: Collection[tuple[str, int]] = ()) -> None:
        """Until every partition but ``skip`` is led by its preferred replica, as node 1 sees
        it: the balancer's first transfers come a few seconds after the start (or after a
        node's restart), and the tests' publishers, which do not resend, want no leader
        change while they publish. ``skip``: partitions an operator placed, which the
        balancers leave alone for minutes."""
        deadline = time.monotonic() + timeout
        while True:
            parts = [
                p
                for p in self.status(self.nodes[0])["partitions"]
                if (p["stream"], p["partition"]) not in skip
            ]
            if all(p["leader"] is not None and p["leader"] == p["preferred_leader"] for p in parts):
                return
            assert time.monotonic() < deadline, [
                (p["leader"], p["preferred_leader"]) for p in parts
            ]
            time.sleep(0.1)

    def stop(self) -> None:
        for b in self.nodes:
            try:
                b.stop()
            except RuntimeError:
                b.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the module (starting three nodes is most of a test's time): each test
    uses its own topics, and a test that kills or stops a node starts it again."""
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start()
        c.wait_balanced()
        yield c
    finally:
        c.stop()


def _publish_all(
    b: BrokerProcess, topic: str, payloads: list[bytes], client_id: str
) -> list[bytes]:
    """Publish QoS 1 one at a time, each waiting for its PUBACK; returns the acknowledged."""
    client = Client(b.port, client_id)
    assert client.connect() == 0
    acked = []
    try:
        for p in payloads:
            info = client.paho.publish(topic, p, qos=1)
            info.wait_for_publish(timeout=5)
            if info.is_published():
                acked.append(p)
    finally:
        client.disconnect()
    return acked


def _replay(b: BrokerProcess, topic: str, expect: int, timeout: float = 10.0) -> list[bytes]:
    """What ``$replay/earliest/<topic>`` delivers through ``b`` (waits for ``expect``)."""
    client = Client(b.port, f"replay-{time.monotonic_ns()}")
    assert client.connect() == 0
    client.subscribe(f"$replay/earliest/{topic}", qos=1)
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < expect and time.monotonic() < deadline:
        try:
            got.append(client.messages.get(timeout=max(0.01, deadline - time.monotonic())).payload)
        except queue.Empty:
            break
    client.expect_none(0.2)  # nothing more than what was published
    client.disconnect()
    return got


def test_three_nodes_agree_on_leaders_and_replicate(cluster: Cluster) -> None:
    leaders = cluster.wait_leaders(cluster.nodes)
    assert len(leaders) == 7  # devices' 4 partitions, default's 1, $retained and $sessions
    view = cluster.status(cluster.nodes[0])
    assert view["mode"] == "cluster" and view["node_id"] == "n1"
    assert sorted(n["id"] for n in view["nodes"]) == ["n1", "n2", "n3"]
    for p in view["partitions"]:
        assert p["replicas"] == ["n1", "n2", "n3"]
    # A publish through each node, read back on every node.
    payloads = [f"m{i}".encode() for i in range(30)]
    for i, b in enumerate(cluster.nodes):
        acked = _publish_all(b, "devices/a/t", payloads[i * 10 : (i + 1) * 10], f"pub{i}")
        assert len(acked) == 10
    for b in cluster.nodes:
        assert _replay(b, "devices/a/t", 30) == payloads


def test_a_subscriber_on_one_node_gets_what_another_node_accepted(cluster: Cluster) -> None:
    cluster.wait_leaders(cluster.nodes)
    sub = Client(cluster.nodes[2].port, "live-sub")
    assert sub.connect() == 0
    assert sub.subscribe("devices/+/t", qos=1) == [1]
    payloads = [f"x{i}".encode() for i in range(20)]
    acked = _publish_all(cluster.nodes[0], "devices/b/t", payloads, "p")
    assert acked == payloads
    assert [m.payload for m in sub.expect(20)] == acked
    sub.disconnect()


def test_leader_killed_new_leader_elected_nothing_acknowledged_lost(cluster: Cluster) -> None:
    leaders = cluster.wait_leaders(cluster.nodes)
    topic = "devices/c/t"
    key = ("devices", zlib.crc32(topic.encode()) % 4)  # the broker's topic -> partition map
    victim_name = leaders[key]
    victim = cluster.nodes[int(victim_name[1:]) - 1]
    via = next(b for b in cluster.nodes if b is not victim)  # where the client publishes
    acked = _publish_all(via, topic, [f"before{i}".encode() for i in range(50)], "p1")
    assert len(acked) == 50
    victim.kill()
    killed_at = time.monotonic()
    # Publishes during the failover wait for the new leader (held, not refused).
    during = _publish_all(via, topic, [f"during{i}".encode() for i in range(5)], "p3")
    live = [b for b in cluster.nodes if b is not victim]
    new = cluster.wait_leaders(live, timeout=15)
    failover = time.monotonic() - killed_at
    assert new[key] != victim_name
    assert during, f"nothing acknowledged during the failover ({failover:.1f} s)"
    after = _publish_all(via, topic, [f"after{i}".encode() for i in range(20)], "p2")
    assert len(after) == 20
    expect = acked + during + after
    for b in live:
        got = _replay(b, topic, len(expect))
        assert got == expect, (failover, got)
    # The victim comes back and catches up.
    cluster.start([victim])
    cluster.wait_leaders(cluster.nodes)
    assert _replay(victim, topic, len(expect)) == expect


def test_a_node_with_the_wrong_secret_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    cluster.wait_leaders(cluster.nodes)
    bad_secret = tmp_path / "bad.key"
    bad_secret.write_bytes(b"another-secret-of-enough-length")
    bad_secret.chmod(0o600)
    port = cluster_port()
    extra = (
        f'[cluster]\nnode_id = "intruder"\nbind = "127.0.0.1"\nraft_port = {port}\n'
        f"gossip_port = {gossip_port()}\n"
        f'seeds = ["127.0.0.1:{cluster.gossip_ports[0]}"]\nsecret_file = "{bad_secret}"\n'
    )
    intruder = BrokerProcess(tmp_path / "intruder", extra)
    thread = threading.Thread(target=lambda: _start_quietly(intruder))
    thread.start()
    try:
        # Its join datagrams carry an HMAC under another secret: dropped and counted.
        deadline = time.monotonic() + 10
        while cluster.status(cluster.nodes[0])["gossip"].get("dropped_bad_mac", 0) == 0:
            assert time.monotonic() < deadline, "no refused gossip datagram counted"
            time.sleep(0.1)
        view = cluster.status(cluster.nodes[0])
        assert sorted(n["id"] for n in view["nodes"]) == ["n1", "n2", "n3"]
        assert sorted(m["id"] for m in view["members"]) == ["n1", "n2", "n3"]
        assert {m["state"] for m in view["members"]} == {"alive"}
        # The cluster keeps serving.
        assert len(_publish_all(cluster.nodes[1], "devices/d/t", [b"still"], "p")) == 1
    finally:
        intruder.kill()
        thread.join()


def _start_quietly(b: BrokerProcess) -> None:
    with contextlib.suppress(RuntimeError):  # it never forms: what the test wants
        b.start(timeout=10)


def test_status_metrics_transfer_leader_and_the_balancer(cluster: Cluster) -> None:
    # The balancer hands each partition to its preferred replica (placement's first).
    deadline = time.monotonic() + 20
    while True:
        view = cluster.status(cluster.nodes[0])
        parts = view["partitions"]
        if all(p["leader"] == p["preferred_leader"] for p in parts):
            break
        assert time.monotonic() < deadline, [(p["leader"], p["preferred_leader"]) for p in parts]
        time.sleep(0.2)
    # mqlog cluster status, from a node's HTTP API.
    b = cluster.nodes[1]
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli", "cluster", "status", "--broker", b.http_url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "node n2: 3 nodes" in out
    # The members as gossip has them: state and incarnation, the Raft port each announced.
    assert "MEMBER" in out and "INCARNATION" in out and "n2 (self)" in out
    for i, port in enumerate(cluster.raft_ports):
        assert re.search(rf"n{i + 1}\b.*127\.0\.0\.1:{cluster.gossip_ports[i]}\s+alive", out)
        assert f"127.0.0.1:{port}" in out
    for p in parts:
        assert f"{p['stream']}/{p['partition']}" in out
    # Metrics: this node's terms, leaderships and the commit latency of what it led.
    assert len(_publish_all(b, "devices/e/t", [b"m"] * 5, "pm")) == 5
    with urllib.request.urlopen(f"{b.http_url}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    for name in (
        "mqlog_cluster_term{",
        "mqlog_cluster_leader{",
        "mqlog_cluster_commit_index{",
        'mqlog_cluster_nodes{state="connected"} 2.0',
        "mqlog_cluster_frames_sent_total",
        "mqlog_cluster_commit_seconds_bucket",
        'mqlog_gossip_members{state="alive"} 3.0',
        "mqlog_gossip_probes_total",
        'mqlog_gossip_dropped_datagrams_total{reason="bad_mac"}',
    ):
        assert name in metrics, name
    # transfer-leader through a node that does not lead the partition.
    part = parts[0]
    key = f"{part['stream']}/{part['partition']}"
    target = next(n for n in ("n1", "n2", "n3") if n != part["leader"])
    asked = next(
        x for x in cluster.nodes if f"n{cluster.nodes.index(x) + 1}" not in (part["leader"],)
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker.cli",
            "cluster",
            "transfer-leader",
            key,
            target,
            "--broker",
            asked.http_url,
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{key}: leader {target}" in done.stdout
    # The operator's choice stands: the balancer (every 50 heartbeats, 2.5 s here) leaves it.
    time.sleep(3.5)
    again = {
        f"{p['stream']}/{p['partition']}": p["leader"] for p in cluster.status(b)["partitions"]
    }
    assert again[key] == target
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker.cli",
            "cluster",
            "transfer-leader",
            key,
            "n9",
            "--broker",
            asked.http_url,
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "'n9' is not a voter" in bad.stderr + bad.stdout


def test_a_persistent_session_on_a_restarted_node_gets_what_it_missed(cluster: Cluster) -> None:
    cluster.wait_leaders(cluster.nodes)
    home = cluster.nodes[0]
    sub = Client(home.port, "durable", clean=False)
    assert sub.connect() == 0
    assert sub.subscribe("devices/+/s", qos=1) == [1]
    sub.disconnect()
    home.stop()
    home.start(timeout=30)  # its partitions are replicated ones from the first read on
    cluster.wait_leaders(cluster.nodes)
    missed = [f"s{i}".encode() for i in range(10)]
    assert _publish_all(cluster.nodes[1], "devices/f/s", missed, "ps") == missed
    again = Client(home.port, "durable", clean=False)
    assert again.connect() == 0 and again.session_present
    assert [m.payload for m in again.expect(10)] == missed
    # and it keeps following what any node accepts
    assert _publish_all(cluster.nodes[2], "devices/f/s", [b"live"], "ps2") == [b"live"]
    assert [m.payload for m in again.expect(1)] == [b"live"]
    again.disconnect()


def test_retained_messages_are_replicated_and_survive_their_node(cluster: Cluster) -> None:
    cluster.wait_leaders(cluster.nodes)
    n1, n2, n3 = cluster.nodes
    pub = Client(n1.port, "retainer")
    assert pub.connect() == 0
    pub.publish("devices/g/state", b"on", qos=1, retain=True)
    pub.publish("devices/h/state", b"gone", qos=1, retain=True)
    pub.publish("devices/h/state", b"", qos=1, retain=True)  # cleared [MQTT-3.3.1-10]
    pub.disconnect()

    want = [("devices/g/state", b"on")]

    def retained_at(b: BrokerProcess, timeout: float = 10.0) -> list[tuple[str, bytes]]:
        """What a new subscription gets as retained through ``b``, once it is ``want``
        (``$retained`` commits on its own, a heartbeat or so after the PUBACK of the
        publish that set it), or at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            sub = Client(b.port, f"r-{time.monotonic_ns()}")
            assert sub.connect() == 0
            sub.subscribe("devices/+/state", qos=1)
            time.sleep(0.5)  # what the subscription brings (no event marks its end)
            sub.disconnect()
            # Only the retained ones: a follower's commit may trail the leader's by a
            # heartbeat, so a publish acknowledged just before can also arrive live.
            got = []
            while not sub.messages.empty():
                m = sub.messages.get()
                if m.retain:
                    got.append((m.topic, m.payload))
            if got == want or time.monotonic() > deadline:
                return got

    for b in (n2, n3):
        assert retained_at(b) == want
    n1.kill()
    cluster.wait_leaders([n2, n3])
    assert retained_at(n3) == want
    cluster.start([n1])
    cluster.wait_leaders(cluster.nodes)
    assert retained_at(n1) == want
