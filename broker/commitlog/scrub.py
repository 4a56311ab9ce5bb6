"""The background :class:`LogScrubber` thread: sealed segments re-read to find damage early.

Reads verify every batch they use (:mod:`broker.commitlog.integrity`), but history nobody
reads is never checked that way, and start-up recovery checks only what changed since the
last clean shutdown (the active segment, a tail past the last index entry): checking every
sealed segment at start would cost seconds to minutes per GiB
(:mod:`broker.commitlog.recovery` has the figures), time a restart does not have.

The scrubber covers them: every ``interval_s`` it reads every sealed segment of every log
this process owns (its own read-only descriptors: a segment retention deletes meanwhile is
simply skipped), every batch's CRC and header checked, at most ``bytes_per_second`` (a token
bucket on its reads, so it never competes with the broker's own I/O for long), and reports
each damaged range it finds (:func:`~broker.commitlog.integrity.report`: an ERROR line, the
``mqlog_corrupt_batches_total`` metric, the ``$SYS`` topics) and one INFO line per pass.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from broker.commitlog.errors import CommitLogError, LogClosed
from broker.commitlog.integrity import DamagedRange, report, scan_segment
from broker.commitlog.streams import Streams

logger = logging.getLogger("broker.commitlog")

#: The first pass starts this long after :meth:`LogScrubber.start` at most (seconds), so a
#: broker restarted more often than ``scrub_interval`` still gets scrubbed.
FIRST_PASS_DELAY_S = 60.0


class LogScrubber:
    """Re-reads sealed segments of every open log of ``streams``; see the module doc.

    ``run_once`` does one pass synchronously (tests call it); ``start`` runs a pass every
    ``interval_s`` seconds on its own thread until ``stop``, which also cuts a pass short.
    """

    def __init__(
        self,
        streams: Streams,
        interval_s: float,
        bytes_per_second: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if bytes_per_second <= 0:
            raise ValueError(f"bytes_per_second must be > 0, got {bytes_per_second}")
        self.streams = streams
        self.interval_s = interval_s
        self.bytes_per_second = bytes_per_second
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._read = 0
        #: Passes completed and bytes read, for tests and the INFO line.
        self.passes = 0
        self.bytes_read = 0

    def _pace(self, size: int) -> None:
        """Wait until ``size`` more bytes fit under the rate cap (or stop was asked)."""
        self._read += size
        self.bytes_read += size
        ahead = self._read / self.bytes_per_second - (self._clock() - self._started)
        if ahead > 0:
            self._stop.wait(ahead)

    def run_once(self) -> list[DamagedRange]:
        """One pass over every sealed segment; returns the damaged ranges found."""
        found: list[DamagedRange] = []
        self._started, self._read = self._clock(), 0
        segments = 0
        for (stream, partition), log in self.streams.open_logs().items():
            try:
                bases = log.segments[:-1]  # sealed: immutable, the active one is appended to
            except LogClosed:
                continue
            for base in bases:
                if self._stop.is_set():
                    return found
                try:
                    ranges = self._scrub(log.directory / f"{base:020d}.log", base)
                except (CommitLogError, OSError):
                    logger.exception("scrubber: %s/%d segment %d failed", stream, partition, base)
                    continue
                if ranges is not None:
                    segments += 1
                    found += ranges
        self.passes += 1
        logger.info(
            "scrubber: %d sealed segments, %d bytes read in %.1f s, %d damaged ranges",
            segments,
            self._read,
            self._clock() - self._started,
            len(found),
        )
        return found

    def _scrub(self, path: Path, base: int) -> list[DamagedRange] | None:
        """Damaged ranges of one segment file, each reported; None if it is gone."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None  # deleted by retention or swapped by compaction meanwhile
        try:
            size = os.fstat(fd).st_size
            scan = scan_segment(fd, path, base, size, pace=self._pace)
        finally:
            os.close(fd)
        for damage in scan.ranges:
            report(damage)
        return scan.ranges

    def _run(self) -> None:
        wait = min(self.interval_s, FIRST_PASS_DELAY_S)
        while not self._stop.wait(wait):
            try:
                self.run_once()
            except Exception:  # the thread must survive a bug in one pass
                logger.exception("scrubber pass failed")
            wait = self.interval_s

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is not None:
            raise RuntimeError("LogScrubber already started")
        self._thread = threading.Thread(target=self._run, name="commitlog-scrubber", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to stop (a pass in progress ends at its next read) and wait."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
