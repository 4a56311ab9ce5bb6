"""A node joining a formed cluster, and a node leaving one, move replicas (issue 21 items 2, 4
and 5, broker.cluster.reshape), on real nodes in network namespaces with replication factor 3,
under a QoS 1 publisher whose longest wait for a PUBACK is reported:

- three nodes form the cluster; a fourth, named in nobody's seeds, starts later with the
  first as its only seed: it joins through gossip, the leaders add it as a learner to every
  group placement over the four now gives it, promote it once caught up, and remove the
  replica placement no longer wants, which gives its copy up; the newcomer leads some
  partitions (the balancers), and everything acknowledged is read back from it;
- in that four-node cluster, ``mqlog cluster leave`` on a node moves its replicas: every
  partition ends with three voters, none of them the leaver, which exits; nothing
  acknowledged is lost.

Both with one worker per node and with two. With two, each worker leads and follows the
groups of the partitions it owns, on a Raft port of its own, and learns of the newcomer and
of the leaver from worker 0's gossip (broker.cluster.worker_view); the replication factor
applies as with one (a node outside a group reads it through the owning worker,
broker.workers.remote_relay), so copies are given up in both workers' groups.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.chaos import History, publisher
from bench.reshape_lab import Founders, longest_gap
from broker.cluster.placement import group_id_of, node_id_of, replicas
from broker.workers.mesh import owner_of
from tests import netlab
from tests.cluster_lab import HTTP_PORT, MQTT_PORT, Member, MqlogCluster
from tests.integration.clients import Client
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

PARTITIONS = 8
EXTRA = f'[[streams]]\nname = "jn"\ntopic_filter = "jn/#"\npartitions = {PARTITIONS}\n'
NAMES = ("n1", "n2", "n3", "n4")
#: Seconds the groups have to reach placement's replicas after a change.
RESHAPE_TIMEOUT = 120.0


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


class Publisher:
    """QoS 1 publishers (bench/chaos.py's: one message in flight each; a publish whose
    outcome a change left unknown closes the connection, and the publisher connects again
    and resends it, QoS 1 may duplicate) on ``member``, each to its own topic, in a thread
    of their own."""

    def __init__(self, member: Member, publishers: int = 4) -> None:
        self.target: Any = Founders([member.node])  # what publisher() needs of a Target
        self.publishers = publishers
        self.hist = History()
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),))

    async def _run(self) -> None:
        await asyncio.gather(
            *(
                publisher(k, self.target, f"jn/d/{k}", self.hist, self.stop, 100.0, 5.0)
                for k in range(self.publishers)
            )
        )

    def __enter__(self) -> Publisher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=30)
        self.loop.close()

    @property
    def acked(self) -> list[bytes]:
        return [p.uid.encode() for p in self.hist.publishes if p.acked]

    def longest_gap(self, since: float, until: float) -> float:
        """The longest time one publisher waited for a PUBACK between ``since`` and
        ``until`` (printed with the wall-clock time it ended, to find it in the logs)."""
        gap = longest_gap(self.hist, since, until)
        wall = time.strftime("%H:%M:%S", time.gmtime(time.time() - (time.monotonic() - until)))
        print(f"\nlongest PUBACK gap {gap:.3f} s in the window ending {wall}")
        return gap


def _settled(cluster: MqlogCluster, members: list[Member], timeout: float = 30.0) -> None:
    """Until every partition is led by its preferred replica (the balancers are done)."""
    deadline = time.monotonic() + timeout
    while True:
        view = _leaders_view(cluster, members)
        if len(view) >= PARTITIONS + 2 and all(
            e["leader"] == e["preferred_leader"] for e in view.values()
        ):
            return
        assert time.monotonic() < deadline, view
        time.sleep(0.5)


def _leaders_view(cluster: MqlogCluster, members: list[Member]) -> dict[str, dict[str, Any]]:
    """Each partition's entry as its leader reports it."""
    out: dict[str, dict[str, Any]] = {}
    for m in members:
        try:
            view = cluster.status(m)
        except OSError:
            continue
        for p in view["partitions"]:
            if p.get("role") == "leader":
                out[f"{p['stream']}/{p['partition']}"] = p
    return out


def _wanted(key: str, names: list[str], rf: int) -> set[str]:
    stream, p = key.rsplit("/", 1)
    by_id = {node_id_of(n): n for n in names}
    return {by_id[i] for i in replicas(group_id_of((stream, int(p))), by_id, rf)}


def _placed(view: dict[str, dict[str, Any]], names: list[str]) -> bool:
    """Every partition of jn has placement's three voters over ``names`` (no learner), and
    ``$retained`` and ``$sessions`` one on each of ``names``."""
    keys = [f"jn/{p}" for p in range(PARTITIONS)] + ["$retained/0", "$sessions/0"]
    for key in keys:
        entry = view.get(key)
        if entry is None or entry.get("learners"):
            return False
        rf = 3 if key.startswith("jn/") else len(names)
        if set(entry["replicas"]) != _wanted(key, names, rf):
            return False
    return True


def _aside(member: Member) -> list[Path]:
    """The copies of jn's partitions ``member`` gave up (moved aside)."""
    return list(Path(member.data_dir).glob("jn/*.removed-*"))


def _read_all(member: Member, acked: list[bytes]) -> None:
    """Read ``jn/#`` from the start on ``member`` until every acknowledged payload is seen."""
    reader = Client(MQTT_PORT, f"reader-{member.node_id}", host=member.addr)
    assert reader.connect() == 0
    assert reader.subscribe("$replay/earliest/jn/#", qos=1) == [1]
    got: set[bytes] = set()
    deadline = time.monotonic() + 60
    while not set(acked) <= got:
        assert time.monotonic() < deadline, sorted(set(acked) - got)[:10]
        got.update(m.payload for m in reader.expect(1, timeout=deadline - time.monotonic()))
    reader.disconnect()


def _join_n4(cluster: MqlogCluster, pub: Publisher) -> float:
    """Start n4 under ``pub``'s load; wait until placement over the four holds. Returns the
    longest PUBACK gap meanwhile."""
    n4 = cluster.member("n4")
    start = time.monotonic()
    cluster.start(n4)
    everyone = list(cluster.members)
    deadline = start + RESHAPE_TIMEOUT
    while True:
        view = _leaders_view(cluster, everyone)
        if _placed(view, list(NAMES)) and any(e["leader"] == "n4" for e in view.values()):
            break
        assert time.monotonic() < deadline, view
        time.sleep(0.5)
    return pub.longest_gap(start, time.monotonic())


def test_a_new_node_joins_receives_replicas_and_leaderships(cluster: MqlogCluster) -> None:
    n1 = cluster.member("n1")
    _settled(cluster, cluster.members[:3])
    with Publisher(n1) as pub:
        time.sleep(2)
        gap = _join_n4(cluster, pub)
        time.sleep(1)
    print(f"\njoin: longest PUBACK gap {gap:.3f} s over {len(pub.acked)} acknowledged")
    assert len(pub.acked) > 100
    logs = {m.node_id: m.log(2_000_000) for m in cluster.members}
    assert "joining the cluster of" in logs["n4"]
    # Every member's gossip filter (user space here) allows the newcomer now, the ones it
    # did not join through too: they learned it from gossip.
    n4 = cluster.member("n4")
    for m in cluster.members[:3]:
        assert n4.addr in cluster.status(m)["xdp"]["members"], m.node_id
    assert "joined as a replica" in logs["n4"]
    # A replica placement no longer wants gave its copy up (moved aside, not deleted), in
    # both workers' groups with two.
    assert any("removed from the group" in text for text in logs.values())
    aside = {int(d.name.split(".")[0]) for m in cluster.members for d in _aside(m)}
    assert aside
    assert {owner_of(("jn", p), cluster.workers) for p in aside} == set(range(cluster.workers))
    # A removed node serves those partitions remotely now.
    for m in cluster.members[:3]:
        view = cluster.status(m)
        for p in view["partitions"]:
            key = f"{p['stream']}/{p['partition']}"
            if key.startswith("jn/") and m.node_id not in _wanted(key, list(NAMES), 3):
                assert p.get("role") == "remote", (m.node_id, p)
    _read_all(cluster.member("n4"), pub.acked)
    assert gap < 5.0


def test_leave_moves_the_leavers_replicas(cluster: MqlogCluster) -> None:
    n1, n2 = cluster.member("n1"), cluster.member("n2")
    _settled(cluster, cluster.members[:3])
    with Publisher(n1) as pub:
        _join_n4(cluster, pub)
        start = time.monotonic()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "broker.cli",
                "cluster",
                "leave",
                "--broker",
                f"http://{n2.addr}:{HTTP_PORT}",
                "--timeout",
                "90",
            ],
            capture_output=True,
            text=True,
            env=cluster.env(),
            timeout=150,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "replica still on" not in out.stdout, out.stdout
        assert n2.proc is not None and n2.proc.popen.wait(timeout=30) == 0
        left = time.monotonic() - start
        stay = [cluster.member(n) for n in ("n1", "n3", "n4")]
        deadline = time.monotonic() + 30
        while True:
            view = _leaders_view(cluster, stay)
            if _placed(view, ["n1", "n3", "n4"]):
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.5)
        gap = pub.longest_gap(start, time.monotonic())
        time.sleep(1)
    print(f"\nleave: {left:.1f} s, longest PUBACK gap {gap:.3f} s over {len(pub.acked)} acked")
    for key, entry in view.items():
        assert "n2" not in entry["replicas"], key
    # The leaver gave up every copy it held (moved aside), in each of its workers' groups.
    held = {p for p in range(PARTITIONS) if "n2" in _wanted(f"jn/{p}", list(NAMES), 3)}
    aside = {int(d.name.split(".")[0]) for d in _aside(n2)}
    assert held <= aside, (held, aside)
    assert {owner_of(("jn", p), cluster.workers) for p in held} == set(range(cluster.workers))
    _read_all(cluster.member("n3"), pub.acked)
    assert gap < 5.0
