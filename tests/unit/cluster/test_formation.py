"""Formation through gossip (broker.cluster.formation, broker.cluster.membership_service), three
real ``ClusterNode``s on 127.0.0.1 with real UDP and TCP and a fast protocol period.

What is asserted: each node forms once its seeds (gossip addresses) are live members, with
every member's Raft address taken from its gossip metadata, and persists the member list
(Raft and gossip addresses); the Raft transport dials those addresses; another worker of a
node takes worker 0's list, at its own ports; the status view shows the members with state and
incarnation; the allowlist observer hears the members' hosts; a node closed is declared dead
by the others, and restarted on its data directory it forms at once and is alive again at a
higher incarnation.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from bench.ports import cluster_port, gossip_port
from broker.cluster.gossip.options import SwimConfig
from broker.cluster.node import ClusterNode
from broker.cluster.nodemeta import NodeMeta
from broker.cluster.nodesettings import GossipSettings, NodeSettings

SECRET = b"formation-test-secret-0123456789"
FAST = SwimConfig(
    probe_interval=100, probe_timeout=40, gossip_interval=20, suspicion_mult=3, join_retry=100
)
WITHIN_S = 15.0


class Trio:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.raft = [cluster_port(2) for _ in range(3)]
        self.gossip = [gossip_port() for _ in range(3)]

    def settings(self, i: int, worker: tuple[int, int] = (0, 1)) -> NodeSettings:
        return NodeSettings(
            name=f"n{i + 1}",
            bind=("127.0.0.1", self.raft[i] + worker[0]),
            seeds=[],
            secret=SECRET,
            replication_factor=3,
            election_timeout=0.3,
            heartbeat_interval=0.03,
            worker=worker,
            gossip=GossipSettings(
                bind=("127.0.0.1", self.gossip[i]),
                seeds=[("localhost", p) for j, p in enumerate(self.gossip) if j != i],
                swim=FAST,
                meta=NodeMeta(self.raft[i], worker[1], f"127.0.0.1:{1883 + i}"),
            ),
        )

    def node(self, i: int, worker: tuple[int, int] = (0, 1)) -> ClusterNode:
        return ClusterNode(self.settings(i, worker), self.root / f"n{i + 1}")


async def until(predicate: object, timeout: float = WITHIN_S) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.02)


def test_nodes_form_through_gossip_and_see_a_death(tmp_path: Path) -> None:
    async def main() -> None:
        trio = Trio(tmp_path)
        nodes = [trio.node(i) for i in range(3)]
        heard: list[frozenset[str]] = []
        try:
            formed = await asyncio.gather(*(n.start() for n in nodes))
            assert all(len(ids) == 3 for ids in formed) and formed[0] == formed[1] == formed[2]
            for i, n in enumerate(nodes):
                others = {f"n{j + 1}": ("127.0.0.1", trio.raft[j]) for j in range(3) if j != i}
                assert n.transport.members.keys() <= others.keys()
                await until(lambda n=n, o=others: n.transport.members == o)  # type: ignore[misc]
                data = orjson.loads((tmp_path / f"n{i + 1}" / "cluster" / "members").read_bytes())
                assert data["members"] == {
                    f"n{j + 1}": ["127.0.0.1", trio.raft[j]] for j in range(3)
                }
                assert data["gossip"] == {
                    f"n{j + 1}": ["127.0.0.1", trio.gossip[j]] for j in range(3) if j != i
                }
            first = nodes[0].membership
            assert first is not None
            first.subscribe(heard.append)
            assert heard == [frozenset({"127.0.0.1"})]
            view = nodes[0].status()
            members = {m["id"]: m for m in view["members"]}
            assert sorted(members) == ["n1", "n2", "n3"]
            assert {m["state"] for m in members.values()} == {"alive"}
            assert members["n2"]["raft"] == f"127.0.0.1:{trio.raft[1]}"
            assert members["n2"]["mqtt"] == "127.0.0.1:1884" and members["n1"]["self"]
            # Formed as soon as every seed answered a join: the first probe may come later.
            await until(lambda: nodes[0].status()["gossip"]["probes"] > 0)
            assert nodes[0].status()["gossip"]["dropped_bad_mac"] == 0

            # Another worker of n1 takes worker 0's member list, at its own ports.
            one = trio.node(0, (1, 2))
            try:
                assert sorted(await one.start()) == formed[0]
                assert one.membership is None
                await until(lambda: set(one.transport.members) == {"n2", "n3"})
                assert one.transport.members["n2"] == ("127.0.0.1", trio.raft[1] + 1)
            finally:
                await one.close()

            # n3 stops: the others declare it dead.
            await nodes[2].close()
            for n in nodes[:2]:
                await until(lambda n=n: _state(n, "n3") == "dead")  # type: ignore[misc]
            inc = _incarnation(nodes[0], "n3")
            # It comes back on its data directory: formed at once, alive, a higher incarnation.
            nodes[2] = trio.node(2)
            assert sorted(await asyncio.wait_for(nodes[2].start(), 5)) == formed[0]
            for n in nodes[:2]:
                await until(lambda n=n: _state(n, "n3") == "alive")  # type: ignore[misc]
            assert _incarnation(nodes[0], "n3") > inc
        finally:
            for n in nodes:
                await n.close()

    asyncio.run(main())


def _state(node: ClusterNode, name: str) -> str:
    return next(m["state"] for m in node.status()["members"] if m["id"] == name)


def _incarnation(node: ClusterNode, name: str) -> int:
    return int(next(m["incarnation"] for m in node.status()["members"] if m["id"] == name))
