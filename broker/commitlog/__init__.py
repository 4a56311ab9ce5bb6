"""mqlog's storage: a partitioned, segmented commit log (Kafka's LogSegment / OffsetIndex /
TimeIndex design, laminarmq's small interfaces).

Public API (see ``/work/notes/commitlog_api.md``): :class:`Record`, :class:`LogConfig`,
:class:`StreamSpec`, :class:`SegmentedLog`, :class:`Streams`, :class:`LogCleaner` and the
:class:`CommitLogError` hierarchy. Invariants and threading rules are stated in each module.
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
    UnsupportedFormat,
)
from broker.commitlog.index import OffsetIndex, TimeIndex
from broker.commitlog.log import SegmentedLog
from broker.commitlog.record import Record
from broker.commitlog.segment import Segment
from broker.commitlog.streams import Streams

__all__ = [
    "FORMAT_VERSION",
    "CommitLogError",
    "CorruptIndex",
    "CorruptRecordBatch",
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
    "Segment",
    "SegmentedLog",
    "StreamSpec",
    "Streams",
    "TimeIndex",
    "UnsupportedFormat",
]
