"""The metadata group with three real ``mqlog serve`` nodes on 127.0.0.1: stream definitions
agreed through it (broker/cluster/metadata.py, metadata_group.py).

What is asserted, in one cluster's life (starting nodes is most of the time):

1. the three nodes agree on every stream's definition (``GET /api/v1/cluster``'s
   ``metadata``: the same definitions, the same node recorded as their definer, one leader)
   and ``mqlog cluster status`` shows the group;
2. a node restarted with a config that defines a stream otherwise refuses to start (exit
   status 2) with one line naming the stream, the key, both values, its config file and the
   node whose definition was committed; restarted with the agreed config, it serves again;
3. the metadata survives a restart of every node: all three stopped, all three configs
   changed alike (they agree with each other), and all three refuse, from the definitions
   their journals kept; with the agreed configs back they start and agree as before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.ports import cluster_port, gossip_port
from tests.integration.conftest import ROOT, BrokerProcess

SECRET = b"0123456789abcdef-test-metadata-secret"
STREAMS = (
    '[[streams]]\nname = "devices"\ntopic_filter = ["devices/#"]\npartitions = 4\n'
    '[[streams]]\nname = "logs"\ntopic_filter = ["logs/#"]\n'
)
#: Seconds for the three nodes to show the same metadata.
AGREE_TIMEOUT = 20.0


class Trio:
    def __init__(self, tmp: Path) -> None:
        secret = tmp / "cluster.key"
        secret.write_bytes(SECRET)
        secret.chmod(0o600)
        ports = [cluster_port() for _ in range(3)]
        gossip = [gossip_port() for _ in range(3)]
        self.nodes = []
        for i in range(3):
            seeds = ", ".join(f'"127.0.0.1:{p}"' for j, p in enumerate(gossip) if j != i)
            cluster = (
                f'[cluster]\nnode_id = "n{i + 1}"\nbind = "127.0.0.1"\nraft_port = {ports[i]}\n'
                f"gossip_port = {gossip[i]}\n"
                f'seeds = [{seeds}]\nsecret_file = "{secret}"\nelection_timeout = "500ms"\n'
                'heartbeat_interval = "50ms"\n'
            )
            self.nodes.append(BrokerProcess(tmp / f"n{i + 1}", STREAMS + cluster))
        self.agreed = [b.config_path.read_text() for b in self.nodes]

    def start(self, nodes: list[BrokerProcess] | None = None) -> list[BaseException | None]:
        """Start ``nodes`` (all) together; the error of each start, None where it serves."""
        chosen = nodes or self.nodes
        errors: list[BaseException | None] = [None] * len(chosen)

        def run(i: int, b: BrokerProcess) -> None:
            try:
                b.start(timeout=30)
            except BaseException as e:
                errors[i] = e

        threads = [threading.Thread(target=run, args=(i, b)) for i, b in enumerate(chosen)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors

    def rewrite(self, b: BrokerProcess, old: str, new: str) -> None:
        text = b.config_path.read_text()
        assert old in text
        b.config_path.write_text(text.replace(old, new))

    def restore(self) -> None:
        for b, text in zip(self.nodes, self.agreed, strict=True):
            b.config_path.write_text(text)

    def stop(self) -> None:
        for b in self.nodes:
            try:
                b.stop()
            except RuntimeError:
                b.kill()


def _metadata(b: BrokerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"{b.http_url}/api/v1/cluster", timeout=5) as r:
        view: dict[str, Any] = json.loads(r.read())["metadata"]
    return view


def _agreed(nodes: list[BrokerProcess]) -> dict[str, Any]:
    """Until every node shows the same definitions and leader; their view. (The nodes are
    other processes: their HTTP view is polled.)"""
    deadline = time.monotonic() + AGREE_TIMEOUT
    while True:
        views = [_metadata(b) for b in nodes]
        first = views[0]
        same = all(
            (v["definitions"], v["leader"]) == (first["definitions"], first["leader"])
            for v in views
        )
        if same and first["leader"] is not None and first["streams"] == 3:
            return first
        if time.monotonic() > deadline:
            raise AssertionError(f"no agreed metadata after {AGREE_TIMEOUT}s: {views}")
        time.sleep(0.05)


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[Trio]:
    t = Trio(tmp_path)
    try:
        yield t
    finally:
        t.stop()


def test_nodes_agree_on_streams_refuse_a_conflicting_one_and_keep_them_across_restarts(
    trio: Trio,
) -> None:
    # 1. Agreed.
    assert trio.start() == [None, None, None]
    view = _agreed(trio.nodes)
    definer = view["definitions"]["devices"]["defined_by"]
    assert definer in {"n1", "n2", "n3"}
    assert {n: (d["partitions"], d["topic_filter"]) for n, d in view["definitions"].items()} == {
        "devices": (4, ["devices/#"]),
        "logs": (1, ["logs/#"]),
        "default": (1, []),
    }
    assert view["conflicts"] == []
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker.cli",
            "cluster",
            "status",
            "--broker",
            trio.nodes[0].http_url,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert f"metadata: leader {view['leader']}, " in status and ", 3 streams, " in status

    # 2. One node restarted with another definition of "devices": refused, clearly.
    n3 = trio.nodes[2]
    n3.stop()
    trio.rewrite(n3, "partitions = 4", "partitions = 8")
    (error,) = trio.start([n3])
    assert isinstance(error, RuntimeError)
    assert n3.proc is not None and n3.proc.returncode == 2
    line = next(x for x in n3.log().splitlines() if "streams[devices]" in x)
    assert (
        f"{n3.config_path}: streams[devices].partitions = 8 on node n3, but the cluster's "
        f"definition of stream 'devices' (committed first, from node {definer}'s config) has "
        "partitions = 4" in line
    ), line
    assert "refuses to start" in line
    trio.restore()
    assert trio.start([n3]) == [None]
    assert _agreed(trio.nodes)["definitions"] == view["definitions"]

    # 3. Every node stopped; every config changed alike: the journals still hold the agreed
    # definition, so all three refuse.
    trio.stop()
    for b in trio.nodes:
        trio.rewrite(b, "partitions = 4", "partitions = 8")
    errors = trio.start()
    assert all(isinstance(e, RuntimeError) for e in errors), errors
    for i, b in enumerate(trio.nodes):
        assert b.proc is not None and b.proc.returncode == 2
        assert (
            f"streams[devices].partitions = 8 on node n{i + 1}, but the cluster's definition "
            f"of stream 'devices' (committed first, from node {definer}'s config)"
        ) in b.log()
    trio.restore()
    assert trio.start() == [None, None, None]
    assert _agreed(trio.nodes)["definitions"] == view["definitions"]
