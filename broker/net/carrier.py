"""What :class:`~broker.net.transport.MQTTProtocol` needs of a transport, for carriers that are
not a plain asyncio socket transport (TLS over memory BIOs, WebSocket frames).

A carrier adapts its medium to this small surface (write, close, abort, is_closing,
get_extra_info, set_write_buffer_limits) and drives the protocol's callbacks
(``connection_made``, ``data_received``, ``pause_writing``, ``resume_writing``,
``connection_lost``), so every listener shares one connection implementation.
"""

from __future__ import annotations

import asyncio
from typing import Any


class Carrier(asyncio.Transport):
    """Base for the adapters: extra info falls back to the underlying socket transport."""

    def __init__(self, outer: asyncio.BaseTransport | None) -> None:
        super().__init__()
        self._outer = outer
        self._closing = False
        self._high_water = 1 << 20

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if self._outer is None:
            return default
        return self._outer.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is not None:
            self._high_water = high
