"""Cluster metrics (``[cluster]``): read at scrape time from the node's status view.

The view is the document ``GET /api/v1/cluster`` serves (``broker.cluster.node``'s
``ClusterNode.status``): this room reads that dictionary through :class:`ClusterSource` and
never imports the cluster. The commit latency histogram is observed by the replicated
partitions, once per committed entry on the leader (propose to commit: the quorum's fsyncs
and one round trip), through :attr:`ClusterMetrics.commit_seconds`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.metrics.xdp import xdp_metrics

#: Commit latency buckets (seconds): a quorum's fsyncs and a round trip, ~1 ms on one host.
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

#: Transport counters exported, with their help text.
TRANSPORT = {
    "frames_sent": "Frames sent to other nodes",
    "frames_received": "Frames received from other nodes",
    "bytes_sent": "Bytes sent to other nodes (frame headers included)",
    "bytes_received": "Bytes received from other nodes (frame headers included)",
    "dropped_full": "Frames dropped because the peer's send buffer was full",
    "dropped_unconnected": "Frames dropped because the peer was not connected",
    "auth_failures": "Node-to-node connections refused (wrong secret, bad handshake)",
    "bad_frames": "Node-to-node connections closed for a malformed frame",
}


#: Gossip counters exported as ``mqlog_gossip_<name>`` (``ClusterNode.status``'s ``gossip``:
#: the SWIM core's and the endpoint's counters, broker.cluster.membership_service).
GOSSIP = {
    "probes": "Direct probes (pings) this node sent",
    "probe_failures": "Probes that got no ack, directly or indirectly, within the period",
    "indirect_probes": "Probes that went on to ping-req through other members",
    "suspect": "Members this node marked suspect (its own probes or others' word)",
    "suspicions_refuted": "Suspected members seen alive again (false suspicions refuted)",
    "refuted": "Suspicions or deaths of this node it refuted (incarnation raised)",
    "probe_hints": "Probes brought forward because a Raft link to the member closed",
    "dead": "Members this node marked dead",
    "left": "Members this node saw leave",
    "gossip_rounds": "Dissemination rounds (pending updates sent to random members)",
    "sent": "Gossip datagrams sent",
    "received": "Gossip datagrams received",
}
#: Reasons a datagram to the gossip port is dropped (the endpoint's ``dropped_<reason>``).
GOSSIP_DROPS = ("bad_magic", "bad_version", "bad_mac", "malformed", "replayed", "stranger")


class ClusterSource(Protocol):
    def cluster_view(self) -> dict[str, Any]: ...


class ClusterMetrics(Collector):
    """Registered on the broker's registry when ``[cluster]`` is configured."""

    def __init__(self, source: ClusterSource, registry: CollectorRegistry) -> None:
        self.source = source
        self.commit_seconds = Histogram(
            "mqlog_cluster_commit_seconds",
            "Propose to commit of each entry this node led (a quorum's fsyncs and a round trip)",
            buckets=COMMIT_BUCKETS,
            registry=registry,
        )
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        view = self.source.cluster_view()
        if view.get("mode") != "cluster":
            return
        nodes = GaugeMetricFamily(
            "mqlog_cluster_nodes", "Cluster members by their state as seen here", labels=["state"]
        )
        states: dict[str, int] = {}
        for n in view["nodes"]:
            states[n["state"]] = states.get(n["state"], 0) + 1
        for state in ("self", "connected", "unreachable"):
            nodes.add_metric([state], states.get(state, 0))
        yield nodes
        labels = ["stream", "partition"]
        term = GaugeMetricFamily("mqlog_cluster_term", "Raft term of each partition", labels=labels)
        leader = GaugeMetricFamily(
            "mqlog_cluster_leader", "1 where this node leads the partition", labels=labels
        )
        commit = GaugeMetricFamily(
            "mqlog_cluster_commit_index", "Commit index (the high-water mark)", labels=labels
        )
        lag = GaugeMetricFamily(
            "mqlog_cluster_follower_lag",
            "Entries a follower lacks, on the leader",
            labels=[*labels, "follower"],
        )
        for p in view["partitions"]:
            if not p.get("replica", True):
                continue  # read remotely: its replicas report it
            key = [p["stream"], str(p["partition"])]
            term.add_metric(key, p["term"])
            leader.add_metric(key, 1 if p["role"] == "leader" else 0)
            commit.add_metric(key, p["commit_index"])
            for f in p["followers"]:
                lag.add_metric([*key, f["node"]], f["lag"])
        yield from (term, leader, commit, lag)
        repaired = CounterMetricFamily(
            "mqlog_repaired_batches",
            "Corrupt record batches rewritten from another replica's copy",
            labels=labels,
        )
        for r in view.get("repaired", ()):
            repaired.add_metric([r["stream"], str(r["partition"])], r["batches"])
        yield repaired
        raft = view["raft"]
        yield _counter(
            "mqlog_cluster_leader_changes",
            "Leader changes seen here, over all partitions",
            raft["leader_changes"],
        )
        yield _counter(
            "mqlog_cluster_elections_won", "Leaderships this node took", raft["elections_won"]
        )
        for name, help_ in TRANSPORT.items():
            yield _counter(f"mqlog_cluster_{name}", help_, view["transport"][name])
        yield from _gossip(view)
        yield GaugeMetricFamily(
            "mqlog_cluster_forwards_waiting",
            "Publishes forwarded to a leader and not answered yet",
            value=view.get("forwards_waiting", 0),
        )
        yield from xdp_metrics(view.get("xdp"))
        remote = view.get("remote_reads", {})
        for name, help_ in REMOTE_READS.items():
            yield _counter(f"mqlog_cluster_{name}", help_, remote.get(name, 0))


#: Counters of the remote reads (broker.workers.remote_fetches), by their status name.
REMOTE_READS = {
    "fetches_served": "Fetches of nodes outside a partition's group answered here",
    "fetches_refused": "Malformed or oversized fetch requests refused",
    "fetch_answers_dropped": "Fetch answers that failed verification (CRC, bounds), dropped",
    "fetches_relayed": "Fetches sent on for another worker of this node (several workers)",
}


def _gossip(view: dict[str, Any]) -> Iterator[Metric]:
    """``mqlog_gossip_*``: the members by state as gossip has them here, the protocol's
    counters, and the datagrams dropped by reason."""
    members = view.get("members") or []
    if not members:
        return
    by_state = GaugeMetricFamily(
        "mqlog_gossip_members", "Members by gossip state as seen here", labels=["state"]
    )
    for state in ("alive", "suspect", "dead", "left"):
        by_state.add_metric([state], sum(1 for m in members if m["state"] == state))
    yield by_state
    stats = view.get("gossip", {})
    for name, help_ in GOSSIP.items():
        yield _counter(f"mqlog_gossip_{name}", help_, stats.get(name, 0))
    dropped = CounterMetricFamily(
        "mqlog_gossip_dropped_datagrams",
        "Datagrams to the gossip port dropped, by reason (a stranger: authenticated, from a "
        "host not in the allowlist)",
        labels=["reason"],
    )
    for reason in GOSSIP_DROPS:
        dropped.add_metric([reason], stats.get(f"dropped_{reason}", 0))
    yield dropped
    yield GaugeMetricFamily(
        "mqlog_gossip_health_score",
        "Lifeguard's local health score (0 healthy; timeouts scale by score + 1)",
        value=stats.get("health", 0),
    )


def _counter(name: str, help_: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_, value=value)
