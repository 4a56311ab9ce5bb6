"""Disk primitives the segments use beyond :mod:`os`: ``fdatasync``, Linux's
``sync_file_range`` (through ctypes: :mod:`os` does not wrap it) and a directory's fsync."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages, do not wait


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc ``sync_file_range`` on Linux (not wrapped by :mod:`os`), else None."""
    if not sys.platform.startswith("linux"):
        return None  # pragma: no cover
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return cast("Callable[[int, int, int, int], int]", function)


#: libc ``sync_file_range``, or None where there is none.
sync_file_range = _load_sync_file_range()


def fsync_data(fd: int) -> None:
    """fdatasync where it exists: it also persists the file size, which is all we need."""
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # pragma: no cover - macOS
        os.fsync(fd)


def fsync_directory(path: Path) -> None:
    """Persist directory entries (new, renamed or removed files)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
