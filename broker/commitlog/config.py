"""Configuration of a partition log and of a stream, as frozen dataclasses.

Units: bytes for ``*_bytes``, milliseconds for ``*_ms``. ``None`` retention means "keep
forever" / "no size limit". Values are validated once, at construction, and raise
:class:`~broker.commitlog.errors.LogConfigError` naming the field; ``broker/config`` parses
the TOML and names the file.

Immutable; safe to share between threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from broker.commitlog.errors import LogConfigError

FsyncPolicy = Literal["always", "interval", "never"]
FSYNC_POLICIES: tuple[str, ...] = get_args(FsyncPolicy)
#: What a read does at a damaged batch (:mod:`broker.commitlog.integrity`).
CorruptionPolicy = Literal["skip", "stop"]
CORRUPTION_POLICIES: tuple[str, ...] = get_args(CorruptionPolicy)

#: Positions inside a segment are stored as unsigned 32-bit integers in the offset index, and a
#: segment never grows past ``segment_bytes`` (except for a single batch larger than it, which
#: gets a segment of its own and still starts at position 0).
MAX_SEGMENT_BYTES = (1 << 31) - 1
#: Relative offsets are stored on 32 bits in the index: a segment spans fewer offsets.
MAX_SEGMENT_OFFSETS = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Per-partition log settings (Kafka names: segment.bytes, segment.ms, ...)."""

    segment_bytes: int = 64 * 1024 * 1024
    segment_ms: int = 7 * 24 * 3600 * 1000
    index_interval_bytes: int = 4096
    fsync: FsyncPolicy = "interval"
    fsync_interval_ms: int = 1000
    retention_ms: int | None = 7 * 24 * 3600 * 1000
    retention_bytes: int | None = None
    compacted: bool = False
    #: Compaction leaves a ``CONTROL_COMPACTED`` placeholder where it empties a batch, so that
    #: every batch keeps its offsets (a log whose batches are Raft entries needs it:
    #: ``broker.cluster.storage``); else the batch goes, its offsets a gap, and an emptied
    #: segment with it. A placeholder costs 86 bytes, forever: a local log goes without.
    keep_empty_batches: bool = False
    on_corruption: CorruptionPolicy = "skip"

    def __post_init__(self) -> None:
        if not 1 <= self.segment_bytes <= MAX_SEGMENT_BYTES:
            raise LogConfigError(
                f"segment_bytes must be in [1, {MAX_SEGMENT_BYTES}], got {self.segment_bytes}"
            )
        if self.segment_ms <= 0:
            raise LogConfigError(f"segment_ms must be > 0, got {self.segment_ms}")
        if self.index_interval_bytes < 0:
            raise LogConfigError(
                f"index_interval_bytes must be >= 0, got {self.index_interval_bytes}"
            )
        if self.fsync not in FSYNC_POLICIES:
            raise LogConfigError(f"fsync must be one of {FSYNC_POLICIES}, got {self.fsync!r}")
        if self.on_corruption not in CORRUPTION_POLICIES:
            raise LogConfigError(
                f"on_corruption must be one of {CORRUPTION_POLICIES}, got {self.on_corruption!r}"
            )
        if self.fsync_interval_ms <= 0:
            raise LogConfigError(f"fsync_interval_ms must be > 0, got {self.fsync_interval_ms}")
        if self.retention_ms is not None and self.retention_ms < 0:
            raise LogConfigError(f"retention_ms must be >= 0 or None, got {self.retention_ms}")
        if self.retention_bytes is not None and self.retention_bytes < 0:
            raise LogConfigError(
                f"retention_bytes must be >= 0 or None, got {self.retention_bytes}"
            )


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """A named log with ``partitions`` partitions, selected by MQTT topic filters.

    ``topic_filters`` is empty for the internal streams and for ``default``.
    ``replication_factor`` is the copies a cluster keeps of each partition (None: the
    cluster's own factor); the log itself does not read it.
    """

    name: str
    topic_filters: tuple[str, ...]
    partitions: int = 1
    log: LogConfig = field(default_factory=LogConfig)
    replication_factor: int | None = None

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise LogConfigError(f"stream name {self.name!r} must be a non-empty path segment")
        if self.partitions < 1:
            raise LogConfigError(
                f"stream {self.name!r}: partitions must be >= 1, got {self.partitions}"
            )
        if self.replication_factor is not None and self.replication_factor < 1:
            raise LogConfigError(
                f"stream {self.name!r}: replication_factor must be >= 1 or None, "
                f"got {self.replication_factor}"
            )
