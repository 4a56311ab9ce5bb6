"""The broker's HTTP admin API (aiohttp), served on the broker's own event loop.

Routes (JSON bodies, encoded with orjson):

- ``GET /healthz``: ``{"status": "ok", ...}`` while the broker serves;
- ``GET /api/v1/streams``: every stream with its partition count and log configuration;
- ``GET /api/v1/streams/<stream>/partitions``: per partition, the earliest retained offset
  (``log_start_offset``) and the high-water mark (``end_offset``: every offset below it is
  committed);
- ``GET /api/v1/streams/<stream>/partitions/<p>/records`` and ``.../offset``: the fetch API
  (records as Arrow or JSON, offset by timestamp), see :mod:`broker.http.fetch_api`;
- ``GET /api/v1/sessions``: each persistent session (client id, connected or not, its
  subscriptions, per consumer and partition its position and lag behind the high-water mark,
  in-flight deliveries), and each shared-subscription group with its positions and members;
- ``GET /`` and ``GET /api/v1/console``: the live console, see :mod:`broker.http.console`.

With ``allow_anonymous = false`` every route but ``/healthz`` needs HTTP Basic credentials
from the password file (:mod:`broker.http.access`, a middleware: a route added to
:attr:`HttpApi.app` is covered too), and the fetch API returns only the records the user's
ACL lets it read.

The handlers only read router and log state; they run on the loop that owns the router, so no
locking is needed, and none of them blocks (a log's offsets are in memory). A stream's logs are
opened on first use, exactly as a subscriber would open them.

The broker is read through :class:`AdminSource` and :class:`SessionsSource`, Protocols naming
what is read (:class:`broker.server.Server` is both): this room never imports the server.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from broker.auth import AuthService
from broker.commitlog import SegmentedLog, StreamSpec
from broker.commitlog.reader import LogReader
from broker.http.access import HttpAccess
from broker.http.console import Console
from broker.http.fetch_api import FetchApi, PartitionSource
from broker.metrics.collector import Metrics, WorkerShare, merge_expositions
from broker.router.session import MAIN, Consumer, Session, SharedGroup

if TYPE_CHECKING:
    from broker.config import HttpConfig
    from broker.router.router import Router

log = logging.getLogger("broker.http")

API = "/api/v1"


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


class SessionsSource(Protocol):
    """What the sessions view reads: the router's sessions and groups, and the partitions'
    high-water marks."""

    @property
    def router(self) -> Router: ...

    def partition_log(self, key: tuple[str, int]) -> SegmentedLog | LogReader: ...


class AdminSource(PartitionSource, SessionsSource, Protocol):
    """Everything the admin API reads; ``runtime`` is None when the worker is the whole
    broker."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def auth(self) -> AuthService:
        """The [auth] decisions: who may use the HTTP API, and what records it may read."""
        ...

    @property
    def runtime(self) -> WorkerShare | None: ...

    def describe(self) -> dict[str, Any]:
        """``ready`` and the counts /healthz shows."""
        ...

    async def cluster_status(self) -> dict[str, Any]:
        """``GET /api/v1/cluster``: nodes and, per partition, leader, replicas, follower
        lag, commit index and term (``"mode": "single node"`` without ``[cluster]``); with
        several workers, every worker's part."""
        ...

    async def transfer_leader(self, key: tuple[str, int], node: str) -> str:
        """Start moving ``key``'s leadership to ``node``; what was done, in a sentence.
        Raises ValueError (a single node, an unknown partition or node)."""
        ...

    async def set_replication(self, stream: str, factor: int) -> dict[str, Any]:
        """Commit ``stream``'s new replication factor cluster-wide; its committed definition.
        Raises ValueError (a single node, an unknown stream, no majority)."""
        ...

    async def leave(self, timeout: float) -> dict[str, Any]:
        """Drain this node (waiting up to ``timeout`` s for its replicas to move) and stop it
        (``mqlog cluster leave``); what was handed over. Raises ValueError where it cannot."""
        ...


class HttpApi:
    """The admin HTTP listener of one broker. Started and stopped by the server."""

    def __init__(self, server: AdminSource, config: HttpConfig) -> None:
        self.server = server
        self.config = config
        #: Every route but /healthz is authenticated here (broker.http.access).
        self.access = HttpAccess(server.auth)
        self.app = web.Application(middlewares=[self.access.middleware])
        self.app.add_routes(
            [
                web.get("/healthz", self.healthz),
                web.get("/metrics", self.metrics),
                web.get(f"{API}/streams", self.streams),
                web.get(f"{API}/streams/{{stream}}/partitions", self.partitions),
                web.get(f"{API}/sessions", self.sessions),
                web.get(f"{API}/cluster", self.cluster),
                web.post(
                    f"{API}/cluster/partitions/{{stream}}/{{partition}}/leader",
                    self.transfer_leader,
                ),
                web.post(f"{API}/cluster/leave", self.leave),
                web.post(f"{API}/cluster/streams/{{stream}}/replication", self.set_replication),
                *FetchApi(server).routes(),
            ]
        )
        Console(server, sessions_view).install(self.app)  # GET /, /api/v1/console
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Bind the listener; logs and returns ``http://host:port`` (the bound port)."""
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        await site.start()
        host, port = self.config.host, self.config.port
        if self._runner.addresses:  # the bound address (port 0 picks a free one)
            host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        log.info("listening on %s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---------------------------------------------------------------- handlers

    async def cluster(self, request: web.Request) -> web.Response:
        return _json(await self.server.cluster_status())

    async def transfer_leader(self, request: web.Request) -> web.Response:
        """``POST .../cluster/partitions/<stream>/<p>/leader`` ``{"node": "<node_id>"}``:
        start moving the partition's leadership to that node (answered at once; the move
        shows in ``GET /api/v1/cluster``)."""
        try:
            body = await request.json()
            node = body["node"]
            key = (request.match_info["stream"], int(request.match_info["partition"]))
        except (ValueError, KeyError, TypeError):
            return _error(
                400, 'expected a JSON body {"node": "<node_id>"} and an integer partition'
            )
        try:
            message = await self.server.transfer_leader(key, str(node))
        except ValueError as e:
            return _error(409, str(e))
        return _json({"message": message})

    async def set_replication(self, request: web.Request) -> web.Response:
        """``POST .../cluster/streams/<stream>/replication`` ``{"replication_factor": N}``:
        commit the stream's new replication factor (answered once committed, with the
        definition); the replicas move after (``GET /api/v1/cluster`` shows them)."""
        try:
            body = await request.json()
            factor = body["replication_factor"]
            if not isinstance(factor, int) or isinstance(factor, bool):
                raise TypeError(factor)
        except (ValueError, KeyError, TypeError):
            return _error(400, 'expected a JSON body {"replication_factor": <integer>}')
        try:
            definition = await self.server.set_replication(request.match_info["stream"], factor)
        except ValueError as e:
            return _error(409, str(e))
        return _json({"definition": definition})

    async def leave(self, request: web.Request) -> web.Response:
        """``POST /api/v1/cluster/leave``: hand this node's leaderships over, tell its clients
        to use another server, say goodbye to the members, then stop (answered before it
        stops): ``{"node", "moved": {partition: node}, "still_leading": [...],
        "replicas_kept": [...] (placement keeps them here: too few other members),
        "replicas_unmoved": [...] (not moved in time)}``; the body may give
        ``{"timeout": seconds}`` to wait for the replicas to move (60)."""
        try:
            body = await request.json() if request.can_read_body else {}
            timeout = float(body.get("timeout", 60.0)) if isinstance(body, dict) else 60.0
            return _json(await self.server.leave(timeout))
        except ValueError as e:
            return _error(409, str(e))

    async def healthz(self, request: web.Request) -> web.Response:
        """200 ``{"status": "ok", "ready": true, "connections", "sessions"}`` while every
        listener serves (the counts are every worker's, added up); 503 while starting or
        shutting down (a load balancer stops sending clients)."""
        info = self.server.describe()
        if not info["ready"]:
            return _json({"status": "unavailable", **info}, 503)
        runtime = self.server.runtime
        if runtime is not None:  # the broker's figures: every worker's added up
            parts = [orjson.loads(part) for part in await runtime.gather("health")]
            for name in ("connections", "sessions"):
                info[name] = sum(part.get(name, 0) for part in parts)
            info["workers_reporting"] = len(parts)
        return _json({"status": "ok", **info})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text exposition (see broker/metrics/collector.py); with several workers, their
        figures added up."""
        runtime = self.server.runtime
        body = (
            self.server.metrics.exposition()
            if runtime is None
            else merge_expositions(await runtime.gather("metrics"))
        )
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def streams(self, request: web.Request) -> web.Response:
        specs = self.server.streams.specs
        return _json({"streams": [_stream_info(spec) for spec in specs.values()]})

    async def partitions(self, request: web.Request) -> web.Response:
        name = request.match_info["stream"]
        spec = self.server.streams.specs.get(name)
        if spec is None:
            return _error(404, f"no stream named {name!r}")
        parts = []
        for p in range(spec.partitions):
            plog = self.server.partition_log((name, p))
            parts.append({"partition": p, **_offsets(plog)})
        return _json({"stream": name, "partitions": parts})

    async def sessions(self, request: web.Request) -> web.Response:
        runtime = self.server.runtime
        if runtime is None:
            return _json(sessions_view(self.server))
        views = [orjson.loads(part) for part in await runtime.gather("sessions")]
        return _json(
            {
                key: sorted(
                    (item for view in views for item in view[key]),
                    key=lambda item: item.get("client_id") or item["subscription"],
                )
                for key in ("sessions", "shared_groups")
            }
        )


def sessions_view(server: SessionsSource) -> dict[str, Any]:
    """This worker's persistent sessions and shared groups, as /api/v1/sessions shows them."""
    view = _Views(server)
    router = server.router
    return {
        "sessions": [
            view.session_info(s)
            for s in sorted(router.sessions.values(), key=lambda s: s.client_id)
            if s.persistent
        ],
        "shared_groups": [view.group_info(key, g) for key, g in sorted(router.groups.items())],
    }


class _Views:
    """JSON views of router state."""

    def __init__(self, server: SessionsSource) -> None:
        self.server = server

    def _positions(self, consumer: Consumer) -> list[dict[str, Any]]:
        """Per partition: the consumer's next offset, the high-water mark and the lag."""
        out = []
        for (stream, p), offset in sorted(consumer.cursors.items()):
            hwm = self.server.partition_log((stream, p)).end_offset
            out.append(
                {
                    "stream": stream,
                    "partition": p,
                    "offset": offset,
                    "high_water_mark": hwm,
                    "lag": max(0, hwm - offset),
                }
            )
        return out

    def session_info(self, session: Session) -> dict[str, Any]:
        subscriptions: list[dict[str, Any]] = []
        positions: list[dict[str, Any]] = []
        for name, consumer in sorted(session.consumers.items()):
            for sub in consumer.subscriptions.values():
                # Replay consumers are named by the full $replay/... filter they came from.
                subscriptions.append(
                    {"filter": name if name != MAIN else sub.topic_filter, "qos": sub.qos}
                )
            for pos in self._positions(consumer):
                positions.append({"consumer": name or "main", **pos})
        for full, sub in sorted(session.shared.items()):
            subscriptions.append({"filter": full, "qos": sub.qos})
        return {
            "client_id": session.client_id,
            "connected": session.link is not None,
            "protocol_version": session.version,
            "expiry_interval": session.expiry_interval,
            "subscriptions": subscriptions,
            "positions": positions,
            "inflight": len(session.inflight),
        }

    def group_info(self, key: str, group: SharedGroup) -> dict[str, Any]:
        return {
            "group": group.name,
            "filter": group.topic_filter,
            "subscription": key,
            "members": list(group.members),
            "orphans": len(group.orphans),
            "positions": self._positions(group.consumer),
        }


def _offsets(plog: SegmentedLog | LogReader) -> dict[str, int]:
    return {"earliest_offset": plog.log_start_offset, "high_water_mark": plog.end_offset}


def _stream_info(spec: StreamSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "internal": spec.name.startswith("$"),
        "topic_filters": list(spec.topic_filters),
        "partitions": spec.partitions,
        "config": dataclasses.asdict(spec.log),
    }
