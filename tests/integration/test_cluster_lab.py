"""The cluster harness (tests/cluster_lab.py) on three real mqlog nodes in network namespaces:
they start with a [cluster] section, each serves MQTT publish/subscribe on its own address,
one survives kill -9 and a restart on its data directory, a paused one answers nothing until
resumed, and leaving the lab leaves no process, namespace or link behind.

Needs root, ``ip`` and ``nft``; skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import queue
import socket
import stat
from pathlib import Path

import pytest

from broker.config import Seed, load_config
from tests import netlab
from tests.cluster_lab import GOSSIP_PORT, MQTT_PORT, Member, MqlogCluster
from tests.integration.clients import Client
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)


def roundtrip(m: Member, tag: str) -> None:
    """A QoS 1 publish to ``m`` is acknowledged and reaches a subscriber of ``m``."""
    sub = Client(MQTT_PORT, f"sub-{m.node_id}-{tag}", host=m.addr)
    pub = Client(MQTT_PORT, f"pub-{m.node_id}-{tag}", host=m.addr)
    try:
        assert sub.connect() == 0
        assert sub.subscribe(f"lab/{m.node_id}", qos=1) == [1]
        assert pub.connect() == 0
        pub.publish(f"lab/{m.node_id}", tag, qos=1)  # asserts the PUBACK
        [msg] = sub.expect(1)
        assert (msg.topic, msg.payload) == (f"lab/{m.node_id}", tag.encode())
    finally:
        pub.disconnect()
        sub.disconnect()


def refused(m: Member) -> bool:
    try:
        socket.create_connection((m.addr, MQTT_PORT), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def ours() -> tuple[list[str], list[str]]:
    pid = os.getpid()
    return (
        [n for n in netlab.list_namespaces() if n.startswith(f"{netlab.NS_PREFIX}{pid}-")],
        [n for n in netlab.list_links() if n.startswith(f"{netlab.LINK_PREFIX}{pid}-")],
    )


def test_three_nodes_serve_survive_kill9_and_leave_nothing(tmp_path: Path) -> None:
    with Lab(3) as lab:
        cluster = MqlogCluster(lab, tmp_path)
        assert stat.S_IMODE(cluster.secret_file.stat().st_mode) == 0o600
        for m in cluster.members:  # the configs the nodes run, as the broker reads them
            c = load_config(m.config_path).cluster
            assert c is not None and (c.node_id, c.bind) == (m.node_id, m.addr)
            others = [o for o in cluster.members if o is not m]
            assert c.seeds == tuple(Seed(o.addr, GOSSIP_PORT) for o in others)
        assert [m.node_id for m in cluster.members] == ["n1", "n2", "n3"]

        cluster.start()
        for m in cluster.members:
            roundtrip(m, "first")

        n2 = cluster.member("n2")
        first = n2.proc
        assert first is not None
        cluster.kill(n2)
        assert not first.group_alive() and not n2.running()
        assert refused(n2)
        roundtrip(cluster.member("n1"), "n2-down")
        roundtrip(cluster.member("n3"), "n2-down")

        cluster.restart(n2)
        assert n2.proc is not first and n2.running()
        for m in cluster.members:
            roundtrip(m, "after-restart")

        n3 = cluster.member("n3")
        cluster.pause(n3)
        paused = Client(MQTT_PORT, "paused", host=n3.addr)
        with pytest.raises(queue.Empty):  # the kernel accepts; the paused broker says nothing
            paused.connect(timeout=1.0)
        cluster.resume(n3)
        assert paused.connacks.get(timeout=10)[0] == 0  # the CONNACK it owed
        paused.disconnect()

        procs = [m.proc for m in cluster.members]
        assert ours()[0], "the lab's namespaces exist while it runs"
    assert ours() == ([], [])
    assert not any(p is not None and p.group_alive() for p in procs)
    assert first is not None and not first.group_alive()


def test_clean_stop_exits_zero(tmp_path: Path) -> None:
    with Lab(3) as lab:
        cluster = MqlogCluster(lab, tmp_path)
        cluster.start()
        assert cluster.stop() == {"n1": 0, "n2": 0, "n3": 0}
        assert not any(m.running() for m in cluster.members)
    assert ours() == ([], [])
