"""Streams registry: topic -> stream/partition, internal streams, FORMAT file, LogCleaner.

The registry is given its topic matcher; most tests pass the broker's
(:func:`broker.mqtt.topics.topic_matches`), one a fake that shows the registry applies no
rule of its own.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from broker.commitlog import (
    CommitLogError,
    LogCleaner,
    LogConfig,
    LogConfigError,
    Record,
    Streams,
    StreamSpec,
    UnsupportedFormat,
)
from broker.commitlog.streams import FORMAT_VERSION
from broker.mqtt.topics import topic_matches

DAY = 24 * 3600 * 1000


class FakeClock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> float:
        return self.now_ms / 1000


SPECS = [
    StreamSpec("telemetry", ("devices/+/telemetry",), partitions=4),
    StreamSpec("devices", ("devices/#",), partitions=2),
]


def test_first_matching_spec_wins_and_default_catches_the_rest(tmp_path: Path) -> None:
    with Streams(tmp_path, SPECS, matches=topic_matches) as streams:
        assert streams.stream_for("devices/7/telemetry").name == "telemetry"
        assert streams.stream_for("devices/7/status").name == "devices"
        assert streams.stream_for("devices").name == "devices"
        assert streams.stream_for("other/x").name == "default"
        assert streams.stream_for("$SYS/x").name == "default"
        assert streams.stream_for("devices/7/telemetry").name == "telemetry"  # cached


def test_partition_is_crc32_of_topic(tmp_path: Path) -> None:
    with Streams(tmp_path, SPECS, matches=topic_matches) as streams:
        for i in range(20):
            topic = f"devices/{i}/telemetry"
            assert streams.partition_for(topic) == ("telemetry", zlib.crc32(topic.encode()) % 4)
        assert streams.partition_for("x/ü") == ("default", 0)


def test_the_matcher_decides_asked_in_configuration_order_once_per_topic(
    tmp_path: Path,
) -> None:
    calls: list[tuple[str, str]] = []

    def prefix(topic_filter: str, topic: str) -> bool:  # no MQTT wildcard rule at all
        calls.append((topic_filter, topic))
        return topic.startswith(topic_filter)

    specs = [StreamSpec("a", ("x/1",)), StreamSpec("b", ("x", "y"))]
    with Streams(tmp_path, specs, matches=prefix) as streams:
        assert streams.stream_for("x/1/z").name == "a"
        assert streams.stream_for("x/2").name == "b"
        assert streams.stream_for("x/1/z").name == "a"  # cached: the matcher is not asked
        assert streams.stream_for("devices/#").name == "default"
        assert calls == [
            ("x/1", "x/1/z"),
            ("x/1", "x/2"),
            ("x", "x/2"),
            ("x/1", "devices/#"),
            ("x", "devices/#"),
            ("y", "devices/#"),
        ]


def test_without_a_matcher_only_unfiltered_streams_route(tmp_path: Path) -> None:
    with Streams(tmp_path, [StreamSpec("default", (), partitions=2)]) as streams:
        assert streams.partition_for("a/b") == ("default", zlib.crc32(b"a/b") % 2)
    with Streams(tmp_path, SPECS) as streams:
        assert streams.log("telemetry", 3).end_offset == 0  # storage needs no matcher
        with pytest.raises(CommitLogError, match="matches="):
            streams.stream_for("devices/1/telemetry")


def test_internal_streams_exist(tmp_path: Path) -> None:
    with Streams(tmp_path, SPECS) as streams:
        assert list(streams.specs) == ["telemetry", "devices", "$retained", "$sessions", "default"]
        for name in ("$retained", "$sessions"):
            spec = streams.specs[name]
            assert spec.partitions == 1 and spec.log.compacted
            assert spec.log.retention_ms is None
        log = streams.log("$retained", 0)
        assert log is streams.log("$retained", 0)
        assert (tmp_path / "$retained" / "0").is_dir()


def test_configured_default_is_used(tmp_path: Path) -> None:
    own = StreamSpec("default", (), partitions=3, log=LogConfig(retention_ms=None))
    with Streams(tmp_path, [own]) as streams:
        assert streams.specs["default"] is own


def test_bad_specs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(LogConfigError):
        Streams(tmp_path, [StreamSpec("a", ()), StreamSpec("a", ())])
    with pytest.raises(LogConfigError):
        StreamSpec("a/b", ())
    with pytest.raises(LogConfigError):
        StreamSpec("a", (), partitions=0)
    with pytest.raises(LogConfigError, match="fsync"):
        LogConfig(fsync="sometimes")  # type: ignore[arg-type]


def test_unknown_stream_or_partition(tmp_path: Path) -> None:
    with Streams(tmp_path, SPECS) as streams:
        with pytest.raises(CommitLogError, match="unknown stream"):
            streams.log("nope", 0)
        with pytest.raises(CommitLogError, match=r"partitions 0\.\.3"):
            streams.log("telemetry", 4)


def test_format_file(tmp_path: Path) -> None:
    Streams(tmp_path, []).close()
    assert (tmp_path / "FORMAT").read_text().strip() == str(FORMAT_VERSION) == "2"
    Streams(tmp_path, []).close()  # same version: fine
    # Version 1 (before compaction kept batch boundaries) opens and is raised to the current
    # one, which a version-1 broker refuses instead of taking compacted batches for damage.
    (tmp_path / "FORMAT").write_text("1\n")
    with Streams(tmp_path, []) as streams:
        assert streams.format_version == 1
    assert (tmp_path / "FORMAT").read_text() == "2\n"
    assert not (tmp_path / "FORMAT.tmp").exists()
    (tmp_path / "FORMAT").write_text(f"{FORMAT_VERSION + 1}\n")
    with pytest.raises(UnsupportedFormat) as info:
        Streams(tmp_path, [])
    assert str(tmp_path / "FORMAT") in str(info.value)
    (tmp_path / "FORMAT").write_text("banana")
    with pytest.raises(CommitLogError, match="FORMAT"):
        Streams(tmp_path, [])


def test_logs_survive_reopen(tmp_path: Path) -> None:
    with Streams(tmp_path, SPECS, matches=topic_matches) as streams:
        stream, partition = streams.partition_for("devices/1/telemetry")
        streams.log(stream, partition).append([Record(0, 1, "devices/1/telemetry", b"x")])
    with Streams(tmp_path, SPECS) as streams:
        assert streams.log(stream, partition).end_offset == 1


def test_cleaner_runs_retention_and_compaction(tmp_path: Path) -> None:
    clock = FakeClock(100 * DAY)
    specs = [StreamSpec("short", ("s/#",), log=LogConfig(retention_ms=DAY))]
    with Streams(tmp_path, specs, clock=clock) as streams:
        short = streams.log("short", 0)
        short.append([Record(0, 1, "s/1", b"old")])
        short.roll()
        short.append([Record(0, 100 * DAY, "s/1", b"new")])
        retained = streams.log("$retained", 0)
        retained.append([Record(0, 1, "a/b", b"v1")])
        retained.roll()
        retained.append([Record(0, 2, "a/b", b"v2")])
        cleaner = LogCleaner(streams, interval_s=3600, clock=clock)
        assert cleaner.run_once() == (1, 1)
        assert short.log_start_offset == 1
        assert [r.payload for r in retained.read(0)] == [b"v2"]
        cleaner.start()
        cleaner.stop(timeout=5)
        assert cleaner.run_once() == (0, 0)
