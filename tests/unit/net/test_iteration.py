"""broker.net.iteration: the end-of-iteration work runs in one pass of the loop, two rounds."""

from __future__ import annotations

import asyncio
import logging

import pytest
import uvloop

from broker.net.iteration import IterationEnd


def run_in_loop(body: object) -> list[str]:
    events: list[str] = []

    async def main() -> None:
        end = IterationEnd(asyncio.get_running_loop())
        body(end, events)  # type: ignore[operator]
        for _ in range(5):  # a few passes
            await asyncio.sleep(0)

    uvloop.run(main())
    return events


def test_what_the_work_schedules_runs_in_the_same_pass_for_one_round() -> None:
    def body(end: IterationEnd, events: list[str]) -> None:
        loop = asyncio.get_running_loop()

        def third() -> None:
            events.append("links flushed again")

        def second() -> None:
            events.append("links flushed")
            end.call_soon(third)  # a third round: the next pass

        def first() -> None:
            events.append("committed")
            end.call_soon(second)

        end.call_soon(first)
        loop.call_soon(lambda: events.append("the rest of the pass"))

    assert run_in_loop(body) == [
        "committed",
        "links flushed",
        "the rest of the pass",
        "links flushed again",
    ]


def test_each_call_runs_once_in_order() -> None:
    def body(end: IterationEnd, events: list[str]) -> None:
        for name in "abc":
            end.call_soon(lambda name=name: events.append(name))

    assert run_in_loop(body) == ["a", "b", "c"]


def test_a_failing_callback_stops_nothing_else(caplog: pytest.LogCaptureFixture) -> None:
    def body(end: IterationEnd, events: list[str]) -> None:
        def bad() -> None:
            raise RuntimeError("boom")

        end.call_soon(bad)
        end.call_soon(lambda: events.append("after"))

    with caplog.at_level(logging.ERROR, logger="broker.server"):
        assert run_in_loop(body) == ["after"]
    assert "boom" in caplog.text
