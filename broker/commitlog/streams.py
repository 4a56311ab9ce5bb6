"""Streams registry: which stream and partition a topic goes to, and the open logs.

``DATA/<stream>/<partition>/`` is one :class:`SegmentedLog`. A topic belongs to the first
stream spec (in configuration order) with a topic filter that ``matches`` (a
:data:`TopicMatcher` the caller passes in) says covers it, else to ``default``; its partition
is ``crc32(utf-8 topic) % partitions`` so one topic keeps its order. The log knows no wire
rules: what a topic filter means (MQTT wildcards) is the matcher's business, and the broker
passes ``broker.mqtt.topics.topic_matches``. Without a matcher the registry still opens and
closes logs, and routes every topic to ``default`` as long as no spec has a topic filter. The
internal compacted streams ``$retained`` (key: topic) and ``$sessions`` (key: client id)
always exist (1 partition, compacted, kept forever) unless the configuration defines them.

``DATA/FORMAT`` holds the data directory's format version (:data:`FORMAT_VERSION`): it is
written when the directory is new, an older one is raised to it (every batch it holds is valid
in the new version), and a newer one raises :class:`UnsupportedFormat`, so a broker never opens
data it could take for damage.

Threads: ``stream_for`` / ``partition_for`` are pure lookups (a bounded cache: the matcher
runs once per topic until the cache is cleared); ``log`` opens
a partition on first use under a lock, so the loop thread and the cleaner may both call it.
Each log's append/read must still come from its owner's loop thread.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from broker.commitlog.config import LogConfig, StreamSpec
from broker.commitlog.errors import CommitLogError, LogConfigError, LogIOError, UnsupportedFormat
from broker.commitlog.keys import PartitionKey
from broker.commitlog.log import SegmentedLog

FORMAT_FILE = "FORMAT"
#: Version 1: batches of format :data:`~broker.commitlog.batch.MAGIC` 1 as first written.
#: Version 2: compaction keeps batch boundaries, so a batch may end in a gap or be a
#: ``CONTROL_COMPACTED`` placeholder (:mod:`broker.commitlog.batch`), which a version-1 broker's
#: validation refuses (it would report it as damage, or cut it from a segment it recovers).
FORMAT_VERSION = 2
DEFAULT_STREAM = "default"
RETAINED_STREAM = "$retained"
SESSIONS_STREAM = "$sessions"
#: Settings of the internal keyed streams: compacted, never deleted by age or size.
INTERNAL_LOG = LogConfig(retention_ms=None, retention_bytes=None, compacted=True)
#: Entries of the topic -> stream cache before it is cleared (bounds memory with many topics).
TOPIC_CACHE_SIZE = 65536

#: ``matches(topic_filter, topic) -> bool``: whether a stream's topic filter covers a topic.
TopicMatcher = Callable[[str, str], bool]


def check_format(data_dir: Path) -> int:
    """Create ``DATA/FORMAT`` if missing, raise an older version to :data:`FORMAT_VERSION`,
    raise :class:`UnsupportedFormat` for a newer one. Returns the version found (the current
    one for a new directory)."""
    path = data_dir / FORMAT_FILE
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            _write_format(path)
            return FORMAT_VERSION
    except OSError as exc:
        raise LogIOError(path, "read or create the format file", exc) from exc
    except UnicodeDecodeError as exc:
        raise CommitLogError(f"{path}: not a format version file") from exc
    if not text.isdigit():
        raise CommitLogError(f"{path}: invalid format version {text!r}")
    version = int(text)
    if version > FORMAT_VERSION:
        raise UnsupportedFormat(path, version, FORMAT_VERSION)
    if version < FORMAT_VERSION:
        try:
            _write_format(path)
        except OSError as exc:
            raise LogIOError(path, "raise the format version", exc) from exc
    return version


def _write_format(path: Path) -> None:
    tmp = path.with_name(FORMAT_FILE + ".tmp")
    tmp.write_text(f"{FORMAT_VERSION}\n", encoding="ascii")
    os.replace(tmp, path)


class Streams:
    """The data directory's streams and their partition logs (opened on first use).

    ``matches`` decides which topics a spec's ``topic_filters`` cover; it is needed only to
    route topics (:meth:`stream_for`) when some spec has topic filters.
    """

    def __init__(
        self,
        data_dir: Path,
        specs: Sequence[StreamSpec],
        *,
        clock: Callable[[], float] = time.time,
        matches: TopicMatcher | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self._clock = clock
        self._matches = matches
        by_name: dict[str, StreamSpec] = {}
        for spec in specs:
            if spec.name in by_name:
                raise LogConfigError(f"stream {spec.name!r} is defined twice")
            by_name[spec.name] = spec
        for name in (RETAINED_STREAM, SESSIONS_STREAM):
            by_name.setdefault(name, StreamSpec(name, (), 1, INTERNAL_LOG))
        by_name.setdefault(DEFAULT_STREAM, StreamSpec(DEFAULT_STREAM, ()))
        self.specs: dict[str, StreamSpec] = by_name
        self._routes = [(f, spec) for spec in specs for f in spec.topic_filters]
        self._default = by_name[DEFAULT_STREAM]
        self._topic_cache: dict[str, StreamSpec] = {}
        self._logs: dict[PartitionKey, SegmentedLog] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.format_version = check_format(self.data_dir)

    def stream_for(self, topic: str) -> StreamSpec:
        """The first spec (in configuration order) with a filter matching ``topic``, else
        ``default``. Raises :class:`CommitLogError` if a spec has topic filters and no
        matcher was given."""
        spec = self._topic_cache.get(topic)
        if spec is None:
            spec = self._select(topic)
            if len(self._topic_cache) >= TOPIC_CACHE_SIZE:
                self._topic_cache.clear()
            self._topic_cache[topic] = spec
        return spec

    def _select(self, topic: str) -> StreamSpec:
        """:meth:`stream_for` without the cache."""
        if not self._routes:
            return self._default
        matches = self._matches
        if matches is None:
            raise CommitLogError(
                f"stream {self._routes[0][1].name!r} has topic filters: "
                "routing a topic needs Streams(..., matches=...)"
            )
        return next((s for f, s in self._routes if matches(f, topic)), self._default)

    def partition_for(self, topic: str) -> PartitionKey:
        """``(stream name, crc32(utf-8 topic) % partitions)``."""
        spec = self.stream_for(topic)
        return spec.name, zlib.crc32(topic.encode()) % spec.partitions

    def log(self, stream: str, partition: int) -> SegmentedLog:
        """The log of ``stream``/``partition``, opened (and recovered) on first use."""
        key = (stream, partition)
        log = self._logs.get(key)
        if log is not None:
            return log
        spec = self.specs.get(stream)
        if spec is None:
            raise CommitLogError(f"unknown stream {stream!r}")
        if not 0 <= partition < spec.partitions:
            raise CommitLogError(
                f"stream {stream!r} has partitions 0..{spec.partitions - 1}, not {partition}"
            )
        with self._lock:
            if self._closed:
                raise CommitLogError(f"{self.data_dir}: streams are closed")
            log = self._logs.get(key)
            if log is None:
                log = SegmentedLog.open(
                    self.partition_dir(stream, partition), spec.log, clock=self._clock
                )
                self._logs[key] = log
            return log

    def partition_dir(self, stream: str, partition: int) -> Path:
        return self.data_dir / stream / str(partition)

    def open_logs(self) -> dict[PartitionKey, SegmentedLog]:
        """Snapshot of the logs opened so far, keyed by (stream, partition)."""
        with self._lock:
            return dict(self._logs)

    def set_aside(self, stream: str, partition: int, suffix: str) -> Path:
        """Close the partition's log and rename its directory to ``<dir>.<suffix>`` (kept,
        not deleted); the next :meth:`log` opens a new, empty one. Returns the new name."""
        key = (stream, partition)
        with self._lock:
            log = self._logs.pop(key, None)
        if log is not None:
            log.close()
        old = self.partition_dir(stream, partition)
        aside = old.with_name(f"{old.name}.{suffix}")
        if old.exists():
            old.rename(aside)
        return aside

    def close(self) -> None:
        """Close every open log (idempotent). Stop a :class:`LogCleaner` first."""
        with self._lock:
            self._closed = True
            logs = list(self._logs.values())
            self._logs.clear()
        errors: list[CommitLogError] = []
        for log in logs:
            try:
                log.close()
            except CommitLogError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Streams:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
