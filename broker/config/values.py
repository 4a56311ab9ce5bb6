"""Typed reading of one TOML table: :class:`Section` checks each value as it is read and
rejects the keys nobody read; durations and sizes in their written forms. Every failure is a
:class:`ConfigError` naming the key (or the flag that set it) and the file."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
_DURATION_UNITS_MS = {
    "ms": 1,
    "s": 1000,
    "m": 60_000,
    "h": 3_600_000,
    "d": 86_400_000,
    "w": 604_800_000,
}
_DURATION_RE = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d|w)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


class ConfigError(Exception):
    """A configuration value is missing, unknown or invalid. The message names key and file."""


def duration_ms(text: str) -> int | None:
    """``"7d"``, ``"500ms"``, ``"2h"`` (units ms, s, m, h, d, w) to milliseconds; None if
    ``text`` is not such a duration. Shared by the config and ``$replay/time:-<duration>``."""
    m = _DURATION_RE.match(text)
    return int(m.group(1)) * _DURATION_UNITS_MS[m.group(2)] if m else None


def parse_duration_ms(value: Any, key: str, source: str) -> int:
    """``"7d"``, ``"500ms"``, ``"2h"`` or an integer of milliseconds, to milliseconds."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        ms = duration_ms(value)
        if ms is not None:
            return ms
    raise ConfigError(
        f"{source}: {key} = {value!r} is not a duration (e.g. 500ms, 30s, 7d, or milliseconds)"
    )


def parse_size(value: Any, key: str, source: str) -> int:
    """``"64MiB"``, ``"1GB"`` or an integer of bytes, to bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    raise ConfigError(f"{source}: {key} = {value!r} is not a size (e.g. 64MiB, 1GB, or bytes)")


class Section:
    """Typed access to one TOML table that remembers which keys were read.

    :meth:`finish` then rejects every key nobody asked for, naming it.
    """

    def __init__(
        self,
        table: Mapping[str, Any],
        name: str,
        source: str,
        flags: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(table, Mapping):
            raise ConfigError(f"{source}: [{name}] must be a table")
        self.table = table
        self.name = name
        self.source = source
        #: The keys of this section a command-line flag set, and that flag (errors name it).
        self.flags = flags or {}
        self.seen: set[str] = set()

    def key(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key

    def bad(self, key: str, value: Any, what: str) -> ConfigError:
        """The error for ``key = value``: it must be ``what``. Names the file and the key,
        or the flag that set it."""
        flag = self.flags.get(key)
        if flag is not None:
            return ConfigError(
                f"command line: {flag} = {value!r} must be {what} "
                f"(it overrides {self.key(key)} of {self.source})"
            )
        return ConfigError(f"{self.source}: {self.key(key)} = {value!r} must be {what}")

    def get(self, key: str, default: T, check: Callable[[Any], bool], what: str) -> T:
        self.seen.add(key)
        if key not in self.table:
            return default
        value: T = self.table[key]
        if not check(value):
            raise self.bad(key, value, what)
        return value

    def integer(self, key: str, default: int, lo: int = 0, hi: int | None = None) -> int:
        def ok(v: Any) -> bool:
            return (
                isinstance(v, int)
                and not isinstance(v, bool)
                and v >= lo
                and (hi is None or v <= hi)
            )

        what = f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")
        return self.get(key, default, ok, what)

    def boolean(self, key: str, default: bool) -> bool:
        return self.get(key, default, lambda v: isinstance(v, bool), "true or false")

    def string(self, key: str, default: str, choices: tuple[str, ...] = ()) -> str:
        what = "one of " + ", ".join(repr(c) for c in choices) if choices else "a string"
        return self.get(
            key, default, lambda v: isinstance(v, str) and (not choices or v in choices), what
        )

    def duration(self, key: str, default: int | None) -> int | None:
        self.seen.add(key)
        if key not in self.table:
            return default
        value = self.table[key]
        if value in ("forever", "none", -1):
            return None
        return parse_duration_ms(value, self.key(key), self.source)

    def size(self, key: str, default: int | None) -> int | None:
        self.seen.add(key)
        if key not in self.table:
            return default
        value = self.table[key]
        if value in ("unlimited", "none", -1):
            return None
        return parse_size(value, self.key(key), self.source)

    def finish(self) -> None:
        for key in self.table:
            if key not in self.seen:
                raise ConfigError(f"{self.source}: unknown key {self.key(key)!r}")
