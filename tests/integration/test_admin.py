"""The HTTP admin API and the ``mqlog streams`` / ``mqlog offsets`` commands, against a real
broker: what they report must follow what clients did over MQTT."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

import orjson
import pytest

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import BrokerFactory, BrokerProcess, free_port, run_mqlog

STREAMS = """
[[streams]]
name = "telemetry"
topic_filter = ["devices/#"]
partitions = 4
retention = "2h"
"""


def get(broker: BrokerProcess, path: str) -> Any:
    with urllib.request.urlopen(broker.http_url + path, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("application/json")
        return orjson.loads(resp.read())


def mqlog(*args: str) -> subprocess.CompletedProcess[str]:
    return run_mqlog(*args)


def rows(output: str, first: str) -> list[list[str]]:
    """Table rows of ``output`` whose first column is ``first``, split on whitespace."""
    return [line.split() for line in output.splitlines() if line.split()[:1] == [first]]


def test_http_listener_logs_ready_line_and_healthz(broker: BrokerProcess) -> None:
    assert f"listening on http://127.0.0.1:{broker.http_port}" in broker.log()
    assert get(broker, "/healthz")["status"] == "ok"
    with pytest.raises(urllib.error.HTTPError) as e:
        get(broker, "/api/v1/streams/nope/partitions")
    assert e.value.code == 404


def test_streams_and_partitions_follow_publishes(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(config=STREAMS)
    streams = {s["name"]: s for s in get(broker, "/api/v1/streams")["streams"]}
    assert streams["telemetry"]["partitions"] == 4
    assert streams["telemetry"]["topic_filters"] == ["devices/#"]
    assert streams["telemetry"]["config"]["retention_ms"] == 2 * 3600 * 1000
    assert {"default", "$retained", "$sessions"} <= streams.keys()
    assert streams["$sessions"]["internal"] and not streams["default"]["internal"]

    pub = Client(broker.port, "pub")
    assert pub.connect() == 0
    n = 40
    for i in range(n):
        pub.publish(f"devices/d{i % 8}/telemetry", f"m{i}", qos=1, wait=False)
    pub.publish("other/topic", "x", qos=1)
    pub.publish("devices/d0/telemetry", "last", qos=1)  # acked: everything before it is in
    parts = get(broker, "/api/v1/streams/telemetry/partitions")["partitions"]
    assert [p["partition"] for p in parts] == [0, 1, 2, 3]
    assert all(p["earliest_offset"] == 0 for p in parts)
    assert sum(p["high_water_mark"] for p in parts) == n + 1
    default = get(broker, "/api/v1/streams/default/partitions")["partitions"]
    assert default == [{"partition": 0, "earliest_offset": 0, "high_water_mark": 1}]

    out = mqlog("streams", "--broker", broker.http_url)
    assert out.returncode == 0, out.stderr
    assert rows(out.stdout, "telemetry")[0][:4] == ["telemetry", "4", "devices/#", "2h"]
    table = {int(r[1]): int(r[3]) for r in rows(out.stdout, "telemetry")[1:]}
    assert table == {p["partition"]: p["high_water_mark"] for p in parts}
    pub.disconnect()


def test_sessions_report_position_and_lag(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(config=STREAMS)
    # A persistent 3.1.1 session that goes offline, and a connected 5.0 one.
    away = Client(broker.port, "away", V311, clean=False)
    assert away.connect() == 0
    away.subscribe("devices/d1/telemetry", qos=1)
    away.disconnect()
    here = Client(broker.port, "here", V5, clean=False, session_expiry=600)
    assert here.connect() == 0
    here.subscribe("devices/d1/telemetry", qos=1)
    here.subscribe("$share/workers/devices/#", qos=1)
    clean = Client(broker.port, "clean", V311)  # not persistent: not listed
    assert clean.connect() == 0
    clean.subscribe("devices/#")

    pub = Client(broker.port, "pub")
    pub.connect()
    for i in range(5):
        pub.publish("devices/d1/telemetry", str(i), qos=1)
    # The connected session reads all 5 (plus the group's copies); the offline one lags by 5.
    assert len(here.expect(10)) == 10

    def positions() -> dict[str, dict[str, Any]]:
        return {s["client_id"]: s for s in get(broker, "/api/v1/sessions")["sessions"]}

    deadline = time.monotonic() + 5
    while positions()["here"]["positions"][0]["lag"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    sessions = positions()
    assert set(sessions) == {"away", "here"}
    assert sessions["away"]["connected"] is False and sessions["here"]["connected"] is True
    assert {s["filter"] for s in sessions["here"]["subscriptions"]} == {
        "devices/d1/telemetry",
        "$share/workers/devices/#",
    }
    (pos,) = sessions["away"]["positions"]
    assert (pos["stream"], pos["offset"], pos["high_water_mark"], pos["lag"]) == (
        "telemetry",
        0,
        5,
        5,
    )
    (pos,) = sessions["here"]["positions"]
    assert (pos["offset"], pos["lag"]) == (5, 0)
    (group,) = get(broker, "/api/v1/sessions")["shared_groups"]
    assert group["members"] == ["here"]
    assert sorted(
        (p["stream"], p["partition"]) for p in group["positions"] if p["stream"] == "telemetry"
    ) == [("telemetry", i) for i in range(4)]

    out = mqlog("offsets", "--broker", broker.http_url)
    assert out.returncode == 0, out.stderr
    (away_row,) = rows(out.stdout, "away")
    assert away_row[1] == "offline" and away_row[-3:] == ["0", "5", "5"]
    (here_row,) = rows(out.stdout, "here")
    assert here_row[1] == "connected" and here_row[-1] == "0"
    assert "clean" not in out.stdout
    group_rows = [r for r in rows(out.stdout, "$share/workers/devices/#") if r[2] == "telemetry"]
    assert len(group_rows) == 4 and sum(int(r[-2]) for r in group_rows) == 5

    # It goes on from its committed offset: the lag disappears once it reads.
    away = Client(broker.port, "away", V311, clean=False)
    away.connect()
    assert [m.payload for m in away.expect(5)] == [str(i).encode() for i in range(5)]
    deadline = time.monotonic() + 5
    while positions()["away"]["positions"][0]["lag"] != 0:
        assert time.monotonic() < deadline, positions()["away"]
        time.sleep(0.05)
    for c in (away, here, clean, pub):
        c.disconnect()


@pytest.mark.parametrize("command", ["streams", "offsets"])
def test_cli_reports_unreachable_broker(command: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = mqlog(command, "--broker", url)
    assert out.returncode == 1
    assert "cannot reach the broker's HTTP API at " + url in out.stderr
    assert "Traceback" not in out.stderr


def test_http_can_be_disabled(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(start=False)
    text = broker.config_path.read_text().replace("[http]\n", "[http]\nenabled = false\n")
    broker.config_path.write_text(text)
    broker.start()
    assert "listening on http://" not in broker.log()
    with pytest.raises(urllib.error.URLError):
        get(broker, "/healthz")
