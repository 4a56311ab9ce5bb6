"""Who a cluster's nodes and groups are, computed the same way on every node.

* A node's Raft id is the CRC-32 of its ``node_id`` (``[cluster] node_id``, a stable string):
  the cores and the wire speak small integers, operators speak names. Two names with one CRC
  are refused when the cluster forms (:func:`node_ids`), never silently merged.
* A partition's group id is the CRC-32 of ``<stream>/<partition>``, checked likewise over the
  configured streams (:func:`group_ids`).
* Placement is rendezvous hashing (highest random weight, Thaler and Ravishankar 1998): a
  group's replicas are the ``replication_factor`` nodes with the highest
  ``weight(group id, node id)`` (SplitMix64's finalizer over the pair: CRC-32 is linear, and
  its weights favoured one node of three for half the groups). Every node computes the same
  answer from the same member list, so a static cluster needs no coordination to agree on
  it, and a member added or removed moves only the groups whose top set it enters or leaves.
  The group's first configuration is this set; after that, the configuration in the group's
  own log is authoritative (a CONFIG entry), so a stale member list can never lose data.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from broker.commitlog.keys import PartitionKey

_MASK = (1 << 64) - 1


class PlacementError(ValueError):
    """Names that cannot be told apart by their ids."""


def node_id_of(name: str) -> int:
    """The Raft id of the node named ``name``."""
    return zlib.crc32(name.encode())


def group_id_of(key: PartitionKey) -> int:
    """The Raft group id of partition ``key``."""
    return zlib.crc32(f"{key[0]}/{key[1]}".encode())


def node_ids(names: Iterable[str]) -> dict[int, str]:
    """Id -> name for every node; raises :class:`PlacementError` on two names with one id."""
    ids: dict[int, str] = {}
    for name in names:
        i = node_id_of(name)
        other = ids.setdefault(i, name)
        if other != name:
            raise PlacementError(
                f"node ids {other!r} and {name!r} have the same CRC-32: rename one"
            )
    return ids


def group_ids(keys: Iterable[PartitionKey]) -> dict[int, PartitionKey]:
    """Group id -> partition; raises :class:`PlacementError` on a collision."""
    ids: dict[int, PartitionKey] = {}
    for key in keys:
        g = group_id_of(key)
        other = ids.setdefault(g, key)
        if other != key:
            raise PlacementError(f"partitions {other} and {key} have the same group id {g}")
    return ids


def weight(group: int, node: int) -> int:
    """The rendezvous weight of ``node`` for ``group``: SplitMix64's finalizer of the pair."""
    z = ((group << 32) | node) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def replicas(group: int, nodes: Iterable[int], replication_factor: int) -> list[int]:
    """The nodes holding ``group``: the ``replication_factor`` (capped at the node count)
    highest-weight nodes, in weight order (the first is where its leadership is preferred)."""
    weights = sorted(((weight(group, n), n) for n in set(nodes)), reverse=True)
    return [n for _, n in weights[: max(1, replication_factor)]]
