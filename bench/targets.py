"""Broker deployments in the network lab (tests/netlab.py) for bench/chaos.py and
bench/cluster_bench.py: one adapter (a ``Target`` subclass) per broker.

- ``NatsTarget``: NATS 2.9 (Debian ``nats-server``), three nodes, MQTT on JetStream with
  ``stream_replicas: 3``, cluster routes between the three;
- ``MqlogTarget``: one mqlog node (``fsync = "always"`` unless told otherwise);
- ``MqlogClusterTarget``: three mqlog nodes with a ``[cluster]`` section (replication factor
  3, ``fsync = "always"``), run by tests/cluster_lab.py's ``MqlogCluster``; the ``chaos/#``
  topics are one stream of one partition, so one Raft group carries the whole workload and
  ``leader()`` names its leader from ``GET /api/v1/cluster``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.mqttclient import MqttClient
from bench.nats import nats_config, nats_server
from broker.commitlog import LogConfig
from broker.commitlog.reader import LogReader
from tests.checker import Read
from tests.cluster_lab import Member, MqlogCluster
from tests.netlab import Lab, Node, Proc, wait_tcp

ROOT = Path(__file__).resolve().parents[1]
MQTT_PORT = 1883
#: Every topic the chaos workload publishes to is under this level.
TOPIC_PREFIX = "chaos"


class Target:
    """A broker deployment in the lab: the interface an adapter fills.

    A subclass sets ``name`` and ``size`` (nodes) and implements ``argv(node)`` (the command
    that serves on ``addr(node)``, writing its config under ``workdir``) and
    ``drain_filter()``; it may override ``leader()`` (so faults can aim at the leader),
    ``before_run()`` (e.g. a durable subscription the drain reads), ``drain_connect()`` and
    ``after_kill()``. The base keeps one process per node and turns process faults into
    process-group signals (kill -9, SIGSTOP, SIGCONT); network faults are the lab's."""

    name = ""
    #: Nodes this target runs on (a lab of this size is built for it).
    size = 1
    ready_timeout = 30.0

    def __init__(self, lab: Lab, workdir: Path) -> None:
        self.lab = lab
        self.workdir = workdir
        self.procs: dict[str, Proc] = {}

    def argv(self, node: Node) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        return None

    def addr(self, node: Node) -> tuple[str, int]:
        return node.addr, MQTT_PORT

    def start(self, node: Node) -> None:
        """Start (or restart after a kill) the node's broker; returns once it listens."""
        self.procs[node.name] = self.lab.spawn(
            node,
            self.argv(node),
            log_path=self.workdir / f"{node.name}.log",
            env=self.env(),
            cwd=ROOT,
        )
        wait_tcp(*self.addr(node), timeout=self.ready_timeout)

    def start_all(self) -> None:
        for node in self.lab.nodes:
            self.procs[node.name] = self.lab.spawn(
                node,
                self.argv(node),
                log_path=self.workdir / f"{node.name}.log",
                env=self.env(),
                cwd=ROOT,
            )
        for node in self.lab.nodes:
            wait_tcp(*self.addr(node), timeout=self.ready_timeout)

    def kill(self, node: Node) -> None:
        self.procs[node.name].kill()
        self.after_kill(node)

    def after_kill(self, node: Node) -> None:
        """Until the killed node's resources are free for a restart."""

    def pause(self, node: Node) -> None:
        self.procs[node.name].pause()

    def resume(self, node: Node) -> None:
        self.procs[node.name].resume()

    def alive(self, node: Node) -> bool:
        p = self.procs.get(node.name)
        return p is not None and p.alive()

    def leader(self) -> Node | None:
        """The node leading the data the publishers write, if the target can tell."""
        return None

    def drain_filter(self) -> str:
        raise NotImplementedError

    async def before_run(self) -> None:
        """Called once the nodes listen, before the first publish."""

    def check_replicas(self) -> dict[str, Any] | None:
        """After the drain, every node up and healed: how the nodes' copies of the data
        compare (None: the target cannot tell). May stop the nodes."""
        return None

    async def drain(self, expect: set[str], quiet: float, timeout: float) -> list[Read]:
        """Read back everything under ``chaos/`` once, until every id of ``expect`` came
        and ``quiet`` seconds passed without a message, or ``timeout``."""
        reads: list[Read] = []
        got: set[str] = set()
        last = [time.monotonic()]

        def on_message(topic: str, payload: bytes) -> None:
            uid = payload.decode(errors="replace")
            reads.append(Read(uid, topic))
            got.add(uid)
            last[0] = time.monotonic()

        deadline = time.monotonic() + timeout
        client = await self._drain_client(on_message, deadline)
        try:
            while time.monotonic() < deadline and not client.is_closed:
                if expect <= got and time.monotonic() - last[0] > quiet:
                    break
                await asyncio.sleep(0.1)
        finally:
            client.close()
        return reads

    async def _drain_client(
        self, on_message: Callable[[str, bytes], None], deadline: float
    ) -> MqttClient:
        while True:
            for node in self.lab.nodes:
                try:
                    c = await self.drain_connect(node, on_message)
                    if await c.subscribe(self.drain_filter()) != 0x80:
                        return c
                    c.close()
                except (OSError, ConnectionError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("no node accepted the drain subscription")
            await asyncio.sleep(0.5)

    async def drain_connect(
        self, node: Node, on_message: Callable[[str, bytes], None]
    ) -> MqttClient:
        return await MqttClient.connect(*self.addr(node), "chaos-drain", on_message=on_message)


class MqlogTarget(Target):
    """One mqlog node; with ``fsync = "always"`` (the default here) every PUBACK follows an
    fsync of the append."""

    name = "mqlog"
    size = 1

    def __init__(self, lab: Lab, workdir: Path, workers: int = 1, fsync: str = "always") -> None:
        super().__init__(lab, workdir)
        self.workers = workers
        self.fsync = fsync

    def config(self, node: Node) -> Path:
        path = self.workdir / f"{node.name}.toml"
        data = self.workdir / f"{node.name}-data"
        path.write_text(
            f'[server]\nhost = "{node.addr}"\nport = {MQTT_PORT}\nsys_interval = 0\n'
            f'[commitlog]\ndata_dir = "{data}"\nfsync = "{self.fsync}"\n'
            f'[http]\nhost = "{node.addr}"\nport = 8080\n'
        )
        return path

    def argv(self, node: Node) -> list[str]:
        return [
            sys.executable,
            "-m",
            "broker.cli",
            "serve",
            "-c",
            str(self.config(node)),
            "--workers",
            str(self.workers),
        ]

    def env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH", "")
        return {**os.environ, "PYTHONPATH": f"{ROOT}:{path}" if path else str(ROOT)}

    def after_kill(self, node: Node) -> None:
        # workers killed with their supervisor exit a moment later, holding the data
        # directory's lock until then: the restart must not start before
        deadline = time.monotonic() + 10
        while self.procs[node.name].group_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def drain_filter(self) -> str:
        return f"$replay/earliest/{TOPIC_PREFIX}/#"


class NatsTarget(Target):
    """NATS 2.9 with MQTT on JetStream, three nodes, ``stream_replicas: 3``."""

    name = "nats"
    size = 3
    monitor_port = 8222

    def argv(self, node: Node) -> list[str]:
        routes = ", ".join(f"nats-route://{m.addr}:6222" for m in self.lab.peers(node))
        conf = self.workdir / f"{node.name}.conf"
        conf.write_text(
            nats_config(
                name=node.name,
                listen=f"{node.addr}:4222",
                http=f"{node.addr}:{self.monitor_port}",
                store_dir=self.workdir / node.name,
                cluster=f'name: chaos, listen: "{node.addr}:6222", routes: [{routes}]',
                mqtt_listen=f"{node.addr}:{MQTT_PORT}",
                mqtt="stream_replicas: 3",
            )
        )
        return [nats_server() or "nats-server", "-c", str(conf)]

    def leader(self) -> Node | None:
        """The leader of ``$MQTT_msgs`` (the stream every QoS 1 publish goes to): the node
        that reports itself as its leader; else the leader most nodes report (a node back
        from a kill or a partition may report a stale one); None if no node answers."""
        reports: dict[str, str] = {}
        for node in self.lab.nodes:
            url = f"http://{node.addr}:{self.monitor_port}/jsz?accounts=true&streams=true"
            try:
                with urllib.request.urlopen(url, timeout=0.5) as r:
                    doc = json.load(r)
            except (OSError, ValueError):
                continue
            for acc in doc.get("account_details") or []:
                for s in acc.get("stream_detail") or []:
                    if s.get("name") == "$MQTT_msgs":
                        lead = (s.get("cluster") or {}).get("leader")
                        if lead:
                            reports[node.name] = lead
        by_name = {n.name: n for n in self.lab.nodes}
        for name, lead in reports.items():
            if name == lead:
                return by_name[name]
        if reports:
            lead = Counter(reports.values()).most_common(1)[0][0]
            return by_name.get(lead)
        return None

    def drain_filter(self) -> str:
        return f"{TOPIC_PREFIX}/#"

    async def drain_connect(
        self, node: Node, on_message: Callable[[str, bytes], None]
    ) -> MqttClient:
        return await MqttClient.connect(
            *self.addr(node), "chaos-drain", clean=False, timeout=5.0, on_message=on_message
        )

    async def before_run(self) -> None:
        """The drain's durable subscription exists before the first publish (NATS keeps
        QoS 1 messages for a persistent session's subscription from then on)."""
        deadline = time.monotonic() + 60
        client = await self._drain_client(lambda t, p: None, deadline)
        client.close()
        await client.closed


class MqlogClusterTarget(Target):
    """Three mqlog nodes, every partition a Raft group of three replicas, ``fsync =
    "always"``: a PUBACK follows a majority's fsync. The processes, configs and secret are
    tests/cluster_lab.py's ``MqlogCluster`` (node ``n<i>`` of the lab is member
    ``n<i+1>``); the ``chaos/#`` topics are the stream ``chaos`` of one partition
    (:attr:`STREAM`), whose group's leader is what ``leader()`` names. ``extra`` is TOML
    appended to every node's config (more ``[[streams]]``, or ``[cluster]`` timings)."""

    name = "mqlog-cluster"
    size = 3
    #: The stream every ``chaos/...`` publish goes to: one partition, so one Raft group.
    STREAM = "chaos"
    STREAM_TOML = (
        f'[[streams]]\nname = "{STREAM}"\ntopic_filter = ["{TOPIC_PREFIX}/#"]\npartitions = 1\n'
    )

    def __init__(self, lab: Lab, workdir: Path, extra: str = "", workers: int = 1) -> None:
        super().__init__(lab, workdir)
        self.workers = workers
        self.cluster = MqlogCluster(lab, workdir, workers=workers, extra=self.STREAM_TOML + extra)

    def member(self, node: Node) -> Member:
        return self.cluster.members[node.index]

    def start(self, node: Node) -> None:
        self.cluster.start(self.member(node), timeout=self.ready_timeout)

    def start_all(self) -> None:
        self.cluster.start(timeout=self.ready_timeout)

    def kill(self, node: Node) -> None:
        """kill -9 of the node's process group; returns once every process of it is gone
        (they hold the data directory)."""
        self.cluster.kill(self.member(node))

    def pause(self, node: Node) -> None:
        self.cluster.pause(self.member(node))

    def resume(self, node: Node) -> None:
        self.cluster.resume(self.member(node))

    def alive(self, node: Node) -> bool:
        return self.member(node).running()

    def partition_views(self, stream: str, partition: int) -> dict[str, dict[str, Any]]:
        """Each answering node's view of ``stream``/``partition`` (its entry of
        ``GET /api/v1/cluster``), by node id; a node that does not answer within 0.5 s
        (paused, killed, cut off from the host) is left out."""
        views: dict[str, dict[str, Any]] = {}
        for m in self.cluster.members:
            try:
                doc = self.cluster.status(m, timeout=0.5)
            except (OSError, ValueError):
                continue
            for p in doc.get("partitions", []):
                if p.get("stream") == stream and p.get("partition") == partition:
                    views[m.node_id] = p
        return views

    def leader(self) -> Node | None:
        """The leader of the ``chaos`` group: among the nodes that answer, the leader named
        in the highest term (Raft has at most one leader per term, section 5.2; a node back
        from a partition may still name an older one); None when no node names one."""
        named = [
            (int(v.get("term") or 0), v["leader"])
            for v in self.partition_views(self.STREAM, 0).values()
            if v.get("leader")
        ]
        if not named:
            return None
        lead = max(named)[1]
        for m in self.cluster.members:
            if m.node_id == lead:
                return m.node
        return None

    def converge(self, timeout: float) -> float | None:
        """Seconds until every node reports the ``chaos`` group with one leader in one term
        and the same last index, all of it committed (every replica caught up); None if that
        did not happen within ``timeout``."""
        t0 = time.monotonic()
        while True:
            views = self.partition_views(self.STREAM, 0)
            seen = {
                (v["term"], v["leader"], v["last_index"], v["commit_index"]) for v in views.values()
            }
            if len(views) == len(self.cluster.members) and len(seen) == 1:
                (_, leader, last, commit) = seen.pop()
                if leader is not None and last == commit:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(0.1)

    def replica(self, node: Node) -> list[StoredRecord]:
        """The records of ``node``'s copy of the ``chaos`` partition, read from its data
        directory with the read-only ``LogReader`` (the node should be stopped)."""
        return read_replica(self.member(node).data_dir / self.STREAM / "0")

    def check_replicas(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until the replicas converge (:meth:`converge`), stop every node (SIGTERM),
        then compare the three copies of the ``chaos`` partition record by record
        (:func:`compare_replicas`)."""
        converged = self.converge(timeout)
        self.cluster.stop()
        copies = {m.node_id: self.replica(m.node) for m in self.cluster.members}
        return {
            "converged_s": None if converged is None else round(converged, 2),
            **compare_replicas(copies),
        }

    def drain_filter(self) -> str:
        return f"$replay/earliest/{TOPIC_PREFIX}/#"


#: One stored record as the replicas are compared: offset, timestamp, topic, payload.
StoredRecord = tuple[int, int, str, bytes]


def read_replica(directory: Path) -> list[StoredRecord]:
    """Every record of the partition log in ``directory`` (control batches skipped), read
    without writing anything (``LogReader``: no recovery, no marker)."""
    reader = LogReader(directory, LogConfig(), end_offset=1 << 62)
    out: list[StoredRecord] = []
    offset = reader.log_start_offset
    while True:
        batch = reader.read(offset, 10_000, 8 << 20)
        if not batch:
            return out
        out.extend((r.offset, r.timestamp, r.topic, r.payload) for r in batch)
        offset = batch[-1].offset + 1


def compare_replicas(copies: dict[str, list[StoredRecord]]) -> dict[str, Any]:
    """Compare the copies of one partition (by node). At each offset below a copy's end, the
    copy holds a record or nothing (a control batch there, where another holds a record);
    where the copies disagree, each that differs from the majority's (every one, on a tie) is
    **divergent**: Raft's Log Matching property (s5.3) says no two committed copies differ.
    A copy that agrees everywhere but ends early is **behind** (it did not catch up).
    Returns ``divergent_replicas`` (count), ``divergent`` and ``behind`` (node names),
    ``records`` (each copy's count) and ``first_divergence`` (an offset, or None)."""
    held = {n: {r[0]: r for r in recs} for n, recs in copies.items()}
    ends = {n: (recs[-1][0] + 1 if recs else 0) for n, recs in copies.items()}
    divergent: set[str] = set()
    first: int | None = None
    for offset in sorted(set().union(*held.values())):
        values = {n: held[n].get(offset) for n in copies if offset < ends[n]}
        ranked = Counter(values.values()).most_common()
        if len(ranked) == 1:
            continue
        first = offset if first is None else first
        majority = ranked[0][0] if ranked[0][1] > ranked[1][1] else ()
        divergent.update(n for n, v in values.items() if v != majority)
    longest = max(ends.values(), default=0)
    return {
        "divergent_replicas": len(divergent),
        "divergent": sorted(divergent),
        "behind": sorted(n for n in copies if n not in divergent and ends[n] < longest),
        "records": {n: len(recs) for n, recs in copies.items()},
        "first_divergence": first,
    }


TARGETS: dict[str, type[Target]] = {
    "nats": NatsTarget,
    "mqlog": MqlogTarget,
    "mqlog-cluster": MqlogClusterTarget,
}
