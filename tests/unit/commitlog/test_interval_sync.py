"""fsync = "interval" off the owner's thread (broker.commitlog.interval_sync): the log hands
out a descriptor of its active segment when a sync is due, appends go on while another thread
fdatasyncs it, and the segment is clean afterwards only if nothing was appended since. Real
logs on real files and a real thread; the disk is made slow by holding ``os.fdatasync`` until
the test lets it go."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.commitlog.interval_sync import IntervalSyncer
from tests.unit.commitlog.test_log import FakeClock, open_log, recs


def test_a_due_sync_hands_out_the_active_segment_and_restarts_the_interval(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    log = open_log(tmp_path, clock, fsync="interval", fsync_interval_ms=1000)
    log.append(recs(2))
    assert log.interval_sync() is None  # the interval has not passed
    clock.advance(1000)
    target = log.interval_sync()
    assert target is not None
    fd, synced = target
    assert log.interval_sync() is None and not log.flush_if_due()  # restarted: not due
    log.append(recs(1))  # the lock is not held meanwhile: the owner goes on appending
    os.fdatasync(fd)
    os.close(fd)
    synced()
    clock.advance(1000)
    target = log.interval_sync()  # what came after the descriptor was taken: synced again
    assert target is not None
    fd, synced = target
    os.fdatasync(fd)
    os.close(fd)
    synced()
    clock.advance(1000)
    assert log.interval_sync() is None and not log.flush_if_due()  # clean: nothing to sync
    log.close()


@pytest.mark.parametrize("policy", ["always", "never"])
def test_only_the_interval_policy_syncs_so(tmp_path: Path, policy: str) -> None:
    clock = FakeClock()
    log = open_log(tmp_path, clock, fsync=policy, fsync_interval_ms=1000)
    log.append(recs(2))
    clock.advance(5000)
    assert log.interval_sync() is None
    log.close()
    # As before: the other policies answer without looking at the log, even a closed one.
    assert log.interval_sync() is None and log.flush_if_due() is False


def test_after_a_roll_the_owner_flushes_as_before(tmp_path: Path) -> None:
    """The rolled segment's tail, its indexes and the directory: not in the active segment,
    so no descriptor of it makes them durable; ``flush_if_due`` does it on this thread."""
    clock = FakeClock()
    log = open_log(tmp_path, clock, fsync="interval", fsync_interval_ms=1000, segment_bytes=1024)
    while len(log.segments) == 1:
        log.append(recs(2, size=100))
    clock.advance(1000)
    assert log.interval_sync() is None
    assert log.flush_if_due()
    log.append(recs(1))
    assert len(log.segments) == 2
    clock.advance(1000)
    target = log.interval_sync()  # the roll is synced: the active segment is enough again
    assert target is not None
    os.close(target[0])
    log.close()


def test_the_syncer_fsyncs_on_its_thread_while_the_owner_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = threading.Event()
    release = threading.Event()
    threads: list[threading.Thread] = []
    real = os.fdatasync

    def slow_disk(fd: int) -> None:
        threads.append(threading.current_thread())
        entered.set()
        assert release.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow_disk)
    clock = FakeClock()
    log = open_log(tmp_path, clock, fsync="interval", fsync_interval_ms=1000)
    posted: queue.Queue[Callable[[], None]] = queue.Queue()
    seconds: list[float] = []
    syncer = IntervalSyncer(posted.put, seconds.append)
    log.append(recs(2))
    clock.advance(1000)
    syncer.tick([log])  # returns with the fdatasync still held
    assert entered.wait(10)
    assert threads == [threads[0]] and threads[0] is not threading.current_thread()
    log.append(recs(1))  # the owner appends meanwhile
    syncer.tick([log])  # one sync in flight per log: nothing more
    assert len(threads) == 1 and posted.empty()
    release.set()
    posted.get(timeout=10)()  # the completion, run on the owner's thread
    assert len(seconds) == 1 and seconds[0] > 0
    clock.advance(1000)
    syncer.tick([log])  # the append made during the sync: synced at the next interval
    posted.get(timeout=10)()
    assert len(threads) == 2 and len(seconds) == 2
    clock.advance(1000)
    syncer.tick([log])  # clean now
    assert len(threads) == 2
    syncer.close()
    log.close()


def test_a_failed_fsync_leaves_the_segment_to_the_next_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = os.fdatasync
    failures = [OSError(5, "Input/output error")]

    def failing_once(fd: int) -> None:
        if failures:
            raise failures.pop()
        real(fd)

    monkeypatch.setattr(os, "fdatasync", failing_once)
    clock = FakeClock()
    log = open_log(tmp_path, clock, fsync="interval", fsync_interval_ms=1000)
    posted: queue.Queue[Callable[[], None]] = queue.Queue()
    seconds: list[float] = []
    syncer = IntervalSyncer(posted.put, seconds.append)
    log.append(recs(2))
    clock.advance(1000)
    syncer.tick([log])
    posted.get(timeout=10)()
    assert "interval fsync failed" in caplog.text and not seconds
    clock.advance(1000)
    syncer.tick([log])  # still dirty: tried again
    posted.get(timeout=10)()
    assert len(seconds) == 1
    syncer.close()
    log.close()
