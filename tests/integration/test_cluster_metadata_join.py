"""The metadata group's members follow the cluster's (issue 21, broker/cluster/metadata_members.py),
on real nodes in network namespaces:

1. three nodes form the cluster; a fourth, named in nobody's seeds, joins later: it becomes a
   member of the metadata group on every node's view (``GET /api/v1/cluster``'s
   ``metadata.members``, ``mqlog cluster status``) and holds the committed definitions;
2. restarted with a conflicting definition of a stream, the joined node refuses to start
   (exit status 2) with the line naming the stream and the key, as a founder does; with the
   agreed config back it serves and is still a member;
3. ``mqlog cluster leave`` on a founder: once it stopped, it is a member nowhere;
4. the joined node killed for good: once dead for ``replace_after``, it is removed too.

And a stream's replication factor changed with ``mqlog cluster set-replication`` (the one key
of a definition that changes, broker/cluster/metadata.py): lowered from 3 to 2, every
partition of the stream ends with placement's two voters (a removed replica gives its copy
up); a node restarted with its config still saying 3 refuses to start naming the key and the
command; with 2 it serves; raised to 3 again, every partition has three voters; every
message acknowledged before is read back.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.cluster.placement import group_id_of, node_id_of, replicas
from tests import netlab
from tests.cluster_lab import HTTP_PORT, MQTT_PORT, ClusterLabError, Member, MqlogCluster
from tests.integration.clients import Client
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

EXTRA = '[[streams]]\nname = "jn"\ntopic_filter = "jn/#"\npartitions = 2\n'
#: Seconds the metadata members have to follow a change of the cluster's.
FOLLOW_TIMEOUT = 60.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[MqlogCluster]:
    with Lab(4) as lab:
        yield MqlogCluster.founded(
            lab,
            tmp_path,
            3,
            extra=EXTRA,
            cluster_extra='join_from = ["10.77.0.0/16"]\nreplace_after = "10s"\n',
        )


def _metadata(cluster: MqlogCluster, m: Member) -> dict[str, Any]:
    """``m``'s view of the metadata group ({} if it is no member)."""
    view: dict[str, Any] = cluster.status(m)["metadata"] or {}
    return view


def _members_are(cluster: MqlogCluster, on: list[Member], names: list[str]) -> dict[str, Any]:
    """Until every node of ``on`` has ``names`` as the metadata group's members and knows a
    leader; the last node's view."""
    deadline = time.monotonic() + FOLLOW_TIMEOUT
    while True:
        try:
            views = {m.node_id: _metadata(cluster, m) for m in on}
        except OSError:
            views = {}
        if views and all(v.get("members") == names and v["leader"] for v in views.values()):
            return views[on[-1].node_id]
        assert time.monotonic() < deadline, views
        time.sleep(0.25)


def _cli(cluster: MqlogCluster, m: Member, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker.cli", "cluster", *args],
        capture_output=True,
        text=True,
        env=cluster.env(),
        timeout=150,
    )


def test_the_metadata_members_follow_joins_leaves_and_replacements(
    cluster: MqlogCluster,
) -> None:
    n1, n2, n3, n4 = (cluster.member(n) for n in ("n1", "n2", "n3", "n4"))
    everyone = ["n1", "n2", "n3", "n4"]

    # 1. n4 joins: a member everywhere, holding the definitions committed before it came.
    start = time.monotonic()
    cluster.start(n4)
    view = _members_are(cluster, [n1, n2, n3, n4], everyone)
    print(f"\njoin: a metadata member everywhere {time.monotonic() - start:.1f} s after its start")
    assert view["definitions"] == _metadata(cluster, n1)["definitions"]
    assert view["definitions"]["jn"]["defined_by"] in {"n1", "n2", "n3"}
    assert view["conflicts"] == []
    out = _cli(cluster, n4, "status", "--broker", f"http://{n4.addr}:{HTTP_PORT}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "members n1, n2, n3, n4" in out.stdout, out.stdout
    assert "joining the cluster of" in n4.log(2_000_000)

    # 2. n4 restarted with another definition of jn: refused, naming the stream and the key.
    definer = view["definitions"]["jn"]["defined_by"]
    assert cluster.stop(n4) == {"n4": 0}
    agreed = n4.config_path.read_text()
    n4.config_path.write_text(agreed.replace("partitions = 2", "partitions = 3"))
    with pytest.raises(ClusterLabError, match="exited with 2 before serving"):
        cluster.start(n4)
    assert (
        f"{n4.config_path}: streams[jn].partitions = 3 on node n4, but the cluster's "
        f"definition of stream 'jn' (committed first, from node {definer}'s config) has "
        "partitions = 2"
    ) in n4.log(20_000)
    n4.config_path.write_text(agreed)
    cluster.start(n4)
    _members_are(cluster, [n1, n2, n3, n4], everyone)

    # 3. n2 leaves: once it stopped, it is a member nowhere.
    out = _cli(cluster, n2, "leave", "--broker", f"http://{n2.addr}:{HTTP_PORT}", "--timeout", "90")
    assert out.returncode == 0, out.stdout + out.stderr
    assert n2.proc is not None and n2.proc.popen.wait(timeout=30) == 0
    start = time.monotonic()
    _members_are(cluster, [n1, n3, n4], ["n1", "n3", "n4"])
    print(f"leave: removed everywhere {time.monotonic() - start:.1f} s after the leaver exited")
    assert any("removing member n2" in m.log(2_000_000) for m in (n1, n3, n4))

    # 4. n4 killed for good: removed once dead for replace_after (10 s).
    start = time.monotonic()
    cluster.kill(n4)
    _members_are(cluster, [n1, n3], ["n1", "n3"])
    print(
        f"kill -9: removed everywhere {time.monotonic() - start:.1f} s after (replace_after 10 s)"
    )


def _voters(cluster: MqlogCluster, on: list[Member], rf: int) -> None:
    """Until every partition of jn has placement's ``rf`` voters over ``on`` (no learner)."""
    names = [m.node_id for m in on]
    by_id = {node_id_of(n): n for n in names}
    deadline = time.monotonic() + FOLLOW_TIMEOUT
    while True:
        led = {}
        for m in on:
            for p in cluster.status(m)["partitions"]:
                if p.get("role") == "leader" and p["stream"] == "jn":
                    led[p["partition"]] = p
        want = {p: {by_id[i] for i in replicas(group_id_of(("jn", p)), by_id, rf)} for p in (0, 1)}
        if all(
            p in led and not led[p]["learners"] and set(led[p]["replicas"]) == want[p]
            for p in (0, 1)
        ):
            return
        assert time.monotonic() < deadline, led
        time.sleep(0.25)


def test_a_streams_replication_factor_changes(cluster: MqlogCluster) -> None:
    n1, n2, n3 = (cluster.member(n) for n in ("n1", "n2", "n3"))
    trio = [n1, n2, n3]
    _members_are(cluster, trio, ["n1", "n2", "n3"])
    _voters(cluster, trio, 3)
    writer = Client(MQTT_PORT, "writer", host=n1.addr)
    assert writer.connect() == 0
    sent = [f"m{i}".encode() for i in range(40)]
    for i, payload in enumerate(sent):
        writer.publish(f"jn/t{i % 8}", payload, qos=1)
    writer.disconnect()

    out = _cli(cluster, n1, "set-replication", "nope", "2", "--broker", f"http://{n1.addr}:8080")
    assert out.returncode != 0 and "stream 'nope' is not defined" in out.stdout + out.stderr
    out = _cli(cluster, n1, "set-replication", "jn", "2", "--broker", f"http://{n1.addr}:8080")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "stream jn: replication_factor = 2 (committed)" in out.stdout, out.stdout
    start = time.monotonic()
    _voters(cluster, trio, 2)
    print(f"\nreplication factor 3 -> 2: {time.monotonic() - start:.1f} s to two voters each")
    # The leader tells the removed replica at its next tick once the removal committed,
    # which may be after its configuration (in force when appended) showed two voters.
    deadline = time.monotonic() + FOLLOW_TIMEOUT
    while not any("removed from the group" in m.log(2_000_000) for m in trio):
        assert time.monotonic() < deadline, "no replica logged its removal"
        time.sleep(0.25)
    assert all(_metadata(cluster, m)["definitions"]["jn"]["replication_factor"] == 2 for m in trio)

    # n3's config still says 3 (the cluster's default): refused, naming the key and command.
    assert cluster.stop(n3) == {"n3": 0}
    with pytest.raises(ClusterLabError, match="exited with 2 before serving"):
        cluster.start(n3)
    assert (
        f"{n3.config_path}: streams[jn].replication_factor = 3 on node n3, but the cluster's "
        "definition of stream 'jn' (committed first, from node "
    ) in n3.log(20_000)
    assert "set by mqlog cluster set-replication on node n1 since) has replication_factor = 2" in (
        n3.log(20_000)
    )
    text = n3.config_path.read_text()
    n3.config_path.write_text(
        text.replace("partitions = 2\n", "partitions = 2\nreplication_factor = 2\n")
    )
    cluster.start(n3)

    out = _cli(cluster, n2, "set-replication", "jn", "3", "--broker", f"http://{n2.addr}:8080")
    assert out.returncode == 0, out.stdout + out.stderr
    start = time.monotonic()
    _voters(cluster, trio, 3)
    print(f"replication factor 2 -> 3: {time.monotonic() - start:.1f} s to three voters each")
    reader = Client(MQTT_PORT, "reader", host=n3.addr)
    assert reader.connect() == 0
    assert reader.subscribe("$replay/earliest/jn/#", qos=1) == [1]
    got = {m.payload for m in reader.expect(len(sent), timeout=30)}
    reader.disconnect()
    assert got == set(sent)
