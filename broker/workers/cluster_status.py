"""One node's cluster status from the views of its workers (``GET /api/v1/cluster``).

With several workers each hosts the Raft groups of the partitions it owns, with its own links
to the other nodes (``broker.workers.replicated``); the node's status is their views put
together: every worker's partitions, its counters added up, and each node's state as the
workers see it: ``connected`` when every worker's link to it is up, ``unreachable`` when none
is, ``partly connected`` in between (``workers_connected`` says how many are).
"""

from __future__ import annotations

from typing import Any


def merge_views(views: list[dict[str, Any]]) -> dict[str, Any]:
    """The node's view from its workers' (worker 0's first; a single node's is returned as
    it is)."""
    first = views[0]
    if first.get("mode") != "cluster" or len(views) == 1:
        return first
    merged = dict(first)
    merged["workers"] = len(views)
    merged["partitions"] = sorted(
        (p for view in views for p in view["partitions"]),
        key=lambda p: (p["stream"], p["partition"]),
    )
    connected: dict[str, int] = {}
    for view in views:
        for n in view["nodes"]:
            connected[n["id"]] = connected.get(n["id"], 0) + (n["state"] == "connected")
    nodes = []
    for n in first["nodes"]:
        n = dict(n)
        if n["state"] != "self":
            k = connected.get(n["id"], 0)
            n["workers_connected"] = k
            n["state"] = (
                "connected" if k == len(views) else "unreachable" if k == 0 else "partly connected"
            )
        nodes.append(n)
    merged["nodes"] = nodes
    for section in ("transport", "raft", "remote_reads", "host"):
        totals: dict[str, int] = {}
        for view in views:
            for name, value in view.get(section, {}).items():
                totals[name] = totals.get(name, 0) + value
        merged[section] = totals
    merged["repaired"] = [r for view in views for r in view.get("repaired", ())]
    merged["session_takeovers"] = sum(view.get("session_takeovers", 0) for view in views)
    merged["forwards_waiting"] = sum(view.get("forwards_waiting", 0) for view in views)
    return merged
