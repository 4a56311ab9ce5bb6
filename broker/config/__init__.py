"""Broker configuration: `config/broker.toml` parsed once into frozen dataclasses.

Every key has a default, so an empty file runs a single node. Unknown sections and keys are
errors (a typo must not silently fall back to a default), and every error is a
:class:`ConfigError` naming the key and the file. Command-line overrides (``mqlog serve --port
N`` ..., :data:`FLAGS`) are merged into the file's values before parsing, so they pass the very
checks the keys they override get; an error in one names the flag.

The package: this module holds the single node's sections and the entry points
(:func:`load_config`, :func:`parse_config`); :mod:`broker.config.values` reads a table's
typed values; :mod:`broker.config.cluster` the ``[cluster]`` and ``[xdp]`` sections, absent
from a single node's file (``Config.cluster is None``).

Safe by default, as Mosquitto 2 is: with anonymous access on and no password file, the MQTT
listeners bind to loopback only unless ``[server] host`` (or ``--host``) names an address.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.commitlog.config import CORRUPTION_POLICIES, FsyncPolicy, LogConfig, StreamSpec
from broker.config.cluster import (
    MAX_REPLICATION_FACTOR,
    METADATA_PORT_OFFSET,
    ClusterConfig,
    Seed,
    XdpConfig,
    parse_cluster,
    parse_xdp,
)
from broker.config.values import ConfigError, Section, duration_ms, parse_duration_ms, parse_size
from broker.mqtt.errors import TopicFilterInvalid
from broker.mqtt.topics import validate_topic_filter

__all__ = [
    "ANY_ADDRESS",
    "FLAGS",
    "LOOPBACK",
    "MAX_PACKET_SIZE_LIMIT",
    "AuthConfig",
    "ClusterConfig",
    "CommitLogSettings",
    "Config",
    "ConfigError",
    "HttpConfig",
    "RouterConfig",
    "Seed",
    "ServerConfig",
    "XdpConfig",
    "check_ports",
    "duration_ms",
    "is_loopback",
    "load_config",
    "parse_config",
    "parse_duration_ms",
    "parse_size",
]

#: ``mqlog serve`` flags, by the config key each overrides.
FLAGS = {
    "server.host": "--host",
    "server.port": "--port",
    "http.port": "--http-port",
    "commitlog.data_dir": "--data-dir",
    "router.workers": "--workers",
}
LOOPBACK = "127.0.0.1"
ANY_ADDRESS = "0.0.0.0"
MAX_PACKET_SIZE_LIMIT = 268_435_455  # the largest remaining length plus header MQTT allows
_STREAM_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_SECTIONS = ("server", "router", "commitlog", "streams", "http", "auth", "cluster", "xdp")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    # Where the MQTT listeners bind. When no address is named (host = ""), the parser picks
    # LOOPBACK while anonymous access is on without a password file, else ANY_ADDRESS.
    host: str = LOOPBACK
    host_named: bool = False  # host came from the file or --host (not the safe default)
    port: int = 1883
    tls_port: int = 0  # MQTT over TLS (8883 by convention); 0 = off
    certfile: Path | None = None  # server certificate chain (PEM)
    keyfile: Path | None = None  # its private key (PEM)
    cafile: Path | None = None  # CAs that sign client certificates (PEM)
    require_certificate: bool = False  # TLS clients must present a certificate from cafile
    ws_port: int = 0  # MQTT over WebSocket (8083 by convention); 0 = off
    sys_interval: int = 10_000  # ms between $SYS/broker/... updates; 0 = off
    connection_messages: bool = True  # INFO lines "New client connected ..." / "... disconnected"


@dataclass(frozen=True, slots=True)
class AuthConfig:
    allow_anonymous: bool = True  # clients without a user name may connect
    password_file: Path | None = None  # `mqlog passwd FILE USER`; None = names not checked
    acl_file: Path | None = None  # mosquitto-style ACL; None = everything allowed
    use_identity_as_username: bool = False  # TLS: the client certificate's CN is the user
    max_failures: int = 5  # failed logins per address within failure_window ...
    failure_window: int = 60_000  # ms
    lockout: int = 60_000  # ... refuse that address for this long (ms)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    workers: int = 0  # 0 = one worker per core
    max_connections: int = 100_000
    max_packet_size: int = 1024 * 1024  # bytes, checked from the fixed header
    # QoS 1/2 deliveries in flight per client (5.0: the least of this and its Receive Maximum).
    # A window, so a bound on a catching-up reader's rate: 100 made a $replay a round trip per
    # 100 messages (~200k msg/s here, 45k on a loaded host); 1,000 keeps it streaming. A live
    # subscriber rarely has more than a few in flight, so the bound costs it nothing.
    max_inflight: int = 1000
    max_queued_bytes: int = 8 * 1024 * 1024  # per-connection output buffer before pausing
    max_topic_length: int = 1024  # bytes of UTF-8
    max_topic_levels: int = 32
    keepalive_min: int = 0  # seconds; 0 = a client may disable keepalive
    keepalive_max: int = 65_535  # seconds; longer requests are clamped (5.0: announced)
    connect_timeout: int = 10  # seconds a new connection has to send its CONNECT
    # ms a connection with nothing in flight stays idle before it parks (broker.net.parking):
    # off the event loop, ~1.3 kB less; 0 = never. Longer than a fleet's publish interval.
    park_after: int = 10_000
    #: Several workers: a device connection moves to the worker owning the partition it
    #: publishes to (broker.workers.handoff); off in a cluster whatever this says.
    handoff: bool = True
    session_expiry_max: int = 7 * 86_400  # seconds
    slow_qos0_policy: str = "drop"  # "drop" or "disconnect" when a QoS 0 reader lags
    max_lag_records: int = 100_000  # QoS 0 lag before the policy applies


@dataclass(frozen=True, slots=True)
class CommitLogSettings:
    data_dir: Path = Path("data")
    defaults: LogConfig = field(default_factory=LogConfig)
    #: Seconds between two scrubs of every sealed segment (0: no scrubber), and the read
    #: rate a scrub may not exceed (bytes per second).
    scrub_interval: float = 86_400.0
    scrub_bytes_per_second: int = 4 << 20


@dataclass(frozen=True, slots=True)
class HttpConfig:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8080


@dataclass(frozen=True, slots=True)
class Config:
    path: Path | None = None
    server: ServerConfig = field(default_factory=ServerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    commitlog: CommitLogSettings = field(default_factory=CommitLogSettings)
    streams: tuple[StreamSpec, ...] = ()
    http: HttpConfig = field(default_factory=HttpConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    cluster: ClusterConfig | None = None  # None: a single node
    xdp: XdpConfig = field(default_factory=XdpConfig)  # enabled only with a cluster

    def stream_specs(self) -> list[StreamSpec]:
        """User streams, plus ``default`` (from the [commitlog] defaults) unless defined."""
        specs = list(self.streams)
        if not any(s.name == "default" for s in specs):
            specs.append(StreamSpec("default", (), 1, self.commitlog.defaults))
        return specs

    def replication_factor(self, spec: StreamSpec) -> int:
        """Copies of each of ``spec``'s partitions: its own factor, else the cluster's (1 on a
        single node). Not yet capped at the node count, which only the cluster knows."""
        if self.cluster is None:
            return 1
        return spec.replication_factor or self.cluster.replication_factor

    def worker_count(self) -> int:
        """Workers to run: the configured number, or when 0 one per core (one in a cluster:
        the README's Cluster section says why)."""
        if self.router.workers:
            return self.router.workers
        return 1 if self.cluster is not None else (os.cpu_count() or 1)


def _log_config(sec: Section, base: LogConfig) -> LogConfig:
    """Read the per-log keys shared by [commitlog] and each [[streams]] entry."""
    segment_bytes = sec.size("segment_bytes", base.segment_bytes)
    segment_ms = sec.duration("segment_age", base.segment_ms)
    fsync_interval = sec.duration("fsync_interval", base.fsync_interval_ms)
    fsync: FsyncPolicy = sec.string(  # type: ignore[assignment]
        "fsync", base.fsync, ("always", "interval", "never")
    )
    if not segment_bytes or segment_bytes < 1024:
        raise ConfigError(f"{sec.source}: {sec.key('segment_bytes')} must be at least 1KiB")
    if segment_ms is None or segment_ms <= 0:
        raise ConfigError(f"{sec.source}: {sec.key('segment_age')} must be a positive duration")
    if fsync_interval is None or fsync_interval <= 0:
        raise ConfigError(f"{sec.source}: {sec.key('fsync_interval')} must be positive")
    return LogConfig(
        segment_bytes=segment_bytes,
        segment_ms=segment_ms,
        index_interval_bytes=sec.integer("index_interval_bytes", base.index_interval_bytes, lo=1),
        fsync=fsync,
        fsync_interval_ms=fsync_interval,
        retention_ms=sec.duration("retention", base.retention_ms),
        retention_bytes=sec.size("retention_bytes", base.retention_bytes),
        compacted=base.compacted,
        on_corruption=sec.string(  # type: ignore[arg-type]
            "on_corruption", base.on_corruption, CORRUPTION_POLICIES
        ),
    )


def _stream(table: Any, i: int, source: str, defaults: LogConfig) -> StreamSpec:
    sec = Section(table, f"streams[{i}]", source)
    name = sec.string("name", "")
    if not _STREAM_NAME_RE.match(name):
        raise ConfigError(
            f"{source}: {sec.key('name')} = {name!r} must be 1-128 of A-Z a-z 0-9 _ . -"
        )
    sec.name = f"streams[{name}]"
    filters: Any = sec.get(
        "topic_filter",
        None,
        lambda v: (
            isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
        ),
        "a topic filter or a list of them",
    )
    if filters is None:
        filters = [] if name == "default" else None
    if filters is None:
        raise ConfigError(f"{source}: {sec.key('topic_filter')} is required")
    if isinstance(filters, str):
        filters = [filters]
    for f in filters:
        try:
            validate_topic_filter(f)
        except TopicFilterInvalid as e:
            raise ConfigError(f"{source}: {sec.key('topic_filter')}: {e}") from None
        if f.startswith("$share/"):
            raise ConfigError(f"{source}: {sec.key('topic_filter')} cannot be a shared filter")
    partitions = sec.integer("partitions", 1, lo=1, hi=4096)
    replication_factor: int | None = sec.get(
        "replication_factor",
        None,
        lambda v: type(v) is int and 1 <= v <= MAX_REPLICATION_FACTOR,
        f"an integer >= 1 and <= {MAX_REPLICATION_FACTOR}",
    )
    log = _log_config(sec, defaults)
    sec.finish()
    return StreamSpec(
        name=name,
        topic_filters=tuple(filters),
        partitions=partitions,
        log=log,
        replication_factor=replication_factor,
    )


def _positive(value: int | None, key: str, source: str) -> int:
    """A size that must be bounded and non-zero (a per-connection buffer cannot be either)."""
    if not value:
        raise ConfigError(f"{source}: {key} must be a positive size (e.g. 8MiB)")
    return value


def _path(sec: Section, key: str) -> Path | None:
    """An optional file path; "" means unset."""
    value = sec.string(key, "")
    return Path(value) if value else None


_SERVER = ServerConfig()
_HTTP = HttpConfig()


def _merge(
    data: Mapping[str, Any], overrides: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """``data`` with each ``"section.key": value`` of ``overrides`` set (``mqlog serve``'s
    flags, :data:`FLAGS`), and per section the keys set that way with their flags."""
    merged = dict(data)
    flags: dict[str, dict[str, str]] = {}
    for full, value in overrides.items():
        section, key = full.split(".")
        table = merged.get(section, {})
        merged[section] = {**table, key: value} if isinstance(table, Mapping) else table
        flags.setdefault(section, {})[key] = FLAGS.get(full, full)
    return merged, flags


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_config(
    data: Mapping[str, Any],
    source: str = "<config>",
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build a :class:`Config` from a parsed TOML document; ``source`` names it in errors.
    ``overrides`` (``{"server.port": 1884}``, the keys of :data:`FLAGS`) take precedence over
    the document and are checked as its values are; their errors name the flag."""
    data, flags = _merge(data, overrides or {})
    for key in data:
        if key not in _SECTIONS:
            raise ConfigError(f"{source}: unknown section [{key}]")

    a = Section(data.get("auth", {}), "auth", source)
    da = AuthConfig()
    auth = AuthConfig(
        allow_anonymous=a.boolean("allow_anonymous", da.allow_anonymous),
        password_file=_path(a, "password_file"),
        acl_file=_path(a, "acl_file"),
        use_identity_as_username=a.boolean("use_identity_as_username", da.use_identity_as_username),
        max_failures=a.integer("max_failures", da.max_failures, lo=1),
        failure_window=a.duration("failure_window", da.failure_window) or da.failure_window,
        lockout=a.duration("lockout", da.lockout) or 0,
    )
    a.finish()

    s = Section(data.get("server", {}), "server", source, flags.get("server"))
    named = s.string("host", "")
    open_to_anyone = auth.allow_anonymous and auth.password_file is None
    server = ServerConfig(
        host=named or (LOOPBACK if open_to_anyone else ANY_ADDRESS),
        host_named=bool(named),
        port=s.integer("port", _SERVER.port, hi=65535),
        tls_port=s.integer("tls_port", _SERVER.tls_port, hi=65535),
        certfile=_path(s, "certfile"),
        keyfile=_path(s, "keyfile"),
        cafile=_path(s, "cafile"),
        require_certificate=s.boolean("require_certificate", _SERVER.require_certificate),
        ws_port=s.integer("ws_port", _SERVER.ws_port, hi=65535),
        sys_interval=s.duration("sys_interval", _SERVER.sys_interval) or 0,
        connection_messages=s.boolean("connection_messages", _SERVER.connection_messages),
    )
    if server.tls_port and (server.certfile is None or server.keyfile is None):
        raise ConfigError(
            f"{source}: server.tls_port is set: server.certfile and server.keyfile are required"
        )
    if server.require_certificate and server.cafile is None:
        raise ConfigError(
            f"{source}: server.require_certificate needs server.cafile "
            "(the CA that signs client certificates)"
        )
    s.finish()

    r = Section(data.get("router", {}), "router", source, flags.get("router"))
    d = RouterConfig()
    router = RouterConfig(
        workers=r.integer("workers", d.workers, hi=256),
        max_connections=r.integer("max_connections", d.max_connections, lo=1),
        max_packet_size=r.integer(
            "max_packet_size", d.max_packet_size, lo=64, hi=MAX_PACKET_SIZE_LIMIT
        ),
        max_inflight=r.integer("max_inflight", d.max_inflight, lo=1, hi=65535),
        max_queued_bytes=_positive(
            r.size("max_queued_bytes", d.max_queued_bytes), r.key("max_queued_bytes"), source
        ),
        max_topic_length=r.integer("max_topic_length", d.max_topic_length, lo=1, hi=65535),
        max_topic_levels=r.integer("max_topic_levels", d.max_topic_levels, lo=1),
        keepalive_min=r.integer("keepalive_min", d.keepalive_min, hi=65535),
        keepalive_max=r.integer("keepalive_max", d.keepalive_max, lo=1, hi=65535),
        connect_timeout=r.integer("connect_timeout", d.connect_timeout, lo=1, hi=3600),
        park_after=r.duration("park_after", d.park_after) or 0,
        handoff=r.boolean("handoff", d.handoff),
        session_expiry_max=r.integer("session_expiry_max", d.session_expiry_max),
        slow_qos0_policy=r.string("slow_qos0_policy", d.slow_qos0_policy, ("drop", "disconnect")),
        max_lag_records=r.integer("max_lag_records", d.max_lag_records, lo=1),
    )
    if router.keepalive_min > router.keepalive_max:
        raise ConfigError(f"{source}: router.keepalive_min is larger than router.keepalive_max")
    r.finish()

    c = Section(data.get("commitlog", {}), "commitlog", source, flags.get("commitlog"))
    data_dir = Path(c.string("data_dir", str(CommitLogSettings().data_dir)))
    if data_dir.exists() and not data_dir.is_dir():
        raise c.bad("data_dir", str(data_dir), "a directory (a file of that name exists)")
    defaults = _log_config(c, LogConfig())
    dc = CommitLogSettings()
    scrub_ms = c.duration("scrub_interval", int(dc.scrub_interval * 1000))
    scrub_rate = c.size("scrub_bytes_per_second", dc.scrub_bytes_per_second)
    if not scrub_rate:
        raise ConfigError(
            f"{source}: {c.key('scrub_bytes_per_second')} must be a positive size (e.g. 16MiB)"
        )
    c.finish()
    commitlog = CommitLogSettings(
        data_dir=data_dir,
        defaults=defaults,
        scrub_interval=(scrub_ms or 0) / 1000,
        scrub_bytes_per_second=scrub_rate,
    )

    raw_streams = data.get("streams", [])
    if not isinstance(raw_streams, list):
        raise ConfigError(f"{source}: streams must be an array of tables ([[streams]])")
    streams = tuple(_stream(t, i, source, defaults) for i, t in enumerate(raw_streams))
    names = [st.name for st in streams]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"{source}: stream {name!r} is defined twice")

    h = Section(data.get("http", {}), "http", source, flags.get("http"))
    http = HttpConfig(
        enabled=h.boolean("enabled", _HTTP.enabled),
        host=h.string("host", _HTTP.host),
        port=h.integer("port", _HTTP.port, hi=65535),
    )
    h.finish()

    cluster = parse_cluster(data["cluster"], source) if "cluster" in data else None
    if cluster is None:
        if "xdp" in data:
            raise ConfigError(
                f"{source}: [xdp] needs [cluster] (the filter guards the cluster's gossip port)"
            )
        for st in streams:
            if st.replication_factor is not None:
                raise ConfigError(
                    f"{source}: streams[{st.name}].replication_factor needs [cluster] "
                    "(a single node keeps one copy)"
                )
    cfg = Config(
        server=server,
        router=router,
        commitlog=commitlog,
        streams=streams,
        http=http,
        auth=auth,
        cluster=cluster,
        xdp=parse_xdp(data.get("xdp", {}), source),
    )
    if cluster is not None:
        check_ports(
            cfg, source, {f"{s}.{k}": flag for s, f in flags.items() for k, flag in f.items()}
        )
    return cfg


def check_ports(
    cfg: Config, source: str = "<config>", flags: Mapping[str, str] | None = None
) -> None:
    """Raise ConfigError when two listeners are given one port number (``mqlog serve
    --port / --http-port`` included: ``flags`` maps the keys they set to the flag, which the
    error names): with several workers the MQTT listeners share their
    port (SO_REUSEPORT), so the clash surfaced late, as the HTTP API's failure to bind in
    worker 0 while worker 1 already served (a flaky test picked one free port twice).
    A cluster's gossip and Raft ports count as listeners: :func:`parse_config` runs this
    check itself for a config with ``[cluster]``."""
    flags = flags or {}

    ports = [
        ("server.port", cfg.server.port),
        ("server.tls_port", cfg.server.tls_port),
        ("server.ws_port", cfg.server.ws_port),
    ]
    if cfg.http.enabled:
        ports.append(("http.port", cfg.http.port))
    if cfg.cluster is not None:
        raft = cfg.cluster.raft_port
        workers = cfg.worker_count()
        if raft + workers - 1 > 65535:
            raise ConfigError(
                f"{source}: cluster.raft_port = {raft} with {workers} workers (router.workers): "
                f"worker i listens on raft_port + i, past port 65535"
            )
        # Seeds name gossip addresses: the other nodes' Raft ports come from gossip
        # (broker.cluster.nodemeta), and nodes sharing an address must space their raft_port
        # by workers + 1 themselves (one that cannot bind says so at start).
        ports += [
            ("cluster.gossip_port", cfg.cluster.gossip_port),
            ("cluster.raft_port", raft),
            *((f"cluster.raft_port + {i} (worker {i})", raft + i) for i in range(1, workers)),
            ("cluster.raft_port - 1 (the metadata group)", raft + METADATA_PORT_OFFSET),
        ]
    seen: dict[int, str] = {}
    for key, port in ports:
        if not port:
            continue  # off, or picked by the system (port 0)
        if port in seen:
            given = [flags[k] for k in (seen[port], key) if k in flags]
            note = f" (set by {' and '.join(given)})" if given else ""
            raise ConfigError(f"{source}: {key} = {port} is also {seen[port]}{note}")
        seen[port] = key


def load_config(path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> Config:
    """Read and parse a TOML config file, with ``overrides`` (see :func:`parse_config`).
    Relative ``data_dir`` is resolved from the CWD."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    return dataclasses.replace(parse_config(data, str(p), overrides), path=p)
