"""A partition as the router sees it: its log, the batch being gathered, a tail in memory.

Publishes that arrive during one event-loop iteration are gathered in :attr:`pending` and
appended as one batch (one ``write``) by :meth:`commit`; their acknowledgements wait for it.
The last records appended are kept in :attr:`tail` so caught-up subscribers are fed from
memory; a subscriber behind the tail reads the log.

Owned by one router; called only from its event loop thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.commitlog import Record, SegmentedLog

#: Records kept in memory per partition for caught-up subscribers.
TAIL_RECORDS = 4096
#: Records read from the log per call for a lagging subscriber.
READ_BATCH = 512


class Partition:
    """Single-writer view of one partition log, with group commit."""

    __slots__ = ("acks", "key", "log", "pending", "tail", "tail_base", "watchers")

    def __init__(self, key: tuple[str, int], log: SegmentedLog) -> None:
        self.key = key
        self.log = log
        self.pending: list[Record] = []
        #: One callback per pending record, called with its offset (or None on failure).
        self.acks: list[Callable[[int | None], None] | None] = []
        self.tail: list[Record] = []
        self.tail_base = log.end_offset
        #: Who reads this partition: ("s", client_id, consumer name) or ("g", group key).
        self.watchers: set[tuple[Any, ...]] = set()

    @property
    def end_offset(self) -> int:
        """Next offset to be assigned; every offset below it is committed."""
        return self.log.end_offset

    def add(self, record: Record, ack: Callable[[int | None], None] | None) -> None:
        self.pending.append(record)
        self.acks.append(ack)

    def commit(self) -> tuple[int, int]:
        """Append the gathered batch as one write; returns ``(first offset, end offset)``.

        On a storage error the batch is dropped (the log rolled itself back) and every ack
        is called with ``None``; the error propagates to the router, which logs it.
        """
        records, acks = self.pending, self.acks
        self.pending, self.acks = [], []
        try:
            first = self.log.append(records)
        except Exception:
            for ack in acks:
                if ack is not None:
                    ack(None)
            raise
        end = self.log.end_offset
        stored = [r._replace(offset=first + i) for i, r in enumerate(records)]
        if self.tail and self.tail_base + len(self.tail) == first:
            self.tail.extend(stored)
            if len(self.tail) > TAIL_RECORDS:
                drop = len(self.tail) - TAIL_RECORDS
                del self.tail[:drop]
                self.tail_base += drop
        else:
            self.tail = stored[-TAIL_RECORDS:]
            self.tail_base = end - len(self.tail)
        for i, ack in enumerate(acks):
            if ack is not None:
                ack(first + i)
        return first, end

    def read(self, offset: int, max_records: int = READ_BATCH) -> list[Record]:
        """Committed records from ``offset``: from memory when caught up, else from the log.

        Raises the log's OffsetOutOfRange when ``offset`` fell below the retained start.
        """
        base = self.tail_base
        if self.tail and offset >= base:
            i = offset - base
            return self.tail[i:i + max_records]
        return self.log.read(offset, max_records=max_records)
