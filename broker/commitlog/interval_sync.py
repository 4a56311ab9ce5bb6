"""fsync = "interval": the periodic fdatasync, off the owner's event-loop thread.

Under ``interval`` a PUBACK follows the append to the page cache, and the log is made
durable every ``fsync_interval_ms`` by an fdatasync. On the owner's thread that fdatasync
stopped the whole worker while it lasted: the fleet's p99 latency was the longest fsync of
the second (issue 23; with the disk shared with a test suite, tens of milliseconds, while
Mosquitto, which does not fsync, kept 0.75 ms). Here the owner only takes a new descriptor
of the active segment (:meth:`IntervalSync.interval_sync`, under the log's lock, no I/O) and
:class:`IntervalSyncer`'s thread fdatasyncs it, while the loop goes on appending. Invariants:

* a sync vouches for what was appended before its descriptor was taken; the segment is
  clean again only if nothing was appended since (``Segment.synced``), else the next
  interval syncs it again;
* the interval restarts when a sync starts, and a log has at most one sync in flight;
* unsynced data outside the active segment (a roll since the last sync: the rolled segment's
  tail, its indexes, the directory) is flushed on the owner's thread as before
  (:meth:`IntervalSync.flush_if_due`), oldest first: rare, once per ``segment_bytes``;
* a failed fdatasync leaves the segment dirty and is logged; the next interval tries again,
  as a failed flush on the loop did.

Threads: :meth:`IntervalSyncer.tick` and :meth:`IntervalSyncer.close` on the owner's
loop thread; completions come back to it through ``post`` (``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from broker.commitlog.config import LogConfig
from broker.commitlog.disk import fsync_data
from broker.commitlog.segment import Segment

log = logging.getLogger("broker.commitlog")

#: What :meth:`IntervalSync.interval_sync` hands out: a descriptor to fdatasync (the
#: caller closes it) and what to call on the owner's thread once that succeeded.
SyncTarget = tuple[int, Callable[[], None]]


class IntervalSync:
    """The ``interval`` policy's durability point, mixed into
    :class:`~broker.commitlog.log.SegmentedLog` (module doc); its state is the log's."""

    if TYPE_CHECKING:
        config: LogConfig
        _segments: list[Segment]
        _rolled: list[Segment]
        _lock: threading.Lock
        _last_flush_ms: int

        def _check_open(self) -> None: ...
        def _now_ms(self) -> int: ...
        def _flush_locked(self, now_ms: int | None = None) -> None: ...

    def _sync_due(self, now: int) -> bool:
        """Under the lock: the interval passed and appends are unsynced."""
        return now - self._last_flush_ms >= self.config.fsync_interval_ms and bool(
            self._segments[-1].dirty or self._rolled
        )

    def flush_if_due(self, now_ms: int | None = None) -> bool:
        """fsync=interval: flush if appends are unsynced and ``fsync_interval_ms`` passed since
        the last flush. Returns whether it flushed; always False for the other policies."""
        if self.config.fsync != "interval":
            return False
        with self._lock:
            self._check_open()
            now = self._now_ms() if now_ms is None else now_ms
            if not self._sync_due(now):
                return False
            self._flush_locked(now)
            return True

    def interval_sync(self, now_ms: int | None = None) -> SyncTarget | None:
        """When a sync is due (as for :meth:`flush_if_due`) and every unsynced append is in
        the active segment: a new descriptor of it, whose fdatasync on another thread makes
        durable what was appended before this call, and ``synced`` to call on this thread
        after it succeeded. The interval restarts now. None otherwise: not due, or a roll
        left unsynced data elsewhere (:meth:`flush_if_due` syncs it on this thread)."""
        if self.config.fsync != "interval":
            return None
        with self._lock:
            self._check_open()
            now = self._now_ms() if now_ms is None else now_ms
            active = self._segments[-1]
            if not self._sync_due(now) or self._rolled:
                return None
            if any(segment.dirty for segment in self._segments[:-1]):
                return None
            self._last_flush_ms = now
            size = active.size

            def synced() -> None:
                with self._lock:
                    active.synced(size)

            return active.dup_fd(), synced


class SyncedLog(Protocol):
    """What :class:`IntervalSyncer` needs of a log."""

    def interval_sync(self) -> SyncTarget | None: ...
    def flush_if_due(self) -> bool: ...


class IntervalSyncer:
    """Runs the interval fdatasyncs of a worker's logs on one thread (module doc).

    ``post(callback)`` runs ``callback`` on the owner's loop thread (the loop's
    ``call_soon_threadsafe``); ``observe(seconds)`` gets each fsync's duration (the
    ``mqlog_fsync_seconds`` histogram)."""

    def __init__(
        self, post: Callable[[Callable[[], None]], object], observe: Callable[[float], None]
    ) -> None:
        self.post = post
        self.observe = observe
        #: Logs with a sync in flight (at most one each).
        self._in_flight: set[SyncedLog] = set()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mqlog-fsync")
        self._closed = False

    def tick(self, logs: Iterable[SyncedLog]) -> None:
        """Start the sync of each log that is due and has none in flight; flush here the
        ones a roll left unsynced elsewhere (module doc)."""
        for plog in logs:
            if plog in self._in_flight or self._closed:
                continue
            target = plog.interval_sync()
            if target is None:
                started = time.perf_counter()
                if plog.flush_if_due():
                    self.observe(time.perf_counter() - started)
                continue
            self._in_flight.add(plog)
            self._thread.submit(self._sync, plog, *target)

    def _sync(self, plog: SyncedLog, fd: int, synced: Callable[[], None]) -> None:
        """On the fsync thread: fdatasync ``fd``, close it, report back to the loop."""
        started = time.perf_counter()
        error: OSError | None = None
        try:
            fsync_data(fd)
        except OSError as exc:
            error = exc
        finally:
            os.close(fd)
        seconds = time.perf_counter() - started
        self.post(lambda: self._ended(plog, synced, seconds, error))

    def _ended(
        self,
        plog: SyncedLog,
        synced: Callable[[], None],
        seconds: float,
        error: OSError | None,
    ) -> None:
        self._in_flight.discard(plog)
        if self._closed:
            return
        if error is not None:
            log.error("%r: interval fsync failed (%s); retried at the next interval", plog, error)
            return
        synced()
        self.observe(seconds)

    def close(self) -> None:
        """Wait for the syncs in flight (their completions are dropped: the logs' close
        fsyncs) and stop the thread; :meth:`tick` does nothing from now on."""
        self._closed = True
        self._thread.shutdown(wait=True)
