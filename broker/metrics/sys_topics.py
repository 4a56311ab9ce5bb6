"""The usual ``$SYS/broker/...`` topics, published by the broker itself as retained messages.

Every ``[server] sys_interval`` the values below are computed; those that changed since the
last round (and the uptime, always) are published through the router like any message, so
they are in the log (the internal stream ``$sys``), retained, and delivered to subscribers of
``$SYS/#`` (a ``#`` filter does not match them [MQTT-4.7.2-1]). Clients cannot publish to
``$SYS/`` themselves.

===================================  ==============================================
``$SYS/broker/version``              ``mqlog <version>``
``$SYS/broker/uptime``               ``<seconds> seconds``
``$SYS/broker/clients/connected``    clients with an accepted CONNECT
``$SYS/broker/clients/total``        sessions, connected or persistent offline
``$SYS/broker/messages/received``    PUBLISH packets received from clients
``$SYS/broker/messages/sent``        PUBLISH packets sent to clients
``$SYS/broker/messages/dropped``     not stored (ACL) or not delivered (slow, oversize)
``$SYS/broker/bytes/received``       bytes received from clients
``$SYS/broker/bytes/sent``           bytes sent to clients
``$SYS/broker/subscriptions/count``  subscriptions over all sessions
``$SYS/broker/retained messages/count``  retained messages
``$SYS/broker/log/corrupt batches``  damaged batches found (reads, recovery, scrubber)
``$SYS/broker/log/corrupt batches/<stream>/<partition>``  the same, per damaged partition
===================================  ==============================================

With several workers, worker 0 publishes the broker's figures: the sum of every worker's
(version, uptime and the retained count are the same everywhere).

The values are read through :class:`SysSource` and :class:`SysHost`, Protocols naming what
is read (:class:`broker.server.Server` is both): this room never imports the server.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from importlib import metadata
from typing import TYPE_CHECKING, Protocol

import orjson

from broker.commitlog import LogConfig, StreamSpec
from broker.commitlog.integrity import corrupt_counts
from broker.metrics.collector import Metrics, WorkerShare, count_subscriptions

if TYPE_CHECKING:
    from broker.router.router import Router

log = logging.getLogger("broker.sys")

PREFIX = "$SYS/broker/"
#: The internal stream ``$SYS/...`` topics are written to, kept out of the user's streams:
#: small segments, an hour of history, no fsync (the values are recomputed anyway).
SYS_STREAM = "$sys"
SYS_SPEC = StreamSpec(
    SYS_STREAM,
    ("$SYS/#",),
    1,
    LogConfig(segment_bytes=1 << 20, segment_ms=3_600_000, retention_ms=3_600_000, fsync="never"),
)


@functools.cache
def broker_version() -> str:
    """The installed package's version, read once: ``importlib.metadata`` parses the package
    METADATA on every call (~2.5M instructions), and the console's sampler asks every 2 s."""
    try:
        return metadata.version("mqlog")
    except metadata.PackageNotFoundError:
        return "unknown"


class SysSource(Protocol):
    """What this worker's ``$SYS`` values are computed from."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def router(self) -> Router: ...


class SysHost(SysSource, Protocol):
    """What :class:`SysPublisher` runs on: the loop, the router it publishes through, and
    the other workers' values (``runtime`` is None when the worker is the whole broker)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def runtime(self) -> WorkerShare | None: ...


def traffic_values(server: SysSource) -> dict[str, str]:
    """The traffic counters of ``$SYS`` alone: what the console samples every 2 s (the
    rest of :func:`sys_values` walks every session)."""
    m = server.metrics
    return {
        "messages/received": str(sum(m.messages_in)),
        "messages/sent": str(sum(m.messages_out)),
        "bytes/received": str(m.bytes_in),
        "bytes/sent": str(m.bytes_out),
    }


def sys_values(server: SysSource) -> dict[str, str]:
    m = server.metrics
    router = server.router
    return {
        "version": f"mqlog {broker_version()}",
        "uptime": f"{int(time.time() - m.started)} seconds",
        "clients/connected": str(router.connections),
        "clients/total": str(len(router.sessions)),
        **traffic_values(server),
        "messages/dropped": str(router.dropped + router.acl_denied + m.oversize_dropped),
        "subscriptions/count": str(count_subscriptions(router)),
        "retained messages/count": str(len(router.retained)),
        **corrupt_values(),
    }


def corrupt_values() -> dict[str, str]:
    """The ``log/corrupt batches`` values: the total, and one per partition with damage."""
    counts = corrupt_counts()
    values = {"log/corrupt batches": str(sum(counts.values()))}
    for (stream, partition), count in sorted(counts.items()):
        values[f"log/corrupt batches/{stream}/{partition}"] = str(count)
    return values


class SysPublisher:
    """Publishes changed ``$SYS`` values every ``interval`` seconds while started."""

    def __init__(self, server: SysHost, interval: float) -> None:
        self.server = server
        self.interval = interval
        self._last: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = self.server.loop.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def publish_once(self) -> int:
        """Publish what changed; returns how many topics were published."""
        published = 0
        for name, value in (await self._values()).items():
            if self._last.get(name) == value and name != "uptime":
                continue
            self._last[name] = value
            self.server.router.publish_broker(PREFIX + name, value.encode())
            published += 1
        return published

    async def _values(self) -> dict[str, str]:
        runtime = self.server.runtime
        if runtime is None:
            return sys_values(self.server)
        parts = [orjson.loads(part) for part in await runtime.gather("sys")]
        values: dict[str, str] = parts[0]
        for part in parts[1:]:  # a name only some workers have (a damaged partition)
            for name in part:
                values.setdefault(name, "0")
        for name in values:
            if name not in _SAME_EVERYWHERE:
                values[name] = str(sum(int(part.get(name, 0)) for part in parts))
        return values

    async def _run(self) -> None:
        while True:
            try:
                await self.publish_once()
            except Exception:
                log.exception("bug while publishing $SYS topics")
            await asyncio.sleep(self.interval)


#: $SYS values every worker has in full (the others are each worker's share).
_SAME_EVERYWHERE = frozenset({"version", "uptime", "retained messages/count"})
