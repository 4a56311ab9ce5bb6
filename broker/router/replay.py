"""``$replay/<from>/<filter>`` subscriptions: where in the log a replay starts.

``<from>`` is one of (the README's quick start shows them in use):

- ``earliest`` / ``latest``;
- ``offset:<n>``: every matched partition from offset n (exact for a single-topic filter);
- ``offsets:<p>=<n>,<p>=<n>``: per partition; partitions not named start at ``earliest``;
- ``time:<RFC 3339 | epoch-ms | -<duration>>``, e.g. ``time:-1h`` or
  ``time:2026-11-21T10:00:00Z``.

Any of them may end in ``;merge`` (``$replay/time:-1h;merge/devices/#``): the records of
every matched partition come merged in timestamp order (ties: the lower partition first)
instead of partition by partition. Its cost: each record is chosen among the partitions'
next records and sent alone, without runs of records in one write
(:meth:`broker.router.delivery.Delivery.pump_merged`).

Pure parsing; the router turns a :class:`ReplayStart` into cursors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime

from broker.config import duration_ms
from broker.mqtt.errors import TopicFilterInvalid
from broker.mqtt.topics import validate_topic_filter

REPLAY_PREFIX = "$replay/"
#: The ``<from>`` option that merges the partitions in timestamp order.
MERGE_OPTION = ";merge"


@dataclass(frozen=True, slots=True)
class ReplayStart:
    """Where to start: ``kind`` is earliest | latest | offset | offsets | time; ``merge``:
    the partitions merged in timestamp order (``;merge``)."""

    kind: str
    offset: int = 0
    offsets: tuple[tuple[int, int], ...] = ()
    timestamp_ms: int = 0
    merge: bool = False


def is_replay(topic_filter: str) -> bool:
    return topic_filter.startswith(REPLAY_PREFIX)


def parse_replay(topic_filter: str, now_ms: int) -> tuple[ReplayStart, str]:
    """Split a ``$replay/...`` filter into its start and the plain filter.

    Raises :class:`TopicFilterInvalid` (0x8F) naming what is wrong.
    """
    rest = topic_filter[len(REPLAY_PREFIX) :]
    spec, sep, plain = rest.partition("/")
    if not sep or not plain:
        raise TopicFilterInvalid(f"{topic_filter!r}: expected $replay/<from>/<filter>")
    if plain.startswith(("$share/", REPLAY_PREFIX)):
        raise TopicFilterInvalid(f"{topic_filter!r}: cannot replay a shared or replay filter")
    validate_topic_filter(plain)
    if spec.endswith(MERGE_OPTION):
        start = _parse_from(spec[: -len(MERGE_OPTION)], now_ms, topic_filter)
        return dataclasses.replace(start, merge=True), plain
    return _parse_from(spec, now_ms, topic_filter), plain


def _parse_from(spec: str, now_ms: int, whole: str) -> ReplayStart:
    if spec in ("earliest", "latest"):
        return ReplayStart(spec)
    kind, _, value = spec.partition(":")
    try:
        if kind == "offset":
            n = int(value)
            if n < 0:
                raise ValueError
            return ReplayStart("offset", offset=n)
        if kind == "offsets":
            pairs = []
            for item in value.split(","):
                part, _, off = item.partition("=")
                if int(part) < 0 or int(off) < 0:
                    raise ValueError
                pairs.append((int(part), int(off)))
            return ReplayStart("offsets", offsets=tuple(pairs))
        if kind == "time":
            return ReplayStart("time", timestamp_ms=_parse_time(value, now_ms))
    except ValueError:
        pass
    raise TopicFilterInvalid(
        f"{whole!r}: <from> must be earliest, latest, offset:<n>, offsets:<p>=<n>,..., or "
        f"time:<RFC 3339 | epoch-ms | -<duration>>, optionally followed by {MERGE_OPTION}"
    )


def _parse_time(value: str, now_ms: int) -> int:
    if value.startswith("-"):
        ago = duration_ms(value[1:])
        if ago is None:
            raise ValueError(value)
        return now_ms - ago
    if value.isdigit():
        return int(value)
    dt = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    if dt.tzinfo is None:
        raise ValueError("RFC 3339 needs a time zone offset")
    return int(dt.timestamp() * 1000)
