"""The record: one MQTT publish as stored in the log.

A :class:`Record` is a plain ``NamedTuple`` (a tuple: the hot path builds one per message).
``offset`` is assigned by the log on append (the value passed in is ignored); ``timestamp`` is
milliseconds since the Unix epoch; ``topic`` is also the compaction key of keyed (compacted)
streams, where an empty ``payload`` is a tombstone that deletes the key. ``properties`` are the
MQTT 5 properties already encoded by the codec: opaque bytes to the log.

Immutable; safe to share between threads.
"""

from __future__ import annotations

from typing import NamedTuple


class Record(NamedTuple):
    """One stored publish. See the module docstring for units and invariants."""

    offset: int
    timestamp: int
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    client_id: str = ""
    properties: bytes = b""

    @property
    def is_tombstone(self) -> bool:
        """An empty payload: in a compacted stream it deletes ``topic``."""
        return not self.payload
