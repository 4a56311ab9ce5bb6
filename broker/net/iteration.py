"""The end of an event-loop iteration: where a worker's deferred work runs, in one pass.

Three things wait for the end of the iteration that made them due: the router's group commit
(the PUBLISHes of this iteration's reads), the links' output (one ``write`` per connection,
the PUBACKs of the commit among it) and the mesh's frames to the other workers (a forward,
an announcement of the commit). Each used to be its own ``loop.call_soon``, and each one
scheduled by another ran in a further pass of the loop (a pass runs only the callbacks
that were ready when it started): a device's PUBLISH took three passes, each with its
``epoll_wait`` and uvloop's own work, where the commit, the acknowledgements and the frames
can leave in one. :class:`IterationEnd` runs what is scheduled while it runs in the same
pass, for one more round; what the second round schedules waits for the next pass, so a
link whose output filled its per-iteration budget (and pumps on, broker.net.transport) still
lets the loop read in between.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("broker.server")

#: Rounds of one run: the first scheduled, then what they scheduled (see the module doc).
ROUNDS = 2


class IterationEnd:
    """``call_soon`` for the work of the end of an iteration (see the module docstring)."""

    __slots__ = ("_due", "_loop", "_running")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: list[Callable[[], None]] = []
        self._running = False

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` at the end of this iteration (in order, once per call)."""
        if not self._due and not self._running:
            self._loop.call_soon(self._run)
        self._due.append(callback)

    def _run(self) -> None:
        self._running = True
        try:
            for _ in range(ROUNDS):
                due, self._due = self._due, []
                if not due:
                    return
                for callback in due:
                    try:
                        callback()
                    except Exception:
                        # As the loop's own handler would: one failure stops nothing else.
                        log.exception("bug in %r at the end of an iteration", callback)
        finally:
            self._running = False
            if self._due:
                self._loop.call_soon(self._run)
