"""The node driver on a real event loop: three ``ClusterNode``s in one process, real TCP on
127.0.0.1, real segmented logs in temporary directories (only the processes are shared).

What is asserted: the nodes form through their seeds and elect one leader; a proposal commits
on every node and readers see it; retention deletes only segments below what the core holds
committed and durable, tells the core, and a follower that was away while the leader's prefix
went gets a snapshot (its log reset to the leader's start) and then the entries after it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench.ports import cluster_port
from broker.cluster.node import ClusterNode
from broker.cluster.nodemeta import NodeMeta
from broker.cluster.nodesettings import NodeSettings, node_settings
from broker.cluster.raft import Role
from broker.cluster.storage import GroupStorage, encode_entry
from broker.commitlog import LogConfig, Record, SegmentedLog
from broker.config.cluster import ClusterConfig, Seed

SECRET = b"a-test-secret-of-enough-bytes"
GROUP = 7
#: Small segments and a byte cap, so that retention has whole segments to delete.
LOG = LogConfig(segment_bytes=2048, retention_bytes=4096, fsync="always")


def _records(n: int, tag: str) -> list[Record]:
    return [
        Record(0, 1000 + i, "t/a", f"{tag}{i:04}".encode() * 8, 1, False, "c", b"")
        for i in range(n)
    ]


class Trio:
    def __init__(self, root: Path, config: LogConfig = LOG) -> None:
        self.root = root
        self.config = config
        self.ports = [cluster_port() for _ in range(3)]
        self.nodes: list[ClusterNode | None] = [None, None, None]

    def settings(self, i: int) -> NodeSettings:
        return NodeSettings(
            name=f"n{i + 1}",
            bind=("127.0.0.1", self.ports[i]),
            seeds=[("127.0.0.1", p) for j, p in enumerate(self.ports) if j != i],
            secret=SECRET,
            replication_factor=3,
            election_timeout=0.3,
            heartbeat_interval=0.03,
        )

    async def start(self, i: int) -> ClusterNode:
        node = ClusterNode(self.settings(i), self.root / f"n{i + 1}")
        await node.start()
        log = SegmentedLog.open(self.root / f"n{i + 1}" / "log", self.config)
        node.host_groups({GROUP: GroupStorage.over(log)}, seed=i)
        self.nodes[i] = node
        return node

    async def stop(self, i: int) -> None:
        node = self.nodes[i]
        assert node is not None
        await node.close()
        node.storages[GROUP].close()
        self.nodes[i] = None

    def live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n is not None]

    async def leader(self, timeout: float = 10.0) -> ClusterNode:
        async def find() -> ClusterNode:
            while True:
                leaders = [n for n in self.live() if n.core(GROUP).role is Role.LEADER]
                if len(leaders) == 1 and all(n.leader(GROUP) == leaders[0].id for n in self.live()):
                    return leaders[0]
                await asyncio.sleep(0.01)

        return await asyncio.wait_for(find(), timeout)

    async def committed_everywhere(self, index: int, timeout: float = 10.0) -> None:
        async def wait() -> None:
            while not all(n.storages[GROUP].commit >= index for n in self.live()):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(wait(), timeout)


def _propose(node: ClusterNode, n: int, tag: str) -> int:
    core = node.core(GROUP)
    payload, count = encode_entry(_records(n, tag), core.terms.last_index, core.term)
    return node.propose(GROUP, payload, count)


def test_three_nodes_replicate_and_a_returning_follower_gets_a_snapshot(tmp_path: Path) -> None:
    async def main() -> None:
        trio = Trio(tmp_path)
        await asyncio.gather(*(trio.start(i) for i in range(3)))
        try:
            leader = await trio.leader()
            index = _propose(leader, 5, "a")
            await trio.committed_everywhere(index)
            for n in trio.live():
                assert [r.payload for r in n.storages[GROUP].log.read(0)][-5:] == [
                    r.payload for r in _records(5, "a")
                ]
            # A follower goes away; the leader's log grows past its retention cap.
            away = next(i for i, n in enumerate(trio.nodes) if n is not leader)
            await trio.stop(away)
            for k in range(40):
                index = _propose(leader, 4, f"b{k}")
                await trio.committed_everywhere(index)
            for n in trio.live():
                assert n.enforce_retention() > 0
                start = n.storages[GROUP].log.log_start_offset
                assert start > 0 and n.core(GROUP).terms.start == start
                assert start <= n.core(GROUP).commit  # never past what is committed
            # It comes back: its log is older than the leader's start, so a snapshot.
            back = await trio.start(away)
            await trio.committed_everywhere(index)
            log = back.storages[GROUP].log
            assert log.log_start_offset >= leader.storages[GROUP].log.log_start_offset - 1
            assert log.end_offset == leader.storages[GROUP].log.end_offset
            assert [r.payload for r in log.read(log.end_offset - 4)] == [
                r.payload for r in _records(4, "b39")
            ]
        finally:
            for i in range(3):
                if trio.nodes[i] is not None:
                    await trio.stop(i)

    asyncio.run(main())


def test_a_compacted_group_compacts_below_commit_and_keeps_replicating(tmp_path: Path) -> None:
    """$retained's case: compaction in the driver's pass keeps every batch's boundaries (an
    emptied batch stays as a placeholder), so the group goes on replicating and a returning
    follower catches up through the compacted entries."""
    config = LogConfig(
        segment_bytes=1024,
        retention_ms=None,
        compacted=True,
        keep_empty_batches=True,
        fsync="always",
    )

    async def main() -> None:
        trio = Trio(tmp_path, config)
        await asyncio.gather(*(trio.start(i) for i in range(3)))
        try:
            leader = await trio.leader()
            away = next(i for i, n in enumerate(trio.nodes) if n is not leader)
            await trio.stop(away)
            for k in range(30):
                index = _propose(leader, 2, f"k{k}")  # the same topic: one key
                await trio.committed_everywhere(index)
            before = [(s.base_offset, s.next_offset) for s in leader.storages[GROUP].log._segments]
            for n in trio.live():
                n.enforce_retention()
            log = leader.storages[GROUP].log
            assert [(s.base_offset, s.next_offset) for s in log._segments] == before
            kept = log.read(0)
            # Every record of the closed segments is superseded: what is read is the active
            # segment's (compaction leaves that one), ending with the latest value.
            assert kept and all(r.offset >= log._segments[-1].base_offset for r in kept)
            assert kept[-1].payload == _records(2, "k29")[1].payload
            back = await trio.start(away)
            index = _propose(leader, 1, "z")
            await trio.committed_everywhere(index)
            for n in trio.live():
                got = n.storages[GROUP].log.read(0)
                assert [r.payload for r in got][-1] == _records(1, "z")[0].payload
            assert back.storages[GROUP].log.end_offset == log.end_offset
        finally:
            for i in range(3):
                if trio.nodes[i] is not None:
                    await trio.stop(i)

    asyncio.run(main())


def test_worker_i_listens_on_raft_port_plus_i_and_keeps_its_own_member_list(
    tmp_path: Path,
) -> None:
    """Several workers per node: worker i binds raft_port + i, says (i, count) in its
    handshakes; the seeds are gossip addresses (worker 0 joins through them and announces its
    raft_port and worker count); without gossip each worker keeps a member list of its own."""
    config = ClusterConfig(
        "n1", "10.0.0.1", tmp_path / "k", SECRET, seeds=(Seed("10.0.0.2", 7960),), raft_port=7950
    )
    assert node_settings(config).bind == ("10.0.0.1", 7950)
    s = node_settings(config, (1, 2), mqtt="10.0.0.1:1883")
    assert s.bind == ("10.0.0.1", 7951) and s.seeds == []
    assert s.gossip is not None and s.gossip.seeds == [("10.0.0.2", 7960)]
    assert s.gossip.bind == ("10.0.0.1", 7946)
    assert s.gossip.meta == NodeMeta(7950, 2, "10.0.0.1:1883", "")
    swim = s.gossip.swim
    assert (swim.probe_interval, swim.suspicion_mult, swim.suspicion_max_mult) == (1000, 1, 2)
    assert s.worker == (1, 2)

    async def main() -> None:
        zero = ClusterNode(node_settings(config, (0, 2)), tmp_path)
        one = ClusterNode(s, tmp_path)
        assert zero.members_file.name == "members"  # as with one worker: data dirs carry over
        assert one.members_file.name == "members.worker1"
        assert one.transport.worker == (1, 2) and one.transport.bind == ("10.0.0.1", 7951)
        await zero.close()
        await one.close()

    asyncio.run(main())
