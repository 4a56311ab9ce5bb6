"""What a cluster node needs of ``[cluster]`` (broker.config's ClusterConfig), in the node's
terms: its name and Raft address, the secret, the Raft timings, which of the node's workers it
is (worker ``i`` listens on ``raft_port + i``) and, for worker 0, the gossip membership's
settings (:class:`GossipSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.cluster.gossip.options import SwimConfig
from broker.cluster.nodemeta import NodeMeta
from broker.config import Config
from broker.config.cluster import ClusterConfig


@dataclass(frozen=True, slots=True)
class GossipSettings:
    """The membership (``broker.cluster.membership_service``): where it listens (UDP), the
    seeds to join through (gossip addresses; host names are resolved at join), SWIM's
    timings and what this node announces of itself (its Raft port and worker count; the
    server adds its MQTT and HTTP addresses)."""

    bind: tuple[str, int]
    seeds: list[tuple[str, int]]
    swim: SwimConfig
    meta: NodeMeta
    #: Seconds a dead member stays on the allowlist (``[cluster] replace_after``).
    replace_after: float = 300.0


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """What a node needs of ``[cluster]`` (broker.config's ClusterConfig).

    ``gossip`` set (the broker's way): the members are learned by gossip and ``seeds`` is
    empty. ``gossip`` None (the node's unit tests): ``seeds`` are the other members' Raft
    addresses and the cluster forms through the transport's handshakes alone."""

    name: str
    bind: tuple[str, int]
    seeds: list[tuple[str, int]]
    secret: bytes
    replication_factor: int
    election_timeout: float  # seconds
    heartbeat_interval: float  # seconds
    #: This worker's index and the node's worker count (module docstring).
    worker: tuple[int, int] = (0, 1)
    gossip: GossipSettings | None = field(default=None)


#: A lone suspicion waits this times the minimum (memberlist's 6): with ``suspicion_mult`` 1,
#: 2 s at up to 10 nodes, the time every suspicion took at the former default of 2, so that a
#: confirmation slow to come (members probing slowly under Lifeguard's health score) never
#: makes a death known later than before (docs/gossip.md).
SUSPICION_MAX_MULT = 2


def swim_config(config: ClusterConfig) -> SwimConfig:
    """SWIM's timings from ``[cluster]`` (the others keep memberlist's LAN defaults but the
    longest suspicion, :data:`SUSPICION_MAX_MULT`)."""
    return SwimConfig(
        probe_interval=config.probe_interval,
        probe_timeout=config.probe_timeout,
        suspicion_mult=config.suspicion_mult,
        suspicion_max_mult=SUSPICION_MAX_MULT,
    )


def node_settings(
    config: ClusterConfig, worker: tuple[int, int] = (0, 1), mqtt: str = "", http: str = ""
) -> NodeSettings:
    """What ``[cluster]`` says, in the node's terms, for worker ``worker[0]`` of ``worker[1]``.
    ``seeds`` name gossip addresses: worker 0 gossips and learns each member's Raft port from
    its gossip metadata; worker ``i`` listens on ``raft_port + i`` and dials each member's
    Raft port ``+ i``. ``mqtt`` and ``http``: this node's listeners, announced for status."""
    i = worker[0]
    return NodeSettings(
        name=config.node_id,
        bind=(config.bind, config.raft_port + i),
        seeds=[],
        secret=config.secret,
        replication_factor=config.replication_factor,
        election_timeout=config.election_timeout / 1000,
        heartbeat_interval=config.heartbeat_interval / 1000,
        worker=worker,
        gossip=GossipSettings(
            bind=(config.bind, config.gossip_port),
            seeds=[(seed.host, seed.port) for seed in config.seeds],
            swim=swim_config(config),
            meta=NodeMeta(config.raft_port, worker[1], mqtt, http),
            replace_after=config.replace_after / 1000,
        ),
    )


def advertised(config: Config) -> tuple[str, str]:
    """This node's MQTT and HTTP listeners as ``host:port`` for the other members' status
    (a wildcard host is shown as the cluster address; the HTTP API off: empty)."""

    def at(host: str, port: int) -> str:
        if host in ("", "0.0.0.0", "::") and config.cluster is not None:
            host = config.cluster.bind
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    http = at(config.http.host, config.http.port) if config.http.enabled else ""
    return at(config.server.host, config.server.port), http
