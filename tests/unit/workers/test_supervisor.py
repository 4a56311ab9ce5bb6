"""The supervisor, driving stand-in workers (toy_worker.py) in real processes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TOY = Path(__file__).with_name("toy_worker.py")


class Running:
    def __init__(self, data_dir: Path, port: int, count: int, *extra: str) -> None:
        self.log = data_dir.parent / f"{data_dir.name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(TOY), str(data_dir), str(port), str(count), *extra],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str, timeout: float = 20) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text())
            if found:
                return found
            time.sleep(0.02)
        raise AssertionError(f"no {pattern!r} in:\n{self.text()}")

    def port(self) -> int:
        return int(self.wait_for(r"listening on (\d+)").group(1))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[list[Running]]:
    started: list[Running] = []
    yield started
    for r in started:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()


def ask(port: int) -> tuple[int, int]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        index, pid = s.makefile().readline().split()
    return int(index), int(pid)


def test_workers_share_the_port_and_a_dead_one_is_restarted(
    tmp_path: Path, running: list[Running]
) -> None:
    sup = Running(tmp_path / "data", 0, 2)
    running.append(sup)
    sup.wait_for("2 workers serving")
    port = sup.port()
    seen = {}
    for _ in range(200):
        index, pid = ask(port)
        seen[index] = pid
        if len(seen) == 2:
            break
    assert sorted(seen) == [0, 1]  # SO_REUSEPORT spreads connections over both
    os.kill(seen[1], signal.SIGKILL)
    sup.wait_for(rf"worker 1 \(pid {seen[1]}\) was killed by SIGKILL; restarting it")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        index, restarted = ask(port)
        if index == 1 and restarted != seen[1]:
            break
    else:
        raise AssertionError("the restarted worker 1 never answered")
    assert sup.stop() == 0
    for pid in (seen[0], restarted):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_taken_port_is_one_line_and_no_worker_starts(
    tmp_path: Path, running: list[Running]
) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    sup = Running(tmp_path / "data", holder.getsockname()[1], 2)
    running.append(sup)
    assert sup.proc.wait(20) == 2
    holder.close()
    assert re.fullmatch(
        r"mqlog: cannot listen on 127\.0\.0\.1:\d+: Address already in use\n", sup.text()
    )


def test_the_data_directory_is_locked_for_the_whole_broker(
    tmp_path: Path, running: list[Running]
) -> None:
    first = Running(tmp_path / "data", 0, 2)
    running.append(first)
    first.wait_for("2 workers serving")
    second = Running(tmp_path / "data", 0, 2)
    running.append(second)
    assert second.proc.wait(20) == 2
    assert "data directory is in use by another mqlog process" in second.text()
    assert first.stop() == 0


def test_a_worker_failing_at_start_fails_the_start(tmp_path: Path, running: list[Running]) -> None:
    sup = Running(tmp_path / "data", 0, 2, "fail")
    running.append(sup)
    assert sup.proc.wait(20) == 2
    text = sup.text()
    assert "worker 1: cannot start: told to fail" in text
    assert "worker 1 failed to start (exited with status 3)" in text
    # Worker 0 was stopped, not left behind.
    pid0 = int(re.search(r"worker 0: started, pid (\d+)", text).group(1))  # type: ignore[union-attr]
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)
