"""The fsyncs of a node's group logs, off the event loop (for ``broker.cluster.node``'s round).

Appends only reach the page cache (``GroupStorage.append``); the round marks each group with
unsynced entries (:meth:`LogSyncer.add`) and calls :meth:`LogSyncer.start`, which hands one
job to a thread: an fdatasync of a descriptor of each such group's active segment
(``GroupStorage.sync_target``). Meanwhile the loop goes on reading publishes and frames and
appending. Invariants:

* a job vouches for what was appended before it started, and for nothing of a group whose
  log was truncated or reset meanwhile (``GroupStorage.synced``); what came after waits for
  the next job, started when this one ends;
* at most :data:`SYNC_JOBS` jobs are in flight: one started while others run joins the file
  system's next journal commit instead of waiting for theirs to end;
* a log that cannot be synced this way (``sync_target`` None: unsynced data outside the active
  segment) is flushed on the loop, at once;
* a group whose fsync failed never reports its log durable again (its entries count on the
  other replicas only): after an fsync error the kernel may have dropped the dirty pages, and
  a retry could succeed without them.

``on_synced([(group, flushed index), ...])`` gets every completion, on the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from broker.cluster.storage import GroupStorage

log = logging.getLogger("broker.cluster")

#: fsync jobs in flight at most (module docstring).
SYNC_JOBS = 4

#: (group, fd, index the fsync makes durable, the log's generation when it started).
_Target = tuple[int, int, int, int]


class LogSyncer:
    """See the module docstring. ``label(group)`` names a group in log lines."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        storages: dict[int, GroupStorage],
        on_synced: Callable[[list[tuple[int, int]]], None],
        label: Callable[[int], str],
    ) -> None:
        self.loop = loop
        self.storages = storages
        self.on_synced = on_synced
        self.label = label
        #: Groups with entries appended since their last fsync started (a dict: ordered).
        self._unsynced: dict[int, None] = {}
        self._jobs: set[asyncio.Future[None]] = set()
        self._thread = ThreadPoolExecutor(SYNC_JOBS, thread_name_prefix="raft-fsync")
        #: Groups whose fsync failed: never reported durable again.
        self.failed: set[int] = set()
        self._closed = False

    def add(self, group: int) -> None:
        """``group`` has entries appended since its last fsync started."""
        if group not in self.failed:
            self._unsynced[group] = None

    def start(self) -> None:
        """Start a job for every group added since the last one, unless :data:`SYNC_JOBS`
        are in flight (the next completion starts it)."""
        if len(self._jobs) >= SYNC_JOBS or not self._unsynced or self._closed:
            return
        targets: list[_Target] = []
        done: list[tuple[int, int]] = []
        for g in self._unsynced:
            storage = self.storages[g]
            target = storage.sync_target()
            if target is None:
                storage.flush()
                done.append((g, storage.flushed_index))
            else:
                targets.append((g, *target))
        self._unsynced.clear()
        if done:
            self.on_synced(done)
        if targets:
            fds = [fd for _, fd, _, _ in targets]
            job = self.loop.run_in_executor(self._thread, _fdatasync_all, fds)
            job.add_done_callback(lambda f: self._ended(targets, f))
            self._jobs.add(job)

    def _ended(self, targets: list[_Target], job: asyncio.Future[None]) -> None:
        self._jobs.discard(job)
        if self._closed:
            return
        error = None if job.cancelled() else job.exception()
        if job.cancelled() or error is not None:
            for g, *_ in targets:
                self.failed.add(g)
                log.critical(
                    "cluster: %s: fsync failed (%s): this replica no longer reports its log "
                    "durable; restart the node",
                    self.label(g),
                    error or "cancelled",
                )
            return
        self.on_synced([(g, self.storages[g].synced(i, gen)) for g, _fd, i, gen in targets])
        self.start()  # what was appended meanwhile

    async def close(self) -> None:
        """Wait for the jobs in flight (their completions are not reported) and stop the
        thread; :meth:`start` does nothing from now on."""
        self._closed = True
        for job in list(self._jobs):
            with contextlib.suppress(OSError):
                await job
        self._thread.shutdown(wait=True)


def _fdatasync_all(fds: list[int]) -> None:
    """On the fsync thread: fdatasync each descriptor, then close them all (even on an
    error, which the caller gets)."""
    try:
        for fd in fds:
            os.fdatasync(fd)
    finally:
        for fd in fds:
            os.close(fd)
