"""The ``mqlog`` source's options, parsed once into a frozen, picklable :class:`SourceOptions`.

Names follow Spark's Kafka source (``startingOffsets``, ``maxRecordsPerTrigger``,
``failOnDataLoss``...):

- ``broker`` (required): the broker's HTTP API, ``http://host:port``;
- ``stream`` (required): a stream name, or several separated by commas;
- ``topicFilter``: an MQTT topic filter (``devices/+/telemetry``); only matching records;
- ``startingOffsets``: ``earliest`` | ``latest`` | JSON, either ``{"0": 42, "1": -2}`` for a
  single stream or ``{"telemetry": {"0": 42}}``; ``-2`` means earliest, ``-1`` latest, and a
  partition left out starts at earliest. Default: ``earliest`` for batch reads, ``latest`` for
  streaming queries (as Kafka's). Checkpointed offsets win over it when a query restarts;
- ``endingOffsets`` (batch only): ``latest`` (default) | JSON as above (``-1`` latest);
- ``startingTimestamp``: epoch milliseconds; each partition starts at its first record at or
  after that time (takes precedence over ``startingOffsets``);
- ``maxRecordsPerTrigger``: at most this many log records per micro-batch (admission
  control; counted before ``topicFilter``, as offsets are);
- ``failOnDataLoss``: ``true`` (default) fails a query whose next offset was deleted by
  retention; ``false`` skips forward to the earliest retained offset with a warning;
- ``maxRecordsPerFetch``: records per HTTP fetch (default 10000, the broker's cap);
- ``user`` and ``password``: a user of the broker's password file, sent as HTTP Basic
  credentials (required when the broker has ``allow_anonymous = false``; the broker then
  returns only the records that user's ACL reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson

from spark_sink.client import BrokerClient, MqlogSourceError

EARLIEST = -2
LATEST = -1
DEFAULT_MAX_RECORDS_PER_FETCH = 10_000

#: A position per stream and partition: ``{stream: {partition: offset}}``; offset may be
#: :data:`EARLIEST` or :data:`LATEST` until resolved against the broker.
Positions = dict[str, dict[int, int]]


class OptionError(MqlogSourceError, ValueError):
    """An option is missing or malformed; the message names it."""


@dataclass(frozen=True, slots=True)
class SourceOptions:
    broker: str
    streams: tuple[str, ...]
    topic_filter: str | None = None
    starting: str | Positions | None = None  # "earliest" | "latest" | positions | None
    ending: str | Positions = "latest"
    starting_timestamp: int | None = None
    max_records_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    max_records_per_fetch: int = DEFAULT_MAX_RECORDS_PER_FETCH
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def client(self) -> BrokerClient:
        """A client of the broker with these options' credentials."""
        return BrokerClient(self.broker, user=self.user, password=self.password)


class _CaseInsensitive(dict[str, str]):
    """Option lookup ignoring case, whatever mapping Spark or a caller passes."""

    def __init__(self, options: Mapping[str, str]) -> None:
        super().__init__((k.lower(), v) for k, v in options.items())

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())


def _positive_int(options: Mapping[str, str], key: str) -> int | None:
    raw = options.get(key)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise OptionError(f"option {key!r} must be an integer, got {raw!r}") from None
    if value <= 0:
        raise OptionError(f"option {key!r} must be > 0, got {value}")
    return value


def parse_positions(
    key: str, raw: str, streams: tuple[str, ...], allowed: tuple[str, ...]
) -> str | Positions:
    """``earliest``/``latest`` (when ``allowed``) or a JSON object of offsets per partition."""
    text = raw.strip()
    if text.lower() in allowed:
        return text.lower()
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise OptionError(
            f"option {key!r} must be {' | '.join(allowed)} or a JSON object like "
            f'{{"0": 42}} or {{"{streams[0]}": {{"0": 42}}}}, got {raw!r}'
        ) from None
    if not isinstance(data, dict) or not data:
        raise OptionError(f"option {key!r} must be a non-empty JSON object, got {raw!r}")
    if all(not isinstance(v, dict) for v in data.values()):
        if len(streams) != 1:
            raise OptionError(
                f"option {key!r}: with several streams give offsets per stream, "
                f'like {{"{streams[0]}": {{"0": 42}}}}'
            )
        data = {streams[0]: data}
    out: Positions = {}
    for stream, parts in data.items():
        if stream not in streams:
            raise OptionError(
                f"option {key!r} names stream {stream!r}, which is not in option "
                f"'stream' ({', '.join(streams)})"
            )
        if not isinstance(parts, dict):
            raise OptionError(
                f"option {key!r}: offsets of stream {stream!r} must be a JSON "
                f"object of partition -> offset, got {parts!r}"
            )
        out[stream] = {}
        for p, offset in parts.items():
            if (
                not str(p).isdigit()
                or not isinstance(offset, int)
                or isinstance(offset, bool)
                or offset < EARLIEST
            ):
                raise OptionError(
                    f"option {key!r}: stream {stream!r} needs partition numbers mapped to "
                    f"offsets >= 0 (or -2 earliest, -1 latest), got {p!r}: {offset!r}"
                )
            out[stream][int(p)] = offset
    return out


def parse_options(options: Mapping[str, str]) -> SourceOptions:
    """Validate Spark's option map (keys are case-insensitive, as in Spark) into SourceOptions."""
    options = _CaseInsensitive(options)
    broker = options.get("broker")
    if not broker:
        raise OptionError(
            "option 'broker' is required: the broker's HTTP API, e.g. "
            ".option('broker', 'http://127.0.0.1:8080')"
        )
    raw_streams = options.get("stream")
    if not raw_streams:
        raise OptionError(
            "option 'stream' is required: a stream name such as 'telemetry' "
            "(`mqlog streams` lists them), or several separated by commas"
        )
    streams = tuple(s.strip() for s in raw_streams.split(",") if s.strip())
    if len(set(streams)) != len(streams):
        raise OptionError(f"option 'stream' names a stream twice: {raw_streams!r}")
    topic_filter = options.get("topicFilter")
    if topic_filter is not None:
        # Imported here: the streaming source runner unpickles options, it never parses them.
        from broker.mqtt.topics import validate_topic_filter

        try:
            validate_topic_filter(topic_filter)
        except Exception as e:
            raise OptionError(
                f"option 'topicFilter' {topic_filter!r} is not a valid MQTT topic filter: {e}"
            ) from None
    starting: str | Positions | None = None
    if options.get("startingOffsets") is not None:
        starting = parse_positions(
            "startingOffsets", options["startingOffsets"], streams, ("earliest", "latest")
        )
    ending: str | Positions = "latest"
    if options.get("endingOffsets") is not None:
        ending = parse_positions("endingOffsets", options["endingOffsets"], streams, ("latest",))
        if isinstance(ending, dict) and any(
            o == EARLIEST for ps in ending.values() for o in ps.values()
        ):
            raise OptionError("option 'endingOffsets': -2 (earliest) is not a valid end")
    starting_timestamp = None
    if options.get("startingTimestamp") is not None:
        raw = options["startingTimestamp"]
        try:
            starting_timestamp = int(raw)
        except ValueError:
            raise OptionError(
                f"option 'startingTimestamp' must be epoch milliseconds, got {raw!r}"
            ) from None
    user = options.get("user")
    password = options.get("password")
    if password is not None and user is None:
        raise OptionError("option 'password' needs option 'user'")
    fail = (options.get("failOnDataLoss") or "true").strip().lower()
    if fail not in ("true", "false"):
        raise OptionError(f"option 'failOnDataLoss' must be true or false, got {fail!r}")
    return SourceOptions(
        broker=broker,
        streams=streams,
        topic_filter=topic_filter,
        starting=starting,
        ending=ending,
        starting_timestamp=starting_timestamp,
        max_records_per_trigger=_positive_int(options, "maxRecordsPerTrigger"),
        fail_on_data_loss=fail == "true",
        max_records_per_fetch=(
            _positive_int(options, "maxRecordsPerFetch") or DEFAULT_MAX_RECORDS_PER_FETCH
        ),
        user=user,
        password=password,
    )
