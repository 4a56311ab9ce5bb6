"""The benchmark's delivery check (bench/loadgen.py ``Check``): every publisher's sequence
numbers must arrive 0, 1, 2, ... on each subscriber; what is missing, repeated or out of
order is counted, also across the batches one connection's reads deliver."""

from __future__ import annotations

import numpy as np

from bench.loadgen import Check


def feed(check: Check, *pairs: tuple[int, int]) -> None:
    pub, seq = zip(*pairs, strict=True)
    check.feed(np.array(pub, dtype=np.uint16), np.array(seq, dtype=np.uint32))


def test_in_order_interleaved_publishers_across_reads() -> None:
    check = Check(n_pubs=3)
    feed(check, (0, 0), (1, 0), (0, 1), (2, 0), (1, 1))
    feed(check, (2, 1), (0, 2), (1, 2), (2, 2))
    assert (check.received, check.gaps, check.dup_reorder) == (9, 0, 0)


def test_a_missing_message_is_a_gap() -> None:
    check = Check(n_pubs=2)
    feed(check, (0, 0), (1, 0), (0, 1), (0, 3), (1, 1))
    assert (check.gaps, check.dup_reorder) == (1, 0)


def test_missing_between_two_reads_and_at_the_start() -> None:
    check = Check(n_pubs=2)
    feed(check, (0, 0), (0, 1), (1, 2))  # publisher 1's 0 and 1 never came
    feed(check, (0, 5), (1, 3))  # publisher 0's 2, 3 and 4 neither
    assert (check.received, check.gaps, check.dup_reorder) == (5, 5, 0)


def test_a_duplicate_and_a_reorder_are_counted() -> None:
    check = Check(n_pubs=2)
    feed(check, (1, 0), (1, 1), (1, 1), (1, 2))  # 1 delivered twice
    assert (check.gaps, check.dup_reorder) == (0, 1)
    feed(check, (0, 0), (0, 2), (0, 1))  # 2 before 1: a gap that a late 1 then fills
    assert (check.gaps, check.dup_reorder) == (1, 2)
    feed(check, (1, 2))  # publisher 1's last, again, in a later read
    assert check.dup_reorder == 3
