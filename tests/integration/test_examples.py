"""Smoke test of examples/iot against a real broker: each example runs briefly, as a user
would start it, and what it prints must agree with what the others did."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.integration.conftest import ROOT, BrokerProcess

EXAMPLES = ROOT / "examples" / "iot"


def run(script: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(proc: subprocess.Popen[str], prefix: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(prefix), (line, proc.stderr.read() if proc.stderr else "")


def test_fleet_dashboard_replay(broker: BrokerProcess) -> None:
    port = str(broker.port)
    dashboard = start("dashboard.py", "--port", port, "--interval", "1", "--duration", "3")
    wait_for_line(dashboard, "dashboard: subscribed to devices/+/telemetry")

    fleet = run(
        "fleet.py",
        "--port",
        port,
        "--devices",
        "3",
        "--rate",
        "10",
        "--qos",
        "1",
        "--duration",
        "1.5",
    )
    assert fleet.returncode == 0, fleet.stderr
    m = re.search(r"fleet: done: 3 devices sent (\d+) messages .* acknowledged (\d+)", fleet.stdout)
    assert m, fleet.stdout
    sent, acked = int(m.group(1)), int(m.group(2))
    assert sent >= 3 * 10 and acked == sent  # ~10 msg/s each for 1.5 s, all acknowledged

    out, err = dashboard.communicate(timeout=20)
    assert dashboard.returncode == 0, err
    final = out.strip().split("\n\n")[-1].splitlines()
    assert final[0].endswith(f"3 devices, {sent} messages"), final
    assert final[1].split()[-2:] == ["LATENCY", "ms"], final  # device stamp to dashboard
    rows = {line.split()[0]: line.split() for line in final[2:]}
    assert sorted(rows) == ["dev-000", "dev-001", "dev-002"]
    for dev, cols in rows.items():
        count, seq = int(cols[1]), int(cols[3])
        assert count == seq + 1, (dev, cols)  # latest seq = messages seen - 1, none lost
        assert -40 < float(cols[4]) < 80 and 0 <= float(cols[6]) <= 100

    replay = run("replay.py", "--port", port, "--from", "earliest", "--count", str(sent))
    assert replay.returncode == 0, replay.stderr
    lines = [ln for ln in replay.stdout.splitlines() if ln.startswith("partition=")]
    assert len(lines) == sent
    seen = {
        tuple(re.match(r"partition=(\d+) offset=(\d+)", ln).groups())  # type: ignore[union-attr]
        for ln in lines
    }
    assert len(seen) == sent  # a distinct (partition, offset) per message
    assert f"replay: {sent} messages" in replay.stdout

    # From an offset: the single-partition default stream resumes exactly there.
    tail = run("replay.py", "--port", port, "--offset", str(sent - 5), "--idle", "1")
    assert tail.returncode == 0, tail.stderr
    offsets = [int(x) for x in re.findall(r"offset=(\d+)", tail.stdout)]
    assert offsets == list(range(sent - 5, sent))

    since = run(
        "replay.py",
        "--port",
        port,
        "--since",
        "1h",
        "--idle",
        "1",
        "--filter",
        "devices/dev-001/telemetry",
    )
    assert since.returncode == 0, since.stderr
    assert since.stdout.count("devices/dev-001/telemetry seq=") == int(rows["dev-001"][1])


def test_examples_report_unreachable_broker() -> None:
    from tests.integration.conftest import free_port

    port = str(free_port())
    for script, extra in (
        ("fleet.py", ["--duration", "1"]),
        ("dashboard.py", []),
        ("replay.py", []),
    ):
        out = run(script, "--port", port, *extra, timeout=20)
        assert out.returncode == 1
        assert "cannot connect to 127.0.0.1:" + port in out.stderr
        assert "Traceback" not in out.stderr
