"""The log as the Raft core reads it back within one step (``broker.cluster.raft``).

``LogReader`` is the driver's log: every entry appended before the current step (durable or
not). ``LogView`` puts in front of it the entries this step handed out in ``AppendLog``, which
the driver writes only after the step returns: a leader may send them in the same step.

Entries are whole record batches (``broker.cluster.messages``): reads start at an entry's first
index and end at an entry's last index, and the unwritten entries follow the driver's log
without a gap (the first one's index is the driver's last index + 1).
"""

from __future__ import annotations

from typing import Protocol

from broker.cluster.messages import Entry


class LogReader(Protocol):
    """The driver's log as the core reads it back (durable or not, as appended)."""

    def entries(self, first: int, last: int, max_entries: int, max_bytes: int) -> list[Entry]:
        """Whole entries in order from the one starting at ``first`` (always an entry's first
        index) through the one ending at ``last`` (an entry's last index), stopping after
        ``max_entries`` or before the entry that would take the payload bytes past
        ``max_bytes``; at least one entry, unless the first cannot be read now (a damaged
        batch the driver is repairing): then none, and the core sends nothing from there."""

    def entry_start(self, index: int) -> int:
        """The first index of the entry holding ``index`` (the log's start < index <= its last
        index)."""


class LogView:
    """The driver's log, then this step's unwritten entries (from ``_first``)."""

    __slots__ = ("_first", "_log", "_unwritten")

    def __init__(self, log: LogReader) -> None:
        self._log = log
        self._first = 0
        self._unwritten: list[Entry] = []

    def add(self, first: int, entries: tuple[Entry, ...]) -> None:
        """Entries from ``first`` handed out in this step's ``AppendLog``."""
        if not self._unwritten:
            self._first = first
        self._unwritten.extend(entries)

    def written(self) -> None:
        """The step ends: the driver writes what was handed out before calling in again."""
        self._unwritten.clear()

    def truncate(self, index: int) -> None:
        """Drop the unwritten entries from ``index`` (an entry's first index) on."""
        kept, at = 0, self._first
        for e in self._unwritten:
            if at >= index:
                break
            at += e.count
            kept += 1
        del self._unwritten[kept:]

    def entries(
        self, first: int, last: int, max_entries: int, max_bytes: int
    ) -> tuple[tuple[Entry, ...], int]:
        """Whole entries from the one starting at ``first`` through the one ending at
        ``last``, within ``max_entries`` entries and ``max_bytes`` payload bytes (at least one):
        from the driver's log, then the unwritten entries; and the last one's last index."""
        room, budget = max_entries, max_bytes
        split = self._first if self._unwritten else last + 1
        found: list[Entry] = []
        reached = first - 1
        if first < split:
            found = self._log.entries(first, min(last, split - 1), room, budget)
            if not found:
                return (), reached  # unreadable now (LogReader.entries)
            reached += sum([e.count for e in found])
            assert found and reached < split, f"log lacks entries {first}..{last}"
            if reached < split - 1 or last < split:
                return tuple(found), reached
            room -= len(found)
            budget -= sum([len(e.payload) for e in found])
        index = split
        for e in self._unwritten:
            if room <= 0 or index > last:
                break
            if index >= first:
                if found and len(e.payload) > budget:
                    break
                found.append(e)
                room -= 1
                budget -= len(e.payload)
                reached = index + e.count - 1
            index += e.count
        assert found, f"no entry starts at {first}"
        return tuple(found), reached

    def entry_start(self, index: int) -> int:
        """The first index of the entry holding ``index``."""
        if self._unwritten and index >= self._first:
            start = self._first
            for e in self._unwritten:
                if index < start + e.count:
                    return start
                start += e.count
        return self._log.entry_start(index)
