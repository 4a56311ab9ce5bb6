"""`mqlog serve` start-up failures: each is one clear line and a non-zero exit, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, BrokerFactory, free_port


def _serve(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker.cli", "serve", "-c", str(config), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_second_broker_on_the_same_data_dir_is_refused(broker_factory: BrokerFactory) -> None:
    first = broker_factory()
    out = _serve(
        first.config_path,
        "--port",
        str(free_port()),
        "--http-port",
        str(free_port()),
        "--workers",
        str(first.workers),
    )
    assert out.returncode == 2
    assert "data directory is in use by another mqlog process" in out.stderr
    assert str(first.data_dir) in out.stderr
    assert "Traceback" not in out.stderr
    assert first.alive()


def test_port_in_use_is_a_clear_error(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    b = broker_factory(start=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _serve(b.config_path, "--port", str(port), "--workers", str(b.workers))
    assert out.returncode == 2
    assert "cannot listen" in out.stderr and "address already in use" in out.stderr.lower()
    assert "Traceback" not in out.stderr
    # The lock was released: the same data directory serves normally afterwards.
    b.start()
    assert b.alive()


def test_http_port_in_use_is_a_clear_error(broker_factory: BrokerFactory) -> None:
    """Refused at once, before any worker serves (with several, worker 0 alone binds it and
    used to fail after worker 1 served, then wait for it)."""
    b = broker_factory(start=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        out = _serve(b.config_path, "--http-port", str(port), "--workers", str(b.workers))
        took = time.monotonic() - started
    assert out.returncode == 2
    assert "cannot listen" in out.stderr and "address already in use" in out.stderr.lower()
    assert "Traceback" not in out.stderr
    assert took < 8, f"took {took:.1f} s to refuse"


def test_one_port_for_two_listeners_is_refused(broker_factory: BrokerFactory) -> None:
    b = broker_factory(start=False)
    out = _serve(b.config_path, "--http-port", str(b.port), "--workers", str(b.workers))
    assert out.returncode == 2
    assert f"http.port = {b.port} is also server.port" in out.stderr
    assert str(b.config_path) in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("text", "key"),
    [
        pytest.param('[router]\nmax_inflight = "many"\n', "router.max_inflight", id="bad-value"),
        pytest.param("[router]\nworkers = 300\n", "router.workers", id="too-many-workers"),
    ],
)
def test_serve_with_bad_config_exits_nonzero(tmp_path: Path, text: str, key: str) -> None:
    """A bad value is one line naming the key and the file (moved from tests/unit/
    test_config.py: it starts ``mqlog serve``, a process)."""
    p = tmp_path / "broker.toml"
    p.write_text(text)
    proc = _serve(p, "--data-dir", str(tmp_path / "data"))
    assert proc.returncode != 0
    assert key in proc.stderr and str(p) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
