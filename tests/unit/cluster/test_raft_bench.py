"""bench/raft_core.py runs and counts what it claims: every proposal commits on its leader in
each mode, idle groups beat as configured without quiescence and not at all with it."""

from __future__ import annotations

import pytest

from bench.raft_core import CONFIG, MODES, TICKS_PER_S, measure_busy, measure_idle


@pytest.mark.parametrize("mode", MODES)
def test_busy_commits_every_proposal(mode: str) -> None:
    row = measure_busy(mode, groups=3, rounds=2, per_round=4)
    assert row["committed"] == 3 * 2 * 4
    assert row["committed_per_s"] > 0 and row["cpu_us_per_batch"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_idle_groups_beat_unless_quiesced(mode: str) -> None:
    row = measure_idle(mode, groups=20, seconds=0.5)
    # Without quiescence a leader beats to its 2 followers every heartbeat interval; with it
    # nothing beats, also with one of the three nodes down (quiesced over the live ones).
    beats = 0.0 if mode in ("quiet", "down") else 2 * TICKS_PER_S / CONFIG.heartbeat_ticks
    assert row["idle_beats_per_group_s"] == beats
    assert row["idle_seconds"] == 0.5 and row["idle_cpu_us_per_group_s"] > 0
