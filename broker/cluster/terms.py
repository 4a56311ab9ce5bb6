"""The shape of a Raft log as the core needs it: its last index and the term of each index.

Kept as runs ``(first_index, term)`` ascending in both, the "term -> first index" table the
segmented log rebuilds at recovery from its batches' leader-epoch field (index = offset + 1, so
a run's first index is its first batch's base offset + 1). Index 0 is the empty prefix, of term
0. The entries themselves, and their boundaries inside a run, are the driver's.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable


class TermTable:
    """Invariant: ``_firsts`` strictly ascending, ``_terms`` strictly ascending (a log's terms
    never decrease, Raft s5.3), every run non-empty and ending at or before ``last_index``."""

    __slots__ = ("_firsts", "_terms", "last_index")

    def __init__(self, runs: Iterable[tuple[int, int]] = (), last_index: int = 0) -> None:
        self._firsts: list[int] = []
        self._terms: list[int] = []
        for first, term in runs:
            self._firsts.append(first)
            self._terms.append(term)
        self.last_index = last_index

    @classmethod
    def of_terms(cls, terms: Iterable[int]) -> TermTable:
        """The table of a log whose entries have these terms, in index order from 1."""
        table = cls()
        for term in terms:
            table.append(term, 1)
        return table

    def copy(self) -> TermTable:
        return TermTable(self.runs(), self.last_index)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TermTable):
            return NotImplemented
        return (self.runs(), self.last_index) == (other.runs(), other.last_index)

    def __repr__(self) -> str:
        return f"TermTable({self.runs()}, last_index={self.last_index})"

    @property
    def last_term(self) -> int:
        return self._terms[-1] if self._terms else 0

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self._firsts, self._terms, strict=True))

    def term_at(self, index: int) -> int | None:
        """The term of ``index``; 0 for index 0; None past the end."""
        if index == 0:
            return 0
        if not 0 < index <= self.last_index:
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
        return None

    def append(self, term: int, count: int) -> None:
        if count <= 0:
            return
        if term != self.last_term or not self._terms:
            if term < self.last_term:
                raise ValueError(f"term {term} after {self.last_term}: terms never decrease")
            self._firsts.append(self.last_index + 1)
            self._terms.append(term)
        self.last_index += count

    def truncate_from(self, index: int) -> None:
        """Drop every index >= ``index``."""
        if index > self.last_index:
            return
        # A run that starts at or after ``index`` goes entirely; the one containing it shrinks.
        keep = bisect_right(self._firsts, index - 1)
        del self._firsts[keep:]
        del self._terms[keep:]
        self.last_index = index - 1
