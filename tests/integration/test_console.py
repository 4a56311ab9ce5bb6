"""The live console's JSON (GET /api/v1/console) and its assets, against a real broker fed
by paho clients. The page itself in a browser: test_console_browser.py."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import orjson

from tests.integration.clients import V5, Client
from tests.integration.conftest import BrokerFactory, BrokerProcess


def get(broker: BrokerProcess, path: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(broker.http_url + path, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def console(broker: BrokerProcess) -> dict[str, Any]:
    status, headers, body = get(broker, "/api/v1/console")
    assert status == 200, body
    assert headers["Content-Type"].startswith("application/json")
    doc: dict[str, Any] = orjson.loads(body)
    return doc


def partition(doc: dict[str, Any], stream: str, p: int) -> dict[str, Any]:
    for s in doc["streams"]:
        if s["name"] == stream:
            found: dict[str, Any] = s["partitions"][p]
            return found
    raise AssertionError(f"no stream {stream} in {doc['streams']}")


def test_page_and_assets_are_served_by_the_broker(broker: BrokerProcess) -> None:
    status, headers, body = get(broker, "/")
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    # Nothing but the broker's own assets: the policy tells the browser so.
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert b'src="/console/console.js"' in body
    assert b"http://" not in body and b"https://" not in body
    for name, kind in (("console.js", "text/javascript"), ("console.css", "text/css")):
        status, headers, body = get(broker, f"/console/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind)
        assert b"https://" not in body.replace(b"http://www.w3.org/2000/svg", b"")
    status, _, body = get(broker, "/console/secrets.txt")
    assert status == 404 and b"no console asset named 'secrets.txt'" in body


def test_console_document_follows_the_broker(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(
        config='[[streams]]\nname = "tele"\ntopic_filter = ["dev/#"]\npartitions = 2\n'
    )
    before = console(broker)
    assert before["cluster"] == {
        "mode": "single node",
        "node_id": None,
        "nodes": [],
        "partitions": [],
    }
    assert before["workers"] == broker.workers
    assert before["workers_up"] == broker.workers
    assert [
        p["high_water_mark"] for p in (partition(before, "tele", 0), partition(before, "tele", 1))
    ] == [0, 0]
    # A persistent session that goes away with a subscription, and a shared group.
    away = Client(broker.port, "console-away", V5, clean=False, session_expiry=600)
    assert away.connect() == 0
    assert away.subscribe("dev/#", 1) == [1]
    away.disconnect()
    # Connected and up to date: listed after the one behind, though its name sorts first.
    present = Client(broker.port, "a-console-present", V5, clean=False, session_expiry=600)
    assert present.connect() == 0
    assert present.subscribe("dev/#", 1) == [1]
    member = Client(broker.port, "console-member")
    assert member.connect() == 0
    assert member.subscribe("$share/crew/dev/#", 1) == [1]
    pub = Client(broker.port, "console-pub")
    assert pub.connect() == 0
    n = 40
    for i in range(n):
        pub.publish(f"dev/d{i % 8}/t", b"x" * 200, qos=1)
    member.expect(n)
    present.expect(n)

    doc = console(broker)
    marks = [partition(doc, "tele", p)["high_water_mark"] for p in (0, 1)]
    assert sum(marks) == n
    for p in (0, 1):
        part = partition(doc, "tele", p)
        assert part["earliest_offset"] == 0
        assert part["segments"] == 1
        assert part["disk_bytes"] > part["high_water_mark"] * 200  # the payloads are in it
    tele = next(s for s in doc["streams"] if s["name"] == "tele")
    assert not tele["internal"] and tele["topic_filters"] == ["dev/#"]
    assert doc["disk"]["log_bytes"] >= tele["disk_bytes"] > n * 200
    assert doc["disk"]["free_bytes"] > 0
    b = doc["broker"]
    assert b["messages_received"] == n
    # To the group's member and the present session; the session that went away: none.
    assert b["messages_sent"] == 2 * n
    assert b["clients_connected"] == 3 and b["connections"] == 3
    assert b["connections_opened"] >= 4
    assert b["subscriptions"] == 3
    assert b["dropped"] == {"slow_qos0": 0, "oversize": 0, "not_authorized": 0}

    assert doc["sessions_total"] == 2 and doc["shared_groups_total"] == 1
    session, other = doc["sessions"]  # the one furthest behind first
    assert (other["client_id"], other["connected"]) == ("a-console-present", True)
    assert sum(p["lag"] for p in other["positions"]) == 0
    assert session["client_id"] == "console-away" and not session["connected"]
    assert session["subscriptions"] == [{"filter": "dev/#", "qos": 1}]
    lag = {(p["stream"], p["partition"]): p["lag"] for p in session["positions"]}
    assert sum(lag[("tele", p)] for p in (0, 1)) == n
    (group,) = doc["shared_groups"]
    assert group["group"] == "crew" and group["filter"] == "dev/#"
    assert group["members"] == ["console-member"]
    assert sum(p["lag"] for p in group["positions"]) == 0

    # The chart's history: one entry per interval between two samples; the messages above
    # show in it from the first sample taken after them (one every interval).
    deadline = time.monotonic() + 5 * doc["history"]["interval"]
    while True:
        history = doc["history"]
        assert len(history["t"]) == len(history["received"]) == len(history["stored"])
        assert all(t <= 0 for t in history["t"])
        rates = [partition(doc, "tele", p)["records_per_s"] for p in (0, 1)]
        if max(history["received"], default=0) > 0 and max(rates) > 0:
            break
        assert time.monotonic() < deadline, f"no traffic in the history: {history}"
        time.sleep(0.2)
        doc = console(broker)
    assert max(history["stored"]) > 0 and max(history["sent"]) > 0
    assert set(doc["throughput"]) == {"received", "sent", "stored", "bytes_received", "bytes_sent"}
    for c in (pub, member, present):
        c.disconnect()
