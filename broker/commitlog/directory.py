"""A partition directory's files: segment names, leftovers of interrupted writes, and the
segments dropped when an earlier one lost its tail (used by :meth:`SegmentedLog.open`)."""

from __future__ import annotations

import logging
from pathlib import Path

from broker.commitlog.errors import LogIOError
from broker.commitlog.segment import (
    CLEANED_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    TIMEINDEX_SUFFIX,
    TMP_SUFFIX,
    Segment,
)

logger = logging.getLogger("broker.commitlog")

_SEGMENT_SUFFIXES = (LOG_SUFFIX, INDEX_SUFFIX, TIMEINDEX_SUFFIX)


def _parse_base_offset(name: str) -> tuple[int, str] | None:
    stem, dot, suffix = name.partition(".")
    if not dot or len(stem) != 20 or not stem.isdigit():
        return None
    return int(stem), "." + suffix


def tidy_directory(directory: Path, names: list[str]) -> list[int]:
    """Remove leftovers of interrupted writes; return the segment base offsets, sorted."""
    parsed = [(name, _parse_base_offset(name)) for name in names]
    bases = sorted({p[0] for _name, p in parsed if p is not None and p[1] == LOG_SUFFIX})
    known = set(bases)
    for name, p in parsed:
        if p is None:
            continue
        base, suffix = p
        leftover = suffix.endswith((CLEANED_SUFFIX, TMP_SUFFIX))
        orphan = suffix in _SEGMENT_SUFFIXES and base not in known
        if leftover or orphan:
            logger.info("%s: removing leftover file", directory / name)
            try:
                (directory / name).unlink()
            except OSError as exc:
                raise LogIOError(directory / name, "remove leftover file", exc) from exc
    return bases


def drop_after_truncation(directory: Path, truncated: Segment, later: list[int]) -> None:
    """A closed segment lost its tail: later segments no longer continue it."""
    for base in later:
        logger.warning(
            "%s: deleting segment %d after the truncated segment %s (log end offset %d)",
            directory,
            base,
            truncated.log_path.name,
            truncated.next_offset,
        )
        for suffix in (INDEX_SUFFIX, TIMEINDEX_SUFFIX, LOG_SUFFIX):
            (directory / f"{base:020d}{suffix}").unlink(missing_ok=True)
