"""Planned leadership transfers under QoS 1 load close no publisher's connection (issue 20),
on three real mqlog nodes in network namespaces: ``mqlog cluster transfer-leader`` moves the
leadership of the partition six publishers (two per node) write to, again and again.

A publish whose outcome is unknown when its leader changes closes its connection so that
the client resends (broker.workers.replicated); a planned transfer leaves none unknown: the
old leader takes no proposal while it hands over and gives the leadership away only once
everything it proposed is committed (broker.cluster.raft), refuses the forwards that reach
it meanwhile (held by their nodes for the next leader), and a node whose forward went to it
waits a moment for its answer (broker.workers.forwards). Before, 10 or 11 of 12 transfers
closed a publisher's connection.

Needs root, ``ip`` and ``nft``; skipped with the reason otherwise.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import netlab
from tests.cluster_lab import HTTP_PORT, MQTT_PORT, Member, MqlogCluster
from tests.integration.clients import Client
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

TRANSFERS = 6


class Publishers:
    """QoS 1 publishers, each on its own thread, 8 in flight, counting the connections the
    broker closed (a publish on a closed connection raises) and the acknowledged."""

    def __init__(self, members: list[Member]) -> None:
        self.closed = 0
        self.acked = 0
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(m, f"pub{i}"), daemon=True)
            for i, m in enumerate(members)
        ]
        for t in self.threads:
            t.start()

    def _run(self, m: Member, client_id: str) -> None:
        while not self.stopping.is_set():
            client = Client(MQTT_PORT, client_id, host=m.addr)
            if client.connect() != 0:
                time.sleep(0.1)
                continue
            try:
                for i in range(1, 1 << 30):
                    if self.stopping.is_set():
                        break
                    client.publish("t/x", b"x" * 50, qos=1, wait=i % 8 == 0)
                    if i % 8 == 0:
                        self.acked += 8
            except Exception:  # paho: not connected, or no PUBACK: the broker closed it
                self.closed += 1
            client.disconnect()

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=20)


def test_planned_transfers_under_load_close_no_publishers_connection(tmp_path: Path) -> None:
    with Lab(3) as lab:
        cluster = MqlogCluster.started(lab, tmp_path)
        names = [m.node_id for m in cluster.members]
        publishers = Publishers(cluster.members * 2)
        moved = []
        try:
            time.sleep(1.0)
            for _ in range(TRANSFERS):
                view = cluster.status(cluster.members[0])["partitions"]
                leader = next(p["leader"] for p in view if p["stream"] == "default")
                target = names[(names.index(leader) + 1) % len(names)]
                url = f"http://{cluster.members[0].addr}:{HTTP_PORT}"
                argv = ["cluster", "transfer-leader", "default/0", target, "--broker", url]
                done = subprocess.run(
                    [sys.executable, "-m", "broker.cli", *argv],
                    capture_output=True,
                    text=True,
                    env=cluster.env(),
                )
                assert done.returncode == 0, done.stdout + done.stderr
                moved.append((leader, target))
                time.sleep(1.0)
        finally:
            publishers.stop()
        print(
            f"{len(moved)} transfers, {publishers.acked} acknowledged, closed {publishers.closed}"
        )
        assert publishers.acked > 1000
        assert publishers.closed == 0, f"{publishers.closed} connections closed over {moved}"
