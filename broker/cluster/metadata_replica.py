"""The metadata group's replicated commands and its fsynced local copy: what pysyncobj applies
on every replica of ``broker.cluster.metadata_group`` (whose docstring says why the copy is
written, and when each method runs)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from pysyncobj import SyncObjConsumer, replicated

from broker.cluster.hardstate import write_atomically
from broker.cluster.metadata import MetadataState

logger = logging.getLogger("broker.cluster")


class Replica(SyncObjConsumer):  # type: ignore[misc]
    """The replicated commands. The ``@replicated`` methods run on pysyncobj's thread when a
    command is applied (called from elsewhere they propose it instead: pass ``callback``)."""

    def __init__(self, changed: Callable[[], None], copy: Path | None = None) -> None:
        # Set before SyncObjConsumer.__init__ (which counts them as properties): never dumped.
        self.lock = threading.Lock()
        self.state = MetadataState()
        self._changed = changed
        #: Where each applied change is made durable (None: nowhere, in tests of the commands).
        self.copy = copy
        self._saved: dict[str, Any] | None = None
        super().__init__()

    def load_copy(self) -> bool:
        """Start from the fsynced copy, if there is one (before pysyncobj replays)."""
        if self.copy is None:
            return False
        try:
            data = orjson.loads(self.copy.read_bytes())
        except FileNotFoundError:
            return False
        except (OSError, orjson.JSONDecodeError, ValueError) as e:
            # Written whole by rename: damage here is the disk's; the group has the state.
            logger.error("cluster: metadata: %s unreadable, not used: %s", self.copy, e)
            return False
        with self.lock:
            self.state.load(data)
            self._saved = self.state.to_data()
        return True

    def _save(self) -> None:
        """Make the state as applied durable (held under :attr:`lock`; a no-op if unchanged)."""
        if self.copy is None:
            return
        data = self.state.to_data()
        if data == self._saved:
            return
        try:
            write_atomically(self.copy, orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS))
        except OSError as e:  # the journal still has it; the next change tries again
            logger.error("cluster: metadata: cannot write %s: %s", self.copy, e)
            return
        self._saved = data

    @replicated  # type: ignore[untyped-decorator]
    def define(self, data: dict[str, Any], node: str) -> tuple[dict[str, Any], str]:
        with self.lock:
            result = self.state.define(data, node)
            self._save()
        self._changed()
        return result

    @replicated  # type: ignore[untyped-decorator]
    def set_replication(
        self, stream: str, factor: int, node: str
    ) -> tuple[dict[str, Any], str] | None:
        with self.lock:
            result = self.state.set_replication(stream, factor, node)
            self._save()
        self._changed()
        return result

    @replicated  # type: ignore[untyped-decorator]
    def place(self, groups: dict[int, list[str]]) -> int:
        with self.lock:
            new = self.state.place(groups)
            self._save()
        self._changed()
        return new

    def _serialize(self) -> dict[str, Any]:
        with self.lock:
            return self.state.to_data()

    def _deserialize(self, data: dict[str, Any]) -> None:
        with self.lock:
            self.state.load(data)
            self._save()
        self._changed()
