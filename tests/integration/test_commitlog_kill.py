"""SIGKILL a process appending with fsync=always: every offset it was told about survives.

A child process opens the log, appends batches and prints ``<base> <count>`` (flushed) after
each ``append`` returns. The test kills it with SIGKILL at a random moment after a few hundred
appends, reads whatever the child managed to print, reopens the log and checks that every
reported record is there with the right content. The child's records are a pure function of
their offset, so the test can also check everything else in the log: records past the last
reported one may exist only as one whole batch (the append the kill interrupted), never as a
part of one. Several rounds run on the same directory, so each child also recovers the log
left by the previous kill.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.commitlog.config import LogConfig
from broker.commitlog.log import SegmentedLog
from broker.commitlog.record import Record

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 4
CONFIG = LogConfig(segment_bytes=64 * 1024, index_interval_bytes=1024, fsync="always")


def batch_size(base: int) -> int:
    return random.Random(base).randint(1, 8)


def record_at(o: int) -> Record:
    """The content the writer puts at offset o (so any record in the log can be checked)."""
    return Record(
        offset=o,
        timestamp=1_700_000_000_000 + o,
        topic=f"kill/{o % 13}",
        payload=(b"%d:" % o) * (1 + o % 40),
        qos=o % 3,
        retain=o % 5 == 0,
        client_id=f"writer-{o % 7}",
        properties=b"" if o % 4 else b"\x01\x01",
    )


def writer_main(directory: str) -> None:
    """The child: append forever, report each batch on stdout once append() has returned."""
    log = SegmentedLog.open(Path(directory), CONFIG)
    out = sys.stdout
    while True:
        base = log.end_offset
        n = batch_size(base)
        first = log.append([record_at(o) for o in range(base, base + n)])
        out.write(f"{first} {n}\n")
        out.flush()


CHILD = (
    "import sys\n"
    "from tests.integration.test_commitlog_kill import writer_main\n"
    "writer_main(sys.argv[1])\n"
)


def python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def run_and_kill(directory: Path, rng: random.Random) -> list[tuple[int, int]]:
    """Start a writer, SIGKILL it after a random number of appends; return what it reported."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen(
        [python(), "-c", CHILD, str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    assert child.stdout is not None and child.stderr is not None
    kill_after = rng.randint(200, 600)
    raw = b""
    try:
        seen = 0
        while seen < kill_after:
            line = child.stdout.readline()
            if not line:
                raise AssertionError(
                    f"writer exited early ({child.wait()}): {child.stderr.read().decode()}"
                )
            raw += line
            seen += 1
        time.sleep(rng.random() * 0.02)  # a random moment, likely mid-append
        child.send_signal(signal.SIGKILL)
        raw += child.stdout.read()  # lines printed before the kill count too
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    reported = []
    for line in raw.split(b"\n"):
        parts = line.split()
        if len(parts) == 2:  # a torn last line (no newline yet) has fewer fields or none
            reported.append((int(parts[0]), int(parts[1])))
    return reported


@pytest.mark.slow  # a kill loop
def test_sigkill_loses_no_reported_offset(tmp_path: Path) -> None:
    directory = tmp_path / "kill" / "0"
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    reported: list[tuple[int, int]] = []
    for round_no in range(ROUNDS):
        new = run_and_kill(directory, rng)
        assert len(new) >= 200, (seed, round_no)
        reported.extend(new)
        log = SegmentedLog.open(directory, CONFIG)
        try:
            check(log, reported, f"seed={seed} round={round_no}")
        finally:
            log.close()


def check(log: SegmentedLog, reported: list[tuple[int, int]], where: str) -> None:
    expected_end = 0
    for base, n in reported:
        # Batches are contiguous (a killed, unreported append may sit between two rounds).
        assert base >= expected_end, where
        assert n == batch_size(base), where
        expected_end = base + n
    assert log.log_start_offset == 0, where
    end = log.end_offset
    assert end >= expected_end, (where, end, expected_end)
    # Past the last reported batch: nothing, or exactly one whole batch.
    assert end in (expected_end, expected_end + batch_size(expected_end)), (where, end)
    offset = 0
    while offset < end:
        chunk = log.read(offset, max_records=500)
        assert chunk, where
        for r in chunk:
            assert r.offset == offset, where
            assert r == record_at(offset), (where, offset)
            offset += 1
    # A reopened log is writable where the last one stopped.
    first = log.append([record_at(end)])
    assert first == end, where
    assert log.read(end) == [record_at(end)]
