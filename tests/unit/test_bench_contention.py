"""The contended fleet's competing load (bench/mqtt_bench.py ``contention``): a real process,
pinned to its one core and busy there while the block runs, gone after it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.mqtt_bench import contention


def _children() -> set[int]:
    me = os.getpid()
    return {int(pid) for pid in Path(f"/proc/{me}/task/{me}/children").read_text().split()}


def test_the_spinner_is_pinned_busy_and_ends_with_the_block() -> None:
    cpu = max(os.sched_getaffinity(0))
    before = _children()
    with contention(cpu) as share:
        (spinner,) = _children() - before
        deadline = time.monotonic() + 10
        while os.sched_getaffinity(spinner) != {cpu} and time.monotonic() < deadline:
            time.sleep(0.01)  # it pins itself as it starts
        assert os.sched_getaffinity(spinner) == {cpu}
        time.sleep(0.5)
        assert share() > 5  # % of its core: it spins (far more on an idle core)
    assert spinner not in _children()  # killed and reaped
