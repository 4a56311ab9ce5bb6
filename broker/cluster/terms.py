"""The shape of a Raft log as the core needs it: its last index and the term of each index.

Kept as runs ``(first_index, term)`` ascending in both, the "term -> first index" table the
segmented log rebuilds at recovery from its batches' leader-epoch field (index = offset + 1, so
a run's first index is its first batch's base offset + 1). Index 0 is the empty prefix, of term
0. The entries themselves, and their boundaries inside a run, are the driver's.

A log whose prefix retention, compaction or an installed snapshot removed starts after
``start`` (of term ``start_term``; an entry's last index, so the log's first index is its start
offset + 1): the terms of the indexes below ``start`` are no longer known.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable


class TermTable:
    """Invariant: ``_firsts`` strictly ascending, ``_terms`` strictly ascending (a log's terms
    never decrease, Raft s5.3), every run non-empty and ending at or before ``last_index``."""

    __slots__ = ("_firsts", "_terms", "last_index", "start", "start_term")

    def __init__(
        self,
        runs: Iterable[tuple[int, int]] = (),
        last_index: int = 0,
        start: int = 0,
        start_term: int = 0,
    ) -> None:
        """``runs`` start after ``start``; ``last_index`` >= ``start`` (an empty log after
        ``start`` when there are no runs)."""
        self._firsts: list[int] = []
        self._terms: list[int] = []
        for first, term in runs:
            if first <= start:
                raise ValueError(f"a run starting at {first} is not after the start {start}")
            self._firsts.append(first)
            self._terms.append(term)
        if last_index < start:
            raise ValueError(f"the log ends at {last_index}, before its start {start}")
        self.last_index = last_index
        #: The last index removed from the front of the log (0: nothing removed), and its term.
        self.start = start
        self.start_term = start_term

    @classmethod
    def of_terms(cls, terms: Iterable[int]) -> TermTable:
        """The table of a log whose entries have these terms, in index order from 1."""
        table = cls()
        for term in terms:
            table.append(term, 1)
        return table

    def copy(self) -> TermTable:
        return TermTable(self.runs(), self.last_index, self.start, self.start_term)

    def _key(self) -> tuple[list[tuple[int, int]], int, int, int]:
        return self.runs(), self.last_index, self.start, self.start_term

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TermTable):
            return NotImplemented
        return self._key() == other._key()

    def __repr__(self) -> str:
        start = f", start={self.start}, start_term={self.start_term}" if self.start else ""
        return f"TermTable({self.runs()}, last_index={self.last_index}{start})"

    @property
    def last_term(self) -> int:
        return self._terms[-1] if self._terms else self.start_term

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self._firsts, self._terms, strict=True))

    def term_at(self, index: int) -> int | None:
        """The term of ``index``; ``start_term`` for ``start`` (0 for index 0); None past the
        end or below ``start``."""
        if index == self.start:
            return self.start_term
        if not self.start < index <= self.last_index:
            return None
        return self._terms[bisect_right(self._firsts, index) - 1]

    def first_index_of_run(self, index: int) -> int:
        """The first index holding the same term as ``index`` (1 <= index <= last_index)."""
        return self._firsts[bisect_right(self._firsts, index) - 1]

    def last_index_of_term(self, term: int) -> int | None:
        """The highest index of ``term`` in the log, or None if the log holds no such term."""
        for i in range(len(self._terms) - 1, -1, -1):
            if self._terms[i] == term:
                return self._firsts[i + 1] - 1 if i + 1 < len(self._firsts) else self.last_index
            if self._terms[i] < term:
                return None
        return self.start if self.start and term == self.start_term else None

    def append(self, term: int, count: int) -> None:
        if count <= 0:
            return
        if term != self.last_term or not self._terms:
            if term < self.last_term:
                raise ValueError(f"term {term} after {self.last_term}: terms never decrease")
            self._firsts.append(self.last_index + 1)
            self._terms.append(term)
        self.last_index += count

    def compact(self, first_index: int) -> None:
        """The log now starts at ``first_index`` (start <= first_index - 1 <= last_index)."""
        new_start = first_index - 1
        if new_start <= self.start:
            return
        if new_start > self.last_index:
            raise ValueError(
                f"cannot start the log after {new_start}: it ends at {self.last_index}"
            )
        start_term = self.term_at(new_start)
        assert start_term is not None
        if new_start == self.last_index:
            self._firsts.clear()
            self._terms.clear()
        else:
            # The run holding ``first_index`` is the first kept, and now starts there.
            keep = bisect_right(self._firsts, first_index) - 1
            del self._firsts[:keep]
            del self._terms[:keep]
            self._firsts[0] = first_index
        self.start, self.start_term = new_start, start_term

    def reset(self, index: int, term: int) -> None:
        """An empty log after ``index`` of ``term`` (an installed snapshot)."""
        self._firsts.clear()
        self._terms.clear()
        self.start, self.start_term, self.last_index = index, term, index

    def truncate_from(self, index: int) -> None:
        """Drop every index >= ``index``."""
        if index > self.last_index:
            return
        # A run that starts at or after ``index`` goes entirely; the one containing it shrinks.
        keep = bisect_right(self._firsts, index - 1)
        del self._firsts[keep:]
        del self._terms[keep:]
        self.last_index = index - 1
