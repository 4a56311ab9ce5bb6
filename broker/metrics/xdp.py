"""The XDP filter's metrics, read from the ``xdp`` block of the node's cluster view.

``mqlog_xdp_enabled`` is 1 where the kernel program is attached and 0 where the user-space
filter stands in (the block's ``reason`` says why); ``mqlog_xdp_packets_total`` and
``mqlog_xdp_bytes_total`` count by ``class`` (gossip, raft, mqtt, other, fragment, ipv6) and
``verdict`` (pass, drop_stranger, drop_bad_magic). The user-space filter counts the gossip
class only, in datagrams and payload bytes. Only worker 0 of a node runs the filter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def xdp_metrics(block: dict[str, Any] | None) -> Iterator[Metric]:
    """The metrics of one ``xdp`` status block (none without one: not worker 0)."""
    if block is None:
        return
    yield GaugeMetricFamily(
        "mqlog_xdp_enabled",
        "1 where the XDP program filters the cluster interface, 0 where user space does",
        value=1 if block["enabled"] else 0,
    )
    for unit, help_ in (
        ("packets", "Packets seen by the cluster interface's filter, by class and verdict"),
        ("bytes", "Bytes of the packets seen by the cluster interface's filter"),
    ):
        family = CounterMetricFamily(f"mqlog_xdp_{unit}", help_, labels=["class", "verdict"])
        for cls, verdicts in sorted(block[unit].items()):
            for verdict, n in sorted(verdicts.items()):
                family.add_metric([cls, verdict], n)
        yield family
