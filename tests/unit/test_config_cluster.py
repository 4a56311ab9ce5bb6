"""broker/config/cluster.py: the [cluster] and [xdp] sections, checked like every other key.

Every bad value is a ConfigError naming the key and the file; the shared secret is read at
load time and never shown.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

import pytest

from broker.config import (
    ClusterConfig,
    ConfigError,
    Seed,
    XdpConfig,
    check_ports,
    load_config,
    parse_config,
)
from broker.config.cluster import parse_seed

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "config" / "broker.toml"
SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "cluster.key"
    p.write_bytes(SECRET + b"\n")
    p.chmod(0o600)
    return p


def cluster_toml(secret: Path, extra: str = "", section: str = "") -> str:
    """A valid [cluster] section, with ``extra`` lines in it and ``section`` after it."""
    return (
        f'[cluster]\nnode_id = "n1"\nbind = "10.0.0.1"\nsecret_file = "{secret}"\n'
        f"{extra}\n{section}"
    )


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "broker.toml"
    p.write_text(text)
    return p


def error_for(tmp_path: Path, text: str) -> str:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    message = str(info.value)
    assert str(p) in message, message  # always names the file
    return message


# ------------------------------------------------------------------ absent: a single node


def test_no_cluster_section_is_a_single_node(tmp_path: Path) -> None:
    for cfg in (load_config(SHIPPED), load_config(write(tmp_path, ""))):
        assert cfg.cluster is None
        assert not cfg.xdp.enabled
        assert all(cfg.replication_factor(s) == 1 for s in cfg.stream_specs())


def test_shipped_file_documents_every_key_with_its_default(tmp_path: Path, secret: Path) -> None:
    """The commented-out block of config/broker.toml, uncommented, is a valid config whose
    values are the defaults (but for the required keys and the example seeds)."""
    text = SHIPPED.read_text()
    block = text[text.index("\n# [cluster]\n") + 1 :]
    lines = [line.removeprefix("#").removeprefix(" ") for line in block.splitlines()]
    uncommented = "\n".join(lines).replace("/etc/mqlog/cluster.key", str(secret))
    cfg = load_config(write(tmp_path, uncommented))
    assert cfg.cluster is not None
    keys = set(re.findall(r"^(\w+) =", uncommented, re.M))
    assert keys == {
        f.name for f in dataclasses.fields(ClusterConfig) + dataclasses.fields(XdpConfig)
    } - {"secret"}
    defaults = ClusterConfig(cfg.cluster.node_id, cfg.cluster.bind, secret, SECRET)
    assert cfg.cluster == dataclasses.replace(defaults, seeds=cfg.cluster.seeds)
    assert cfg.xdp == XdpConfig(interface="eth0")


# ------------------------------------------------------------------ happy paths


def test_required_keys_only_give_the_defaults(tmp_path: Path, secret: Path) -> None:
    c = load_config(write(tmp_path, cluster_toml(secret))).cluster
    assert c is not None
    assert (c.node_id, c.bind, c.secret_file, c.secret, c.seeds) == (
        "n1",
        "10.0.0.1",
        secret,
        SECRET,
        (),
    )
    assert (c.gossip_port, c.raft_port, c.replication_factor) == (7946, 7950, 3)
    assert (c.election_timeout, c.heartbeat_interval, c.replace_after) == (1000, 100, 300_000)
    assert (c.probe_interval, c.probe_timeout, c.suspicion_mult) == (1000, 500, 1)


def test_every_key_is_read(tmp_path: Path, secret: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            '[cluster]\nnode_id = "node-2.eu_west"\nbind = "fd00::0:1"\n'
            'seeds = ["10.0.0.2:7950", "[::1]:7951", "n3.example.org:8000"]\n'
            "gossip_port = 17946\nraft_port = 17950\nreplication_factor = 5\n"
            f'secret_file = "{secret}"\n'
            'election_timeout = "2s"\nheartbeat_interval = "200ms"\nreplace_after = "1h"\n'
            'probe_interval = "2s"\nprobe_timeout = "300ms"\nsuspicion_mult = 4\n'
            '[xdp]\nenabled = true\ninterface = "veth-n1"\nmode = "native"\n',
        )
    )
    c = cfg.cluster
    assert c is not None
    assert (c.node_id, c.bind) == ("node-2.eu_west", "fd00::1")  # the address normalized
    assert c.seeds == (
        Seed("10.0.0.2", 7950),
        Seed("::1", 7951),
        Seed("n3.example.org", 8000),
    )
    assert [str(s) for s in c.seeds] == ["10.0.0.2:7950", "[::1]:7951", "n3.example.org:8000"]
    assert (c.gossip_port, c.raft_port, c.replication_factor) == (17946, 17950, 5)
    assert (c.election_timeout, c.heartbeat_interval, c.replace_after) == (2000, 200, 3_600_000)
    assert (c.probe_interval, c.probe_timeout, c.suspicion_mult) == (2000, 300, 4)
    assert (cfg.xdp.enabled, cfg.xdp.interface, cfg.xdp.mode) == (True, "veth-n1", "native")


def test_xdp_defaults_with_a_cluster(tmp_path: Path, secret: Path) -> None:
    xdp = load_config(write(tmp_path, cluster_toml(secret, section="[xdp]\n"))).xdp
    assert (xdp.enabled, xdp.interface, xdp.mode) == (False, "", "generic")


def test_durations_take_milliseconds_too(tmp_path: Path, secret: Path) -> None:
    extra = "election_timeout = 300\nheartbeat_interval = 99\nreplace_after = 300\n"
    c = load_config(write(tmp_path, cluster_toml(secret, extra))).cluster
    assert c is not None
    assert (c.election_timeout, c.heartbeat_interval, c.replace_after) == (300, 99, 300)


def test_the_secret_is_never_shown(tmp_path: Path, secret: Path) -> None:
    cfg = load_config(write(tmp_path, cluster_toml(secret)))
    assert cfg.cluster is not None and cfg.cluster.secret == SECRET
    for text in (repr(cfg), str(cfg), repr(cfg.cluster)):
        assert SECRET.decode() not in text
        assert str(secret) in text  # the file's name is not a secret


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (SECRET, SECRET),
        (SECRET + b"\r\n", SECRET),
        (b"x" * 16 + b"\n\n", b"x" * 16),  # 16 bytes: the least accepted
        (b"\n" + b"y" * 20, b"\n" + b"y" * 20),  # only the end is stripped
    ],
)
def test_secret_file_contents(tmp_path: Path, content: bytes, expected: bytes) -> None:
    key = tmp_path / "k"
    key.write_bytes(content)
    key.chmod(0o600)
    c = load_config(write(tmp_path, cluster_toml(key))).cluster
    assert c is not None and c.secret == expected


def test_stream_overrides_the_replication_factor(tmp_path: Path, secret: Path) -> None:
    streams = (
        '[[streams]]\nname = "critical"\ntopic_filter = "alarms/#"\nreplication_factor = 5\n'
        '[[streams]]\nname = "bulk"\ntopic_filter = "bulk/#"\n'
    )
    cfg = load_config(write(tmp_path, cluster_toml(secret, "replication_factor = 2", streams)))
    critical, bulk = cfg.streams
    assert (critical.replication_factor, bulk.replication_factor) == (5, None)
    assert [cfg.replication_factor(s) for s in cfg.stream_specs()] == [5, 2, 2]  # + default


def test_parse_seed_forms() -> None:
    assert parse_seed("192.168.1.9:1") == Seed("192.168.1.9", 1)
    assert parse_seed("[2001:DB8::7]:65535") == Seed("2001:db8::7", 65535)
    assert parse_seed("localhost:7950") == Seed("localhost", 7950)
    for bad in ("10.0.0.2", "10.0.0.2:", ":7950", "::1:7950", "[10.0.0.2]:7950", "a b:1"):
        with pytest.raises(ValueError):
            parse_seed(bad)


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        pytest.param("nodes = 3", "cluster.nodes", id="unknown-key"),
        pytest.param('node_id = ""', "cluster.node_id", id="empty-node-id"),
        pytest.param(f'node_id = "{"n" * 65}"', "cluster.node_id", id="long-node-id"),
        pytest.param('node_id = "n 1"', "cluster.node_id", id="space-in-node-id"),
        pytest.param('node_id = "n/1"', "cluster.node_id", id="slash-in-node-id"),
        pytest.param("node_id = 1", "cluster.node_id", id="int-node-id"),
        pytest.param('bind = "node1.example"', "cluster.bind", id="bind-host-name"),
        pytest.param('bind = "10.0.0.1:7950"', "cluster.bind", id="bind-with-port"),
        pytest.param('bind = "0.0.0.0"', "cluster.bind", id="bind-any"),
        pytest.param('bind = "::"', "cluster.bind", id="bind-any-v6"),
        pytest.param('bind = "224.0.0.1"', "cluster.bind", id="bind-multicast"),
        pytest.param('seeds = "10.0.0.2:7950"', "cluster.seeds", id="seeds-not-list"),
        pytest.param("seeds = [7950]", "cluster.seeds", id="seed-not-string"),
        pytest.param('seeds = ["10.0.0.2"]', "cluster.seeds[0]", id="seed-without-port"),
        pytest.param('seeds = ["a:1", "b:0"]', "cluster.seeds[1]", id="seed-port-0"),
        pytest.param('seeds = ["b:65536"]', "cluster.seeds[0]", id="seed-port-too-large"),
        pytest.param('seeds = ["b:http"]', "cluster.seeds[0]", id="seed-port-name"),
        pytest.param('seeds = ["::1:7950"]', "cluster.seeds[0]", id="seed-v6-unbracketed"),
        pytest.param('seeds = ["bad_host:7950"]', "cluster.seeds[0]", id="seed-bad-host"),
        pytest.param('seeds = ["10.0.0.1:7946"]', "cluster.seeds[0]", id="seed-is-self"),
        pytest.param(
            'seeds = ["10.0.0.2:7950", "10.0.0.2:7950"]', "cluster.seeds[1]", id="seed-twice"
        ),
        pytest.param("gossip_port = 0", "cluster.gossip_port", id="gossip-port-0"),
        pytest.param("gossip_port = 65536", "cluster.gossip_port", id="gossip-port-range"),
        pytest.param('raft_port = "7950"', "cluster.raft_port", id="raft-port-string"),
        pytest.param("raft_port = 7946", "cluster.raft_port = 7946 is also", id="ports-equal"),
        pytest.param("raft_port = 1883", "cluster.raft_port = 1883 is also server.port", id="mqtt"),
        pytest.param("gossip_port = 8080", "cluster.gossip_port = 8080 is also http.port", id="h"),
        pytest.param("replication_factor = 0", "cluster.replication_factor", id="rf-0"),
        pytest.param("replication_factor = 8", "cluster.replication_factor", id="rf-8"),
        pytest.param("replication_factor = true", "cluster.replication_factor", id="rf-bool"),
        pytest.param('election_timeout = "50ms"', "cluster.election_timeout", id="elect-short"),
        pytest.param('election_timeout = "61s"', "cluster.election_timeout", id="elect-long"),
        pytest.param('election_timeout = "forever"', "cluster.election_timeout", id="elect-inf"),
        pytest.param('election_timeout = "soon"', "cluster.election_timeout", id="elect-word"),
        pytest.param('heartbeat_interval = "0ms"', "cluster.heartbeat_interval", id="hb-0"),
        pytest.param(
            'heartbeat_interval = "334ms"', "cluster.heartbeat_interval", id="hb-over-a-third"
        ),
        pytest.param(
            'election_timeout = "300ms"', "cluster.heartbeat_interval", id="hb-default-too-long"
        ),
        pytest.param('replace_after = "500ms"', "cluster.replace_after", id="replace-too-soon"),
        pytest.param('replace_after = "never"', "cluster.replace_after", id="replace-word"),
        pytest.param('probe_interval = "50ms"', "cluster.probe_interval", id="probe-too-fast"),
        pytest.param('probe_interval = "2m"', "cluster.probe_interval", id="probe-too-slow"),
        pytest.param("probe_interval = true", "cluster.probe_interval", id="probe-bool"),
        pytest.param('probe_timeout = "1s"', "cluster.probe_timeout", id="timeout-not-under"),
        pytest.param('probe_timeout = "0ms"', "cluster.probe_timeout", id="timeout-zero"),
        pytest.param("suspicion_mult = 0", "cluster.suspicion_mult", id="suspicion-zero"),
        pytest.param("suspicion_mult = 11", "cluster.suspicion_mult", id="suspicion-big"),
        pytest.param('suspicion_mult = "2"', "cluster.suspicion_mult", id="suspicion-text"),
    ],
)
def test_bad_cluster_value_names_key_and_file(
    tmp_path: Path, secret: Path, extra: str, key: str
) -> None:
    # A key given twice is a TOML error: the extra line replaces the valid one.
    lines = [line for line in cluster_toml(secret).splitlines() if line.split(" =")[0] not in extra]
    assert key in error_for(tmp_path, "\n".join([*lines, extra]) + "\n")


@pytest.mark.parametrize("key", ["node_id", "bind", "secret_file"])
def test_required_keys(tmp_path: Path, secret: Path, key: str) -> None:
    lines = [line for line in cluster_toml(secret).splitlines() if not line.startswith(key)]
    message = error_for(tmp_path, "\n".join(lines) + "\n")
    assert f"cluster.{key} is required" in message


def test_cluster_must_be_a_table(tmp_path: Path) -> None:
    assert "[cluster] must be a table" in error_for(tmp_path, "cluster = 1\n")


def test_heartbeat_message_says_why(tmp_path: Path, secret: Path) -> None:
    message = error_for(tmp_path, cluster_toml(secret, 'heartbeat_interval = "400ms"'))
    assert (
        "cluster.heartbeat_interval = '400ms' must be less than a third of "
        "cluster.election_timeout (1000 ms)"
    ) in message


def test_own_address_in_seeds_ipv6(tmp_path: Path, secret: Path) -> None:
    text = cluster_toml(secret, 'seeds = ["[fd00:0::1]:7946"]').replace("10.0.0.1", "fd00::1")
    message = error_for(tmp_path, text)
    assert "not this node's own" in message and "cluster.gossip_port" in message
    # The same address at another port is another member (several nodes on one host).
    text = text.replace(":7946", ":7956")
    assert load_config(write(tmp_path, text)).cluster is not None


def test_port_clash_with_a_flag_names_it(secret: Path) -> None:
    data = {"cluster": {"node_id": "n1", "bind": "10.0.0.1", "secret_file": str(secret)}}
    with pytest.raises(
        ConfigError,
        match=r"^b.toml: cluster.raft_port = 7950 is also server.port \(set by --port\)$",
    ):
        parse_config(data, "b.toml", {"server.port": 7950})
    cfg = parse_config(data, "b.toml")
    check_ports(cfg, "b.toml")  # the CLI's own check passes the same config


def test_each_worker_has_its_raft_port(secret: Path) -> None:
    """Worker i listens on raft_port + i: those ports clash like the others, and may not
    run past 65535."""
    data = {
        "cluster": {"node_id": "n1", "bind": "10.0.0.1", "secret_file": str(secret)},
        "router": {"workers": 3},
        "http": {"port": 7952},
    }
    with pytest.raises(
        ConfigError,
        match=r"^b.toml: cluster.raft_port \+ 2 \(worker 2\) = 7952 is also http.port$",
    ):
        parse_config(data, "b.toml")
    data["http"] = {"port": 8080}
    cfg = parse_config(data, "b.toml")
    with pytest.raises(ConfigError, match=r"cluster.raft_port \+ 1 \(worker 1\).*--http-port"):
        check_ports(
            parse_config(data, "b.toml", {"http.port": 7951}),
            "b.toml",
            {"http.port": "--http-port"},
        )
    check_ports(cfg, "b.toml")
    data["cluster"]["raft_port"] = 65534  # type: ignore[index]
    with pytest.raises(ConfigError, match=r"raft_port = 65534 with 3 workers .*past port 65535"):
        parse_config(data, "b.toml")
    data["cluster"]["raft_port"] = 7950  # type: ignore[index]
    # Seeds are gossip addresses: no Raft port is derived from them.
    data["cluster"]["seeds"] = ["10.0.0.2:65535"]  # type: ignore[index]
    parse_config(data, "b.toml")


# ------------------------------------------------------------------ the secret file


def test_secret_file_missing(tmp_path: Path) -> None:
    message = error_for(tmp_path, cluster_toml(tmp_path / "absent.key"))
    assert "cluster.secret_file" in message and "absent.key" in message
    assert "cannot be read: No such file or directory" in message


def test_secret_file_empty_path(tmp_path: Path, secret: Path) -> None:
    text = cluster_toml(secret).replace(str(secret), "")
    assert "cluster.secret_file = '' must be a file's path" in error_for(tmp_path, text)


def test_secret_file_is_a_directory(tmp_path: Path) -> None:
    message = error_for(tmp_path, cluster_toml(tmp_path))
    assert "cluster.secret_file" in message and "cannot be read" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_secret_file_unreadable(tmp_path: Path, secret: Path) -> None:
    secret.chmod(0)
    message = error_for(tmp_path, cluster_toml(secret))
    assert "cannot be read: Permission denied" in message


@pytest.mark.parametrize("content", [b"", b"\n", b"\r\n\n"])
def test_secret_file_empty(tmp_path: Path, content: bytes) -> None:
    key = tmp_path / "k"
    key.write_bytes(content)
    key.chmod(0o600)
    message = error_for(tmp_path, cluster_toml(key))
    assert f"cluster.secret_file = '{key}' is empty" in message


def test_secret_file_short(tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_bytes(b"x" * 15 + b"\n")
    key.chmod(0o600)
    message = error_for(tmp_path, cluster_toml(key))
    assert f"cluster.secret_file = '{key}' holds 15 bytes" in message
    assert "at least 16" in message


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_secret_readable_by_others_is_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int
) -> None:
    key = tmp_path / "k"
    key.write_bytes(SECRET)
    key.chmod(mode)
    p = write(tmp_path, cluster_toml(key))
    with caplog.at_level(logging.WARNING, logger="broker.config"):
        load_config(p)
        load_config(p)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(p) in warnings[0] and "cluster.secret_file" in warnings[0]
    assert str(key) in warnings[0] and f"mode {mode:03o}" in warnings[0]
    assert SECRET.decode() not in caplog.text


def test_secret_readable_by_owner_only_is_not_warned(
    tmp_path: Path, secret: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret.chmod(0o400)
    with caplog.at_level(logging.WARNING, logger="broker.config"):
        load_config(write(tmp_path, cluster_toml(secret)))
    assert not caplog.records


# ------------------------------------------------------------------ [xdp]


@pytest.mark.parametrize("xdp", ["[xdp]\n", '[xdp]\nenabled = true\ninterface = "eth0"\n'])
def test_xdp_without_cluster(tmp_path: Path, xdp: str) -> None:
    message = error_for(tmp_path, xdp)
    assert "[xdp] needs [cluster]" in message


@pytest.mark.parametrize(
    ("xdp", "key"),
    [
        pytest.param("enabled = true", "xdp.interface is required", id="no-interface"),
        pytest.param('enabled = "yes"', "xdp.enabled", id="enabled-string"),
        pytest.param('mode = "offload"', "xdp.mode", id="bad-mode"),
        pytest.param('interface = "eth0/1"', "xdp.interface", id="slash"),
        pytest.param('interface = "averyveryverylongname"', "xdp.interface", id="too-long"),
        pytest.param("interface = 3", "xdp.interface", id="not-a-string"),
        pytest.param('iface = "eth0"', "xdp.iface", id="unknown-key"),
        pytest.param("xdp = 1", "[xdp] must be a table", id="not-a-table"),
    ],
)
def test_bad_xdp_value_names_key_and_file(tmp_path: Path, secret: Path, xdp: str, key: str) -> None:
    section = xdp + "\n" if xdp.startswith("xdp =") else f"[xdp]\n{xdp}\n"
    if xdp.startswith("xdp ="):  # a top-level key must come before any table
        text = section + cluster_toml(secret)
    else:
        text = cluster_toml(secret, section=section)
    assert key in error_for(tmp_path, text)


# ------------------------------------------------------------------ [[streams]] override


@pytest.mark.parametrize("value", ["0", "8", "true", '"3"'])
def test_bad_stream_replication_factor(tmp_path: Path, secret: Path, value: str) -> None:
    stream = f'[[streams]]\nname = "s"\ntopic_filter = "a/#"\nreplication_factor = {value}\n'
    message = error_for(tmp_path, cluster_toml(secret, section=stream))
    assert "streams[s].replication_factor" in message
    assert "must be an integer >= 1 and <= 7" in message


def test_stream_replication_factor_without_cluster(tmp_path: Path) -> None:
    stream = '[[streams]]\nname = "s"\ntopic_filter = "a/#"\nreplication_factor = 3\n'
    message = error_for(tmp_path, stream)
    assert "streams[s].replication_factor needs [cluster]" in message
