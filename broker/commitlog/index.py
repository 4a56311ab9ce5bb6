"""Sparse segment indexes: :class:`OffsetIndex` and :class:`TimeIndex` (Kafka's names).

Both live in memory as parallel arrays (bisect lookups, no syscall) and are written to their
file as a whole, atomically (temporary file + rename), when the segment is rolled or the log is
closed. They are *hints*: the ``.log`` file is the truth, and recovery rebuilds an index that is
missing or fails :meth:`sanity_check` (after an unclean shutdown the active segment's indexes
are always rebuilt).

``OffsetIndex`` file: 8-byte entries ``<II`` = (offset - base_offset, file position in bytes).
An entry (o, p) means the batch starting at position p has base offset o. Relative offsets and
positions strictly increase.

``TimeIndex`` file: 12-byte entries ``<qI`` = (timestamp ms, offset - base_offset). An entry
(t, o) means every record of the segment with offset <= o has a timestamp <= t; timestamps
strictly increase and offsets do not decrease. Records may carry out-of-order timestamps: the
entry holds the maximum seen so far, so a lookup never skips a matching record.

Not thread-safe by themselves: the owning segment is guarded by the log's lock.
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from bisect import bisect_right
from pathlib import Path

from broker.commitlog.errors import CorruptIndex

OFFSET_ENTRY = struct.Struct("<II")
TIME_ENTRY = struct.Struct("<qI")


def _write_atomically(path: Path, data: bytes, fsync: bool) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class OffsetIndex:
    """Sparse map offset -> file position of one segment (floor lookups)."""

    __slots__ = ("_dirty", "_offsets", "_positions", "base_offset", "path")

    def __init__(self, path: Path, base_offset: int) -> None:
        self.path = path
        self.base_offset = base_offset
        self._offsets = array("I")  # relative offsets
        self._positions = array("I")
        self._dirty = True

    @classmethod
    def load(cls, path: Path, base_offset: int, log_size: int) -> OffsetIndex:
        """Read ``path``; raise :class:`CorruptIndex` unless :meth:`sanity_check` passes.

        ``FileNotFoundError`` propagates (the caller rebuilds).
        """
        data = path.read_bytes()
        if len(data) % OFFSET_ENTRY.size:
            raise CorruptIndex(path, f"size {len(data)} is not a multiple of {OFFSET_ENTRY.size}")
        index = cls(path, base_offset)
        pairs = array("I", data)
        if sys.byteorder != "little":
            pairs.byteswap()
        index._offsets = pairs[0::2]
        index._positions = pairs[1::2]
        index._dirty = False
        index.sanity_check(log_size)
        return index

    def sanity_check(self, log_size: int) -> None:
        """Entries strictly increase and every position lies inside the log file."""
        offsets, positions = self._offsets, self._positions
        for i in range(1, len(offsets)):
            if offsets[i] <= offsets[i - 1] or positions[i] <= positions[i - 1]:
                raise CorruptIndex(self.path, f"entry {i} does not increase")
        if positions and positions[-1] >= log_size:
            raise CorruptIndex(
                self.path, f"last position {positions[-1]} beyond log size {log_size}"
            )

    def __len__(self) -> int:
        return len(self._offsets)

    def append(self, offset: int, position: int) -> None:
        """Add an entry; ``offset`` (absolute) and ``position`` must exceed the last entry's."""
        rel = offset - self.base_offset
        if self._offsets and (rel <= self._offsets[-1] or position <= self._positions[-1]):
            raise ValueError(f"index entry ({offset}, {position}) does not increase")
        self._offsets.append(rel)
        self._positions.append(position)
        self._dirty = True

    def lookup(self, offset: int) -> tuple[int, int]:
        """Largest entry with offset <= ``offset`` as (absolute offset, position).

        ``(base_offset, 0)`` when there is none (the segment's first batch is at position 0).
        """
        i = bisect_right(self._offsets, offset - self.base_offset) - 1
        if i < 0:
            return self.base_offset, 0
        return self.base_offset + self._offsets[i], self._positions[i]

    def last_entry(self) -> tuple[int, int]:
        """The last entry, or ``(base_offset, 0)`` when empty."""
        if not self._offsets:
            return self.base_offset, 0
        return self.base_offset + self._offsets[-1], self._positions[-1]

    def entries(self) -> list[tuple[int, int]]:
        """All entries as (absolute offset, position) (tests, tools)."""
        return [
            (self.base_offset + o, p) for o, p in zip(self._offsets, self._positions, strict=True)
        ]

    def to_bytes(self) -> bytes:
        pairs = array("I", bytes(8 * len(self._offsets)))
        pairs[0::2] = self._offsets
        pairs[1::2] = self._positions
        if sys.byteorder != "little":
            pairs.byteswap()
        return pairs.tobytes()

    def write(self, *, fsync: bool) -> None:
        """Persist the entries to :attr:`path` atomically if they changed."""
        if self._dirty:
            _write_atomically(self.path, self.to_bytes(), fsync)
            self._dirty = False


class TimeIndex:
    """Sparse map max-timestamp-so-far -> offset of one segment."""

    __slots__ = ("_dirty", "_offsets", "_timestamps", "base_offset", "path")

    def __init__(self, path: Path, base_offset: int) -> None:
        self.path = path
        self.base_offset = base_offset
        self._timestamps = array("q")
        self._offsets = array("I")  # relative offsets
        self._dirty = True

    @classmethod
    def load(cls, path: Path, base_offset: int, next_offset: int) -> TimeIndex:
        """Read ``path``; raise :class:`CorruptIndex` unless :meth:`sanity_check` passes."""
        data = path.read_bytes()
        if len(data) % TIME_ENTRY.size:
            raise CorruptIndex(path, f"size {len(data)} is not a multiple of {TIME_ENTRY.size}")
        index = cls(path, base_offset)
        for ts, rel in TIME_ENTRY.iter_unpack(data):
            index._timestamps.append(ts)
            index._offsets.append(rel)
        index._dirty = False
        index.sanity_check(next_offset)
        return index

    def sanity_check(self, next_offset: int) -> None:
        """Timestamps strictly increase, offsets do not decrease and lie below ``next_offset``."""
        ts, offs = self._timestamps, self._offsets
        for i in range(1, len(ts)):
            if ts[i] <= ts[i - 1] or offs[i] < offs[i - 1]:
                raise CorruptIndex(self.path, f"entry {i} does not increase")
        if offs and self.base_offset + offs[-1] >= next_offset:
            raise CorruptIndex(
                self.path, f"last offset {self.base_offset + offs[-1]} beyond {next_offset - 1}"
            )

    def __len__(self) -> int:
        return len(self._timestamps)

    def maybe_append(self, timestamp: int, offset: int) -> None:
        """Add (timestamp, offset) if ``timestamp`` exceeds the last entry's timestamp."""
        if self._timestamps and timestamp <= self._timestamps[-1]:
            return
        rel = offset - self.base_offset
        if self._offsets and rel < self._offsets[-1]:
            raise ValueError(f"time index offset {offset} goes backwards")
        self._timestamps.append(timestamp)
        self._offsets.append(rel)
        self._dirty = True

    def last_timestamp(self) -> int:
        """Largest indexed timestamp, or -1 when empty."""
        return self._timestamps[-1] if self._timestamps else -1

    def lookup_before(self, timestamp: int) -> int | None:
        """Offset o of the last entry whose timestamp is < ``timestamp``, else None.

        Every record with offset <= o is older than ``timestamp``, so the first record at or
        after ``timestamp`` has an offset > o.
        """
        i = bisect_right(self._timestamps, timestamp - 1) - 1
        if i < 0:
            return None
        return self.base_offset + self._offsets[i]

    def entries(self) -> list[tuple[int, int]]:
        """All entries as (timestamp, absolute offset) (tests, tools)."""
        return [
            (t, self.base_offset + o) for t, o in zip(self._timestamps, self._offsets, strict=True)
        ]

    def to_bytes(self) -> bytes:
        pack = TIME_ENTRY.pack
        return b"".join(pack(t, o) for t, o in zip(self._timestamps, self._offsets, strict=True))

    def write(self, *, fsync: bool) -> None:
        """Persist the entries to :attr:`path` atomically if they changed."""
        if self._dirty:
            _write_atomically(self.path, self.to_bytes(), fsync)
            self._dirty = False
