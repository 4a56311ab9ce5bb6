"""Broker metrics: plain integer counters on the hot path, Prometheus text at scrape time.

The per-message cost is one attribute increment (``metrics.messages_in[qos] += 1``): no
locks, no label lookups. :class:`BrokerCollector` reads these counters, the router's and the
auth service's, and the logs' offsets only when ``GET /metrics`` is scraped. The fsync
latency histogram is a real prometheus Histogram: it is observed per fsync (at most a few
per second per partition with ``fsync = "interval"``, per batch with ``"always"``).

Everything here is touched only from the broker's event loop thread.

The collector reads the broker through :class:`Scraped`, a Protocol naming exactly what it
reads (:class:`broker.server.Server` is one): this room never imports the server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from broker.commitlog.integrity import corrupt_counts

if TYPE_CHECKING:
    from broker.auth import AuthService
    from broker.router.router import Router

#: fsync latency buckets (seconds): a page-cache-only device is ~50 us, a disk ~10 ms.
FSYNC_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class Metrics:
    """Counters the transport bumps per connection, packet and write."""

    __slots__ = (
        "bytes_in",
        "bytes_out",
        "connections_closed",
        "connections_opened",
        "fsync_seconds",
        "messages_in",
        "messages_out",
        "oversize_dropped",
        "registry",
        "started",
    )

    def __init__(self) -> None:
        self.started = time.time()
        self.connections_opened = 0
        self.connections_closed = 0
        self.messages_in = [0, 0, 0]  # client PUBLISHes received, per QoS
        self.messages_out = [0, 0, 0]  # PUBLISHes sent to clients, per QoS
        self.bytes_in = 0
        self.bytes_out = 0
        self.oversize_dropped = 0  # deliveries over a client's maximum packet size
        self.registry = CollectorRegistry(auto_describe=False)
        self.fsync_seconds = Histogram(
            "mqlog_fsync_seconds",
            "Latency of log fsyncs (interval flushes and fsync=always "
            "appends, which include the write)",
            buckets=FSYNC_BUCKETS,
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


class SessionHandovers(Protocol):
    """Sessions this worker handed to another (a ``broker.workers`` session directory)."""

    @property
    def takeovers(self) -> int: ...


class PartitionShare(Protocol):
    """This worker's share of the partitions (a ``broker.workers`` partition service)."""

    @property
    def forwarded(self) -> int: ...

    def owns(self, key: tuple[str, int]) -> bool: ...


class WorkerShare(Protocol):
    """One worker of several, as the metrics, ``$SYS`` and the HTTP API read it
    (``broker.workers.runtime.WorkerRuntime`` is one)."""

    @property
    def sessions(self) -> SessionHandovers: ...

    @property
    def partitions(self) -> PartitionShare: ...

    @property
    def handed_off(self) -> int:
        """Connections handed to the worker owning their partition (broker.workers.handoff)."""
        ...

    async def gather(self, name: str) -> list[bytes]:
        """View ``name`` of every worker, this one first."""
        ...


class Scraped(Protocol):
    """What :class:`BrokerCollector` reads at scrape time; ``runtime`` is None when the
    worker is the whole broker."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def router(self) -> Router: ...

    @property
    def auth(self) -> AuthService: ...

    @property
    def links(self) -> Sized: ...

    @property
    def parking(self) -> Sized: ...

    @property
    def runtime(self) -> WorkerShare | None: ...

    @property
    def handoff_rejected(self) -> int:
        """Messages on the hand-off channel from anyone but a sibling worker, dropped."""
        ...


class BrokerCollector(Collector):
    """Reads the broker's state at scrape time."""

    def __init__(self, server: Scraped) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        server = self.server
        m = server.metrics
        router = server.router
        auth = server.auth

        yield _gauge(
            "mqlog_uptime_seconds", "Seconds since the broker started", time.time() - m.started
        )
        yield _gauge(
            "mqlog_connections", "Open network connections (any listener)", len(server.links)
        )
        yield _gauge(
            "mqlog_connections_parked",
            "Idle connections parked off the event loop (broker.net.parking)",
            len(server.parking),
        )
        yield _gauge(
            "mqlog_clients_connected", "Clients with an accepted CONNECT", router.connections
        )
        yield _counter("mqlog_connections_opened", "Connections accepted", m.connections_opened)
        yield _gauge(
            "mqlog_sessions", "Sessions (connected and persistent offline)", len(router.sessions)
        )
        yield _gauge(
            "mqlog_subscriptions", "Subscriptions over all sessions", count_subscriptions(router)
        )
        for name, help_, values in (
            ("mqlog_messages_received", "PUBLISH packets received from clients", m.messages_in),
            ("mqlog_messages_sent", "PUBLISH packets sent to clients", m.messages_out),
        ):
            fam = CounterMetricFamily(name, help_, labels=["qos"])
            for qos, value in enumerate(values):
                fam.add_metric([str(qos)], value)
            yield fam
        yield _counter("mqlog_bytes_received", "Bytes received from clients", m.bytes_in)
        yield _counter("mqlog_bytes_sent", "Bytes sent to clients", m.bytes_out)
        yield _counter(
            "mqlog_log_appends", "Record batches appended to partition logs", router.log_appends
        )
        yield _counter(
            "mqlog_log_records_appended",
            "Records appended to partition logs",
            router.records_appended,
        )
        dropped = CounterMetricFamily(
            "mqlog_messages_dropped", "Messages not stored or not delivered", labels=["reason"]
        )
        dropped.add_metric(["slow_qos0"], router.dropped)
        dropped.add_metric(["oversize"], m.oversize_dropped)
        dropped.add_metric(["not_authorized"], router.acl_denied)
        yield dropped
        if server.runtime is not None:
            yield _counter(
                "mqlog_session_handovers",
                "Sessions handed from one worker to "
                "another (their client reconnected to another worker)",
                server.runtime.sessions.takeovers,
            )
            yield _counter(
                "mqlog_connections_handed_off",
                "Device connections handed to the worker owning the partition they publish to",
                server.runtime.handed_off,
            )
            yield _counter(
                "mqlog_handoff_rejected",
                "Messages on a worker's hand-off channel from anyone but a sibling worker, dropped",
                server.handoff_rejected,
            )
            yield _counter(
                "mqlog_records_forwarded",
                "Records sent to the worker owning their partition",
                server.runtime.partitions.forwarded,
            )
        yield _counter("mqlog_auth_failures", "Refused logins", auth.failures)
        yield _counter(
            "mqlog_auth_lockouts", "Addresses locked out after failed logins", auth.lockouts
        )

        hwm = GaugeMetricFamily(
            "mqlog_partition_high_water_mark",
            "Next offset to be written (all below are committed)",
            labels=["stream", "partition"],
        )
        start = GaugeMetricFamily(
            "mqlog_partition_log_start_offset",
            "Earliest offset still retained",
            labels=["stream", "partition"],
        )
        runtime = server.runtime
        for (stream, p), part in sorted(router.partitions.items()):
            if runtime is not None and not runtime.partitions.owns((stream, p)):
                continue  # its owner reports it (the figures of all workers are added up)
            hwm.add_metric([stream, str(p)], part.end_offset)
            start.add_metric([stream, str(p)], part.log.log_start_offset)
        yield hwm
        yield start
        yield corrupt_batches()

        lag = GaugeMetricFamily(
            "mqlog_consumer_lag_records",
            "Records a persistent session or shared group has not read "
            "yet, summed over its partitions",
            labels=["client_id"],
        )
        for client_id, session in sorted(router.sessions.items()):
            if session.persistent:
                total = 0
                for consumer in session.consumers.values():
                    for key, offset in consumer.cursors.items():
                        total += max(0, router.partition(key).end_offset - offset)
                lag.add_metric([client_id], total)
        for name, group in sorted(router.groups.items()):
            total = sum(
                max(0, router.partition(k).end_offset - off)
                for k, off in group.consumer.cursors.items()
            )
            lag.add_metric([name], total)
        yield lag


def corrupt_batches() -> CounterMetricFamily:
    """``mqlog_corrupt_batches_total{stream,partition}``: damaged ranges this worker's reads,
    recovery and scrubber found (:mod:`broker.commitlog.integrity`; each reported once per
    worker, so with several workers a range read by two counts twice)."""
    fam = CounterMetricFamily(
        "mqlog_corrupt_batches",
        "Damaged record batches (CRC or structure) found in partition logs",
        labels=["stream", "partition"],
    )
    for (stream, partition), count in sorted(corrupt_counts().items()):
        fam.add_metric([stream, partition], count)
    return fam


def count_subscriptions(router: Router) -> int:
    """Subscriptions over all of ``router``'s sessions (shared ones included): kept as
    they change (``RouterState.count``), not counted session by session at each scrape."""
    return router.subscriptions


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_, value=value)


def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_, value=value)


#: Figures that are the same for every worker, not a share of the whole: merged by maximum.
_NOT_ADDED = frozenset({"mqlog_uptime_seconds", "mqlog_cluster_nodes"})


def merge_expositions(parts: list[bytes]) -> bytes:
    """One exposition from several workers' (worker 0's first): each sample the sum of the
    workers' samples with the same name and labels (the maximum for :data:`_NOT_ADDED`).
    Consumer lag is reported by the worker holding the session, a partition's offsets by
    the worker owning it, so the sums count each once."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for part in parts:
        for family in text_string_to_metric_families(part.decode()):
            families.setdefault(family.name, family)
            merged = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key in merged and (
                    family.name in _NOT_ADDED or sample.name.endswith("_created")
                ):
                    merged[key] = max(merged[key], sample.value)
                else:
                    merged[key] = merged.get(key, 0.0) + sample.value
    out = []
    for name, family in families.items():
        kind = family.type
        out.append(f"# HELP {name} {_escape(family.documentation)}")
        out.append(f"# TYPE {name} {kind}")
        for (sample_name, labels), value in values[name].items():
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels)
            out.append(
                f"{sample_name}{{{text}}} {_number(value)}"
                if text
                else f"{sample_name} {_number(value)}"
            )
    return ("\n".join(out) + "\n").encode()


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label(value: str) -> str:
    return _escape(value).replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if value != int(value) or abs(value) >= 1e16 else f"{value:.1f}"
