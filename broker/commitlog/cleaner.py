"""The background :class:`LogCleaner` thread: retention and compaction for every open log.

The policies are in :mod:`broker.commitlog.policy`; each log applies them under its own lock
(:meth:`SegmentedLog.enforce_retention`, :meth:`SegmentedLog.compact`), so the cleaner only
walks the logs a :class:`Streams` has open and calls those two methods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container

from broker.commitlog.errors import CommitLogError, LogClosed
from broker.commitlog.keys import PartitionKey
from broker.commitlog.streams import Streams

logger = logging.getLogger("broker.commitlog")


class LogCleaner:
    """Background thread applying retention and compaction to every open log of ``streams``.

    ``run_once`` does one pass synchronously (tests call it directly with a fake clock);
    ``start`` runs a pass every ``interval_s`` seconds until ``stop``. An error in one log is
    logged and does not stop the others or the thread.
    """

    def __init__(
        self,
        streams: Streams,
        interval_s: float = 30.0,
        *,
        clock: Callable[[], float] = time.time,
        skip: Container[PartitionKey] = (),
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.streams = streams
        #: Partitions another owner cleans (a replicated partition's retention is bounded by
        #: its commit index and told to its Raft group, on the group's own thread).
        self.skip = skip
        self.interval_s = interval_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> tuple[int, int]:
        """One pass; returns (segments deleted by retention, records removed by compaction)."""
        deleted = removed = 0
        now_ms = int(self._clock() * 1000)
        for (stream, partition), log in self.streams.open_logs().items():
            if (stream, partition) in self.skip:
                continue
            try:
                deleted += log.enforce_retention(now_ms)
                if log.config.compacted:
                    removed += log.compact()
            except LogClosed:
                continue
            except (CommitLogError, OSError):
                logger.exception("cleaner: %s/%d failed", stream, partition)
        return deleted, removed

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:  # the thread must survive a bug in one pass
                logger.exception("cleaner pass failed")

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is not None:
            raise RuntimeError("LogCleaner already started")
        self._thread = threading.Thread(target=self._run, name="commitlog-cleaner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to stop and wait for the current pass to finish."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> LogCleaner:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
