"""A small blocking client of the broker's HTTP admin and fetch API (stdlib ``http.client``).

Used on the Spark driver (planning offsets) and in the Python workers (fetching records).
It holds one keep-alive connection; an instance is cheap and is created where it is used, never
pickled. Errors are translated here, in one place, into :class:`MqlogSourceError` subclasses
whose messages tell the user what to fix.
"""

from __future__ import annotations

import base64
import http.client
import urllib.parse
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa

#: Seconds to wait for the broker to answer one request.
DEFAULT_TIMEOUT = 30.0


class MqlogSourceError(Exception):
    """Base class of the Spark source's errors (bad options, broker answers)."""


class BrokerUnavailable(MqlogSourceError):
    """The broker's HTTP API could not be reached or answered something unexpected."""


class AccessDenied(MqlogSourceError):
    """The broker asks for credentials (allow_anonymous = false) or refused the ones given."""


class UnknownStream(MqlogSourceError):
    """The stream (or partition) does not exist on the broker."""


class OffsetOutOfRange(MqlogSourceError):
    """An offset outside ``[earliest_offset, high_water_mark]`` of a partition."""

    def __init__(
        self, message: str, offset: int, earliest_offset: int, high_water_mark: int
    ) -> None:
        super().__init__(message)
        self.offset = offset
        self.earliest_offset = earliest_offset
        self.high_water_mark = high_water_mark


@dataclass(frozen=True, slots=True)
class PartitionOffsets:
    partition: int
    earliest_offset: int
    high_water_mark: int


@dataclass(frozen=True, slots=True)
class Fetched:
    """One fetch: the records (``None`` when there were none) and where to continue."""

    batch: pa.RecordBatch | None
    next_offset: int
    high_water_mark: int


class BrokerClient:
    """Blocking calls to one broker, e.g. ``BrokerClient("http://127.0.0.1:8080")``; with
    ``user`` (and ``password``) every request carries HTTP Basic credentials (a broker with
    allow_anonymous = false asks for a user of its password file)."""

    def __init__(
        self,
        url: str,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise MqlogSourceError(
                f"option 'broker' must be the broker's HTTP API as http://host:port, got {url!r}"
            )
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.timeout = timeout
        self.user = user
        self._auth: dict[str, str] = {}
        if user is not None:
            token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
            self._auth["Authorization"] = f"Basic {token}"
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport
    def _request(self, path: str, accept: str) -> tuple[int, http.client.HTTPResponse, bytes]:
        """GET ``path``; one retry on a fresh connection if a kept-alive one went stale."""
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self._conn.request("GET", path, headers={"Accept": accept, **self._auth})
                resp = self._conn.getresponse()
                return resp.status, resp, resp.read()
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if attempt:
                    raise BrokerUnavailable(
                        f"cannot reach the mqlog broker's HTTP API at {self.url} ({e}); is "
                        "`mqlog serve` running with [http] enabled, and is option 'broker' "
                        "right?"
                    ) from None
        raise AssertionError("unreachable")

    def _json(self, path: str) -> tuple[int, Any]:
        status, _, body = self._request(path, "application/json")
        try:
            return status, orjson.loads(body)
        except orjson.JSONDecodeError:
            raise BrokerUnavailable(
                f"{self.url}{path}: HTTP {status}, the answer is not JSON; is {self.url} an "
                "mqlog broker?"
            ) from None

    @staticmethod
    def _path(stream: str, partition: int | None = None) -> str:
        path = f"/api/v1/streams/{urllib.parse.quote(stream, safe='')}/partitions"
        return path if partition is None else f"{path}/{partition}"

    def _check(self, status: int, data: Any, what: str) -> Any:
        if status == 200:
            return data
        message = data.get("error", data) if isinstance(data, dict) else data
        if status == 401:
            who = f"user {self.user!r}" if self.user is not None else "no credentials"
            raise AccessDenied(
                f"{what}: broker {self.url} refused {who}: {message} (options 'user' and "
                "'password': a user of the broker's password file)"
            )
        if status == 404:
            raise UnknownStream(
                f"{what}: {message} (broker {self.url}); streams: "
                f"{', '.join(self.user_streams()) or 'none'}"
            )
        raise BrokerUnavailable(f"{what}: broker {self.url} answered HTTP {status}: {message}")

    # ------------------------------------------------------------------ calls
    def streams(self) -> list[dict[str, Any]]:
        status, data = self._json("/api/v1/streams")
        streams: list[dict[str, Any]] = self._check(status, data, "list streams")["streams"]
        return streams

    def user_streams(self) -> list[str]:
        """Names of the streams that hold client publishes (not the internal ``$`` ones)."""
        return [s["name"] for s in self.streams() if not s["name"].startswith("$")]

    def partitions(self, stream: str) -> list[PartitionOffsets]:
        status, data = self._json(self._path(stream))
        data = self._check(status, data, f"stream {stream!r}")
        return [
            PartitionOffsets(p["partition"], p["earliest_offset"], p["high_water_mark"])
            for p in data["partitions"]
        ]

    def offset_for_time(self, stream: str, partition: int, timestamp_ms: int) -> int:
        status, data = self._json(
            f"{self._path(stream, partition)}/offset?timestamp={timestamp_ms}"
        )
        return int(self._check(status, data, f"stream {stream!r} partition {partition}")["offset"])

    def fetch(
        self, stream: str, partition: int, offset: int, max_records: int, max_bytes: int = 4 << 20
    ) -> Fetched:
        """Records from ``offset`` (at most ``max_records``) as one Arrow batch.

        Raises :class:`OffsetOutOfRange` (with the valid range) for an offset the partition
        does not hold, :class:`UnknownStream` for an unknown stream or partition.
        """
        path = (
            f"{self._path(stream, partition)}/records?offset={offset}"
            f"&max_records={max_records}&max_bytes={max_bytes}"
        )
        status, resp, body = self._request(path, "application/vnd.apache.arrow.stream")
        what = f"stream {stream!r} partition {partition}"
        if status != 200:
            try:
                data = orjson.loads(body)
            except orjson.JSONDecodeError:
                data = {"error": body[:200].decode(errors="replace")}
            if status == 416:
                raise OffsetOutOfRange(
                    data["error"], offset, data["earliest_offset"], data["high_water_mark"]
                )
            self._check(status, data, what)
        try:
            next_offset = int(resp.headers["X-Mqlog-Next-Offset"])
            hwm = int(resp.headers["X-Mqlog-High-Water-Mark"])
            table = pa.ipc.open_stream(body).read_all()
        except (KeyError, ValueError, pa.ArrowInvalid) as e:
            raise BrokerUnavailable(
                f"{what}: unexpected fetch answer from {self.url}: {e}"
            ) from None
        batches = table.to_batches()
        batch = None
        if len(batches) == 1:
            batch = batches[0]
        elif batches:
            batch = table.combine_chunks().to_batches()[0]
        return Fetched(batch, next_offset, hwm)
