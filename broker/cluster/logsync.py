"""The fsyncs of a node's group logs (for ``broker.cluster.node``'s round).

Appends only reach the page cache (``GroupStorage.append``). Once a round has sent its frames,
:meth:`LogSyncer.flush` fsyncs the log of every group whose core asked for a flush, one
fdatasync per group however many entries the round appended to it, and returns what is
durable now, for ``core.flushed``. Invariants:

* nothing is reported durable before its fdatasync returned;
* a group whose fsync failed never reports its log durable again (its entries count on the
  other replicas only): after an fsync error the kernel may have dropped the dirty pages, and
  a retry could succeed without them.

The fsyncs run on the loop's thread, as the single node's group commit does its own
(``broker.router.commit``). The frames left before them: a leader's followers write their
disks while it writes its own (Raft thesis s10.2.1), and a follower's acknowledgement leaves
in the same round, as soon as its fsync returned. They used to run on a thread while the loop
went on: each job cost a hand-off to the thread, the GIL taken back from the loop and a wake
of the loop, more CPU than the overlap saved on this design (docs/bench/README.md, "The
fsyncs on the loop": 25-30% less CPU per replicated message).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker.cluster.storage import GroupStorage
from broker.commitlog.errors import LogIOError

log = logging.getLogger("broker.cluster")


class LogSyncer:
    """See the module docstring. ``label(group)`` names a group in log lines."""

    def __init__(self, storages: dict[int, GroupStorage], label: Callable[[int], str]) -> None:
        self.storages = storages
        self.label = label
        #: Groups whose fsync failed: never reported durable again.
        self.failed: set[int] = set()

    def flush(self, wanted: dict[int, int]) -> list[tuple[int, int]]:
        """Make each group's log durable through the index its core asked for (``group ->
        index``); return ``(group, flushed index)`` for each group not :attr:`failed`."""
        done: list[tuple[int, int]] = []
        for g, index in wanted.items():
            if g in self.failed:
                continue
            storage = self.storages[g]
            if storage.flushed_index < index:
                try:
                    storage.flush()
                except LogIOError as error:
                    self.failed.add(g)
                    log.critical(
                        "cluster: %s: fsync failed (%s): this replica no longer reports its "
                        "log durable; restart the node",
                        self.label(g),
                        error,
                    )
                    continue
            done.append((g, storage.flushed_index))
        return done
