"""Control batches (a replicated log's Raft no-ops and configurations, broker/commitlog/batch.py)
take offsets in a partition's log, yet no subscriber sees one: replays from every kind of start
and at every QoS (the router's record and column reads), and the live delivery that follows.
The filter is ``#``, which the control record's empty topic would match were it read."""

from __future__ import annotations

import pytest

from broker.commitlog.batch import encode_control
from tests.unit.router.conftest import Harness
from tests.unit.router.test_replay import annotated, fill


def control(h: Harness, topic: str) -> int:
    """Append a control batch to ``topic``'s partition behind the router's back, then restart
    the router over the data directory (as a replicated log's reader would find it)."""
    log = h.streams.log(*h.streams.partition_for(topic))
    offset = log.append_raw(encode_control(log.end_offset, 1, 1, b"", 0))
    h.restart()
    return offset


@pytest.mark.parametrize("start", ["earliest", "offset:0", "offset:2", "time:0"])
@pytest.mark.parametrize("qos", [0, 1])
def test_a_replay_skips_control_batches(h: Harness, start: str, qos: int) -> None:
    fill(h, {"a/b": 2})
    assert control(h, "a/b") == 2
    fill(h, {"a/c": 2})
    assert control(h, "a/b") == 5
    assert control(h, "a/b") == 6
    pub = fill(h, {"a/d": 1})
    link, s = h.connect("r", 5)
    h.subscribe(s, f"$replay/{start}/#", qos)
    history = [(0, 0, b"a/b:0"), (0, 1, b"a/b:1"), (0, 3, b"a/c:0"), (0, 4, b"a/c:1")]
    want = [*(x for x in history if x[1] >= (2 if start == "offset:2" else 0)), (0, 7, b"a/d:0")]
    assert annotated(link.take()) == want
    h.publish(pub, "a/e", b"live", qos, 1 if qos else None)
    h.run()
    assert annotated(link.take()) == [(0, 8, b"live")]
