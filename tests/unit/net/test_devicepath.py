"""Which device path serves (broker.net.devicepath): the compiled one unless the environment
asks for Python, and Python, logged once, when the compiled module is not built."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

from broker.net import devicepath


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The choice not made yet in this process (it is made once, on first use)."""
    monkeypatch.setattr(devicepath, "_resolved", False)
    monkeypatch.setattr(devicepath, "_lane_class", None)
    monkeypatch.delenv(devicepath.ENV, raising=False)
    return monkeypatch


def test_the_environment_selects_python(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv(devicepath.ENV, "python")
    assert devicepath.lane_class() is None
    assert devicepath.new_lane(object(), ("telemetry", 0)) is None


def test_without_the_module_python_serves_and_it_is_logged_once(
    fresh: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fresh.setitem(sys.modules, "broker.net._devicelane", None)  # import raises ImportError
    with caplog.at_level(logging.INFO, logger="broker.net.devicepath"):
        assert devicepath.lane_class() is None
        assert devicepath.lane_class() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "not built" in warnings[0].getMessage()


def test_the_compiled_module_serves_by_default(fresh: pytest.MonkeyPatch) -> None:
    cls = devicepath.lane_class()
    if cls is None:
        pytest.fail("broker.net._devicelane is not built (pip install -e . builds it)")
    assert cls.__module__ == "broker.net._devicelane"


def test_the_compiled_lane_calls_only_the_public_c_api() -> None:
    """A private function (``_PyDict_GetItem_KnownHash`` was one) may change or vanish in
    the next CPython (3.13 made several internal): the lane builds on the public API."""
    source = (Path(devicepath.__file__).parent / "_devicelane.pyx").read_text()
    assert re.findall(r"\b_Py[A-Za-z_]+", source) == []
