"""A damaged range rewritten in place from another replica's batches (broker/commitlog/rewrite.py,
``ReplicaOps.rewrite`` and ``read_batches``): two logs written with the same batches stand for
two replicas; one has bytes of a sealed segment damaged as a disk would, the other's batches
for the damaged offsets replace them. Afterwards every record reads back as written, the
segment's bytes equal the healthy copy's, and a batch that does not fit the range is refused
with nothing written."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.commitlog import CorruptRecordBatch, RewriteRefused, SegmentedLog, integrity
from broker.commitlog.batch import BATCH_HEADER_SIZE, BatchHeader, encode_batch, read_header
from broker.commitlog.config import LogConfig
from broker.commitlog.integrity import DamagedRange, scan_segment
from tests.unit.commitlog.test_integrity import CONFIG, STOP, message, read_everything, sealed

COUNT = 600


def replica(directory: Path, config: object = CONFIG) -> None:
    """The same 200 batches of three records as every other replica (epoch 7)."""
    log = SegmentedLog.open(directory, config)  # type: ignore[arg-type]
    for first in range(0, COUNT, 3):
        log.append_raw(
            bytes(
                encode_batch(first, [message(i) for i in range(first, first + 3)], leader_epoch=7)
            )
        )
    log.close()


@pytest.fixture
def reports() -> Iterator[list[DamagedRange]]:
    found: list[DamagedRange] = []
    integrity.forget_reports()
    integrity.add_listener(found.append)
    yield found
    integrity.remove_listener(found.append)
    integrity.forget_reports()


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    damaged, healthy = tmp_path / "s" / "0", tmp_path / "h" / "0"
    replica(damaged)
    replica(healthy)
    return damaged, healthy


def flip_payload_byte(directory: Path, segment: int = 1) -> Path:
    target = sealed(directory)[segment]
    data = bytearray(target.read_bytes())
    at = data.index(b"m00") + 2
    data[at] ^= 0x20
    target.write_bytes(data)
    return target


def batches_for(healthy: Path, first: int, last: int) -> list[bytes]:
    with SegmentedLog.open(healthy, CONFIG) as log:
        return log.read_batches(first, last + 1, 1 << 20, 1 << 30)


def test_a_damaged_batch_is_rewritten_in_place_and_reads_back_as_written(
    pair: tuple[Path, Path], reports: list[DamagedRange]
) -> None:
    damaged, healthy = pair
    target = flip_payload_byte(damaged)
    written = [message(i) for i in range(COUNT)]
    with SegmentedLog.open(damaged, CONFIG) as log:
        assert len(read_everything(log)) == COUNT - 3  # the damaged batch skipped
        (damage,) = reports
        assert log.damaged_offsets(damage) == (damage.first_offset, damage.last_offset)
        first, last = damage.first_offset, damage.last_offset
        assert last - first == 2
        assert log.rewrite(damage, batches_for(healthy, first, last)) == 1
        assert read_everything(log) == written  # the cached damage scan was dropped
        assert log.read(first, 3) == written[first : first + 3]
    assert target.read_bytes() == (healthy / target.name).read_bytes()
    assert len(reports) == 1  # no new report
    # The report is forgotten: damage at the same place later is reported again.
    flip_payload_byte(damaged)
    with SegmentedLog.open(damaged, CONFIG) as log:
        read_everything(log)
    assert len(reports) == 2 and reports[1].position == damage.position
    assert integrity.corrupt_counts() == {("s", "0"): 2}


def test_a_range_the_scrubber_found_is_rewritten_before_any_read(
    pair: tuple[Path, Path], reports: list[DamagedRange]
) -> None:
    damaged, healthy = pair
    target = flip_payload_byte(damaged, 2)
    fd = os.open(target, os.O_RDONLY)
    try:
        (damage,) = scan_segment(fd, target, int(target.stem), target.stat().st_size).ranges
    finally:
        os.close(fd)
    with SegmentedLog.open(damaged, CONFIG) as log:
        batches = batches_for(healthy, damage.first_offset, damage.last_offset)
        assert log.rewrite(damage, batches) == 1
        assert log.rewrite(damage, batches) == 0  # done already: nothing written
        assert read_everything(log) == [message(i) for i in range(COUNT)]
    assert reports == []


def test_a_damaged_tail_of_a_sealed_segment_is_bounded_by_the_next_segment(
    pair: tuple[Path, Path], reports: list[DamagedRange]
) -> None:
    damaged, healthy = pair
    target = sealed(damaged)[1]
    data = bytearray(target.read_bytes())
    # The last batch's length field: no intact batch follows it in the file.
    pos = 0
    while True:
        length = read_header(bytes(data[pos : pos + 48])).batch_length
        if pos + length >= len(data):
            break
        pos += length
    data[pos + 8] ^= 0x7F
    target.write_bytes(data)
    next_base = int(sealed(damaged)[2].stem)
    with SegmentedLog.open(damaged, CONFIG) as log:
        read_everything(log)
        (damage,) = reports
        assert damage.last_offset == -1 and damage.end == len(data)
        assert log.damaged_offsets(damage) == (damage.first_offset, next_base - 1)
        batches = batches_for(healthy, damage.first_offset, next_base - 1)
        assert log.rewrite(damage, batches) == 1
        assert read_everything(log) == [message(i) for i in range(COUNT)]
    assert target.read_bytes() == (healthy / target.name).read_bytes()


def test_batches_that_do_not_fit_the_range_are_refused_and_nothing_is_written(
    pair: tuple[Path, Path], reports: list[DamagedRange]
) -> None:
    damaged, healthy = pair
    target = flip_payload_byte(damaged)
    before = target.read_bytes()
    with SegmentedLog.open(damaged, CONFIG) as log:
        read_everything(log)
        (damage,) = reports
        first, last = damage.first_offset, damage.last_offset
        good = batches_for(healthy, first, last)
        shifted = batches_for(healthy, first + 3, last + 3)
        longer = bytes(
            encode_batch(
                first,
                [message(i)._replace(payload=b"longer") for i in range(first, last + 1)],
                leader_epoch=7,
            )
        )
        broken = bytearray(good[0])
        broken[-1] ^= 1
        cases = {
            "starts at offset": shifted,
            "bytes of replacement batches": [longer],
            "CRC mismatch": [bytes(broken)],
            "end at offset": batches_for(healthy, first, last + 3),
        }
        for reason, batches in cases.items():
            with pytest.raises(RewriteRefused, match=reason):
                log.rewrite(damage, batches)
            assert target.read_bytes() == before
        gone = damage._replace(path=damage.path.with_name("00000000000000999999.log"))
        with pytest.raises(RewriteRefused, match="no such damaged range"):
            log.rewrite(gone, good)
        assert log.rewrite(damage, good) == 1


def test_read_batches_stops_before_damage_and_never_returns_it(
    pair: tuple[Path, Path], reports: list[DamagedRange]
) -> None:
    damaged, healthy = pair
    flip_payload_byte(damaged)
    with SegmentedLog.open(damaged, CONFIG) as log, SegmentedLog.open(healthy, CONFIG) as good:
        everything = good.read_batches(0, COUNT, 1 << 20, 1 << 30)
        got = log.read_batches(0, COUNT, 1 << 20, 1 << 30)
        (damage,) = reports  # reported by the read
        first = damage.first_offset
        assert got == everything[: first // 3]  # up to the damaged batch, not past it
        with pytest.raises(CorruptRecordBatch) as caught:
            log.read_batches(first + 1, COUNT, 1 << 20, 1 << 30)
        assert (caught.value.first_offset, caught.value.last_offset) == (first, first + 2)
        # Past the damage, reads go on as before.
        after = log.read_batches(first + 3, COUNT, 1 << 20, 1 << 30)
        assert after == everything[first // 3 + 1 :]
        log.rewrite(damage, everything[first // 3 : first // 3 + 1])
        assert log.read_batches(0, COUNT, 1 << 20, 1 << 30) == everything
    assert len(reports) == 1


def test_a_reader_held_at_the_damage_goes_on_once_it_is_rewritten(
    tmp_path: Path, reports: list[DamagedRange]
) -> None:
    damaged, healthy = tmp_path / "s" / "0", tmp_path / "h" / "0"
    replica(damaged, STOP)
    replica(healthy)
    flip_payload_byte(damaged)
    with SegmentedLog.open(damaged, STOP) as log:
        got = []
        with pytest.raises(CorruptRecordBatch):  # held at the damage (on_corruption = "stop")
            while True:
                got += log.read(got[-1].offset + 1 if got else 0, 50)
        (damage,) = reports
        assert got[-1].offset == damage.first_offset - 1
        with pytest.raises(CorruptRecordBatch):
            log.read(damage.first_offset)
        log.rewrite(damage, batches_for(healthy, damage.first_offset, damage.last_offset))
        rest = log.read(damage.first_offset, COUNT)
        assert got + rest == [message(i) for i in range(COUNT)]


def test_damage_across_a_batch_boundary_is_rewritten_with_both_batches(
    pair: tuple[Path, Path], reports: list[DamagedRange]
) -> None:
    damaged, healthy = pair
    target = sealed(damaged)[1]
    data = bytearray(target.read_bytes())
    boundary = read_header(bytes(data[:48])).batch_length  # the end of the first batch
    for i in range(boundary - 4, boundary + 4):  # its last bytes, the next one's base offset
        data[i] ^= 0xFF
    target.write_bytes(data)
    with SegmentedLog.open(damaged, CONFIG) as log:
        assert len(read_everything(log)) == COUNT - 6
        (damage,) = reports
        assert damage.last_offset - damage.first_offset == 5  # two batches of three
        batches = batches_for(healthy, damage.first_offset, damage.last_offset)
        assert len(batches) == 2
        assert log.rewrite(damage, batches) == 2
        assert read_everything(log) == [message(i) for i in range(COUNT)]
    assert target.read_bytes() == (healthy / target.name).read_bytes()


COMPACTED = LogConfig(
    segment_bytes=4096,
    index_interval_bytes=256,
    fsync="never",
    compacted=True,
    keep_empty_batches=True,
)


def test_a_compacted_replicas_shorter_copy_rewrites_the_segment_whole(
    tmp_path: Path, reports: list[DamagedRange]
) -> None:
    """``$retained`` and ``$sessions`` are compacted by each node at its own time: the
    healthy replica's copy of the damaged offsets is shorter (compaction emptied those
    batches into placeholders), so it cannot be written in place; the sealed segment is
    rewritten whole, its other batches as they were."""
    damaged, healthy = tmp_path / "s" / "0", tmp_path / "h" / "0"
    replica(damaged, COMPACTED)
    replica(healthy, COMPACTED)
    with SegmentedLog.open(healthy, COMPACTED) as log:
        assert log.compact() > 0  # one topic: every record but the last one is removed
    target = flip_payload_byte(damaged)
    with SegmentedLog.open(damaged, COMPACTED) as log:
        read_everything(log)
        (damage,) = reports
        first, last = damage.first_offset, damage.last_offset
        with SegmentedLog.open(healthy, COMPACTED) as other:
            copy = other.read_batches(first, last + 1, 1 << 20, 1 << 30)
        assert sum(map(len, copy)) < damage.end - damage.position
        others = [h for h in scan_batches(target) if not first <= h.base_offset <= last]
        assert log.rewrite(damage, copy) == len(copy)
        after = read_everything(log)
        # The range reads as on the healthy replica (compacted away), the rest as written.
        assert [r.offset for r in after] == [i for i in range(COUNT) if not first <= i <= last]
        assert after == [message(i) for i in range(COUNT) if not first <= i <= last]
    assert [h for h in scan_batches(target) if not first <= h.base_offset <= last] == others
    assert not list(damaged.glob("*.cleaned"))
    # Reopened: the segment and its rebuilt indexes read the same; nothing is damaged.
    reports.clear()
    with SegmentedLog.open(damaged, COMPACTED) as log:
        assert [r.offset for r in read_everything(log)] == [r.offset for r in after]
        assert log.read(first + 3, 3) == [message(i) for i in range(first + 3, first + 6)]
    assert reports == []


def test_a_compacted_segment_with_other_damage_is_not_rewritten_whole(
    tmp_path: Path, reports: list[DamagedRange]
) -> None:
    damaged, healthy = tmp_path / "s" / "0", tmp_path / "h" / "0"
    replica(damaged, COMPACTED)
    replica(healthy, COMPACTED)
    with SegmentedLog.open(healthy, COMPACTED) as log:
        log.compact()
    target = sealed(damaged)[1]
    data = bytearray(target.read_bytes())
    for at in (data.index(b"m00") + 2, data.rindex(b"m00") + 2):
        data[at] ^= 0x20  # two damaged batches, far apart
    target.write_bytes(data)
    before = target.read_bytes()
    with SegmentedLog.open(damaged, COMPACTED) as log:
        read_everything(log)
        first_damage = reports[0]
        first, last = first_damage.first_offset, first_damage.last_offset
        with SegmentedLog.open(healthy, COMPACTED) as other:
            copy = other.read_batches(first, last + 1, 1 << 20, 1 << 30)
        with pytest.raises(RewriteRefused, match="too: not rewritten whole"):
            log.rewrite(first_damage, copy)
    assert target.read_bytes() == before
    assert not list(damaged.glob("*.cleaned"))


def scan_batches(path: Path) -> list[BatchHeader]:
    """The headers of every batch of a segment file (intact ones)."""
    data = path.read_bytes()
    out, pos = [], 0
    while pos + BATCH_HEADER_SIZE <= len(data):
        h = read_header(data[pos : pos + BATCH_HEADER_SIZE])
        out.append(h)
        pos += h.batch_length
    return out
