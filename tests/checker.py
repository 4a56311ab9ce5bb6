"""A queue checker in the style of Jepsen's queue workload, for a broker under faults.

Input: the history of a run, as plain records (pure functions here, no I/O):

- ``Publish``: one message a client tried to publish, with a unique id, its topic and QoS,
  when it was first sent (``start``), when the attempt that got its acknowledgement was sent
  (``sent``; a client resends the same id after a reconnect), and when the PUBACK came
  (``end``, None if it never did);
- ``Read``: one message read back by the final drain (every copy, in the order read);
- ``Fault``: one fault of the schedule (kind, target, when it began and when it was healed).

``check`` reports:

- **lost**: acknowledged ids never read back. A broker that acknowledges a QoS 1 publish
  promises to deliver it [MQTT-4.3.2-2 .. 4.3.2-5]: this must be 0;
- **unacked_seen**: publishes without a PUBACK that were read back (allowed: the outcome of a
  publish interrupted by a fault is unknown to the client), and ``unacked_lost`` (allowed);
- **duplicates**: copies beyond the first of each id (QoS 1 is at least once: counted, not
  an error), and **unexpected**: ids read back that nobody published (must be 0);
- **order violations** per topic: message b was acknowledged before message a was first sent,
  yet a was read before b (first copies). Only real-time order is required: concurrent
  publishes may land either way;
- **unavailability** after each fault: from the fault's start to the first acknowledgement of
  a publish sent at or after that moment (None: none was, until the run ended).

Times are seconds on one monotonic clock.
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Publish:
    uid: str
    client: str
    topic: str
    qos: int
    start: float
    sent: float
    end: float | None

    @property
    def acked(self) -> bool:
        return self.end is not None


@dataclass(frozen=True, slots=True)
class Read:
    uid: str
    topic: str


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    target: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class FaultWindow:
    """One fault and how long publishes went unacknowledged after it began."""

    kind: str
    target: str
    start: float
    duration: float
    unavailable: float | None


@dataclass
class Report:
    faults: int
    published: int
    acked: int
    lost: int
    unacked_seen: int
    unacked_lost: int
    read: int
    duplicates: int
    unexpected: int
    order_violations: int
    unavailable_median: float | None
    unavailable_max: float | None
    never_available: int
    lost_ids: list[str] = field(default_factory=list)
    order_examples: list[tuple[str, str, str]] = field(default_factory=list)
    windows: list[FaultWindow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing a broker may not do: no acknowledged loss, no invented message, no
        real-time reordering on a topic."""
        return self.lost == 0 and self.unexpected == 0 and self.order_violations == 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        rows = [
            ("faults", self.faults),
            ("published", self.published),
            ("acknowledged", self.acked),
            ("acknowledged lost", self.lost),
            ("unacknowledged, read back", self.unacked_seen),
            ("unacknowledged, not read back", self.unacked_lost),
            ("copies read back", self.read),
            ("duplicates", self.duplicates),
            ("unexpected (never published)", self.unexpected),
            ("per-topic order violations", self.order_violations),
            ("unavailable after a fault, median s", _fmt(self.unavailable_median)),
            ("unavailable after a fault, max s", _fmt(self.unavailable_max)),
            ("faults never followed by an ack", self.never_available),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        if self.windows:
            lines.append("")
            lines.append(f"{'t (s)':>8}  {'fault':<10} {'target':<14} {'held s':>6}  unavail s")
            for w in self.windows:
                lines.append(
                    f"{w.start:8.2f}  {w.kind:<10} {w.target:<14} {w.duration:6.2f}  "
                    f"{_fmt(w.unavailable)}"
                )
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "never" if x is None else f"{x:.2f}"


def lost_ids(publishes: Iterable[Publish], seen: set[str]) -> list[str]:
    """Acknowledged ids not in ``seen``, in publish order."""
    return [p.uid for p in publishes if p.acked and p.uid not in seen]


def order_violations(
    publishes: Sequence[Publish], reads: Sequence[Read]
) -> list[tuple[str, str, str]]:
    """(topic, a, b) for every message b read after some a on its topic although b was
    acknowledged before a was first sent. One pass per topic over the first copies: b
    violates iff its ack time is below the largest ``start`` among the messages read before
    it (a is that message)."""
    by_uid = {p.uid: p for p in publishes}
    firsts: dict[str, list[Publish]] = defaultdict(list)
    seen: set[str] = set()
    for r in reads:
        p = by_uid.get(r.uid)
        if p is None or r.uid in seen:
            continue
        seen.add(r.uid)
        firsts[r.topic].append(p)
    out: list[tuple[str, str, str]] = []
    for topic, ps in firsts.items():
        latest: Publish | None = None
        for p in ps:
            if p.end is not None and latest is not None and p.end < latest.start:
                out.append((topic, latest.uid, p.uid))
            if latest is None or p.start > latest.start:
                latest = p
    return out


def unavailability(publishes: Sequence[Publish], faults: Sequence[Fault]) -> list[FaultWindow]:
    """For each fault, seconds from its start to the first ack of a publish sent at or
    after it (None if there is none)."""
    acks = sorted((p.sent, p.end) for p in publishes if p.end is not None)
    sents = [sent for sent, _ in acks]
    # suffix_min[i]: the earliest ack among the publishes sent at or after sents[i]
    suffix_min: list[float | None] = [None] * (len(acks) + 1)
    for i in range(len(acks) - 1, -1, -1):
        nxt = suffix_min[i + 1]
        end = acks[i][1]
        suffix_min[i] = end if nxt is None else min(end, nxt)
    out: list[FaultWindow] = []
    for f in faults:
        first = suffix_min[bisect.bisect_left(sents, f.start)]
        out.append(
            FaultWindow(
                f.kind,
                f.target,
                f.start,
                f.end - f.start,
                None if first is None else first - f.start,
            )
        )
    return out


def check(
    publishes: Sequence[Publish], reads: Sequence[Read], faults: Sequence[Fault] = ()
) -> Report:
    """The whole report of one run (see the module docstring)."""
    uids = Counter(p.uid for p in publishes)
    dup_uids = [u for u, n in uids.items() if n > 1]
    if dup_uids:
        raise ValueError(f"publish ids must be unique; repeated: {dup_uids[:5]}")
    copies = Counter(r.uid for r in reads)
    seen = set(copies)
    lost = lost_ids(publishes, seen)
    acked = sum(1 for p in publishes if p.acked)
    unacked_seen = sum(1 for p in publishes if not p.acked and p.uid in seen)
    order = order_violations(publishes, reads)
    windows = unavailability(publishes, faults)
    finite = [w.unavailable for w in windows if w.unavailable is not None]
    return Report(
        faults=len(faults),
        published=len(publishes),
        acked=acked,
        lost=len(lost),
        unacked_seen=unacked_seen,
        unacked_lost=len(publishes) - acked - unacked_seen,
        read=len(reads),
        duplicates=sum(n - 1 for n in copies.values()),
        unexpected=len(seen - uids.keys()),
        order_violations=len(order),
        unavailable_median=statistics.median(finite) if finite else None,
        unavailable_max=max(finite) if finite else None,
        never_available=len(windows) - len(finite),
        lost_ids=lost[:100],
        order_examples=order[:20],
        windows=windows,
    )


def dumps(report: Report) -> str:
    """One JSON line for the report (windows included)."""
    return json.dumps(report.to_json(), separators=(",", ":"))
