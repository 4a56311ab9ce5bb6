"""A rewritten copy of a segment, written beside the original before the swap.

:meth:`SegmentedLog.compact` rewrites a closed segment with the records compaction keeps
(:func:`broker.commitlog.policy.cleaned_batches`) into ``<base>.log.cleaned`` (and its
indexes), complete and fsynced before the log renames it over the original
(:func:`swap_in`); ``ReplicaOps.rewrite`` does the same with a damaged range replaced by
another replica's copy (:func:`broker.commitlog.rewrite.resized_batches`). A crash leaves
the original, the copy's leftovers are removed at the next open.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from broker.commitlog.config import LogConfig
from broker.commitlog.disk import fsync_directory
from broker.commitlog.errors import LogIOError
from broker.commitlog.segment import _OPEN_FLAGS, LOG_SUFFIX, Segment, file_name


def write_segment(
    directory: Path,
    base_offset: int,
    config: LogConfig,
    batches: Iterable[bytes | bytearray],
    suffix: str,
    *,
    fsync: bool,
) -> Segment:
    """Write a new segment from encoded batches to ``<base><.log|.index|.timeindex><suffix>``.

    Used by compaction: the files are complete (and fsynced when ``fsync``) before the caller
    renames them into place. Returns the segment, open on the suffixed ``.log`` file.
    """
    path = directory / (file_name(base_offset, LOG_SUFFIX) + suffix)
    try:
        fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:
        raise LogIOError(path, "create cleaned segment", exc) from exc
    seg = Segment(directory, base_offset, config, fd, 0, 0)
    seg.log_path = path
    seg.offset_index.path = seg.index_path = seg.index_path.with_name(seg.index_path.name + suffix)
    seg.time_index.path = seg.timeindex_path = seg.timeindex_path.with_name(
        seg.timeindex_path.name + suffix
    )
    try:
        for batch in batches:
            seg.append(batch, fsync=False)
        if fsync:
            seg.flush()
        seg.persist_indexes(fsync=fsync)
    except BaseException:
        seg.delete()
        raise
    return seg


def swap_in(segment: Segment, copy: Segment, directory: Path, *, fsync: bool) -> Segment:
    """Rename ``copy`` (from :func:`write_segment`) over ``segment`` in a crash-safe order (old
    indexes removed, log renamed over, new indexes renamed in; a missing index is rebuilt at
    open); returns ``copy``, now under the original's names. Called with the log's lock."""
    try:
        segment.index_path.unlink(missing_ok=True)
        segment.timeindex_path.unlink(missing_ok=True)
        os.replace(copy.log_path, segment.log_path)
        os.replace(copy.index_path, segment.index_path)
        os.replace(copy.timeindex_path, segment.timeindex_path)
        if fsync:
            fsync_directory(directory)
    except OSError as exc:
        copy.close()
        raise LogIOError(segment.log_path, "swap in a rewritten segment", exc) from exc
    copy.log_path = segment.log_path
    copy.index_path = copy.offset_index.path = segment.index_path
    copy.timeindex_path = copy.time_index.path = segment.timeindex_path
    copy.rolling_base_ms = segment.rolling_base_ms
    segment.close()
    return copy
