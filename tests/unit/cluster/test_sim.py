"""The simulator passes the correct core and catches each known-bad variant within a bound.

Bounds: each variant must fail within ``CATCH_WITHIN`` seeds from seed 0 (3 nodes, 8 groups).
With membership changes, retention, clock skew, entries of 1-5 records and torn writes in the
workload, the first failing seed and how many of seeds 0-19 fail, measured before commit
notices (``broker.cluster.commits``) changed every run's messages: commit-unflushed 0 (20 of
20), learners-count 0 (19), no-prev-term-check 0 (9), truncate-below-commit 0 (18),
vote-before-persist 1 (4: it needs a crash inside the few milliseconds between a vote leaving
and its hard state landing). The membership variant concurrent-changes runs on 5 nodes (3
voters and 2 spare nodes: with 3 nodes two quick changes cannot build disjoint majorities out
of 3 voters): first failing seed 4 (9 of 20). With commit notices: no-prev-term-check first
fails at seed 4; commit-notice-unchecked at seed 3 (6 of 20: a lagging follower told a commit
past its log). Bounding a notice by the follower's own last index instead of what it matched,
the subtler bug, escaped 30 seeds; tests/unit/cluster/test_raft.py's notice tests hold it.
"""

from __future__ import annotations

import pytest

from broker.cluster.raft import Variant
from broker.cluster.sim import Sim, Violation, main, run_seed, run_seeds

CATCH_WITHIN = 30


@pytest.mark.parametrize(
    "variant",
    [
        # The vote variant needs a crash inside the few ms a vote's hard state is in flight:
        # few seeds catch it (4 of 20), so the unit tier leaves it to make test.
        pytest.param(v, marks=pytest.mark.slow) if v is Variant.VOTE_BEFORE_PERSIST else v
        for v in Variant
        if v is not Variant.CORRECT
    ],
)
def test_each_bad_variant_is_caught(variant: Variant) -> None:
    nodes = 5 if variant is Variant.CONCURRENT_CHANGES else 3
    outcome = run_seeds(range(CATCH_WITHIN), nodes, variant=variant, stop_at_first=True)
    assert outcome.violations, f"{variant.value} passed {outcome.seeds} seeds"


def test_correct_core_passes() -> None:
    outcome = run_seeds(range(12))
    assert (outcome.violations, outcome.stuck) == ([], [])
    assert outcome.events > 100_000


def test_five_nodes_pass_while_members_change_and_snapshots_are_installed() -> None:
    outcome = run_seeds(range(100, 103), nodes=5, groups=4)
    assert (outcome.violations, outcome.stuck) == ([], [])
    for happened in ("add-learner", "promote", "remove", "snapshots installed", "retention"):
        assert outcome.counts[happened] > 0, happened


def test_a_seed_replays_exactly() -> None:
    def trace(seed: int) -> tuple[int, list[tuple[int, str]]]:
        sim = Sim(seed, variant=Variant.NO_PREV_TERM_CHECK)
        with pytest.raises(Violation):
            sim.run()
        return sim.events, list(sim.trace)

    first = trace(4)  # the first seed that catches the variant
    assert first == trace(4)
    assert len(first[1]) == 30


def test_cli_contract(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "2", "--start", "7", "--groups", "4"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("seeds: 2, events: ") and last.endswith("violations: 0, stuck: 0")
    assert main(["--seeds", "1", "--variant", "commit-unflushed"]) == 1
    out = capsys.readouterr().out
    assert "seed 0: VIOLATION" in out and out.splitlines()[-1].endswith("violations: 1, stuck: 0")


def test_jobs_run_seeds_in_parallel_with_the_same_output(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--seeds", "3", "--groups", "4", "--variant", "commit-unflushed"]
    assert main(args) == 1
    alone = capsys.readouterr().out
    assert main([*args, "--jobs", "2"]) == 1
    assert capsys.readouterr().out == alone
    assert "VIOLATION" in alone
    with pytest.raises(SystemExit):
        main(["--jobs", "0"])


@pytest.mark.slow
def test_many_seeds_pass() -> None:
    # Two processes: the suite runs one test at a time on a machine of two cores.
    outcome = run_seeds(range(1000, 1300), jobs=2)
    assert (outcome.violations, outcome.stuck) == ([], [])


def test_a_window_of_lost_appends_is_resent() -> None:
    """Seed 8486 of the 10,000-seed run: a follower in REPLICATE lost a full window of
    AppendEntries and went on answering heartbeats at its old match; those answers counted as
    acknowledgements, so the leader never probed it again and the group's proposals never
    committed (stuck). Fixed in ``Progress.acknowledged``."""
    _events, _counts, failure, report = run_seed(8486, 3, 8, Variant.CORRECT)
    assert failure is None, report
