"""The brokers' fork server (tests.integration.launcher) runs ``mqlog`` as ``python -m
broker.cli`` does: the same output in the log, the same exit status, signals reach it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.integration.launcher import launcher


def test_a_launched_command_exits_with_its_status_and_output(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    log = tmp_path / "out.log"
    proc = launcher().spawn(["serve", "-c", str(missing)], log, dict(os.environ))
    assert proc.wait(30) == 2  # a config error (broker.cli.main)
    assert "cannot read config file" in log.read_text()
    assert proc.poll() == 2


def test_a_launched_broker_stops_on_sigterm_and_wait_times_out_before(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(
        f'[server]\nport = 0\n[commitlog]\ndata_dir = "{tmp_path / "data"}"\n[http]\nport = 0\n'
    )
    log = tmp_path / "broker.log"
    proc = launcher().spawn(["serve", "-c", str(config)], log, dict(os.environ))
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)  # serving: no status yet
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
