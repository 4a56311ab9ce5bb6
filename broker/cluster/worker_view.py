"""What worker 0's gossip sees, told to the node's other workers (several workers per node,
issue 21).

Gossip runs in worker 0 alone (``broker.cluster.membership_service``), yet every worker leads
and follows groups of its own (``broker.cluster.node``) and plans their shape
(``broker.cluster.reshape``). So on each planner pass worker 0 tells the others (over the
workers' mesh: the worker runtime's ``tell_all``) a :func:`view_of` its gossip: the members'
Raft addresses (worker 0's ports) and the placement survey (who counts, who is live, who is
leaving). Worker ``i`` takes it in (:func:`hear`): it dials each member not known before at
its ``raft_port + i`` (the peer worker that hosts the same groups), admits it to its groups'
host, and keeps the survey for its own planner passes. This is how a node joining after
formation reaches the workers ``i`` > 0 of the others, which read the member list only at
start (``broker.cluster.formation``).

It also carries the streams' replication factors as the metadata group committed them
(``mqlog cluster set-replication``): the metadata group is worker 0's, and each worker's
leaders move their groups' replicas to match (``broker.cluster.metadata_members``).

The view is JSON: ``{"members": {name: [host, raft_port]}, "eligible": [id], "live": [id],
"leaving": [id], "replication": {stream: factor}}`` (no factors before worker 0 caught up
with the metadata group's leader).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.cluster.metadata_members import committed_factors, follow_factors
from broker.cluster.placement import node_id_of
from broker.cluster.reshape import Survey

if TYPE_CHECKING:
    from broker.cluster.node import ClusterNode


def view_of(node: ClusterNode) -> dict[str, Any]:
    """Worker 0's view (the module docstring)."""
    survey = node.reshape.eligible()
    return {
        "members": {name: list(addr) for name, addr in node.transport.members.items()},
        "eligible": survey.eligible,
        "live": sorted(survey.live),
        "leaving": sorted(survey.leaving),
        "replication": committed_factors(metadata)
        if (metadata := node.metadata) is not None and metadata.ready
        else {},
    }


def hear(node: ClusterNode, view: Any) -> None:
    """Worker ``i`` > 0 takes worker 0's view (the module docstring)."""
    index = node.settings.worker[0]
    for name, (host, port) in view["members"].items():
        if name == node.name:
            continue
        addr = (str(host), int(port) + index)
        if node.transport.members.get(name) != addr:
            node.transport.learn(name, addr)
        new = node.names.get(node_id_of(name)) is None or (
            node.host is not None and node_id_of(name) not in node.host.peers
        )
        if new:
            node.admit(name)
    survey = Survey(
        [int(n) for n in view["eligible"]],
        {int(n) for n in view["live"]},
        {int(n) for n in view["leaving"]},
    )
    node.reshape.told = (survey, node.loop.time())
    follow_factors(node, view.get("replication", {}))
