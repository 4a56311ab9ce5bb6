"""The ``[cluster]`` and ``[xdp]`` sections (see docs in ``config/broker.toml``).

No ``[cluster]`` section means a single node: :attr:`broker.config.Config.cluster` is None and
nothing below runs. With one, every key is checked here, at load time, like the others: an
unknown key or a bad value is a :class:`ConfigError` naming the key and the file.

The shared secret is read once, here, so that a node without it is refused before it serves
anything; it is kept as bytes in :attr:`ClusterConfig.secret`, which no repr shows. Durations
are milliseconds.

``seeds`` are gossip addresses (``host:gossip_port``, DESIGN): a node joins the membership
through any of them and learns every member's Raft port from its gossip metadata
(``broker.cluster.nodemeta``). The gossip timings (``probe_interval``, ``probe_timeout``,
``suspicion_mult``) are SWIM's alone: Raft's ``election_timeout`` and ``heartbeat_interval``
are independent of them (gossip decides membership, never elections).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

from broker.config.values import ConfigError, Section

log = logging.getLogger("broker.config")

DEFAULT_GOSSIP_PORT = 7946
DEFAULT_RAFT_PORT = 7950
#: The metadata group (broker.cluster.metadata_group) listens on raft_port + this (so 7949),
#: on every node: a node derives its peers' metadata addresses from their Raft addresses.
#: Below the Raft port, since worker i of a node uses raft_port + i.
METADATA_PORT_OFFSET = -1
MAX_REPLICATION_FACTOR = 7
#: A shared secret shorter than this is refused (16 bytes: 128 bits if they are random).
MIN_SECRET_BYTES = 16
ELECTION_TIMEOUT_MS = (100, 60_000)  # the range election_timeout may take
PROBE_INTERVAL_MS = (100, 60_000)  # the range probe_interval may take
#: suspicion_mult's range: the minimum suspicion timeout is suspicion_mult * max(1, log10(n))
#: * probe_interval (memberlist's; broker.cluster.gossip.health).
SUSPICION_MULT = (1, 10)
XdpMode = Literal["generic", "native"]
XDP_MODES: tuple[str, ...] = get_args(XdpMode)

_NODE_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_LABEL_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_BRACKETED_RE = re.compile(r"^\[([^\]]+)\]:(\d{1,5})$")
#: Linux refuses an interface name longer than 15 bytes (IFNAMSIZ - 1) or holding '/', ':'
#: or white space (net/core/dev.c, dev_valid_name).
_IFNAME_RE = re.compile(r"^[^/:\s]+$")
_IFNAMSIZ = 16
#: Secret files already warned about (their permissions are logged once per process).
_warned: set[Path] = set()


class Seed(NamedTuple):
    """Another member's gossip ``host:port``; ``host`` is an IP address (normalized) or a host
    name (resolved when the node joins)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    node_id: str  # stable and unique in the cluster
    bind: str  # this node's cluster address (an IP address, normalized)
    secret_file: Path
    secret: bytes = field(repr=False)  # secret_file's bytes, trailing newlines stripped
    seeds: tuple[Seed, ...] = ()  # members' gossip addresses (host:gossip_port) to join through
    gossip_port: int = DEFAULT_GOSSIP_PORT  # UDP
    raft_port: int = DEFAULT_RAFT_PORT  # TCP
    replication_factor: int = 3  # copies of each partition (capped at the node count)
    election_timeout: int = 1000  # ms without a leader before a follower stands
    heartbeat_interval: int = 100  # ms; less than a third of election_timeout
    replace_after: int = 300_000  # ms a member may be dead before its replicas are re-created
    probe_interval: int = 1000  # ms: SWIM's protocol period (one probe per period)
    probe_timeout: int = 500  # ms a direct probe waits for its ack before indirect probes
    #: The minimum suspicion timeout is suspicion_mult * max(1, log10(n)) * probe_interval:
    #: 1 s at up to 10 nodes, reached once another member confirms the suspicion (a lone one
    #: waits 2x that), so that a silent death is known everywhere within 5 s (docs/gossip.md).
    suspicion_mult: int = 1
    #: Networks (CIDR, normalized) from which a node not yet a member may join through this
    #: one: their datagrams pass the user-space gossip filter to the MAC check.
    join_from: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class XdpConfig:
    enabled: bool = False
    interface: str = ""  # the cluster interface the filter attaches to; required when enabled
    mode: XdpMode = "generic"  # "native" needs driver support


def _required_string(sec: Section, key: str) -> str:
    if key not in sec.table:
        raise ConfigError(f"{sec.source}: {sec.key(key)} is required in [{sec.name}]")
    return sec.string(key, "")


def _bind_address(sec: Section) -> str:
    text = _required_string(sec, "bind")
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise sec.bad("bind", text, "an IP address (IPv4 or IPv6)") from None
    if address.is_unspecified or address.is_multicast:
        raise sec.bad("bind", text, "an address the other members can reach (not any, multicast)")
    return str(address)


def _host_name(text: str) -> bool:
    """An RFC 1123 host name; one whose last label is all digits must be an IPv4 address."""
    labels = text.rstrip(".").split(".")
    return (
        len(text) <= 253
        and all(_LABEL_RE.match(label) for label in labels)
        and not labels[-1].isdigit()
    )


def parse_seed(text: str) -> Seed:
    """``"10.0.0.2:7950"``, ``"[::1]:7950"`` or ``"node2.example:7950"`` to a :class:`Seed`;
    ValueError saying what ``text`` must be."""
    bracketed = _BRACKETED_RE.match(text)
    if bracketed:
        host, port_text = bracketed.groups()
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise ValueError("[IPv6 address]:port (brackets are for IPv6 only)") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if ":" in host:
            raise ValueError('"[IPv6 address]:port", in brackets (e.g. "[::1]:7950")')
        if not sep or not port_text.isdigit():
            raise ValueError('"host:port" (e.g. "10.0.0.2:7950")')
        try:
            host = str(ipaddress.IPv4Address(host))
        except ValueError:
            if not _host_name(host):
                raise ValueError('"host:port" with an IP address or a host name') from None
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError('"host:port" with a port from 1 to 65535')
    return Seed(host, port)


def _seeds(sec: Section, bind: str, gossip_port: int) -> tuple[Seed, ...]:
    entries: list[str] = sec.get(
        "seeds",
        [],
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        'a list of "host:port" strings',
    )
    own = Seed(bind, gossip_port)
    seeds: list[Seed] = []
    for i, entry in enumerate(entries):
        key = f"seeds[{i}]"
        try:
            seed = parse_seed(entry)
        except ValueError as e:
            raise sec.bad(key, entry, str(e)) from None
        if seed == own:
            raise sec.bad(
                key,
                entry,
                f"another member's gossip address, not this node's own ({sec.key('bind')}, "
                f"{sec.key('gossip_port')})",
            )
        if seed in seeds:
            raise sec.bad(key, entry, f"listed once (it is also seeds[{seeds.index(seed)}])")
        seeds.append(seed)
    return tuple(seeds)


def read_secret(path: Path, key: str, source: str) -> bytes:
    """``path``'s bytes without trailing newlines, at least :data:`MIN_SECRET_BYTES` of them.
    Logs a warning (once per file and process) when its group or everyone may read it."""
    where = f"{source}: {key} = {str(path)!r}"
    try:
        with path.open("rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.read().rstrip(b"\r\n")
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror}") from None
    if not secret:
        raise ConfigError(f"{where} is empty: it must hold the cluster's shared secret")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{where} holds {len(secret)} bytes: a shared secret needs at least "
            f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32 > FILE`)"
        )
    if mode & (stat.S_IRGRP | stat.S_IROTH) and path.resolve() not in _warned:
        _warned.add(path.resolve())
        log.warning(
            "%s: %s %s is readable by its group or by everyone (mode %03o): chmod 600 it",
            source,
            key,
            path,
            stat.S_IMODE(mode),
        )
    return secret


def _duration(sec: Section, key: str, default: int, lo: int, hi: int | None = None) -> int:
    """A duration of at least ``lo`` ms (and at most ``hi``); "forever" is refused."""
    value = sec.duration(key, default)
    if value is None or value < lo or (hi is not None and value > hi):
        bound = f"from {lo} ms to {hi} ms" if hi is not None else f"of at least {lo} ms"
        raise sec.bad(key, sec.table.get(key), f"a duration {bound}")
    return value


def parse_cluster(table: Any, source: str) -> ClusterConfig:
    """The ``[cluster]`` table. Its ports clashing with a listener's are found by
    :func:`broker.config.check_ports`, which sees them all."""
    sec = Section(table, "cluster", source)
    node_id = _required_string(sec, "node_id")
    if not _NODE_ID_RE.match(node_id):
        raise sec.bad("node_id", node_id, "1-64 of A-Z a-z 0-9 _ . -")
    bind = _bind_address(sec)
    d = ClusterConfig(node_id, bind, Path(), b"")
    gossip_port = sec.integer("gossip_port", d.gossip_port, lo=1, hi=65535)
    # raft_port + METADATA_PORT_OFFSET must be a port too.
    raft_port = sec.integer("raft_port", d.raft_port, lo=1 - METADATA_PORT_OFFSET, hi=65535)
    seeds = _seeds(sec, bind, gossip_port)
    secret_text = _required_string(sec, "secret_file")
    if not secret_text:
        raise sec.bad("secret_file", secret_text, "a file's path")
    secret_file = Path(secret_text)
    election = _duration(sec, "election_timeout", d.election_timeout, *ELECTION_TIMEOUT_MS)
    heartbeat = _duration(sec, "heartbeat_interval", d.heartbeat_interval, 1)
    if heartbeat * 3 >= election:
        # Raft s5.6: the broadcast time must be well under the election timeout, or a follower
        # stands for election while its leader is alive.
        raise sec.bad(
            "heartbeat_interval",
            sec.table.get("heartbeat_interval", f"{heartbeat}ms (the default)"),
            f"less than a third of {sec.key('election_timeout')} ({election} ms)",
        )
    replace_after = _duration(sec, "replace_after", d.replace_after, election)
    probe_interval = _duration(sec, "probe_interval", d.probe_interval, *PROBE_INTERVAL_MS)
    probe_timeout = _duration(sec, "probe_timeout", min(d.probe_timeout, probe_interval // 2), 1)
    if probe_timeout >= probe_interval:
        # SWIM s3.1: the direct probe's timeout leaves room in the period for the indirect one.
        raise sec.bad(
            "probe_timeout",
            sec.table.get("probe_timeout"),
            f"less than {sec.key('probe_interval')} ({probe_interval} ms)",
        )
    suspicion_mult = sec.integer("suspicion_mult", d.suspicion_mult, *SUSPICION_MULT)
    replication_factor = sec.integer(
        "replication_factor", d.replication_factor, lo=1, hi=MAX_REPLICATION_FACTOR
    )
    join_from = _networks(sec, "join_from")
    sec.finish()
    return ClusterConfig(
        node_id=node_id,
        bind=bind,
        secret_file=secret_file,
        secret=read_secret(secret_file, sec.key("secret_file"), source),
        seeds=seeds,
        gossip_port=gossip_port,
        raft_port=raft_port,
        replication_factor=replication_factor,
        election_timeout=election,
        heartbeat_interval=heartbeat,
        replace_after=replace_after,
        probe_interval=probe_interval,
        probe_timeout=probe_timeout,
        suspicion_mult=suspicion_mult,
        join_from=join_from,
    )


def _networks(sec: Section, key: str) -> tuple[str, ...]:
    """A list of networks ("10.0.0.0/24", or one address), normalized."""
    entries: list[str] = sec.get(
        key,
        [],
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        'a list of networks, e.g. ["10.0.0.0/24"]',
    )
    out = []
    for i, entry in enumerate(entries):
        try:
            out.append(str(ipaddress.ip_network(entry, strict=False)))
        except ValueError as e:
            raise sec.bad(f"{key}[{i}]", entry, f"a network such as 10.0.0.0/24 ({e})") from None
    return tuple(out)


def parse_xdp(table: Any, source: str) -> XdpConfig:
    """The ``[xdp]`` table (the caller refuses it without ``[cluster]``)."""
    sec = Section(table, "xdp", source)
    enabled = sec.boolean("enabled", False)
    interface = sec.string("interface", "")
    mode: XdpMode = sec.string("mode", "generic", XDP_MODES)  # type: ignore[assignment]
    sec.finish()
    if enabled and not interface:
        raise ConfigError(f"{source}: {sec.key('interface')} is required when xdp.enabled = true")
    valid = (
        _IFNAME_RE.match(interface)
        and len(interface.encode()) < _IFNAMSIZ
        and interface not in (".", "..")
    )
    if interface and not valid:
        raise sec.bad("interface", interface, "an interface name (1-15 bytes, no '/', ':', space)")
    return XdpConfig(enabled=enabled, interface=interface, mode=mode)
