"""The filter's parts that need no kernel: the user-space twin's verdicts and counters, the
allowlist's set arithmetic, the ports and macros the kernel program is compiled with, the
choice of filter from the config, the gossip endpoint's ``accept``, the metrics and the
status block of ``mqlog cluster status``. The kernel program itself is tested attached, in
tests/integration/test_xdp.py."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
import sys
from pathlib import Path

import pytest

from broker.cli.cluster import _print_xdp
from broker.cluster.gossip.codec import MAGIC
from broker.cluster.gossip.endpoint import open_endpoint
from broker.cluster.gossip.options import SwimConfig
from broker.config import load_config
from broker.config.values import ConfigError
from broker.metrics.xdp import xdp_metrics
from broker.xdp import CLASSES, VERDICTS, open_filter, ports_of, static_members
from broker.xdp.classes import Counters, slot
from broker.xdp.userspace import UserSpaceFilter

SECRET = b"k" * 32


def config_file(tmp_path: Path, extra: str = "", xdp: str = "") -> Path:
    key = tmp_path / "cluster.key"
    key.write_bytes(SECRET)
    key.chmod(0o600)
    path = tmp_path / "broker.toml"
    path.write_text(
        "[server]\nport = 1883\nws_port = 8083\n[router]\nworkers = 2\n"
        f'[cluster]\nnode_id = "n1"\nbind = "10.0.0.1"\nsecret_file = "{key}"\n'
        f"raft_port = 7950\ngossip_port = 7946\n{extra}\n{xdp}"
    )
    return path


def test_user_space_verdicts_and_counters() -> None:
    f = UserSpaceFilter("test")
    f.allow("10.0.0.2")
    assert f.accept("10.0.0.2", MAGIC + b"body")
    assert not f.accept("10.0.0.2", b"XXXXbody")  # a member without the magic
    assert not f.accept("10.0.0.3", MAGIC + b"body")  # a stranger, magic or not
    assert not f.accept("10.0.0.3", b"")
    assert f.accept("::ffff:10.0.0.2", MAGIC)  # a dual-stack socket's spelling
    c = f.counters()
    assert (c.get("gossip", "pass"), c.get("gossip", "drop_bad_magic")) == (2, 1)
    assert c.get("gossip", "drop_stranger") == 2
    assert c.bytes[("gossip", "pass")] == len(MAGIC) * 2 + 4
    status = f.status()
    assert status["enabled"] is False and status["reason"] == "test"
    assert status["packets"]["gossip"] == {"pass": 2, "drop_bad_magic": 1, "drop_stranger": 2}


def test_hosts_of_a_join_from_network_pass_to_the_mac_check() -> None:
    f = UserSpaceFilter("test")
    f.set_join_from(["10.0.1.0/24"])
    assert f.accept("10.0.1.7", MAGIC + b"body")  # may join: the codec authenticates it
    assert not f.accept("10.0.1.7", b"XXXXbody")
    assert not f.accept("10.0.2.7", MAGIC + b"body")  # a stranger still
    assert f.counters().get("gossip", "drop_stranger") == 1
    f.set_join_from([])
    assert not f.accept("10.0.1.7", MAGIC + b"body")


def test_join_from_is_read_normalized_and_given_to_the_filter(tmp_path: Path) -> None:
    config = load_config(config_file(tmp_path, 'join_from = ["10.0.1.9/24", "10.0.2.1"]'))
    assert config.cluster is not None
    assert config.cluster.join_from == ("10.0.1.0/24", "10.0.2.1/32")
    f = open_filter(config)
    assert f.join_from == (ipaddress.ip_network("10.0.1.0/24"), ipaddress.ip_network("10.0.2.1"))
    with pytest.raises(ConfigError, match=r"join_from\[0\] = '10.0.1/33' must be a network"):
        load_config(config_file(tmp_path, 'join_from = ["10.0.1/33"]'))


def test_set_members_is_the_whole_list_normalized() -> None:
    f = UserSpaceFilter("test")
    f.set_members(["10.0.0.1", "10.0.0.2"])
    f.set_members(["10.0.0.2", "::ffff:10.0.0.3", "fd00:0::1"])
    assert f.members == {"10.0.0.2", "10.0.0.3", "fd00::1"}
    f.deny("10.0.0.9")  # not a member: nothing to do
    f.deny("10.0.0.2")
    assert f.members == {"10.0.0.3", "fd00::1"}
    with pytest.raises(ValueError):
        f.allow("node2.example")
    assert not f.accept("10.0.0.2", MAGIC)


def test_counter_slots_follow_the_kernel_numbering() -> None:
    assert slot("gossip", "pass") == 0
    assert slot("raft", "drop_stranger") == len(VERDICTS) + 1
    assert sorted(slot(c, v) for c in CLASSES for v in VERDICTS) == list(
        range(len(CLASSES) * len(VERDICTS))
    )
    c = Counters()
    c.add("mqtt", "pass", 100, 2)
    assert c.as_dict() == {"packets": {"mqtt": {"pass": 2}}, "bytes": {"mqtt": {"pass": 100}}}


def test_ports_and_macros_from_the_config(tmp_path: Path) -> None:
    ports = ports_of(load_config(config_file(tmp_path)))
    # The metadata group's raft_port - 1, then one per worker (two here).
    assert (ports.gossip, ports.raft_first, ports.raft_last) == (7946, 7949, 7951)
    assert ports.mqtt == (1883, 8083)
    flags = ports.cflags()
    assert "-DMQTT_PORT_2=0" in flags and "-DGOSSIP_PORT=7946" in flags
    assert [f"-DMAGIC_{i}={b}" for i, b in enumerate(MAGIC)] == [
        f for f in flags if f.startswith("-DMAGIC_")
    ]
    assert "-DVERDICT_DROP_BAD_MAGIC=2" in flags and "-DCLASS_IPV6=5" in flags


def test_static_members_are_the_node_and_its_seeds(tmp_path: Path) -> None:
    seeds = 'seeds = ["10.0.0.2:7950", "localhost:7950"]'
    cfg = load_config(config_file(tmp_path, seeds))
    assert cfg.cluster is not None
    members = static_members(cfg.cluster)
    assert members[:2] == ["10.0.0.1", "10.0.0.2"] and "127.0.0.1" in members


def test_disabled_xdp_falls_back_and_says_why_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(config_file(tmp_path, 'seeds = ["10.0.0.2:7950"]', "[xdp]\n"))
    with caplog.at_level(logging.INFO, logger="broker.xdp"):
        f = open_filter(cfg)
    assert isinstance(f, UserSpaceFilter) and f.reason == "[xdp] enabled = false"
    assert f.members == {"10.0.0.1", "10.0.0.2"}
    assert [r.getMessage() for r in caplog.records] == [
        "xdp: gossip is filtered in user space: [xdp] enabled = false"
    ]


def test_enabled_on_a_missing_interface_falls_back(tmp_path: Path) -> None:
    xdp = '[xdp]\nenabled = true\ninterface = "nosuchif0"\n'
    f = open_filter(load_config(config_file(tmp_path, xdp=xdp)))
    assert isinstance(f, UserSpaceFilter)
    assert f.reason is not None and f.reason != "[xdp] enabled = false"


def test_gossip_endpoint_drops_what_accept_refuses() -> None:
    async def scenario() -> None:
        fast = SwimConfig(probe_interval=50, probe_timeout=20, gossip_interval=10)
        guard = UserSpaceFilter("test")
        a = await open_endpoint("a", ("127.0.0.1", 0), SECRET, fast, random.Random(1))
        b = await open_endpoint(
            "b", ("127.0.0.1", 0), SECRET, fast, random.Random(2), prefilter=guard.accept
        )
        a.join([])
        b.join([a.core.addr])  # b's join reaches a; a's answers are refused by b's filter
        await a.until(lambda: a.counters["sent"] >= 3, 5)
        await b.until(lambda: b.counters["filtered"] >= 1, 5)
        assert b.counters["received"] == 0 and b.core.size == 1
        guard.allow("127.0.0.1")
        await b.until(lambda: b.core.size == 2, 5)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"XXXX", b.core.addr)
        await b.until(lambda: guard.counters().get("gossip", "drop_bad_magic") == 1, 5)
        assert b.counters["dropped_bad_magic"] == 0  # refused before the codec
        a.close()
        b.close()

    asyncio.run(scenario())


def test_metrics_and_status_block(capsys: pytest.CaptureFixture[str]) -> None:
    f = UserSpaceFilter("bcc is not installed")
    f.allow("10.0.0.2")
    f.accept("10.0.0.9", MAGIC)
    block = f.status()
    samples = {
        (m.name, s.name, tuple(sorted(s.labels.items()))): s.value
        for m in xdp_metrics(block)
        for s in m.samples
    }
    assert samples[("mqlog_xdp_enabled", "mqlog_xdp_enabled", ())] == 0
    key = (("class", "gossip"), ("verdict", "drop_stranger"))
    assert samples[("mqlog_xdp_packets", "mqlog_xdp_packets_total", key)] == 1
    assert samples[("mqlog_xdp_bytes", "mqlog_xdp_bytes_total", key)] == len(MAGIC)
    assert list(xdp_metrics(None)) == []
    _print_xdp(block)
    out = capsys.readouterr().out
    assert "xdp: off, gossip filtered in user space (bcc is not installed)" in out
    assert "allowed: 10.0.0.2" in out
    assert "gossip  drop_stranger        1      4" in out


def test_without_bcc_the_reason_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from broker.xdp import system_bcc

    monkeypatch.delitem(sys.modules, "bcc", raising=False)
    monkeypatch.setattr(system_bcc, "DIST_PACKAGES", str(tmp_path))  # no bcc in there
    monkeypatch.setattr(socket, "if_nametoindex", lambda name: 1)
    xdp = '[xdp]\nenabled = true\ninterface = "eth0"\n'
    f = open_filter(load_config(config_file(tmp_path, xdp=xdp)))
    assert isinstance(f, UserSpaceFilter)
    assert f.reason is not None and "python3-bpfcc" in f.reason
