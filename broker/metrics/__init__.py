"""What the broker counts and how it tells: Prometheus metrics and the ``$SYS`` topics.

- :mod:`broker.metrics.collector`: plain int counters and the prometheus-client collector.
- :mod:`broker.metrics.sys_topics`: ``$SYS/broker/...`` retained topics, published on a timer.
"""
