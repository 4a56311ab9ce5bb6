"""How the log names one partition: :data:`PartitionKey`, ``(stream name, partition number)``.

The log owns stream and partition naming (:meth:`broker.commitlog.Streams.partition_for`
makes keys, :meth:`~broker.commitlog.Streams.log` opens them), so the one name for the pair
lives here and every layer above (router, workers, transport) imports it.

A plain tuple alias, not a ``NamedTuple``: keys are dictionary keys on the per-message path,
and they cross the worker mesh inside ``marshal``-ed and JSON bodies (broker.workers), which
take tuples but refuse ``NamedTuple`` instances (``marshal``: "unmarshallable object").
tests/unit/workers/test_keys.py holds that.
"""

from __future__ import annotations

#: ``(stream name, partition number)``; partitions are numbered from 0.
PartitionKey = tuple[str, int]
