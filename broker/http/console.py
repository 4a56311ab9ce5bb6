"""The live console: a read-only page at ``GET /`` and the JSON it polls.

Routes (added to the admin HTTP app by :class:`broker.http.api.HttpApi`):

- ``GET /``: the page (``static/console.html``), its script and its stylesheet under
  ``/console/``. Every asset is served by the broker itself, nothing is fetched from
  elsewhere (the page's Content-Security-Policy says so to the browser);
- ``GET /api/v1/console``: one JSON document with everything the page shows, for all
  workers: the broker's counters (the ``/metrics`` exposition, merged over the workers),
  throughput over the last :data:`HISTORY_SAMPLES` samples, every stream's partitions
  (earliest offset, high-water mark, records/s, bytes on disk), the persistent sessions
  and shared groups (``/api/v1/sessions``; the :data:`MAX_LISTED` furthest behind), the
  log's disk use and the cluster.

Rates come from :class:`Sampler`, a task on the HTTP API's loop that every
:data:`SAMPLE_SECONDS` reads the workers' ``$SYS`` counters (a few integers each) and every
partition's high-water mark (announced to every worker, so read here without asking the
owner). It runs while the HTTP API is up, so a console opened now shows the minutes before.

The broker is not clustered yet: the document's ``cluster`` member says so (``mode``
``"single node"``, no nodes, no partition leaders), in the shape the page already renders
for a cluster: nodes, and per partition its leader, replicas and each follower's lag.

The routes are added to the HTTP API's own application, so whatever guards the API guards
the console too (its middlewares run for every route of the app): the console asks for the
same credentials as the rest of the API, and a browser prompts for them.

Everything here runs on the loop that owns the router (worker 0's with several workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol

import orjson
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from broker.commitlog import SegmentedLog, Streams
from broker.commitlog.reader import LogReader
from broker.commitlog.segment import LOG_SUFFIX
from broker.metrics.collector import Metrics, WorkerShare, merge_expositions
from broker.metrics.sys_topics import SysSource, traffic_values

log = logging.getLogger("broker.http.console")

#: Seconds between two samples of the counters (the page polls at the same pace).
SAMPLE_SECONDS = 2.0
#: Samples kept for the throughput chart: ten minutes.
HISTORY_SAMPLES = 300
#: Samples a partition's records/s is averaged over (the last ten seconds).
RATE_SAMPLES = 5
#: The ``$SYS`` counters the chart follows, by the name the page knows them by.
COUNTERS = {
    "received": "messages/received",
    "sent": "messages/sent",
    "bytes_received": "bytes/received",
    "bytes_sent": "bytes/sent",
}

#: Sessions and shared groups listed, each: those furthest behind first (the counts say how
#: many there are; ``/api/v1/sessions`` lists them all).
MAX_LISTED = 100

#: The page and its assets: file name -> content type. Nothing else is served.
ASSETS = {
    "console.html": "text/html",
    "console.js": "text/javascript",
    "console.css": "text/css",
}
#: The browser may load nothing from anywhere but this broker.
SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:"
)

SessionsView = Callable[[Any], dict[str, Any]]


class ConsoleSource(SysSource, Protocol):
    """What the console reads (:class:`broker.server.Server` is one); ``runtime`` is None
    when the worker is the whole broker."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def runtime(self) -> WorkerShare | None: ...

    @property
    def streams(self) -> Streams: ...

    async def cluster_status(self) -> dict[str, Any]: ...

    def partition_log(self, key: tuple[str, int]) -> SegmentedLog | LogReader: ...

    def describe(self) -> dict[str, Any]:
        """``ready`` and the counts /healthz shows (with several workers: ``workers`` and
        ``peers_up``)."""
        ...


@dataclass(frozen=True, slots=True)
class Sample:
    """The broker's counters at one instant (``time.monotonic()`` seconds): the ``$SYS``
    totals of :data:`COUNTERS` and every partition's high-water mark."""

    at: float
    counters: dict[str, int]
    marks: dict[tuple[str, int], int]


def _rate(new: int, old: int, seconds: float) -> float:
    """Per second between two readings of a counter; a counter that went back (a worker
    restarted and counts from zero again) counts as no traffic, not as negative."""
    return max(0, new - old) / seconds if seconds > 0 else 0.0


class Sampler:
    """The counters every :data:`SAMPLE_SECONDS`, the last :data:`HISTORY_SAMPLES` kept."""

    def __init__(self, server: ConsoleSource) -> None:
        self.server = server
        self.samples: deque[Sample] = deque(maxlen=HISTORY_SAMPLES + 1)
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> Sample:
        """Read the counters now and keep the reading."""
        server = self.server
        runtime = server.runtime
        if runtime is None:
            parts = [traffic_values(server)]
        else:
            parts = [orjson.loads(part) for part in await runtime.gather("traffic")]
        counters = {
            name: sum(int(part.get(key, 0)) for part in parts) for name, key in COUNTERS.items()
        }
        marks = {
            (spec.name, p): server.partition_log((spec.name, p)).end_offset
            for spec in server.streams.specs.values()
            for p in range(spec.partitions)
        }
        sample = Sample(time.monotonic(), counters, marks)
        self.samples.append(sample)
        return sample

    def history(self) -> dict[str, Any]:
        """Per interval between two samples: its end (seconds before now, negative) and the
        rates of :data:`COUNTERS` and of records stored in the user's streams."""
        now = time.monotonic()
        out: dict[str, list[float]] = {"t": [], "stored": [], **{n: [] for n in COUNTERS}}
        for old, new in pairwise(self.samples):
            seconds = new.at - old.at
            out["t"].append(round(new.at - now, 1))
            for name in COUNTERS:
                out[name].append(_rate(new.counters[name], old.counters[name], seconds))
            stored = sum(
                max(0, mark - old.marks.get(key, mark))
                for key, mark in new.marks.items()
                if not key[0].startswith("$")
            )
            out["stored"].append(stored / seconds if seconds > 0 else 0.0)
        return {"interval": SAMPLE_SECONDS, **out}

    def partition_rate(self, key: tuple[str, int]) -> float:
        """Records/s appended to partition ``key`` over the last :data:`RATE_SAMPLES`."""
        if len(self.samples) < 2:
            return 0.0
        new = self.samples[-1]
        old = self.samples[max(0, len(self.samples) - 1 - RATE_SAMPLES)]
        mark = new.marks.get(key, 0)
        return _rate(mark, old.marks.get(key, mark), new.at - old.at)

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception:
                log.exception("bug while sampling the console's counters")
            await asyncio.sleep(SAMPLE_SECONDS)

    async def start(self, app: web.Application) -> None:
        """aiohttp ``on_startup``: sample from now on."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, app: web.Application) -> None:
        """aiohttp ``on_cleanup``."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class Console:
    """The console's routes on the admin HTTP app.

    ``sessions_view`` makes this worker's part of ``/api/v1/sessions`` (passed in: this
    module is imported by the one that defines it).
    """

    def __init__(self, server: ConsoleSource, sessions_view: SessionsView) -> None:
        self.server = server
        self.sessions_view = sessions_view
        self.sampler = Sampler(server)
        static = resources.files("broker.http") / "static"
        self.assets = {name: (static / name).read_bytes() for name in ASSETS}

    def install(self, app: web.Application) -> None:
        """Add the routes to ``app`` and run the sampler while it runs."""
        app.add_routes(
            [
                web.get("/", self.page),
                web.get("/console/{name}", self.asset),
                web.get("/api/v1/console", self.document),
            ]
        )
        app.on_startup.append(self.sampler.start)
        app.on_cleanup.append(self.sampler.stop)

    # ---------------------------------------------------------------- handlers

    async def page(self, request: web.Request) -> web.Response:
        return self._asset("console.html")

    async def asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in ASSETS:
            return web.Response(
                body=orjson.dumps({"error": f"no console asset named {name!r}"}),
                status=404,
                content_type="application/json",
            )
        return self._asset(name)

    def _asset(self, name: str) -> web.Response:
        return web.Response(
            body=self.assets[name],
            content_type=ASSETS[name],
            charset="utf-8",
            headers={"Cache-Control": "no-cache", "Content-Security-Policy": SECURITY_POLICY},
        )

    async def document(self, request: web.Request) -> web.Response:
        return web.Response(
            body=orjson.dumps(await self.snapshot()),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    # ---------------------------------------------------------------- the document

    async def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, for all workers (see the module docstring)."""
        server = self.server
        runtime = server.runtime
        if runtime is None:
            exposition = server.metrics.exposition()
            sessions = self.sessions_view(server)
        else:
            exposition = merge_expositions(await runtime.gather("metrics"))
            sessions = _merge_sessions([orjson.loads(p) for p in await runtime.gather("sessions")])
        if not self.sampler.samples:
            await self.sampler.sample()
        info = server.describe()
        history = self.sampler.history()
        streams = self._streams()
        data_dir = server.streams.data_dir
        return {
            "time": time.time(),
            "workers": info.get("workers", 1),
            "workers_up": 1 + len(info.get("peers_up", ())),
            "broker": _figures(exposition),
            "throughput": {
                name: values[-1] if values else 0.0
                for name, values in history.items()
                if isinstance(values, list) and name != "t"
            },
            "history": history,
            "streams": streams,
            "disk": {
                "data_dir": str(data_dir),
                "log_bytes": sum(s["disk_bytes"] for s in streams),
                "free_bytes": _free_bytes(data_dir),
            },
            **_most_behind(sessions),
            "cluster": await self.server.cluster_status(),
        }

    def _streams(self) -> list[dict[str, Any]]:
        server = self.server
        out = []
        for spec in server.streams.specs.values():
            partitions = []
            for p in range(spec.partitions):
                plog = server.partition_log((spec.name, p))
                size, segments = _disk_use(server.streams.partition_dir(spec.name, p))
                partitions.append(
                    {
                        "partition": p,
                        "earliest_offset": plog.log_start_offset,
                        "high_water_mark": plog.end_offset,
                        "records_per_s": self.sampler.partition_rate((spec.name, p)),
                        "disk_bytes": size,
                        "segments": segments,
                    }
                )
            out.append(
                {
                    "name": spec.name,
                    "internal": spec.name.startswith("$"),
                    "topic_filters": list(spec.topic_filters),
                    "partitions": partitions,
                    "disk_bytes": sum(p["disk_bytes"] for p in partitions),
                }
            )
        return out


#: The figures the page shows, by the sample name in the ``/metrics`` exposition.
FIGURES = {
    "uptime_seconds": "mqlog_uptime_seconds",
    "connections": "mqlog_connections",
    "clients_connected": "mqlog_clients_connected",
    "connections_opened": "mqlog_connections_opened_total",
    "sessions": "mqlog_sessions",
    "subscriptions": "mqlog_subscriptions",
    "messages_received": "mqlog_messages_received_total",
    "messages_sent": "mqlog_messages_sent_total",
    "bytes_received": "mqlog_bytes_received_total",
    "bytes_sent": "mqlog_bytes_sent_total",
    "records_appended": "mqlog_log_records_appended_total",
    "auth_failures": "mqlog_auth_failures_total",
    "fsyncs": "mqlog_fsync_seconds_count",
    "fsync_seconds": "mqlog_fsync_seconds_sum",
}


def _figures(exposition: bytes) -> dict[str, Any]:
    """:data:`FIGURES` from a ``/metrics`` exposition (a labelled figure summed over its
    labels), and the dropped messages by reason."""
    totals: dict[str, float] = {}
    dropped: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition.decode()):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            if sample.name == "mqlog_messages_dropped_total":
                dropped[sample.labels["reason"]] = sample.value
    out: dict[str, Any] = {name: totals.get(metric, 0.0) for name, metric in FIGURES.items()}
    out["dropped"] = dropped
    return out


def _merge_sessions(views: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' parts of ``/api/v1/sessions`` as one, sorted as that route sorts them."""
    return {
        key: sorted(
            (item for view in views for item in view[key]),
            key=lambda item: item.get("client_id") or item["subscription"],
        )
        for key in ("sessions", "shared_groups")
    }


def _most_behind(view: dict[str, Any]) -> dict[str, Any]:
    """``view``'s sessions and groups, at most :data:`MAX_LISTED` of each, those with the
    most records unread first, then by name; with their counts."""
    out: dict[str, Any] = {}
    for key in ("sessions", "shared_groups"):
        items = view[key]
        items.sort(key=lambda item: -sum(p["lag"] for p in item["positions"]))  # stable
        out[key] = items[:MAX_LISTED]
        out[f"{key}_total"] = len(items)
    return out


def _disk_use(directory: Path) -> tuple[int, int]:
    """Bytes in the files of a partition's directory and its number of segments (0, 0 for
    a partition never written)."""
    size = segments = 0
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0, 0
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):  # retention may delete it meanwhile
            if entry.is_file(follow_symlinks=False):
                size += entry.stat(follow_symlinks=False).st_size
                segments += entry.name.endswith(LOG_SUFFIX)
    return size, segments


def _free_bytes(directory: Path) -> int | None:
    """Bytes free on the file system holding ``directory`` (None if it cannot be read)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None
