"""Churn on two workers (bench/churn.py): devices taken over, cut off and reconnecting while
their connections are handed between workers, and a worker killed (-9) now and then, lose no
acknowledged publish or command and no persistent session, a shared subscription's members
(coming and going) get every acknowledged publish between them, a connection taken over is
always closed [MQTT-3.1.4-3], and every connection that ended without DISCONNECT (aborted,
taken over, or its worker killed) has its will published [MQTT-3.1.2-8].

A short run of the benchmark's workload (``python -m bench.churn --runs N`` runs longer
ones). Two races of broker/workers/sessions.py, both fixed on 2026-11-29, showed here on the
code before their fixes: a takeover racing a hand-off left two connections holding one client
id (``not_closed``), and a restarting worker answered its peers' claims before it had loaded
its sessions (``sessions_lost``, ``commands_lost``). On the code before the fixes of
broker/router/lifecycle.py of 2026-11-29 (evening), wills were lost at each kill: the home
worker published the wills of the sessions the dead worker held to partitions the dead
worker owned (the forwards refused, the wills dropped), a persistent session's will was
written at the next tick only (a kill before it left the previous connection's state), and
a device back on another worker before its home's next tick cancelled the due will (one in
ten lost then; about one in a thousand still is, rarely here: not fixed yet).
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

from bench.churn import churn, worker_killer
from tests.integration.conftest import BrokerProcess

STREAMS = '[[streams]]\nname = "churn"\ntopic_filter = ["churn/#"]\npartitions = 4\n'


def test_churn_and_worker_kills_lose_nothing_and_leave_one_holder(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "b", STREAMS, workers=2)
    broker.start()
    try:
        assert broker.proc is not None
        kill = worker_killer(broker.proc.pid, seed=7)
        report = asyncio.run(
            churn(
                broker.host,
                broker.port,
                seconds=15,
                devices=40,
                seed=7,
                kill=kill,
                kill_every=3,
                shared=2,
                wills=True,
            )
        )
        with urllib.request.urlopen(f"{broker.http_url}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        broker.stop()
    assert report.takeovers > 50 and report.aborts > 30 and len(report.kills) >= 2, report
    assert report.acked > 1000 and report.commands_acked > 100, report
    assert not report.not_closed, f"taken over, still open: {report.not_closed}"
    assert not report.lost, f"acknowledged, not in the log: {report.lost[:10]}"
    assert not report.sessions_lost, f"persistent sessions lost: {report.sessions_lost}"
    assert not report.shared_lost, f"not given to the group: {report.shared_lost[:10]}"
    assert not report.commands_lost, f"acknowledged, not delivered: {report.commands_lost[:10]}"
    assert report.wills_expected > 100, report
    # At most one in 200 (the code before the fixes lost about one in ten): a narrower race,
    # not fixed yet, still loses one now and then, more often with three workers or a busy
    # machine (docs/bench, "Wills and retained messages under worker kills").
    assert len(report.wills_lost) <= report.wills_expected // 200, (
        f"wills never published: {len(report.wills_lost)} of {report.wills_expected}, "
        f"{report.wills_lost[:10]}"
    )
    handed = re.search(r"^mqlog_connections_handed_off_total (\S+)$", metrics, re.M)
    assert handed and float(handed.group(1)) > 20, "the devices were not handed between workers"
