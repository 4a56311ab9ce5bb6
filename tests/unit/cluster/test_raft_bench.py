"""bench/raft_core.py runs and counts what it claims: every proposal commits on its leader."""

from __future__ import annotations

from bench.raft_core import measure


def test_measure_commits_every_proposal_and_reports_costs() -> None:
    row = measure(groups=3, rounds=2, per_round=4, idle_seconds=1)
    assert row["committed"] == 3 * 2 * 4
    assert row["committed_per_s"] > 0 and row["cpu_us_per_batch"] > 0
    assert row["idle_cpu_us_per_group_s"] > 0
