"""Placement: the same answer on every node, stable under membership changes, collisions refused."""

from __future__ import annotations

import itertools

import pytest

from broker.cluster.placement import (
    PlacementError,
    group_id_of,
    group_ids,
    node_id_of,
    node_ids,
    replicas,
)


def test_ids_are_stable_crc32s() -> None:
    assert node_id_of("n1") == node_id_of("n1") != node_id_of("n2")
    assert group_id_of(("devices", 0)) != group_id_of(("devices", 1))
    assert node_ids(["n1", "n2"]) == {node_id_of("n1"): "n1", node_id_of("n2"): "n2"}


def test_a_collision_is_refused_by_name() -> None:
    # "plumless" and "buckeroo" share a CRC-32 (a well-known pair).
    assert node_id_of("plumless") == node_id_of("buckeroo")
    with pytest.raises(PlacementError, match=r"plumless.*buckeroo"):
        node_ids(["plumless", "buckeroo"])
    assert group_ids([("a", 0), ("a", 0)]) == {group_id_of(("a", 0)): ("a", 0)}


def test_replicas_capped_ordered_and_independent_of_input_order() -> None:
    nodes = [node_id_of(f"n{i}") for i in range(1, 6)]
    for g in range(100):
        r = replicas(g, nodes, 3)
        assert len(r) == 3 == len(set(r)) and set(r) <= set(nodes)
        assert all(
            replicas(g, list(p), 3) == r for p in itertools.islice(itertools.permutations(nodes), 5)
        )
    assert sorted(replicas(7, nodes[:2], 3)) == sorted(nodes[:2])  # capped at the node count


def test_adding_a_node_moves_only_the_groups_it_joins() -> None:
    nodes = [node_id_of(f"n{i}") for i in range(1, 6)]
    new = node_id_of("n6")
    moved = 0
    for g in range(1000):
        before, after = set(replicas(g, nodes, 3)), set(replicas(g, [*nodes, new], 3))
        if before != after:
            moved += 1
            assert new in after and len(before - after) == 1
    assert 350 < moved < 650  # about RF / (N + 1) = 3/6 of the groups


def test_leaders_spread_evenly_by_first_replica() -> None:
    nodes = [node_id_of(f"n{i}") for i in range(1, 4)]
    firsts = [replicas(g, nodes, 3)[0] for g in range(3000)]
    for n in nodes:
        assert 800 < firsts.count(n) < 1200
