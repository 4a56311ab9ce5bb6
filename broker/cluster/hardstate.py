"""A Raft group's small state files: its hard state, its leader-epoch checkpoint and its log
start.

Both live in the group's partition directory beside the segments (the log ignores names that
are not segment files) and are written the same way, so that a crash leaves the old file or the
new one, never a mix: a temporary file written and fsynced, renamed over the old name, then the
directory fsynced (:func:`write_atomically`). Both end with a CRC-32 over the bytes before it;
a file that is torn, truncated or garbage is a :class:`StateFileError` naming it, never read as
a default.

``raft-hard-state`` (Raft figure 2, "persistent state": currentTerm, votedFor; the log aside),
36 bytes, little-endian (``HARD_STATE``)::

    off size field
      0  4   magic        b"MQHS"
      4  2   version      1
      6  2   reserved     0
      8  8   term         current term
     16  8   voted_for    node id voted for in ``term``, -1 for none
     24  8   commit_hint  a commit index this node knew when writing: a hint for readers after
                          a restart, NEVER a truncation point (Kafka KIP-101: a follower that
                          cut its log to its own high-water mark at restart, then led, lost
                          acknowledged writes)
     32  4   crc          CRC-32 (zlib's) of bytes [0, 32)

``leader-epoch-checkpoint`` (Kafka's file of that name; a cache of what the batch headers say,
see :mod:`broker.cluster.storage`): magic b"MQEC", version 1 (2 bytes), reserved (2), the run
count ``n`` (4), ``n`` runs of (first offset, epoch) as two int64, and the CRC-32 of all that.

``raft-log-start`` (the driver's ``LogStart`` and the group's configurations, see
:mod:`broker.cluster.storage`): magic b"MQLS", version 1 (2 bytes), reserved (2), the start
index and its term (two int64: the last index retention, compaction or an installed snapshot
removed, 0 for none), the count ``n`` (4) of configurations, then ``n`` of (index int64, length
uint32, that many bytes of ``Configuration.encode``) by ascending index: one at the start index
(the configuration in force there) if known, then the CONFIG entries after it; and the CRC-32.
"""

from __future__ import annotations

import os
import struct
import zlib
from itertools import pairwise
from pathlib import Path

from broker.cluster.messages import HardState
from broker.commitlog.disk import fsync_directory

HARD_STATE_FILE = "raft-hard-state"
EPOCH_CHECKPOINT_FILE = "leader-epoch-checkpoint"
HARD_STATE = struct.Struct("<4sHHqqq")
_HARD_MAGIC = b"MQHS"
_EPOCH_HEAD = struct.Struct("<4sHHI")
_EPOCH_RUN = struct.Struct("<qq")
_EPOCH_MAGIC = b"MQEC"
LOG_START_FILE = "raft-log-start"
_START_HEAD = struct.Struct("<4sHHqqI")
_START_CONF = struct.Struct("<qI")
_START_MAGIC = b"MQLS"
_VERSION = 1
_CRC = struct.Struct("<I")
_TMP_SUFFIX = ".tmp"


class StateFileError(Exception):
    """A state file is torn, truncated or not ours: the message names it and says why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data``: temporary file, fsync, rename, directory fsync. Raises
    OSError; a crash at any point leaves the old content or the new."""
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_directory(path.parent)


def _sealed(body: bytes) -> bytes:
    return body + _CRC.pack(zlib.crc32(body))


def _unsealed(path: Path, data: bytes, magic: bytes, minimum: int) -> bytes:
    """The body of ``data`` read from ``path`` once its size, CRC, magic and version check."""
    if len(data) < minimum + _CRC.size:
        raise StateFileError(path, f"{len(data)} bytes: torn or truncated")
    body = data[: -_CRC.size]
    (stored,) = _CRC.unpack_from(data, len(body))
    if zlib.crc32(body) != stored:
        raise StateFileError(path, "CRC mismatch: torn or corrupt")
    if body[:4] != magic:
        raise StateFileError(path, f"not a {magic.decode()} file (magic {body[:4]!r})")
    (version,) = struct.unpack_from("<H", body, 4)
    if version != _VERSION:
        raise StateFileError(path, f"format version {version}, this broker reads {_VERSION}")
    return body


def write_hard_state(directory: Path, state: HardState, commit_hint: int) -> None:
    """Make ``state`` durable (module doc) before the core is told ``hard_state_persisted``."""
    voted = -1 if state.voted_for is None else state.voted_for
    body = HARD_STATE.pack(_HARD_MAGIC, _VERSION, 0, state.term, voted, commit_hint)
    write_atomically(directory / HARD_STATE_FILE, _sealed(body))


def read_hard_state(directory: Path) -> tuple[HardState, int] | None:
    """``(hard state, commit hint)`` from the group's file; None when there is none (a group
    that never voted nor learnt a term). Raises :class:`StateFileError`."""
    path = directory / HARD_STATE_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    body = _unsealed(path, data, _HARD_MAGIC, HARD_STATE.size)
    if len(body) != HARD_STATE.size:
        raise StateFileError(path, f"{len(data)} bytes, a hard state has {HARD_STATE.size + 4}")
    _magic, _version, _reserved, term, voted, hint = HARD_STATE.unpack(body)
    if term < 0 or voted < -1 or hint < 0:
        raise StateFileError(path, f"impossible values: term {term}, vote {voted}, hint {hint}")
    return HardState(term, None if voted < 0 else voted), hint


def write_epoch_checkpoint(directory: Path, runs: list[tuple[int, int]]) -> None:
    """Persist the ``(first offset, epoch)`` runs (module doc)."""
    head = _EPOCH_HEAD.pack(_EPOCH_MAGIC, _VERSION, 0, len(runs))
    body = head + b"".join(_EPOCH_RUN.pack(offset, epoch) for offset, epoch in runs)
    write_atomically(directory / EPOCH_CHECKPOINT_FILE, _sealed(body))


def read_epoch_checkpoint(directory: Path) -> list[tuple[int, int]] | None:
    """The runs of the checkpoint; None when there is none. Raises
    :class:`StateFileError` for a damaged one (the caller rebuilds from the log)."""
    path = directory / EPOCH_CHECKPOINT_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    body = _unsealed(path, data, _EPOCH_MAGIC, _EPOCH_HEAD.size)
    count = _EPOCH_HEAD.unpack_from(body)[3]
    if len(body) != _EPOCH_HEAD.size + count * _EPOCH_RUN.size:
        raise StateFileError(path, f"{count} runs do not fill {len(body)} bytes")
    runs = [(int(o), int(e)) for o, e in _EPOCH_RUN.iter_unpack(body[_EPOCH_HEAD.size :])]
    for (o1, e1), (o2, e2) in pairwise(runs):
        if not (o1 < o2 and e1 < e2):
            raise StateFileError(path, f"runs ({o1}, {e1}) then ({o2}, {e2}) do not ascend")
    return runs


def write_log_start(
    directory: Path, index: int, term: int, configs: list[tuple[int, bytes]]
) -> None:
    """Persist the log start ``(index, term)`` and the encoded configurations (module doc)."""
    body = _START_HEAD.pack(_START_MAGIC, _VERSION, 0, index, term, len(configs))
    body += b"".join(_START_CONF.pack(i, len(conf)) + conf for i, conf in configs)
    write_atomically(directory / LOG_START_FILE, _sealed(body))


def read_log_start(directory: Path) -> tuple[int, int, list[tuple[int, bytes]]] | None:
    """``(start index, its term, [(index, encoded configuration)...])``; None when there is no
    file (a log that never lost its prefix and never held a configuration). Raises
    :class:`StateFileError`."""
    path = directory / LOG_START_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    body = _unsealed(path, data, _START_MAGIC, _START_HEAD.size)
    _magic, _version, _reserved, index, term, count = _START_HEAD.unpack_from(body)
    if index < 0 or term < 0:
        raise StateFileError(path, f"impossible start: index {index}, term {term}")
    configs: list[tuple[int, bytes]] = []
    pos = _START_HEAD.size
    for _ in range(count):
        if pos + _START_CONF.size > len(body):
            raise StateFileError(path, f"{count} configurations do not fit {len(body)} bytes")
        at, length = _START_CONF.unpack_from(body, pos)
        pos += _START_CONF.size
        if pos + length > len(body) or at < index or (configs and at <= configs[-1][0]):
            raise StateFileError(path, f"configuration at {at}: out of place or truncated")
        configs.append((at, body[pos : pos + length]))
        pos += length
    if pos != len(body):
        raise StateFileError(path, f"{len(body) - pos} bytes after the configurations")
    return index, term, configs
