"""Errors of the commit log.

Every error the log raises on purpose is a :class:`CommitLogError`; anything else escaping the
package is a bug. Errors about files name the path they concern, so an operator can act on the
message alone (fix a permission, free disk space, upgrade the broker).

Pure data, no I/O; safe to raise and inspect from any thread.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


class CommitLogError(Exception):
    """Base class of every error raised by :mod:`broker.commitlog`."""


class LogConfigError(CommitLogError, ValueError):
    """A :class:`~broker.commitlog.config.LogConfig` or stream spec value is out of range."""


class InvalidRecord(CommitLogError, ValueError):
    """A record cannot be encoded (a field is too long or of the wrong range)."""


class LogClosed(CommitLogError):
    """An operation was attempted on a log that was closed."""


class OffsetOutOfRange(CommitLogError):
    """A read asked for an offset outside ``[log_start_offset, end_offset]``."""

    def __init__(self, offset: int, log_start_offset: int, end_offset: int) -> None:
        super().__init__(
            f"offset {offset} is out of range: valid offsets are "
            f"[{log_start_offset}, {end_offset}] (log start offset .. log end offset)"
        )
        self.offset = offset
        self.log_start_offset = log_start_offset
        self.end_offset = end_offset


class UnsupportedFormat(CommitLogError):
    """A data directory or segment was written by a newer on-disk format version."""

    def __init__(self, path: Path | str, found: int | str, supported: int) -> None:
        super().__init__(
            f"{path}: on-disk format version {found} is not supported "
            f"(this broker reads version {supported} and older)"
        )
        self.path = Path(path)
        self.found = found
        self.supported = supported


class LogIOError(CommitLogError):
    """An OS error (permission denied, disk full, I/O error...) on a log file.

    Raised from open and append. After a failed append the log has been rolled back to its
    previous end: nothing written before is damaged and the next append may succeed.
    """

    def __init__(self, path: Path | str, action: str, error: OSError) -> None:
        reason = error.strerror or str(error)
        name = errno.errorcode.get(error.errno, "") if error.errno is not None else ""
        code = f" [{name}]" if name else ""
        super().__init__(f"{path}: cannot {action}: {reason}{code}")
        self.path = Path(path)
        self.action = action
        self.error = error
        self.errno = error.errno

    @property
    def disk_full(self) -> bool:
        """True when the cause is ENOSPC / EDQUOT (no space left, quota exceeded)."""
        return self.errno in (errno.ENOSPC, errno.EDQUOT)


class CorruptRecordBatch(CommitLogError):
    """A record batch failed validation (CRC, length, magic or offset continuity).

    Recovery turns this into a truncation of the segment at ``position``; a read meets it
    only under ``on_corruption = "stop"`` (:mod:`broker.commitlog.integrity`), with the held
    range's ``first_offset`` and ``last_offset`` (-1: to the segment's end) set.
    """

    first_offset = -1
    last_offset = -1

    def __init__(self, reason: str, position: int, path: Path | str | None = None) -> None:
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}corrupt record batch at byte {position}: {reason}")
        self.reason = reason
        self.position = position
        self.path = Path(path) if path is not None else None


class RewriteRefused(CommitLogError, ValueError):
    """Batches offered to replace a damaged range do not fit it (offsets, bytes, CRC), or the
    range is no longer there; nothing was written (:mod:`broker.commitlog.rewrite`)."""


class CorruptIndex(CommitLogError):
    """An ``.index`` or ``.timeindex`` file is inconsistent; recovery rebuilds it."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: corrupt index: {reason}")
        self.path = Path(path)
        self.reason = reason


def io_error(path: Path | str, action: str, error: OSError) -> LogIOError:
    """Wrap ``error`` (keeping the original as ``__cause__`` at the raise site)."""
    return LogIOError(os.fspath(path), action, error)
