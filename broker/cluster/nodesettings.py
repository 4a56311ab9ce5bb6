"""What a cluster node needs of ``[cluster]`` (broker.config's ClusterConfig), in the node's
terms: its name and Raft address, its seeds, the secret, the Raft timings, and which of the
node's workers it is (worker ``i`` listens on ``raft_port + i``)."""

from __future__ import annotations

from dataclasses import dataclass

from broker.config.cluster import ClusterConfig


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """What a node needs of ``[cluster]`` (broker.config's ClusterConfig)."""

    name: str
    bind: tuple[str, int]
    seeds: list[tuple[str, int]]
    secret: bytes
    replication_factor: int
    election_timeout: float  # seconds
    heartbeat_interval: float  # seconds
    #: This worker's index and the node's worker count (module docstring).
    worker: tuple[int, int] = (0, 1)


def node_settings(config: ClusterConfig, worker: tuple[int, int] = (0, 1)) -> NodeSettings:
    """What ``[cluster]`` says, in the node's terms, for worker ``worker[0]`` of ``worker[1]``.
    In this release ``seeds`` name the other members' Raft addresses (``host:raft_port``);
    worker ``i`` listens on ``raft_port + i`` and dials each seed's port ``+ i``."""
    i = worker[0]
    return NodeSettings(
        name=config.node_id,
        bind=(config.bind, config.raft_port + i),
        seeds=[(seed.host, seed.port + i) for seed in config.seeds],
        secret=config.secret,
        replication_factor=config.replication_factor,
        election_timeout=config.election_timeout / 1000,
        heartbeat_interval=config.heartbeat_interval / 1000,
        worker=worker,
    )
