"""Topic names and filters: validation, matching, shared subscriptions (MQTT 3.1.1 / 5.0 s4.7-4.8).

Examples come from the specification text (5.0 s4.7.1.2, s4.7.1.3, s4.7.2, s4.8.2); a
hypothesis test compares :func:`topic_matches` with a regular-expression reference written here
from the prose of s4.7, independently of the implementation.
"""

from __future__ import annotations

import contextlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.mqtt.errors import MQTTError, TopicFilterInvalid, TopicNameInvalid
from broker.mqtt.reason_codes import ReasonCode
from broker.mqtt.topics import (
    MAX_TOPIC_BYTES,
    filters_overlap,
    is_wildcard,
    parse_shared,
    topic_matches,
    validate_topic_filter,
    validate_topic_name,
)

# --------------------------------------------------------------------------- topic names


@pytest.mark.parametrize(
    "topic",
    [
        "a",
        "/",  # s4.7.1.3: '/' alone is a valid topic with two empty levels
        "/finance",
        "sport/tennis/player1",
        "sport/tennis/player1/ranking",
        "$SYS/monitor/Clients",
        "a//b",
        "ACCOUNTS",
        " leading space",  # s4.7.3: spaces are allowed
        "\u00e9t\u00e9/\U0001f600",
        "a" * MAX_TOPIC_BYTES,
    ],
)
def test_valid_topic_names(topic: str) -> None:
    validate_topic_name(topic)


@pytest.mark.parametrize(
    ("topic", "rule"),
    [
        ("", "MQTT-4.7.3-1: at least one character"),
        ("+", "MQTT-3.3.2-2: no wildcards in a topic name"),
        ("#", "MQTT-3.3.2-2"),
        ("sport/+/player1", "MQTT-3.3.2-2"),
        ("sport/#", "MQTT-3.3.2-2"),
        ("sport+", "MQTT-4.7.1-1: wildcards only in filters"),
        ("a#b", "MQTT-4.7.1-1"),
        ("a\x00b", "MQTT-4.7.3-2: no U+0000"),
        ("a" * (MAX_TOPIC_BYTES + 1), "MQTT-4.7.3-3: at most 65,535 bytes"),
        ("\u00e9" * (MAX_TOPIC_BYTES // 2 + 1), "MQTT-4.7.3-3: bytes, not characters"),
    ],
)
def test_invalid_topic_names(topic: str, rule: str) -> None:
    with pytest.raises(TopicNameInvalid) as info:
        validate_topic_name(topic)
    assert isinstance(info.value, MQTTError)
    assert info.value.reason_code == ReasonCode.TOPIC_NAME_INVALID == 0x90, rule


# --------------------------------------------------------------------------- topic filters


@pytest.mark.parametrize(
    "topic_filter",
    [
        "#",  # s4.7.1.2: '#' alone is valid and matches every message
        "+",
        "sport/#",
        "sport/tennis/#",
        "sport/tennis/+",
        "sport/+/player1",
        "+/tennis/#",
        "+/+",
        "/+",
        "+/",
        "//",
        "$SYS/#",
        "$SYS/monitor/+",
        "a//#",
        "$share/consumer1/sport/tennis/+",  # s4.8.2 example
        "$share/consumer2/sport/tennis/+",
        "$share/g/#",
        "$share/g/+",
        "$share/g/$SYS/#",
        "$share/g//",
        "$SHARE/g",  # case-sensitive: not a shared subscription, a plain filter
        "$share",  # no '/' after it: a plain filter
        "a" * MAX_TOPIC_BYTES,
    ],
)
def test_valid_topic_filters(topic_filter: str) -> None:
    validate_topic_filter(topic_filter)


@pytest.mark.parametrize(
    ("topic_filter", "rule"),
    [
        ("", "MQTT-4.7.3-1: at least one character"),
        ("sport/tennis#", "MQTT-4.7.1-2: '#' must be a whole level (s4.7.1.2 example)"),
        ("sport/tennis/#/ranking", "MQTT-4.7.1-2: '#' must be last (s4.7.1.2 example)"),
        ("##", "MQTT-4.7.1-2"),
        ("#/", "MQTT-4.7.1-2"),
        ("sport+", "MQTT-4.7.1-3: '+' must occupy a whole level (s4.7.1.3 example)"),
        ("sport/+tennis", "MQTT-4.7.1-3"),
        ("++", "MQTT-4.7.1-3"),
        ("a/+#", "MQTT-4.7.1-2/3"),
        ("a\x00", "MQTT-4.7.3-2: no U+0000"),
        ("$share/", "MQTT-4.8.2-1: ShareName at least one character"),
        ("$share//a", "MQTT-4.8.2-1"),
        ("$share/g", "MQTT-4.8.2-1: a Topic Filter must follow the ShareName"),
        ("$share/g/", "MQTT-4.8.2-1: the Topic Filter must be non-empty"),
        ("$share/g+/a", "MQTT-4.8.2-2: ShareName must not contain '+'"),
        ("$share/+/a", "MQTT-4.8.2-2"),
        ("$share/g#/a", "MQTT-4.8.2-2: ShareName must not contain '#'"),
        ("$share/#/a", "MQTT-4.8.2-2"),
        ("$share/g/a#", "MQTT-4.7.1-2 applies to the filter after the ShareName"),
        ("$share/g/a/#/b", "MQTT-4.7.1-2"),
        ("$share/g/a+", "MQTT-4.7.1-3"),
        ("a" * (MAX_TOPIC_BYTES + 1), "MQTT-4.7.3-3: at most 65,535 bytes"),
    ],
)
def test_invalid_topic_filters(topic_filter: str, rule: str) -> None:
    with pytest.raises(TopicFilterInvalid) as info:
        validate_topic_filter(topic_filter)
    assert info.value.reason_code == ReasonCode.TOPIC_FILTER_INVALID == 0x8F, rule


@pytest.mark.parametrize(
    ("topic_filter", "expected"),
    [
        ("a/b", False),
        ("$SYS/x", False),
        ("+", True),
        ("#", True),
        ("a/+/c", True),
        ("a/#", True),
        ("$share/g/a", False),
        ("$share/g/a/+", True),
    ],
)
def test_is_wildcard(topic_filter: str, expected: bool) -> None:
    assert is_wildcard(topic_filter) is expected


# --------------------------------------------------------------------------- shared subscriptions


@pytest.mark.parametrize(
    ("topic_filter", "expected"),
    [
        ("$share/consumer1/sport/tennis/+", ("consumer1", "sport/tennis/+")),
        ("$share/g/#", ("g", "#")),
        ("$share/g/+", ("g", "+")),
        ("$share/g//a", ("g", "/a")),
        ("$share/g/$SYS/#", ("g", "$SYS/#")),
        ("sport/tennis/+", (None, "sport/tennis/+")),
        ("#", (None, "#")),
        ("$SHARE/g/a", (None, "$SHARE/g/a")),  # the prefix is case-sensitive
        ("$shared/g/a", (None, "$shared/g/a")),
        ("a/$share/g/b", (None, "a/$share/g/b")),
    ],
)
def test_parse_shared(topic_filter: str, expected: tuple[str | None, str]) -> None:
    validate_topic_filter(topic_filter)
    assert parse_shared(topic_filter) == expected


# --------------------------------------------------------------------------- matching

SPEC_MATCHES: list[tuple[str, str, bool]] = [
    # s4.7.1.2 multi-level wildcard examples
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/#", "sport", True),  # '#' includes the parent level
    ("sport/#", "sport/", True),
    ("sport/#", "sports", False),
    ("#", "sport/tennis", True),
    ("#", "/", True),
    ("#", "a", True),
    # s4.7.1.3 single-level wildcard examples
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player2", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),  # '+' matches an empty level
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+/tennis/#", "sport/tennis/player1", True),
    ("+/tennis/#", "sport/tennis", True),
    ("+/tennis/#", "sport/football", False),
    ("sport/+/player1", "sport/tennis/player1", True),
    ("sport/+/player1", "sport//player1", True),
    ("a/+/+", "a//", True),
    ("+", "a", True),
    ("+/#", "a", True),
    # s4.7.2 topics beginning with '$' [MQTT-4.7.2-1]
    ("#", "$SYS/monitor/Clients", False),
    ("#", "$SYS", False),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("+", "$SYS", False),
    ("+/#", "$SYS/a", False),
    ("$SYS/#", "$SYS/monitor/Clients", True),
    ("$SYS/#", "$SYS", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("$SYS/monitor/Clients", "$SYS/monitor/Clients", True),
    ("a/#", "a/$SYS", True),  # only a leading '$' is special
    ("+/+", "a/$b", True),
    ("#", "a$", True),
    # s4.7.3: case-sensitive, no normalisation, levels are exact
    ("ACCOUNTS", "Accounts", False),
    ("ACCOUNTS", "ACCOUNTS", True),
    ("a/b", "a/b/", False),
    ("a/b", "/a/b", False),
    ("a/b", "a//b", False),
    ("a", "a/b", False),
    ("a/b", "a", False),
    (" a", "a", False),
]


@pytest.mark.parametrize(("topic_filter", "topic", "expected"), SPEC_MATCHES)
def test_topic_matches_spec_examples(topic_filter: str, topic: str, expected: bool) -> None:
    validate_topic_filter(topic_filter)
    validate_topic_name(topic)
    assert topic_matches(topic_filter, topic) is expected


@pytest.mark.parametrize(("topic_filter", "topic", "expected"), SPEC_MATCHES)
def test_reference_agrees_with_spec_examples(topic_filter: str, topic: str, expected: bool) -> None:
    """The reference used by the property test must itself be right on the spec examples."""
    assert reference_matches(topic_filter, topic) is expected


def reference_matches(topic_filter: str, topic: str) -> bool:
    """Translate the filter into a regular expression per s4.7.1 and s4.7.2.

    '+' is any run of non-'/' characters (possibly empty); a trailing '/#' is "this level and
    everything below it, or nothing"; a filter that is just '#' is everything. A filter starting
    with a wildcard never matches a topic starting with '$' [MQTT-4.7.2-1].
    """
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    levels = topic_filter.split("/")
    multi = levels[-1] == "#"
    if multi:
        levels = levels[:-1]
    parts = ["[^/]*" if level == "+" else re.escape(level) for level in levels]
    if not multi:
        pattern = "/".join(parts)
    elif not parts:
        pattern = ".*"
    else:
        pattern = "/".join(parts) + "(?:/.*)?"
    return re.fullmatch(pattern, topic, flags=re.DOTALL) is not None


# Small alphabets so that levels collide often and both outcomes are common.
_LEVEL = st.sampled_from(["", "a", "b", "ab", "$a", "$SYS", "x y", "\u00e9", "a.b"])
_TOPIC = st.lists(_LEVEL, min_size=1, max_size=5).map("/".join).filter(bool)


@st.composite
def _filter_for(draw: st.DrawFn, topic: str | None = None) -> str:
    """A valid filter: either derived from ``topic`` (likely to match) or random."""
    if topic is not None and draw(st.booleans()):
        levels = topic.split("/")
        out = [
            draw(st.sampled_from([level, level, "+"])) if level not in ("+", "#") else "+"
            for level in levels
        ]
        cut = draw(st.integers(0, len(out)))
        if draw(st.booleans()):
            out = [*out[:cut], "#"]
        else:
            out = out[: max(cut, 1)] + draw(st.lists(_LEVEL, max_size=1))
        return "/".join(out) or "+"
    levels = draw(st.lists(st.one_of(_LEVEL, st.just("+")), min_size=1, max_size=5))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "+"


@st.composite
def _filter_and_topic(draw: st.DrawFn) -> tuple[str, str]:
    topic = draw(_TOPIC)
    return draw(_filter_for(topic)), topic


@settings(max_examples=400, deadline=None)
@given(_filter_and_topic())
def test_topic_matches_agrees_with_regex_reference(pair: tuple[str, str]) -> None:
    topic_filter, topic = pair
    validate_topic_filter(topic_filter)
    validate_topic_name(topic)
    assert topic_matches(topic_filter, topic) is reference_matches(topic_filter, topic)


@settings(max_examples=200, deadline=None)
@given(_TOPIC)
def test_topic_name_is_a_filter_that_matches_itself(topic: str) -> None:
    validate_topic_filter(topic)
    assert topic_matches(topic, topic)
    if not topic.startswith("$"):
        assert topic_matches("#", topic)
    else:
        assert not topic_matches("#", topic)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12))
def test_validators_raise_only_their_error(text: str) -> None:
    """Arbitrary strings are either accepted or rejected with the matching MQTTError."""
    try:
        validate_topic_name(text)
    except TopicNameInvalid:
        pass
    else:
        assert text and "+" not in text and "#" not in text and "\x00" not in text
    with contextlib.suppress(TopicFilterInvalid):
        validate_topic_filter(text)


# --------------------------------------------------------------------------- filter overlap
#
# filters_overlap(a, b) decides which streams a subscription can receive from (router): a false
# "no" would silently lose messages. Reference: search every topic of at most len + 1 levels
# over the filters' own literal levels plus fresh ones; a witness topic, if one exists, can
# always be found in that universe ('+' takes a fresh level, '#' takes nothing or one level).


def reference_overlap(a: str, b: str) -> bool:
    literals = {lvl for f in (a, b) for lvl in f.split("/") if lvl not in ("+", "#")}
    alphabet = sorted(literals | {"q", "$q", ""})
    depth = max(len(a.split("/")), len(b.split("/"))) + 1
    frontier = [[lvl] for lvl in alphabet]
    for _ in range(depth):
        nxt = []
        for levels in frontier:
            topic = "/".join(levels)
            if topic and reference_matches(a, topic) and reference_matches(b, topic):
                return True
            nxt.extend([*levels, lvl] for lvl in alphabet)
        frontier = nxt
    return False


_SMALL_LEVEL = st.sampled_from(["a", "b", "", "$a", "+"])


@st.composite
def _small_filter(draw: st.DrawFn) -> str:
    levels = draw(st.lists(_SMALL_LEVEL, min_size=1, max_size=3))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "#"


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("sport/#", "sport", True),  # s4.7.1.2: '#' includes the parent level
        ("sport/+", "sport", False),
        ("#", "$SYS/x", False),  # [MQTT-4.7.2-1]
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS", True),
        ("a/b/#", "a", False),
        ("a/+", "+/b", True),
        ("a/+/c", "a/b", False),
        ("+", "+/+", False),
        ("#", "+/+", True),
        ("a/#", "a/b/c/d", True),
        ("/#", "+", False),  # the only common "topic" would be "", not a topic [MQTT-4.7.3-1]
        ("/#", "/", True),
        ("+/#", "+", True),
    ],
)
def test_filters_overlap_examples(a: str, b: str, expected: bool) -> None:
    assert filters_overlap(a, b) is expected
    assert filters_overlap(b, a) is expected
    assert reference_overlap(a, b) is expected


@settings(max_examples=150, deadline=None)
@given(_small_filter(), _small_filter())
def test_filters_overlap_agrees_with_exhaustive_reference(a: str, b: str) -> None:
    validate_topic_filter(a)
    validate_topic_filter(b)
    assert filters_overlap(a, b) is reference_overlap(a, b)
