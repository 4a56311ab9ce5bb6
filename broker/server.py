"""One broker worker: listeners, the router, timers, and orderly shutdown.

Owns the event loop's periodic work (keepalive checks, router timers, fsync on interval,
retention) and the output coalescing: connections that queued bytes during an iteration are
flushed once at its end.

Alone (``workers = 1``) it is the whole broker. As one of several worker processes under the
supervisor (:mod:`broker.workers`) it shares the MQTT listeners with the others through
SO_REUSEPORT, owns a share of the partitions and reaches the rest through its
:class:`~broker.workers.runtime.WorkerRuntime`; worker 0 also serves the HTTP API and the
``$SYS`` topics.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from broker.auth import AuthFileError, AuthService
from broker.cluster.worker_view import hear, view_of
from broker.commitlog import LogCleaner, SegmentedLog, Streams
from broker.commitlog.interval_sync import IntervalSyncer
from broker.commitlog.keys import PartitionKey
from broker.commitlog.reader import LogReader
from broker.commitlog.scrub import LogScrubber
from broker.config import Config
from broker.http.api import HttpApi, sessions_view
from broker.metrics.cluster import ClusterMetrics
from broker.metrics.collector import BrokerCollector, Metrics
from broker.metrics.sys_topics import SYS_SPEC, SysPublisher, sys_values, traffic_values
from broker.mqtt.reason_codes import ReasonCode
from broker.mqtt.topics import topic_matches
from broker.net.context import SessionClaims
from broker.net.iteration import IterationEnd
from broker.net.keepalive import KeepaliveWheel, keepalive_deadline, link_expired
from broker.net.parking import ParkingLot
from broker.net.tls import TLSConfigError, TLSProtocol, server_context
from broker.net.transport import MQTTProtocol
from broker.net.websocket import WebSocketListener
from broker.router.commit import OUTCOME_UNKNOWN
from broker.router.partition import Partition, PartitionBase
from broker.router.router import Router
from broker.router.state import SESSIONS
from broker.workers.cluster_groups import share_across_workers
from broker.workers.cluster_status import merge_views
from broker.workers.handoff import HandOff
from broker.workers.leaving import Leaving
from broker.workers.mesh import PeerDown, owner_of
from broker.workers.remote_relay import RemoteRelay
from broker.workers.replicated import CLUSTER_SPECS, ClusterService
from broker.workers.runtime import WorkerRuntime, WorkerSpec
from broker.xdp import MemberFilter, open_filter

log = logging.getLogger("broker.server")

#: ``mqlog cluster leave``: seconds to wait, by default, for the node's replicas to move.
LEAVE_MOVE_SECONDS = 60.0

#: Seconds between timer runs (keepalive, wills, session expiry, interval fsync).
TICK_SECONDS = 0.5
#: Allocations between two young-generation garbage collections (CPython: 700).
GC_THRESHOLD = 50_000


class ServeError(Exception):
    """The broker cannot start: the message says why and names the path or address."""


def lock_data_dir(data_dir: Path) -> int:
    """Take an exclusive lock on ``DATA/.lock`` so two brokers never write one log.

    Returns the open descriptor (the lock lives as long as it); raises :class:`ServeError`.
    """
    path = Path(data_dir) / ".lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ServeError(f"{path}: cannot create the data directory lock: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ServeError(f"{data_dir}: data directory is in use by another mqlog process") from None
    return fd


class Server:
    """A broker worker bound to the current event loop (the whole broker when alone)."""

    def __init__(
        self,
        config: Config,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        clock: Callable[[], float] = time.time,
        worker: WorkerSpec | None = None,
    ) -> None:
        self.config = config
        self.worker = worker
        self.monotonic = monotonic
        self.loop = asyncio.get_running_loop()
        try:
            self.auth = AuthService(config.auth, monotonic)
            self.tls_context = server_context(config.server) if config.server.tls_port else None
        except (AuthFileError, TLSConfigError) as e:
            raise ServeError(str(e)) from None
        self.metrics = Metrics()
        #: True from "listening" until shutdown begins (GET /healthz answers 503 otherwise).
        self.ready = False
        # Several workers: the supervisor holds the lock for all of them.
        self._lock_fd = lock_data_dir(config.commitlog.data_dir) if worker is None else -1
        # $SYS topics first: their own internal stream, whatever the user's filters say.
        self.streams = Streams(
            config.commitlog.data_dir,
            [SYS_SPEC, *config.stream_specs(), *(CLUSTER_SPECS if config.cluster else ())],
            clock=clock,
            matches=topic_matches,
        )
        self.runtime = (
            WorkerRuntime(worker.index, worker.count, self.streams)
            if worker is not None and worker.count > 1
            else None
        )
        #: The cluster ([cluster]): every partition of the replicated streams a Raft group;
        #: with several workers, each hosts the groups of the partitions it owns.
        self.cluster = (
            ClusterService(
                config,
                self.streams,
                (self.runtime.index, self.runtime.count),
                self.runtime.partitions.owns,
            )
            if config.cluster is not None and self.runtime is not None
            else ClusterService(config, self.streams)
            if config.cluster is not None
            else None
        )
        #: Where the group commit, the links' output and the mesh's frames wait for the end
        #: of the iteration, and run in one pass (broker.net.iteration).
        self.iteration_end = IterationEnd(self.loop)
        self.router = Router(
            self.streams,
            config.router,
            schedule=self.iteration_end.call_soon,
            clock=clock,
            monotonic=monotonic,
            partition_factory=self._partition_factory(),
            # None: one worker (broker.router.hooks.SingleWorker); a cluster node of one worker
            # loads the sessions it owns (broker.workers.replicated_sessions).
            hooks=self.runtime
            if self.runtime is not None
            else self.cluster.hooks
            if self.cluster is not None
            else None,
            acl=self.auth.acl,
            on_sync_append=self.metrics.fsync_seconds.observe,
            load=self.runtime is None,
        )
        if self.runtime is not None:
            self._join_runtime(self.runtime)
        if self.cluster is not None:
            self.cluster.attach(self.router)
            if self.runtime is not None:
                self._join_cluster_sessions(self.runtime, self.cluster)
                self._join_cluster_view(self.runtime, self.cluster)
                # The other workers' partitions that this node reads remotely.
                self.relay = RemoteRelay(self.runtime, self.cluster)
        self.metrics.registry.register(BrokerCollector(self))
        if self.cluster is not None:
            cluster_metrics = ClusterMetrics(self, self.metrics.registry)
            self.cluster.observe_commit = cluster_metrics.commit_seconds.observe
        self.links: set[MQTTProtocol] = set()
        #: Every link by its keepalive (or CONNECT) deadline, looked at when that passes.
        self.keepalive: KeepaliveWheel[MQTTProtocol] = KeepaliveWheel(TICK_SECONDS, monotonic())
        #: Idle links off the loop, their sockets in one epoll (broker.net.parking).
        self.parking = ParkingLot(self.loop, config.router.park_after / 1000, monotonic())
        #: Device connections moved to the worker owning their partition (several workers,
        #: no cluster, ``[router] handoff``); ``handoff`` is what the edge tells of them.
        self.handoffs = (
            HandOff(self, self.runtime)
            if self.runtime is not None and config.router.handoff and config.cluster is None
            else None
        )
        self.handoff = self.handoffs.consider if self.handoffs is not None else None
        self._flush_pending: list[MQTTProtocol] = []
        self._listeners: list[asyncio.Server] = []
        self._timer: asyncio.Task[None] | None = None
        #: fsync = "interval": the logs' periodic fdatasyncs, on a thread of their own, so
        #: that a slow disk never stops this loop (broker.commitlog.interval_sync).
        self._syncer = IntervalSyncer(
            self.loop.call_soon_threadsafe, self.metrics.fsync_seconds.observe
        )
        # Replicated partitions' retention runs in their Raft groups (broker.cluster.node).
        self._cleaner = LogCleaner(
            self.streams, skip=self.cluster.keys if self.cluster is not None else ()
        )
        scrub = config.commitlog
        self._scrubber = (
            LogScrubber(self.streams, scrub.scrub_interval, scrub.scrub_bytes_per_second)
            if scrub.scrub_interval > 0
            else None
        )
        first = worker is None or worker.index == 0
        #: The admin HTTP API ([http]); it logs its own "listening on http://..." line.
        self.http = HttpApi(self, config.http) if config.http.enabled and first else None
        self.websocket = (
            WebSocketListener(
                self, config.server.host, config.server.ws_port, reuse_port=worker is not None
            )
            if config.server.ws_port
            else None
        )
        self.sys = (
            SysPublisher(self, config.server.sys_interval / 1000)
            if config.server.sys_interval and first
            else None
        )
        #: The cluster interface's filter (broker.xdp: the XDP program, or its user-space twin
        #: where BPF cannot load), on worker 0 of a cluster node; the membership code keeps
        #: its allowlist with ``set_members`` and gives the gossip socket its ``accept``.
        self.xdp: MemberFilter | None = None
        self.stopped = asyncio.Event()
        #: ``mqlog cluster leave`` (broker.workers.leaving): this worker's part of it.
        self.leaving = Leaving(self)

    def _partition_factory(self) -> Callable[[PartitionKey], PartitionBase] | None:
        """The router's partitions: a replicated one for a partition this worker hosts the
        Raft group of, else the worker runtime's (owned or another worker's), else the
        cluster's, else the router's own (one worker, no cluster)."""
        runtime, cluster = self.runtime, self.cluster
        if runtime is None:
            return cluster.make_partition if cluster is not None else None
        if cluster is None:
            return runtime.make_partition
        partitions = runtime.partitions

        def make(key: PartitionKey) -> PartitionBase:
            if key in cluster.keys:  # replicated, and this worker owns it
                part = cluster.make_partition(key)
                if isinstance(part, Partition):
                    partitions.adopt(part)
                return part
            return runtime.make_partition(key)  # type: ignore[no-any-return]

        cluster.on_committed = partitions.announce
        partitions.peer_reads_committed = False  # a group's home may be another node
        partitions.lost_outcome = OUTCOME_UNKNOWN  # the owner may have proposed them
        partitions.forward_batches = False  # a replicated partition proposes records
        return make

    def _join_runtime(self, runtime: WorkerRuntime) -> None:
        """Connect the worker runtime to the router (which has the runtime as its hooks),
        the server's output pass, authentication and admin views (see
        broker.workers.runtime)."""
        runtime.attach(self.router)
        runtime.mesh.schedule = self.iteration_end.call_soon
        self.auth.on_failure = runtime.login_refused
        runtime.login_failed = self.auth.peer_failure
        runtime.views["sessions"] = lambda: orjson.dumps(sessions_view(self))
        runtime.views["metrics"] = self.metrics.exposition
        runtime.views["sys"] = lambda: orjson.dumps(sys_values(self))
        runtime.views["traffic"] = lambda: orjson.dumps(traffic_values(self))
        runtime.views["health"] = lambda: orjson.dumps(self.counts())
        runtime.views["cluster"] = lambda: orjson.dumps(self.cluster_view())
        runtime.actions["transfer_leader"] = self._transfer_action

    @staticmethod
    def _join_cluster_sessions(runtime: WorkerRuntime, cluster: ClusterService) -> None:
        """Several workers on a cluster node: a claim at a client id's home worker is the
        node's claim first (broker.workers.replicated_sessions), every worker follows
        ``$sessions`` as its owner announces new commits, learns from worker 0 which
        members are dead and from the worker hosting ``$sessions`` whose sessions the node
        adopts (broker.workers.orphans), and reaches the shared groups' home across the
        nodes through the worker hosting ``$sessions`` (broker.workers.cluster_groups)."""
        sessions = cluster.sessions
        sessions.directory = runtime.sessions
        share_across_workers(runtime, sessions.group_peers)
        runtime.sessions.cluster = sessions
        runtime.actions["orphans"] = sessions.orphans.told
        runtime.actions["sessions_resumed"] = sessions.resumed
        owner = owner_of(SESSIONS, runtime.count)
        if owner != runtime.index:
            cluster.sessions_owner = lambda: runtime.call(owner, "sessions_resumed", None)
        sessions.orphans.tell = lambda message: runtime.tell_all("orphans", message)
        moved = runtime.partitions.on_moved

        def follow(key: PartitionKey, old_end: int, part: Any) -> None:
            if moved is not None:
                moved(key, old_end, part)
            sessions.follow(key, old_end, part)

        runtime.partitions.on_moved = follow

    @staticmethod
    def _join_cluster_view(runtime: WorkerRuntime, cluster: ClusterService) -> None:
        """Several workers on a cluster node: worker 0 tells the others what its gossip sees,
        so that each plans its groups' shape over the members (broker.cluster.worker_view)."""
        node = cluster.node
        if runtime.index == 0:
            node.reshape.tell = lambda: runtime.tell_all("members", view_of(node))
        else:
            runtime.actions["members"] = lambda view: hear(node, view)

    @property
    def session_claims(self) -> SessionClaims | None:
        """Where a CONNECT's session is claimed before the router connects it: the session
        directory of several workers, the cluster's owners, or None (one worker alone)."""
        if self.runtime is not None:
            return self.runtime.sessions
        if self.cluster is not None:
            return self.cluster.sessions
        return None

    def partition_log(self, key: PartitionKey) -> SegmentedLog | LogReader:
        """The log of partition ``key`` for reading: this worker's own, or a read-only view
        of the one another worker owns."""
        return self.router.partition(key).log

    async def start(self) -> list[str]:
        """Open the listeners; returns one description per listener."""
        cfg = self.config.server
        runtime = self.runtime
        if runtime is not None:
            await runtime.start(
                lambda: [self.router.partition(key) for key in runtime.owned_keys()]
            )
            loaded = self.router.load(skip=runtime.sessions.registry)
            runtime.sessions.loaded(loaded)
            runtime.groups.loaded()
        if self.config.cluster is not None and (self.worker is None or self.worker.index == 0):
            # Before the cluster's sockets open; seconds of compilation, off the loop.
            self.xdp = await asyncio.to_thread(open_filter, self.config)
            if self.cluster is not None:  # the membership keeps its allowlist from now on
                self.cluster.node.gossip_filter = self.xdp
        if self.cluster is not None:
            await self.cluster.start()  # formed and hosting before any client is served
        # Alone, no SO_REUSEPORT: a second broker on the same port must fail to bind, not
        # silently share the clients. Several workers share the port that way; the
        # supervisor checked it was free and holds the data directory.
        reuse = self.worker is not None
        server = await self.loop.create_server(
            lambda: MQTTProtocol(self), cfg.host, cfg.port, backlog=4096, reuse_port=reuse
        )
        self._listeners.append(server)
        ready = []
        for sock in server.sockets:
            host, port = sock.getsockname()[:2]
            ready.append(f"mqtt://{host}:{port}")
        if self.tls_context is not None:
            context = self.tls_context
            tls = await self.loop.create_server(
                lambda: TLSProtocol(self, context),
                cfg.host,
                cfg.tls_port,
                backlog=4096,
                reuse_port=reuse,
            )
            self._listeners.append(tls)
            for sock in tls.sockets:
                host, port = sock.getsockname()[:2]
                ready.append(f"mqtts://{host}:{port}")
        if self.websocket is not None:
            ready.append(await self.websocket.start())
        self._timer = self.loop.create_task(self._run_timers())
        self._cleaner.start()
        if self._scrubber is not None:
            self._scrubber.start()
        if self.sys is not None:
            self.sys.start()
        if self.http is not None:
            await self.http.start()
        auth = self.config.auth
        log.info(
            "auth: anonymous %s, password file %s, acl file %s",
            "ALLOWED" if auth.allow_anonymous else "refused",
            auth.password_file or "none",
            auth.acl_file or "none (all topics allowed)",
        )
        # The broker allocates millions of short-lived tuples (records, packets): with the
        # default thresholds the collector ran every 700 allocations and, on a replay of
        # 1,000,000 records, took half the broker's time (py-spy, gc_collect_main). What
        # start-up built (config, streams, sessions) is moved out of its reach.
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD, 20, 20)
        self.ready = True
        return ready

    def flush_peers(self) -> None:
        if self.runtime is not None:
            self.runtime.mesh.flush_now()

    def want_flush(self, link: MQTTProtocol) -> None:
        """``link`` queued output: flush it at the end of this iteration."""
        if not self._flush_pending:
            self.iteration_end.call_soon(self._flush_links)
        self._flush_pending.append(link)

    def _flush_links(self) -> None:
        """Each pending link's output. A failure on one link is logged and does not stop the
        others: a link left out here keeps its output (it is not pending again until that
        output is written) and its client waits for it forever.

        With several workers, this iteration's frames to the other workers leave first: the
        announcement of a commit (broker.workers.partitions) is then in each peer's socket
        before a client can read its PUBACK or SUBACK, and a worker killed right after has
        still told its peers. What a peer knows of a dead worker's partitions is what it
        announced: the sessions it held are restored from ``$sessions`` up to there (a
        SUBACK written first, the kill falling between the two writes, had the session
        restored without that subscription), and its subscribers here would have waited
        for the restarted worker's next commit to that partition for the records."""
        self.flush_peers()
        pending, self._flush_pending = self._flush_pending, []
        for link in pending:
            try:
                link.flush_output()
            except Exception:
                log.exception("bug while writing to %s (%s)", link.client_id or "?", link.peer)

    async def _run_timers(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                self.check_keepalives(self.monotonic())
                self.parking.check(self.monotonic())
                self.router.tick()
                if self.cluster is not None:
                    self.cluster.tick()
                self._syncer.tick(self.streams.open_logs().values())  # the ones it writes
            except Exception:
                log.exception("bug in the broker timers")

    def check_keepalives(self, now: float) -> None:
        """Close the links whose keepalive (or CONNECT timeout) expired by ``now``
        [MQTT-3.1.2-24]; file the others that came due again under their new deadline."""
        wheel = self.keepalive
        for link in wheel.due(now):
            if link_expired(link, now):
                log.info("%s (%s): keepalive expired", link.client_id or "-", link.peer)
                link.close(ReasonCode.KEEP_ALIVE_TIMEOUT, "keep alive timeout")
                continue
            deadline = keepalive_deadline(link)
            if deadline is not None:
                wheel.file(link, deadline)

    async def stop(self) -> None:
        """Stop accepting, close connections, persist sessions, flush and fsync the logs."""
        self.ready = False
        if self.handoffs is not None:
            self.handoffs.stopping = True  # none starts or is taken from now on
        for server in self._listeners:
            server.close()
        if self.sys is not None:
            self.sys.stop()
        if self.http is not None:
            await self.http.stop()
        if self._timer is not None:
            self._timer.cancel()
        for link in list(self.links):
            link.close(ReasonCode.SERVER_SHUTTING_DOWN, "server shutting down")
        self._flush_links()
        await self.parking.close()  # the parked links resumed to close
        if self.websocket is not None:
            # After the DISCONNECTs above were queued: each WebSocket sends its own and closes.
            await self.websocket.stop()
        await asyncio.sleep(0)  # let connection_lost callbacks run
        self._cleaner.stop()
        self._syncer.close()
        if self._scrubber is not None:
            self._scrubber.stop()
        if self.handoffs is not None:
            # The hand-offs under way end first: each one's session is then here or at its
            # sender when the router writes the sessions (broker.workers.handoff, "Stopping").
            await self.handoffs.settle()
        self.router.close()
        self._flush_links()
        if self.runtime is not None:
            # Sessions persisted above may be on their way to the worker owning $sessions,
            # and peers may be sending theirs here: every worker finishes before any closes
            # (with its Raft groups still running: a forward's answer waits for its commit).
            await self.runtime.finish()
        if self.handoffs is not None:
            self.handoffs.close()
        if self.cluster is not None:
            await self.cluster.close()
        if self.xdp is not None:
            self.xdp.close()  # the kernel filter detaches (a crash detaches it too)
        self.streams.close()
        for server in self._listeners:
            await server.wait_closed()
        self.auth.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
        self.stopped.set()

    @property
    def handoff_rejected(self) -> int:
        """Strangers' messages on this worker's hand-off channel (broker.net.handoff)."""
        return self.handoffs.rejected if self.handoffs is not None else 0

    def counts(self) -> dict[str, int]:
        """This worker's connections and sessions (GET /healthz adds up every worker's)."""
        return {"connections": len(self.links), "sessions": len(self.router.sessions)}

    def cluster_view(self) -> dict[str, Any]:
        """This worker's view of the cluster (module doc of broker.cluster.node): the groups
        it hosts, its links; or the single node's. The metrics read it (each worker's, added
        up by worker 0); :meth:`cluster_status` is the node's."""
        if self.cluster is None:
            return {"mode": "single node", "node_id": None, "nodes": [], "partitions": []}
        if self.xdp is not None:
            return {**self.cluster.status(), "xdp": self.xdp.status()}
        return self.cluster.status()

    async def cluster_status(self) -> dict[str, Any]:
        """``GET /api/v1/cluster``, ``mqlog cluster status``: this node's view, every
        worker's put together (broker.workers.cluster_status)."""
        if self.runtime is None or self.cluster is None:
            return self.cluster_view()
        views = [orjson.loads(part) for part in await self.runtime.gather("cluster")]
        return merge_views(views)

    async def transfer_leader(self, key: PartitionKey, node: str) -> str:
        """Start moving ``key``'s leadership to ``node``, through the worker hosting its
        group. Raises ValueError (a single node, an unknown partition or node)."""
        if self.cluster is None:
            raise ValueError("a single node: no [cluster] section")
        runtime = self.runtime
        if runtime is None or key not in self.cluster.replicated:
            return self.cluster.transfer_leader(key, node)
        owner = owner_of(key, runtime.count)
        try:
            answer = await runtime.call(owner, "transfer_leader", [key[0], key[1], node])
        except PeerDown:
            raise ValueError(f"{key[0]}/{key[1]}: its worker {owner} is down: try again") from None
        if "error" in answer:
            raise ValueError(answer["error"])
        return str(answer["message"])

    async def set_replication(self, stream: str, factor: int) -> dict[str, Any]:
        """``mqlog cluster set-replication``: commit ``stream``'s new replication factor in the
        metadata group (its committed definition); the partitions' leaders then move replicas
        to match (broker.cluster.metadata_members). Raises ValueError where it cannot."""
        if self.cluster is None:
            raise ValueError("a single node: no [cluster] section")
        if self.cluster.node.metadata is None:  # worker 0's (the HTTP API's) alone
            raise ValueError("the metadata group is not open on this worker")
        return await self.cluster.node.metadata.set_replication(stream, factor, 10.0)

    async def leave(self, timeout: float = LEAVE_MOVE_SECONDS) -> dict[str, Any]:
        """``mqlog cluster leave``: drain this node, waiting up to ``timeout`` s for its
        replicas to move, and stop it (broker.workers.leaving). Raises ValueError on a
        single node."""
        return await self.leaving.leave(timeout)

    def stop_accepting(self) -> None:
        """Close the MQTT listeners (a leaving node: its clients go to the other nodes)."""
        for listener in self._listeners:
            listener.close()

    def _transfer_action(self, argument: list[Any]) -> dict[str, str]:
        """:meth:`transfer_leader` in the worker hosting the group (the runtime's action)."""
        stream, partition, node = argument
        assert self.cluster is not None
        try:
            return {"message": self.cluster.transfer_leader((stream, partition), node)}
        except ValueError as e:
            return {"error": str(e)}

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"ready": self.ready, **self.counts()}
        if self.runtime is not None:
            info.update(self.runtime.describe())
        return info
