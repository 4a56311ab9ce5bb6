"""``mqlog streams`` and ``mqlog offsets``: tables from a running broker's HTTP admin API.

A client of the API, not of the broker's insides: what it prints is what ``GET
/api/v1/streams`` and ``GET /api/v1/sessions`` answer (as ``--user`` when the broker asks for a
user, the password from :data:`PASSWORD_ENV`).
"""

from __future__ import annotations

import argparse
import base64
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import orjson

DEFAULT_BROKER = "http://127.0.0.1:8080"


class BrokerUnreachable(Exception):
    """The admin HTTP API could not be reached or answered with an error."""


#: Where the commands that ask the HTTP API with ``--user`` find the password (a flag would
#: show it to every local user in the process list).
PASSWORD_ENV = "MQLOG_PASSWORD"


def _get(broker: str, path: str, user: str | None = None) -> Any:
    """GET ``path`` from the broker's admin API and decode the JSON body; with ``user``, as
    that user (HTTP Basic, the password from :data:`PASSWORD_ENV`)."""
    return _call(urllib.request.Request(broker.rstrip("/") + path), broker, user)


def _post(broker: str, path: str, body: Any, user: str | None = None, timeout: float = 10.0) -> Any:
    """POST ``body`` as JSON to ``path``; the decoded answer (an error's message raised)."""
    request = urllib.request.Request(
        broker.rstrip("/") + path,
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    return _call(request, broker, user, timeout)


def _call(
    request: urllib.request.Request, broker: str, user: str | None, timeout: float = 10.0
) -> Any:
    url = request.full_url
    if user is not None:
        token = base64.b64encode(f"{user}:{os.environ.get(PASSWORD_ENV, '')}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return orjson.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise BrokerUnreachable(
                f"{url}: HTTP 401: the broker wants a user of its password file "
                f"(--user NAME, the password in ${PASSWORD_ENV})"
                if user is None
                else f"{url}: HTTP 401: user {user!r} refused (is ${PASSWORD_ENV} right?)"
            ) from None
        try:
            message = orjson.loads(e.read())["error"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            message = e.reason
        raise BrokerUnreachable(f"{url}: HTTP {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise BrokerUnreachable(
            f"cannot reach the broker's HTTP API at {broker} ({reason}); is `mqlog serve` "
            "running with [http] enabled, and is --broker right?"
        ) from None
    except orjson.JSONDecodeError:
        raise BrokerUnreachable(f"{url}: the answer is not JSON; is it an mqlog broker?") from None


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned text columns; numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [
        all(isinstance(row[i], int) for row in rows) and bool(rows) for i in range(len(headers))
    ]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    return "\n".join([line(headers), *(line(r) for r in cells)])


def _duration(ms: int | None) -> str:
    """Milliseconds in the config's own units: 604800000 -> "7d"; None -> "forever"."""
    if ms is None:
        return "forever"
    for unit, size in (
        ("w", 604_800_000),
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def cmd_streams(args: argparse.Namespace) -> int:
    streams = _get(args.broker, "/api/v1/streams", args.user)["streams"]
    rows = []
    for st in streams:
        cfg = st["config"]
        rows.append(
            [
                st["name"],
                st["partitions"],
                ",".join(st["topic_filters"]) or "-",
                _duration(cfg.get("retention_ms")),
                cfg.get("fsync", "-"),
            ]
        )
    print(table(["STREAM", "PARTITIONS", "TOPIC FILTERS", "RETENTION", "FSYNC"], rows))
    print()
    rows = []
    for st in streams:
        path = f"/api/v1/streams/{urllib.parse.quote(st['name'])}/partitions"
        parts = _get(args.broker, path, args.user)["partitions"]
        for p in parts:
            rows.append(
                [
                    st["name"],
                    p["partition"],
                    p["earliest_offset"],
                    p["high_water_mark"],
                    p["high_water_mark"] - p["earliest_offset"],
                ]
            )
    print(table(["STREAM", "PARTITION", "EARLIEST", "HIGH-WATER", "RECORDS"], rows))
    return 0


def cmd_offsets(args: argparse.Namespace) -> int:
    data = _get(args.broker, "/api/v1/sessions", args.user)
    rows: list[list[Any]] = []
    for s in data["sessions"]:
        state = "connected" if s["connected"] else "offline"
        if not s["positions"]:
            rows.append([s["client_id"], state, "-", "-", "-", "-", "-", "-"])
        for p in s["positions"]:
            rows.append(
                [
                    s["client_id"],
                    state,
                    p["consumer"],
                    p["stream"],
                    p["partition"],
                    p["offset"],
                    p["high_water_mark"],
                    p["lag"],
                ]
            )
    print(f"sessions ({len(data['sessions'])} persistent)")
    print(
        table(
            ["CLIENT", "STATE", "CONSUMER", "STREAM", "PARTITION", "OFFSET", "HIGH-WATER", "LAG"],
            rows,
        )
    )
    groups = data.get("shared_groups", [])
    if groups:
        rows = []
        for g in groups:
            members = ",".join(g["members"]) or "-"
            for p in g["positions"]:
                rows.append(
                    [
                        g["subscription"],
                        members,
                        p["stream"],
                        p["partition"],
                        p["offset"],
                        p["high_water_mark"],
                        p["lag"],
                    ]
                )
        print()
        print(f"shared groups ({len(groups)})")
        print(
            table(["GROUP", "MEMBERS", "STREAM", "PARTITION", "OFFSET", "HIGH-WATER", "LAG"], rows)
        )
    return 0
