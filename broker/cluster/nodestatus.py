"""A cluster node's status view (``GET /api/v1/cluster``, ``mqlog cluster status``, the
console): its members and, per partition it holds, role, term, leader, replicas, commit index
and each follower's lag on the leader. Read-only over :class:`~broker.cluster.node.ClusterNode`.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

from broker.cluster.raft import Role

if TYPE_CHECKING:
    from broker.cluster.node import ClusterNode


def node_status(node: ClusterNode) -> dict[str, Any]:
    """The node's view for ``GET /api/v1/cluster``, ``mqlog cluster status`` and the
    console: nodes (name, address, state) and, per partition this node holds, its role
    here, term, leader, replicas, commit index and, on the leader, each follower's lag."""
    nodes = []
    for i, name in sorted(node.names.items(), key=lambda kv: kv[1]):
        here = i == node.id
        nodes.append(
            {
                "id": name,
                "raft_id": i,
                "address": addr(
                    node.settings.bind if here else node.transport.members.get(name, ("?", 0))
                ),
                "state": "self"
                if here
                else "connected"
                if node.transport.connected(name)
                else "unreachable",
            }
        )
    partitions = []
    host = node.host
    for g, storage in sorted(
        node.storages.items(), key=lambda kv: node.group_keys.get(kv[0], ("", 0))
    ):
        assert host is not None
        core = host.core(g)
        leader = node.leader(g)
        stream, p = node.group_keys.get(g, ("?", 0))
        last = storage.terms.last_index
        entry: dict[str, Any] = {
            "stream": stream,
            "partition": p,
            "group": g,
            "role": core.role.name.lower(),
            "term": core.term,
            "leader": node.names.get(leader) if leader is not None else None,
            "replicas": sorted(node.names.get(n, str(n)) for n in core.configuration.members),
            "preferred_leader": node.names.get(node.preferred(g) or -1),
            "commit_index": storage.commit,
            "last_index": last,
            "quiesced": host.quiesced(g),
            "followers": [
                {
                    "node": node.names.get(peer, str(peer)),
                    "match": pr.match,
                    "lag": last - pr.match,
                }
                for peer, pr in sorted(core.progress.items())
            ]
            if core.role is Role.LEADER
            else [],
        }
        partitions.append(entry)
    return {
        "mode": "cluster",
        "node_id": node.name,
        "nodes": nodes,
        "partitions": partitions,
        "repaired": node.repair.view(),
        "transport": _counters(node.transport.stats),
        "raft": _counters(node.stats),
        "metadata": node.metadata.status() if node.metadata is not None else None,
    }


def _counters(obj: Any) -> dict[str, int]:
    """A stats dataclass's counters."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def addr(a: tuple[str, int]) -> str:
    """``host:port``, an IPv6 host in brackets."""
    host, port = a
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
