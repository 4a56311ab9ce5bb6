"""mqlog with one worker against mqlog with N worker processes, in one run (issue 5).

The same scenarios and load generator as :mod:`bench.mqtt_bench` (fan-in and fan-out, QoS 0
and 1; the generator runs in its own processes), on ``config/broker.toml`` as shipped but for
``--workers``: 1, then N, interleaved per scenario (the order alternates with ``--runs``).
Broker CPU is the sum over the supervisor and its workers. Besides throughput, the table
shows where the broker's time went: CPU seconds per process, and how many records crossed
between workers (``mqlog_records_forwarded_total``: publishes that arrived on a worker not
owning their partition and went to the owner).

Run: ``.venv/bin/python -m bench.workers_bench [--workers 2] [--runs 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.mqtt_bench import (
    RESULTS,
    Figure,
    Mqlog,
    fanin,
    fanout,
    load_avg,
    wait_port,
)
from bench.ports import free_port

SCENARIOS = ("fanin0", "fanin1", "fanout0", "fanout1")


class MqlogWorkers(Mqlog):
    """mqlog with ``--workers N`` (CPU and RSS are summed over its processes by Mqlog)."""

    def __init__(self, tmp: Path, workers: int) -> None:
        super().__init__(tmp, name=f"mqlog-w{workers}")
        self.workers = workers
        self.http_port = 0

    def start(self) -> None:
        data = self.tmp / f"{self.name}-data"
        self.http_port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "broker.cli",
            "--log-level",
            "WARNING",
            "serve",
            "-c",
            str(self.src / "config" / "broker.toml"),
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            "--data-dir",
            str(data),
            "--workers",
            str(self.workers),
        ]
        env = {**os.environ, "PYTHONPATH": str(self.src)}
        self.proc = subprocess.Popen(cmd, cwd=self.src, env=env)
        wait_port(self.port, self.proc)
        self.pid = self.proc.pid
        time.sleep(0.5)  # every worker listening, not just the first

    def forwarded(self) -> float:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.http_port}/metrics", timeout=10
        ) as resp:
            text = resp.read().decode()
        m = re.search(r"^mqlog_records_forwarded_total (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


def run(scenario: str, broker: MqlogWorkers, quick: bool, tag: str) -> dict[str, Any]:
    cpu0 = broker.cpu_by_process()
    fwd0 = broker.forwarded()
    qos = int(scenario[-1])
    fig: Figure = (fanin if scenario.startswith("fanin") else fanout)(broker, qos, quick, tag)
    cpu1 = broker.cpu_by_process()
    return {
        "scenario": scenario,
        "workers": broker.workers,
        "value": fig.value,
        "unit": fig.unit,
        "lost": fig.lost,
        "broker_cpu": fig.m["broker_cpu"],
        "gen_cpu": fig.m["gen_cpu"],
        "elapsed": fig.m["elapsed"],
        "cpu_by_process": [round(b - a, 2) for a, b in zip(cpu0, cpu1, strict=False)],
        "forwarded": broker.forwarded() - fwd0,
        "received": fig.m["received"],
        "load": load_avg(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="workers_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="N to compare with 1")
    ap.add_argument("--runs", type=int, default=1, help="repeat; the table shows medians")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--scenario", default=",".join(SCENARIOS))
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenario.split(",") if s]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mqlog-workers-bench-") as tmp:
        brokers = [MqlogWorkers(Path(tmp), 1), MqlogWorkers(Path(tmp), args.workers)]
        for b in brokers:
            b.start()
        try:
            for run_no in range(args.runs):
                for scenario in scenarios:
                    order = brokers if run_no % 2 == 0 else brokers[::-1]
                    for b in order:
                        row = run(scenario, b, args.quick, f"{scenario}-r{run_no}-{b.name}")
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            for b in brokers:
                b.stop()
    print(table(rows, args.workers))
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "workers_bench.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return 0


def table(rows: list[dict[str, Any]], n: int) -> str:
    lines = [
        f"| scenario | unit | workers=1 | workers={n} | scaling | broker CPU s (1 / {n}) "
        f"| CPU s per process, workers={n} (supervisor, workers...) | forwarded | lost |",
        "|---|---|---:|---:|---:|---|---|---:|---:|",
    ]
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        one = [r for r in rows if r["scenario"] == scenario and r["workers"] == 1]
        many = [r for r in rows if r["scenario"] == scenario and r["workers"] == n]
        v1 = statistics.median(r["value"] for r in one)
        vn = statistics.median(r["value"] for r in many)
        last = many[-1]
        lines.append(
            f"| {scenario} | {one[0]['unit']} | {v1:,.0f} | {vn:,.0f} | {vn / v1:.2f}x | "
            f"{statistics.median(r['broker_cpu'] for r in one):.1f} / "
            f"{statistics.median(r['broker_cpu'] for r in many):.1f} | "
            f"{', '.join(map(str, last['cpu_by_process']))} | "
            f"{statistics.median(r['forwarded'] for r in many):,.0f} | "
            f"{sum(r['lost'] for r in one + many)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
