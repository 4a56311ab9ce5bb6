"""mqlog's storage: a partitioned, segmented commit log (Kafka's LogSegment / OffsetIndex /
TimeIndex design, laminarmq's small interfaces).

Public API: :class:`Record`, :class:`LogConfig`, :class:`StreamSpec`, :class:`SegmentedLog`,
:class:`Streams`, :class:`LogCleaner` and the :class:`CommitLogError` hierarchy (all listed in
``__all__``); what is not exported here is internal to the package. Invariants and threading
rules are stated in each module: :mod:`~broker.commitlog.log` (offsets, rolls, fsync policy,
recovery), :mod:`~broker.commitlog.segment` and :mod:`~broker.commitlog.index` (files),
:mod:`~broker.commitlog.batch` (the on-disk format), :mod:`~broker.commitlog.policy`
(retention and compaction), :mod:`~broker.commitlog.streams` (which stream and partition a
topic goes to, through a matcher the caller passes in).

The package imports nothing else of the broker: no wire rule (``broker.mqtt``), no router,
no event loop (pyproject.toml ``[tool.importlinter]``, tests/unit/test_layers.py).
"""

from broker.commitlog.batch import MAGIC as FORMAT_VERSION
from broker.commitlog.cleaner import LogCleaner
from broker.commitlog.config import FsyncPolicy, LogConfig, StreamSpec
from broker.commitlog.errors import (
    CommitLogError,
    CorruptIndex,
    CorruptRecordBatch,
    InvalidRecord,
    LogClosed,
    LogConfigError,
    LogIOError,
    OffsetOutOfRange,
    RewriteRefused,
    UnsupportedFormat,
)
from broker.commitlog.index import OffsetIndex, TimeIndex
from broker.commitlog.integrity import DamagedRange
from broker.commitlog.log import SegmentedLog
from broker.commitlog.record import Record
from broker.commitlog.segment import Segment
from broker.commitlog.streams import Streams

__all__ = [
    "FORMAT_VERSION",
    "CommitLogError",
    "CorruptIndex",
    "CorruptRecordBatch",
    "DamagedRange",
    "FsyncPolicy",
    "InvalidRecord",
    "LogCleaner",
    "LogClosed",
    "LogConfig",
    "LogConfigError",
    "LogIOError",
    "OffsetIndex",
    "OffsetOutOfRange",
    "Record",
    "RewriteRefused",
    "Segment",
    "SegmentedLog",
    "StreamSpec",
    "Streams",
    "TimeIndex",
    "UnsupportedFormat",
]
