"""broker/config: every bad value is a ConfigError naming the key and the file."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from broker.config import ConfigError, RouterConfig, check_ports, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "config" / "broker.toml"


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


# ------------------------------------------------------------------ the shipped file


def test_shipped_config_parses_to_the_defaults() -> None:
    cfg = load_config(SHIPPED)
    # The file documents every [router] key with its default value.
    assert cfg.router == RouterConfig()
    assert cfg.server.port == 1883 and cfg.http.port == 8080
    assert [s.name for s in cfg.streams] == ["telemetry"]
    assert cfg.streams[0].topic_filters == ("devices/#",)
    assert cfg.streams[0].partitions == 4


def test_shipped_config_shows_every_router_key() -> None:
    text = SHIPPED.read_text()
    section = text.split("[router]", 1)[1].split("\n[", 1)[0]
    keys = set(re.findall(r"^(\w+)\s*=", section, re.M))
    assert keys == {f.name for f in dataclasses.fields(RouterConfig)}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(RouterConfig)])
def test_every_router_key_is_used_by_the_broker(name: str) -> None:
    """A key nobody reads is a promise nobody keeps: each must be read outside broker/config."""
    users = [
        p
        for p in (ROOT / "broker").rglob("*.py")
        if ROOT / "broker" / "config" not in p.parents and re.search(rf"\.{name}\b", p.read_text())
    ]
    assert users, f"router.{name} is parsed but never used"


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, ""))
    assert cfg.router == RouterConfig()
    assert [s.name for s in cfg.stream_specs()] == ["default"]


def test_values_are_read(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            (
                "[router]\nmax_connections = 3\nmax_packet_size = 2048\nkeepalive_max = 30\n"
                'connect_timeout = 5\nmax_queued_bytes = "2MiB"\npark_after = "2s"\n'
                '[commitlog]\nsegment_bytes = "1MiB"\nsegment_age = "2h"\nretention = "forever"\n'
                'fsync_interval = "250ms"\n'
            ),
        )
    )
    r = cfg.router
    assert (
        r.max_connections,
        r.max_packet_size,
        r.keepalive_max,
        r.connect_timeout,
        r.max_queued_bytes,
        r.park_after,
    ) == (3, 2048, 30, 5, 2 * 1024 * 1024, 2000)
    d = cfg.commitlog.defaults
    assert (d.segment_bytes, d.segment_ms, d.retention_ms, d.fsync_interval_ms) == (
        1024 * 1024,
        2 * 3_600_000,
        None,
        250,
    )


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("text", "key"),
    [
        pytest.param("[router]\nmax_conections = 3\n", "router.max_conections", id="unknown-key"),
        pytest.param("[routr]\n", "[routr]", id="unknown-section"),
        pytest.param('[router]\nworkers = "2"\n', "router.workers", id="string-for-int"),
        pytest.param("[router]\nmax_inflight = true\n", "router.max_inflight", id="bool-for-int"),
        pytest.param("[router]\nmax_inflight = 1.5\n", "router.max_inflight", id="float-for-int"),
        pytest.param("[router]\nmax_packet_size = 10\n", "router.max_packet_size", id="too-small"),
        pytest.param("[router]\nmax_inflight = 70000\n", "router.max_inflight", id="too-large"),
        pytest.param("[router]\nmax_connections = 0\n", "router.max_connections", id="zero"),
        pytest.param("[router]\nconnect_timeout = 0\n", "router.connect_timeout", id="timeout-0"),
        pytest.param('[router]\npark_after = "soon"\n', "router.park_after", id="park-after"),
        pytest.param(
            '[router]\nslow_qos0_policy = "block"\n', "router.slow_qos0_policy", id="bad-choice"
        ),
        pytest.param(
            "[router]\nkeepalive_min = 20\nkeepalive_max = 10\n",
            "router.keepalive_min",
            id="keepalive-min-over-max",
        ),
        pytest.param(
            '[router]\nmax_queued_bytes = "8 MeB"\n', "router.max_queued_bytes", id="bad-size"
        ),
        pytest.param(
            '[router]\nmax_queued_bytes = "unlimited"\n',
            "router.max_queued_bytes",
            id="unbounded-buffer",
        ),
        pytest.param(
            "[router]\nmax_queued_bytes = 0\n", "router.max_queued_bytes", id="zero-buffer"
        ),
        pytest.param(
            '[commitlog]\nsegment_bytes = "lots"\n', "commitlog.segment_bytes", id="bad-size-word"
        ),
        pytest.param(
            '[commitlog]\nsegment_age = "7 days"\n', "commitlog.segment_age", id="bad-duration"
        ),
        pytest.param(
            "[commitlog]\nsegment_age = -5\n", "commitlog.segment_age", id="negative-duration"
        ),
        pytest.param('[commitlog]\nfsync = "sometimes"\n', "commitlog.fsync", id="bad-fsync"),
        pytest.param("[server]\nport = 70000\n", "server.port", id="port-range"),
        pytest.param('[http]\nenabled = "yes"\n', "http.enabled", id="string-for-bool"),
        pytest.param("router = 5\n", "[router]", id="section-not-table"),
        pytest.param(
            '[[streams]]\nname = "a"\ntopic_filter = "x/#"\n'
            '[[streams]]\nname = "a"\ntopic_filter = "y/#"\n',
            "'a'",
            id="duplicate-stream",
        ),
        pytest.param(
            '[[streams]]\nname = "s"\ntopic_filter = "a/#/b"\n',
            "streams[s].topic_filter",
            id="bad-topic-filter",
        ),
        pytest.param(
            '[[streams]]\nname = "s"\ntopic_filter = ["ok/#", "a+"]\n',
            "streams[s].topic_filter",
            id="bad-filter-in-list",
        ),
        pytest.param(
            '[[streams]]\nname = "s"\ntopic_filter = "$share/g/a"\n',
            "streams[s].topic_filter",
            id="shared-filter",
        ),
        pytest.param(
            '[[streams]]\nname = "s"\n', "streams[s].topic_filter", id="missing-topic-filter"
        ),
        pytest.param(
            '[[streams]]\nname = "bad name"\ntopic_filter = "a"\n',
            "streams[0].name",
            id="bad-stream-name",
        ),
        pytest.param(
            '[[streams]]\nname = "s"\ntopic_filter = "a"\npartitions = 0\n',
            "streams[s].partitions",
            id="zero-partitions",
        ),
        pytest.param(
            '[[streams]]\nname = "s"\ntopic_filter = "a"\nretension = "1d"\n',
            "streams[s].retension",
            id="unknown-stream-key",
        ),
        pytest.param("streams = 3\n", "streams", id="streams-not-array"),
        pytest.param(
            '[commitlog]\non_corruption = "ignore"\n', "commitlog.on_corruption", id="policy"
        ),
        pytest.param(
            '[[streams]]\nname = "s"\ntopic_filter = "a"\non_corruption = 1\n',
            "streams[s].on_corruption",
            id="stream-policy",
        ),
        pytest.param(
            '[commitlog]\nscrub_interval = "often"\n', "commitlog.scrub_interval", id="scrub"
        ),
        pytest.param(
            "[commitlog]\nscrub_bytes_per_second = 0\n",
            "commitlog.scrub_bytes_per_second",
            id="scrub-rate",
        ),
        pytest.param(
            '[[streams]]\nname = "s"\ntopic_filter = "a"\nscrub_interval = "1d"\n',
            "streams[s].scrub_interval",
            id="scrub-is-not-per-stream",
        ),
    ],
)
def test_bad_value_names_key_and_file(tmp_path: Path, text: str, key: str) -> None:
    assert key in error_for(tmp_path, text)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    assert "not valid TOML" in error_for(tmp_path, "[router\nworkers = 1\n")
    assert "not valid TOML" in error_for(tmp_path, "[router]\nworkers = 1\nworkers = 1\n")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")


def test_parse_config_source_name() -> None:
    with pytest.raises(ConfigError, match=r"^<mine>: unknown key 'router.nope'"):
        parse_config({"router": {"nope": 1}}, "<mine>")


def test_two_listeners_on_one_port_are_refused() -> None:
    cfg = parse_config({"server": {"port": 1883, "ws_port": 1883}}, "b.toml")
    with pytest.raises(ConfigError, match=r"^b.toml: server.ws_port = 1883 is also server.port$"):
        check_ports(cfg, "b.toml")
    check_ports(parse_config({"server": {"port": 0, "ws_port": 0}, "http": {"port": 0}}))
    check_ports(parse_config({"server": {"port": 8080}, "http": {"enabled": False}}))


# ------------------------------------------------------------------ safe defaults, overrides


def test_shipped_config_listens_on_loopback_only() -> None:
    """Anonymous access without a password file (the shipped file): this machine only,
    unless an address is named, as Mosquitto 2 does."""
    cfg = load_config(SHIPPED)
    assert cfg.auth.allow_anonymous and cfg.auth.password_file is None
    assert cfg.server.host == "127.0.0.1" and not cfg.server.host_named
    assert cfg.http.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("toml", "host", "named"),
    [
        pytest.param("", "127.0.0.1", False, id="anonymous-no-passwords"),
        pytest.param('[server]\nhost = ""\n', "127.0.0.1", False, id="empty-is-unnamed"),
        pytest.param('[server]\nhost = "0.0.0.0"\n', "0.0.0.0", True, id="named"),
        pytest.param("[auth]\nallow_anonymous = false\n", "0.0.0.0", False, id="closed"),
        pytest.param('[auth]\npassword_file = "p"\n', "0.0.0.0", False, id="password-file"),
    ],
)
def test_listen_address_default(tmp_path: Path, toml: str, host: str, named: bool) -> None:
    server = load_config(write(tmp_path, toml)).server
    assert (server.host, server.host_named) == (host, named)


def test_host_flag_names_the_address(tmp_path: Path) -> None:
    server = load_config(write(tmp_path, ""), {"server.host": "0.0.0.0"}).server
    assert (server.host, server.host_named) == ("0.0.0.0", True)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("server.port", 70000, "command line: --port = 70000 must be an integer >= 0 and <= 65535"),
        ("http.port", 70000, "command line: --http-port = 70000 must be an integer >= 0"),
        ("router.workers", -3, "command line: --workers = -3 must be an integer >= 0 and <= 256"),
        ("server.host", 5, "command line: --host = 5 must be a string"),
    ],
)
def test_overrides_get_the_keys_checks_and_name_the_flag(
    tmp_path: Path, key: str, value: object, message: str
) -> None:
    p = write(tmp_path, "")
    with pytest.raises(ConfigError) as info:
        load_config(p, {key: value})
    assert str(info.value).startswith(message), info.value
    assert f"(it overrides {key} of {p})" in str(info.value)


def test_data_dir_naming_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    message = error_for(tmp_path, f'[commitlog]\ndata_dir = "{afile}"\n')
    assert "commitlog.data_dir" in message and "must be a directory" in message
    with pytest.raises(ConfigError, match=r"^command line: --data-dir = .* must be a directory"):
        load_config(write(tmp_path, ""), {"commitlog.data_dir": str(afile)})


def test_connection_messages_switch(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")).server.connection_messages
    off = load_config(write(tmp_path, "[server]\nconnection_messages = false\n"))
    assert not off.server.connection_messages
    message = error_for(tmp_path, '[server]\nconnection_messages = "no"\n')
    assert "server.connection_messages = 'no' must be true or false" in message


def test_port_clash_names_the_flags() -> None:
    cfg = parse_config({}, "b.toml", {"server.port": 1884, "http.port": 1884})
    with pytest.raises(
        ConfigError,
        match=r"http.port = 1884 is also server.port \(set by --port and --http-port\)$",
    ):
        check_ports(cfg, "b.toml", {"server.port": "--port", "http.port": "--http-port"})


def test_integrity_keys(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            '[commitlog]\non_corruption = "stop"\nscrub_interval = "1h"\n'
            'scrub_bytes_per_second = "1MiB"\n'
            '[[streams]]\nname = "s"\ntopic_filter = "a"\non_corruption = "skip"\n',
        )
    )
    assert cfg.commitlog.defaults.on_corruption == "stop"
    assert cfg.commitlog.scrub_interval == 3600.0
    assert cfg.commitlog.scrub_bytes_per_second == 1 << 20
    assert cfg.streams[0].log.on_corruption == "skip"
    assert load_config(SHIPPED).commitlog.defaults.on_corruption == "skip"
    off = load_config(write(tmp_path, '[commitlog]\nscrub_interval = "0s"\n'))
    assert off.commitlog.scrub_interval == 0
