"""The inner rooms import no I/O module (import-linter, in ``make lint``, sees only ours).

``broker/mqtt`` (sans-IO codec and connection state) and ``broker/router`` (synchronous logic
with an injected clock) import neither the event loop nor sockets, files or threads;
``broker/commitlog`` needs files and its cleaner thread (``os``, ``threading``) but no event
loop and no network. Every import statement counts, those under ``TYPE_CHECKING`` and inside
functions included. What each room may import of ours is in pyproject.toml
``[tool.importlinter]``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BROKER = Path(__file__).resolve().parents[2] / "broker"

#: Event loops, sockets and HTTP: I/O lives at the edges (broker/net, broker/http).
NETWORK = frozenset({"aiohttp", "asyncio", "selectors", "socket", "ssl", "uvloop"})
#: Per room, the top-level modules none of its files may import.
FORBIDDEN = {
    "mqtt": NETWORK | {"os", "threading"},
    "router": NETWORK | {"os", "threading"},
    "commitlog": NETWORK,
}


def forbidden_imports(source: str, forbidden: frozenset[str]) -> list[tuple[int, str]]:
    """``(line, module)`` of each import in ``source`` whose top-level name is forbidden."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in forbidden]
    return sorted(found)


def test_the_check_sees_every_kind_of_import() -> None:
    source = (
        "import os.path, json\n"
        "from asyncio import Event\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import uvloop.loop\n"
        "def f():\n"
        "    import socket\n"
        "from . import asyncio\n"  # relative: one of ours, not the stdlib's
    )
    found = forbidden_imports(source, FORBIDDEN["mqtt"])
    assert found == [(1, "os.path"), (2, "asyncio"), (5, "uvloop.loop"), (7, "socket")]


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_no_io_module(room: str) -> None:
    files = sorted((BROKER / room).rglob("*.py"))
    assert files, f"no module under broker/{room}"
    bad = [
        f"{path.relative_to(BROKER.parent)}:{line}: import {module}"
        for path in files
        for line, module in forbidden_imports(path.read_text(), FORBIDDEN[room])
    ]
    assert not bad, "\n".join(bad)


#: A file a newcomer reads whole (CONVENTIONS: split by responsibility before it grows past).
MAX_LINES = 600


def test_no_file_in_broker_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(BROKER)): n
        for path in BROKER.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"
