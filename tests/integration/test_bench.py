"""The broker benchmark end to end (`mqlog bench`, bench/mqtt_bench.py), as a user runs it:
a quick run of two scenarios on mqlog and Mosquitto must measure both, check every delivery,
and write the table, the JSON lines and the chart. Its figures are not judged here (speed is
for the benchmark's own runs, never a timed test); that it measures is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench.nats import nats_server
from tests.integration.conftest import ROOT


def _quick_bench(results: Path, *args: str) -> str:
    """``python -m bench.mqtt_bench --quick ARGS`` writing into ``results``: its output, once it
    ended well."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.mqtt_bench", "--quick", *args, "--results", str(results)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # a benchmark run of two brokers: about a minute
def test_quick_bench_measures_mqlog_and_mosquitto(tmp_path: Path) -> None:
    stdout = _quick_bench(
        tmp_path, "--runs", "1", "--scenario", "fanin1,fanout0", "--brokers", "mqlog,mosquitto"
    )
    for scenario in ("fanin1", "fanout0"):
        for broker in ("mqlog", "mosquitto"):
            line = re.search(
                rf"run 0 {scenario}\s+{broker}\s+([\d,.]+) \S+\s+lost (\d+) "
                rf"dup/reorder (\d+)",
                stdout,
            )
            assert line is not None, (scenario, broker, stdout)
            assert float(line[1].replace(",", "")) > 0
            assert line[2] == line[3] == "0", line[0]  # every delivery arrived, once, in order
    table = stdout.split("mqlog vs Mosquitto 2", 1)[1]
    assert re.search(r"fan-in QoS 1 .*\d\.\d\dx", table), table
    assert re.search(r"fan-out QoS 0 .*\d\.\d\dx", table), table

    lines = [orjson.loads(x) for x in (tmp_path / "mqtt_bench.jsonl").read_bytes().splitlines()]
    measured = {(x["scenario"], x["broker"]) for x in lines if not x.get("summary")}
    assert measured == {(s, b) for s in ("fanin1", "fanout0") for b in ("mqlog", "mosquitto")}
    (summary,) = [x for x in lines if x.get("summary")]
    assert set(summary["ratios_favouring_mqlog"]) == {"fanin1", "fanout0"}
    assert all(r > 0 for r in summary["ratios_favouring_mqlog"].values())
    assert (tmp_path / "mqtt_bench.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow  # NATS and mqlog, one small scenario: about 15 s
@pytest.mark.skipif(
    nats_server() is None,
    reason="nats-server is not installed (scripts/install-system-deps.sh installs it)",
)
def test_quick_bench_measures_nats(tmp_path: Path) -> None:
    """NATS (MQTT on JetStream's file store) as the optional broker: it starts, serves the
    QoS 1 fan-in with every delivery checked, and has its own columns in the table."""
    stdout = _quick_bench(tmp_path, "--scenario", "fanin1", "--brokers", "mqlog,nats")
    line = re.search(
        r"run 0 fanin1\s+nats\s+([\d,.]+) msg/s\s+lost (\d+) dup/reorder (\d+)", stdout
    )
    assert line is not None, stdout
    assert float(line[1].replace(",", "")) > 0
    assert line[2] == line[3] == "0", line[0]
    table = stdout.split("mqlog vs Mosquitto 2", 1)[1]
    assert "mqlog/nats" in table, table  # NATS's columns, with mqlog's ratio to it
    assert re.search(r"fan-in QoS 1 .*\d\.\d\dx", table), table
    lines = [orjson.loads(x) for x in (tmp_path / "mqtt_bench.jsonl").read_bytes().splitlines()]
    assert {x["broker"] for x in lines if not x.get("summary")} == {"mqlog", "nats"}
