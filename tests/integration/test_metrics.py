"""GET /metrics (Prometheus text) and $SYS topics move when messages flow; /healthz
readiness; `--log-format json` structured logs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.clients import V5, Client, Message
from tests.integration.conftest import ROOT, BrokerFactory, BrokerProcess
from tests.integration.test_auth import make_password_file


def scrape(broker: BrokerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(broker.http_url + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(
    m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def test_metrics_move_when_messages_flow(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(fsync="always")
    before = scrape(broker)
    assert value(before, "mqlog_messages_received_total", qos="1") == 0
    assert value(before, "mqlog_clients_connected") == 0
    sub = Client(broker.port, "m-sub", V5)
    assert sub.connect() == 0
    assert sub.subscribe("devices/#", 1) == [1]
    pub = Client(broker.port, "m-pub")
    assert pub.connect() == 0
    n = 25
    for i in range(n):
        pub.publish(f"devices/d{i % 5}/t", b"x" * 100, qos=1)
    pub.publish("devices/d0/t", "zero", qos=0)
    sub.expect(n + 1)
    after = scrape(broker)
    assert value(after, "mqlog_messages_received_total", qos="1") == n
    assert value(after, "mqlog_messages_received_total", qos="0") == 1
    assert value(after, "mqlog_messages_sent_total", qos="1") == n
    assert value(after, "mqlog_messages_sent_total", qos="0") == 1
    assert value(after, "mqlog_clients_connected") == 2
    assert value(after, "mqlog_connections_opened_total") >= 2
    assert value(after, "mqlog_subscriptions") == 1
    assert value(after, "mqlog_bytes_received_total") > n * 100
    assert value(after, "mqlog_bytes_sent_total") > n * 100
    assert value(after, "mqlog_log_records_appended_total") >= n + 1
    assert (
        0
        < value(after, "mqlog_log_appends_total")
        <= value(after, "mqlog_log_records_appended_total")
    )
    # fsync = "always": every append was timed.
    assert value(after, "mqlog_fsync_seconds_count") >= 1
    assert value(after, "mqlog_fsync_seconds_sum") > 0
    hwm = sum(
        v
        for (name, labels), v in after.items()
        if name == "mqlog_partition_high_water_mark" and ("stream", "default") in labels
    )
    assert hwm == n + 1
    assert value(after, "mqlog_messages_dropped_total", reason="slow_qos0") == 0
    for c in (sub, pub):
        c.disconnect()


def test_consumer_lag_and_auth_failures(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    pw = make_password_file(tmp_path / "passwd", {"lagger": "x"})
    broker = broker_factory(config=f'[auth]\npassword_file = "{pw}"\n')
    anon = Client(broker.port, "anon")
    assert anon.connect() == 0, "anonymous allowed"
    anon.disconnect()
    wrong = Client(broker.port, "wrong")
    wrong.paho.username_pw_set("lagger", "y")
    assert wrong.connect() == 0x86
    wrong.disconnect()
    offline = Client(broker.port, "lagger", V5, clean=False, session_expiry=3600)
    offline.paho.username_pw_set("lagger", "x")
    assert offline.connect() == 0
    assert offline.subscribe("lag/#", 1) == [1]
    offline.disconnect()
    pub = Client(broker.port, "lag-pub")
    assert pub.connect() == 0
    for i in range(7):
        pub.publish("lag/t", str(i), qos=1)
    pub.disconnect()
    m = scrape(broker)
    assert value(m, "mqlog_consumer_lag_records", client_id="lagger") == 7
    assert value(m, "mqlog_auth_failures_total") == 1
    assert value(m, "mqlog_sessions") == 1


def test_sys_topics(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(server='sys_interval = "200ms"\n')
    sub = Client(broker.port, "sys-sub")
    assert sub.connect() == 0
    assert sub.subscribe("#", 0) == [0]
    assert sub.subscribe("$SYS/#", 0) == [0]
    seen: dict[str, str] = {}
    retained: set[str] = set()
    pub = Client(broker.port, "sys-pub")
    assert pub.connect() == 0
    for i in range(3):
        pub.publish("plain/topic", str(i), qos=1)
    deadline = time.monotonic() + 10
    while (
        seen.get("$SYS/broker/messages/received") != "3"
        or seen.get("$SYS/broker/clients/connected") != "2"
        or seen.get("$SYS/broker/subscriptions/count") != "2"
        or int(seen.get("$SYS/broker/bytes/received", "0")) == 0
    ):
        assert time.monotonic() < deadline, seen
        msg = sub.expect(1)[0]
        if msg.topic.startswith("$SYS/"):
            seen[msg.topic] = msg.payload.decode()
            if msg.retain:
                retained.add(msg.topic)
    assert seen["$SYS/broker/version"].startswith("mqlog ")
    assert seen["$SYS/broker/uptime"].endswith(" seconds")
    assert int(seen["$SYS/broker/bytes/received"]) > 0
    assert int(seen["$SYS/broker/subscriptions/count"]) == 2
    # A late subscriber gets the current values as retained messages.
    late = Client(broker.port, "sys-late")
    assert late.connect() == 0
    assert late.subscribe("$SYS/broker/version", 0) == [0]
    (version,) = late.expect(1)
    assert version.retain and version.payload.decode().startswith("mqlog ")
    with urllib.request.urlopen(broker.http_url + "/api/v1/streams/default/partitions") as r:
        parts = orjson.loads(r.read())["partitions"]
    assert parts[0]["high_water_mark"] == 3  # $SYS is not in the default stream
    # '#' alone never matches $SYS [MQTT-4.7.2-1]; the user's default stream stays clean.
    sub.paho.unsubscribe("$SYS/#")
    sub.unsubacks.get(timeout=10)  # paho hands over what came before the UNSUBACK first
    while not sub.messages.empty():
        sub.messages.get()
    # A $SYS round after the UNSUBACK: a live (not retained) uptime reaches a watcher ...
    watch = Client(broker.port, "sys-watch")
    assert watch.connect() == 0
    assert watch.subscribe("$SYS/broker/uptime", 0) == [0]
    while watch.expect(1)[0].retain:
        pass
    # ... and then a marker through '#': nothing of $SYS may come before it (or with it).
    pub.publish("plain/marker", "end", qos=1)
    got: list[Message] = []
    while not got or got[-1].topic != "plain/marker":
        got += sub.expect(1)
    assert not [m.topic for m in got if m.topic.startswith("$SYS/")], got
    for c in (sub, pub, late, watch):
        c.disconnect()


def test_healthz_reports_readiness(broker: BrokerProcess) -> None:
    with urllib.request.urlopen(broker.http_url + "/healthz", timeout=5) as resp:
        body = orjson.loads(resp.read())
    assert resp.status == 200
    assert body["status"] == "ok" and body["ready"] is True


def test_json_log_format(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(start=False)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker.cli",
            "serve",
            "-c",
            str(broker.config_path),
            "--workers",
            str(broker.workers),
            "--log-format",
            "json",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        events = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "broker exited"
            events.append(orjson.loads(line))  # every line is one JSON object
            if events[-1]["msg"].startswith("listening on mqtt://"):
                break
        c = Client(broker.port, "json-log")
        assert c.connect() == 0
        c.disconnect()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=15)
    events += [orjson.loads(line) for line in (rest or "").splitlines() if line.strip()]
    assert {"ts", "level", "logger", "msg"} <= events[0].keys()
    assert any(e["msg"] == "stopped" and e["logger"] == "mqlog" for e in events)
    assert all(e["ts"].endswith("Z") for e in events)
