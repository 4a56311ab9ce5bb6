"""``mqlog verify DATA_DIR [--repair]`` and the scrubber (issue 25): damage found offline and
in the background, reported; a repair moves damaged bytes aside and keeps every intact batch."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.cli import main
from broker.commitlog import integrity
from broker.commitlog.config import LogConfig, StreamSpec
from broker.commitlog.integrity import DamagedRange
from broker.commitlog.log import SegmentedLog
from broker.commitlog.scrub import LogScrubber
from broker.commitlog.streams import Streams
from broker.commitlog.verify import verify_data_dir
from tests.unit.commitlog.test_integrity import CONFIG, message, read_everything, write_log


@pytest.fixture
def reports() -> Iterator[list[DamagedRange]]:
    found: list[DamagedRange] = []
    integrity.forget_reports()
    integrity.add_listener(found.append)
    yield found
    integrity.remove_listener(found.append)
    integrity.forget_reports()


def partition_dir(data: Path) -> Path:
    directory = data / "telemetry" / "0"
    write_log(directory, CONFIG)
    return directory


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0x20
    path.write_bytes(data)


def test_verify_of_an_intact_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    partition_dir(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "13 segments in 1 partitions" in out and "no damage found" in out


def test_verify_prints_every_damaged_file_and_repair_keeps_intact_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reports: list[DamagedRange]
) -> None:
    directory = partition_dir(tmp_path)
    logs = sorted(directory.glob("*.log"))
    flip(logs[1], 1000)  # a batch of a sealed segment
    flip(logs[2], -5)  # the last batch of another: a damaged tail
    index = directory / f"{logs[3].name[:20]}.index"
    index.write_bytes(index.read_bytes()[:-8] + b"\x01\x00\x00\x00\x07\x00\x00\x00")
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("telemetry")]
    assert len(rows) == 3
    assert logs[1].name in rows[0] and "CRC mismatch" in rows[0]
    assert logs[2].name in rows[1] and rows[1].split()[4].endswith("..")  # to the end
    assert index.name in rows[2] and "entry" in rows[2]
    # Read-only without --repair.
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before

    assert main(["verify", str(tmp_path), "--repair"]) == 1
    out = capsys.readouterr().out
    assert "quarantine" in out and "rebuilt" in out
    for damaged in logs[1:3]:  # moved aside, byte for byte
        assert (directory / "quarantine" / damaged.name).read_bytes() == before[damaged.name]
    assert main(["verify", str(tmp_path)]) == 0
    capsys.readouterr()

    reports.clear()
    integrity.forget_reports()
    log = SegmentedLog.open(directory, CONFIG)
    try:
        got = read_everything(log)
        assert log.segments == [int(p.name[:20]) for p in logs]  # none dropped
    finally:
        log.close()
    written = {r.offset: r for r in (message(i) for i in range(600))}
    assert all(written[r.offset] == r for r in got)
    assert 600 - len(got) == 6  # the two damaged batches of three records, nothing more
    assert reports == []  # the loss was reported by the repair, not again at every open


def test_verify_refuses_a_missing_directory(tmp_path: Path) -> None:
    assert main(["verify", str(tmp_path / "nope")]) == 2


def test_scrubber_finds_damage_in_sealed_segments(
    tmp_path: Path, reports: list[DamagedRange]
) -> None:
    streams = Streams(tmp_path, [StreamSpec("telemetry", ("devices/#",), 1, CONFIG)])
    log = streams.log("telemetry", 0)
    for first in range(0, 600, 3):
        log.append([message(i) for i in range(first, first + 3)])
    sealed = sorted((tmp_path / "telemetry" / "0").glob("*.log"))[:-1]
    flip(sealed[4], 700)
    clock = [0.0]

    def wait(seconds: float | None) -> bool:  # the injected clock moves by what is waited
        clock[0] += seconds or 0.0
        return False

    scrubber = LogScrubber(streams, 3600, 4096, clock=lambda: clock[0])
    scrubber._stop.wait = wait  # type: ignore[method-assign]
    try:
        found = scrubber.run_once()
    finally:
        streams.close()
    assert [d.path for d in found] == [sealed[4]] and reports == found
    total = sum(p.stat().st_size for p in sealed)
    assert scrubber.bytes_read >= total
    # The rate cap: reading took (at least) the time 4 KiB/s allows, no more.
    assert clock[0] == pytest.approx(scrubber.bytes_read / 4096, rel=0.01)


def test_verify_data_dir_checks_time_indexes(tmp_path: Path) -> None:
    directory = partition_dir(tmp_path)
    timeindex = sorted(directory.glob("*.timeindex"))[0]
    data = bytearray(timeindex.read_bytes())
    data[0] ^= 0x01  # a timestamp that is not the batch's
    timeindex.write_bytes(data)
    ((_dir, checks),) = verify_data_dir(tmp_path)
    assert [c.timeindex_problem is not None for c in checks].count(True) == 1
    shutil.rmtree(directory)


def test_log_config_rejects_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="on_corruption"):
        LogConfig(on_corruption="ignore")  # type: ignore[arg-type]


def test_verify_takes_an_incomplete_last_batch_of_the_active_segment_for_a_write(
    tmp_path: Path,
) -> None:
    # A running broker's active segment may end inside a batch being written: not damage.
    directory = partition_dir(tmp_path)
    logs = sorted(directory.glob("*.log"))
    with open(logs[-1], "ab") as f:
        f.write(logs[-1].read_bytes()[:100])  # a batch's first 100 bytes
    with open(logs[-2], "ab") as f:  # the same in a sealed segment is damage
        f.write(logs[-2].read_bytes()[:100])
    ((_dir, checks),) = verify_data_dir(tmp_path)
    assert [c.log_path for c in checks if c.ranges] == [logs[-2]]
