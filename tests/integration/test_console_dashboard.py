"""docs/grafana-dashboard.json: importable as is (its data source is the ``DS_PROMETHEUS``
input Grafana asks for on import), and every metric it queries is one a live broker's
GET /metrics exposes."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.clients import V5, Client
from tests.integration.conftest import ROOT, BrokerFactory

DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
METRIC = re.compile(r"\bmqlog_[a-z0-9_]+\b")
#: Counted only where there are several workers (broker.metrics.collector).
WORKERS_ONLY = {"mqlog_records_forwarded_total", "mqlog_session_handovers_total"}
#: PromQL functions over a counter's range: what they are applied to must be a counter.
COUNTER_FUNCTIONS = re.compile(r"\b(?:rate|irate|increase)\(\s*(mqlog_[a-z0-9_]+)")


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = orjson.loads(DASHBOARD.read_bytes())
    return dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())  # a collapsed row holds its panels


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the template variables' queries."""
    out = [t["expr"] for p in panels(dashboard) for t in p.get("targets", ())]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


def test_dashboard_is_importable_as_is() -> None:
    dashboard = load()
    (source,) = dashboard["__inputs"]
    assert source == {
        "name": "DS_PROMETHEUS",
        "label": "Prometheus",
        "description": source["description"],
        "type": "datasource",
        "pluginId": "prometheus",
        "pluginName": "Prometheus",
    }
    required = {(r["type"], r["id"]) for r in dashboard["__requires"]}
    assert ("datasource", "prometheus") in required
    # An import creates the dashboard: no database id; a stable uid keeps its links.
    assert dashboard["id"] is None and dashboard["uid"] == "mqlog-broker"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert ("panel", panel["type"]) in required, panel["type"]
        # Every query goes to the data source chosen at import, none to a uid of ours.
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == DATASOURCE, panel["title"]
            assert 'instance=~"$instance"' in t["expr"], t["expr"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"] == DATASOURCE
    # No panel overlaps another (Grafana would push one down and the layout would drift).
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard):
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_rates_are_taken_of_counters_only() -> None:
    for expr in queries(load()):
        for metric in COUNTER_FUNCTIONS.findall(expr):
            assert metric.endswith(("_total", "_bucket", "_count", "_sum")), (metric, expr)


def scraped_names(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_metric_queried_is_exposed(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(fsync="always")  # the fsync histogram has observations
    # Traffic and a persistent session, so the labelled families have samples.
    away = Client(broker.port, "dash-away", V5, clean=False, session_expiry=600)
    assert away.connect() == 0
    assert away.subscribe("dash/#", 1) == [1]
    away.disconnect()
    pub = Client(broker.port, "dash-pub")
    assert pub.connect() == 0
    for i in range(10):
        pub.publish(f"dash/{i}", b"x", qos=1)
    pub.disconnect()
    exposed = scraped_names(broker.http_url)
    queried = {name for expr in queries(load()) for name in METRIC.findall(expr)}
    assert len(queried) >= 20  # the dashboard covers the broker, not a corner of it
    expected = queried if broker.workers > 1 else queried - WORKERS_ONLY
    assert expected - exposed == set(), "queried but not in /metrics"
    # The exceptions are real: those metrics are in the dashboard, and a lone worker has none.
    assert queried >= WORKERS_ONLY
    if broker.workers == 1:
        assert not WORKERS_ONLY & exposed
