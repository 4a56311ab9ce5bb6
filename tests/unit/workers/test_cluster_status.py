"""A node's cluster status from its workers' views (broker.workers.cluster_status)."""

from __future__ import annotations

from typing import Any

from broker.workers.cluster_status import merge_views


def view(partitions: list[tuple[str, int]], states: dict[str, str], sent: int) -> dict[str, Any]:
    return {
        "mode": "cluster",
        "node_id": "n1",
        "nodes": [{"id": name, "state": state} for name, state in states.items()],
        "partitions": [{"stream": s, "partition": p, "leader": "n1"} for s, p in partitions],
        "transport": {"frames_sent": sent, "incompatible": 0},
        "raft": {"leader_changes": 1},
        "forwards_waiting": 1,
    }


def test_every_workers_partitions_once_counters_added_and_node_states_combined() -> None:
    w0 = view(
        [("devices", 1), ("devices", 3)],
        {"n1": "self", "n2": "connected", "n3": "connected", "n4": "unreachable"},
        10,
    )
    w1 = view(
        [("$retained", 0), ("devices", 0)],
        {"n1": "self", "n2": "connected", "n3": "unreachable", "n4": "unreachable"},
        5,
    )
    merged = merge_views([w0, w1])
    assert merged["workers"] == 2
    assert [(p["stream"], p["partition"]) for p in merged["partitions"]] == [
        ("$retained", 0),
        ("devices", 0),
        ("devices", 1),
        ("devices", 3),
    ]
    assert {n["id"]: n["state"] for n in merged["nodes"]} == {
        "n1": "self",
        "n2": "connected",
        "n3": "partly connected",
        "n4": "unreachable",
    }
    assert merged["nodes"][2]["workers_connected"] == 1
    assert merged["transport"] == {"frames_sent": 15, "incompatible": 0}
    assert merged["raft"] == {"leader_changes": 2}
    assert merged["forwards_waiting"] == 2
    assert w0["nodes"][2]["state"] == "connected"  # the workers' views are left as they were


def test_one_worker_or_a_single_node_is_returned_as_it_is() -> None:
    single = {"mode": "single node", "node_id": None, "nodes": [], "partitions": []}
    assert merge_views([single, single]) is single
    alone = view([("devices", 0)], {"n1": "self"}, 1)
    assert merge_views([alone]) is alone
