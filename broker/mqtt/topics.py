"""Topic names and topic filters: validation and matching (MQTT 3.1.1 s4.7, MQTT 5.0 s4.7-4.8).

A *topic name* is what a PUBLISH carries; it never contains wildcards. A *topic filter* is what a
SUBSCRIBE carries; ``+`` matches exactly one level and ``#`` matches the parent level and
everything below it. Shared subscriptions are filters of the form ``$share/<group>/<filter>``.

Pure functions, no I/O; safe to call from any thread.
"""

from __future__ import annotations

from broker.mqtt.errors import TopicFilterInvalid, TopicNameInvalid

SHARE_PREFIX = "$share/"

#: The spec allows 65,535 bytes of UTF-8; brokers apply a smaller configured limit on top.
MAX_TOPIC_BYTES = 65535

#: A str of at most this many characters cannot exceed MAX_TOPIC_BYTES in UTF-8 (4 bytes per
#: code point at most), so the common short topic skips the encode.
_MAX_CHARS_WITHOUT_ENCODE = MAX_TOPIC_BYTES // 4


def _too_long(text: str) -> bool:
    """[MQTT-4.7.3-3] topic names and filters encode to at most 65,535 bytes of UTF-8."""
    return len(text) > _MAX_CHARS_WITHOUT_ENCODE and (
        len(text.encode("utf-8", "surrogatepass")) > MAX_TOPIC_BYTES
    )


def validate_topic_name(topic: str) -> None:
    """Raise :class:`TopicNameInvalid` unless ``topic`` is a valid PUBLISH topic name.

    [MQTT-4.7.3-1] at least one character; [MQTT-3.3.2-2] no wildcard characters;
    [MQTT-4.7.3-2] no U+0000 (the codec already rejects it in every UTF-8 string);
    [MQTT-4.7.3-3] at most 65,535 bytes of UTF-8.
    """
    if not topic:
        raise TopicNameInvalid("topic name must not be empty [MQTT-4.7.3-1]")
    if _too_long(topic):
        raise TopicNameInvalid("topic name longer than 65,535 bytes [MQTT-4.7.3-3]")
    if "+" in topic or "#" in topic:
        raise TopicNameInvalid(f"topic name {topic!r} contains a wildcard [MQTT-3.3.2-2]")
    if "\x00" in topic:
        raise TopicNameInvalid("topic name contains U+0000 [MQTT-4.7.3-2]")


def validate_topic_filter(topic_filter: str) -> None:
    """Raise :class:`TopicFilterInvalid` unless ``topic_filter`` is a valid SUBSCRIBE filter.

    [MQTT-4.7.1-2] ``#`` must be the last character and occupy a whole level;
    [MQTT-4.7.1-3] ``+`` must occupy a whole level; [MQTT-4.7.3-1] not empty.
    A shared filter ``$share/<group>/<filter>`` needs a non-empty group without wildcards
    or ``/`` and a valid non-empty filter after it [MQTT-4.8.2-1], [MQTT-4.8.2-2].
    [MQTT-4.7.3-3] at most 65,535 bytes of UTF-8.
    """
    if not topic_filter:
        raise TopicFilterInvalid("topic filter must not be empty [MQTT-4.7.3-1]")
    if _too_long(topic_filter):
        raise TopicFilterInvalid("topic filter longer than 65,535 bytes [MQTT-4.7.3-3]")
    if "\x00" in topic_filter:
        raise TopicFilterInvalid("topic filter contains U+0000 [MQTT-4.7.3-2]")
    if topic_filter.startswith(SHARE_PREFIX):
        group, _, rest = topic_filter[len(SHARE_PREFIX) :].partition("/")
        if not group or "+" in group or "#" in group:
            raise TopicFilterInvalid(
                f"shared subscription {topic_filter!r} has an invalid group name [MQTT-4.8.2-2]"
            )
        if not rest:
            raise TopicFilterInvalid(
                f"shared subscription {topic_filter!r} has no topic filter [MQTT-4.8.2-1]"
            )
        topic_filter = rest
    levels = topic_filter.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != last):
            raise TopicFilterInvalid(
                f"'#' must be the last level of {topic_filter!r} [MQTT-4.7.1-2]"
            )
        if "+" in level and level != "+":
            raise TopicFilterInvalid(
                f"'+' must occupy a whole level of {topic_filter!r} [MQTT-4.7.1-3]"
            )


def is_wildcard(topic_filter: str) -> bool:
    """True if the filter contains ``+`` or ``#`` (so it can match more than one topic)."""
    return "+" in topic_filter or "#" in topic_filter


def parse_shared(topic_filter: str) -> tuple[str | None, str]:
    """Split ``$share/<group>/<filter>`` into ``(group, filter)``; ``(None, f)`` otherwise.

    The filter is assumed valid (see :func:`validate_topic_filter`).
    """
    if topic_filter.startswith(SHARE_PREFIX):
        group, _, rest = topic_filter[len(SHARE_PREFIX) :].partition("/")
        return group, rest
    return None, topic_filter


def topic_matches(topic_filter: str, topic: str) -> bool:
    """True if the (non-shared, valid) ``topic_filter`` matches the topic name ``topic``.

    [MQTT-4.7.2-1] a filter starting with a wildcard does not match topics starting with ``$``.
    ``sport/#`` also matches ``sport`` (s4.7.1.2); ``+`` matches an empty level.
    """
    if topic_filter == topic:
        return True
    if topic[:1] == "$" and topic_filter[:1] in ("+", "#"):
        return False
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    n_t = len(t_levels)
    for i, f in enumerate(f_levels):
        if f == "#":
            return True
        if i >= n_t:
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == n_t


def filters_overlap(a: str, b: str) -> bool:
    """True if some topic name could match both (non-shared, valid) filters ``a`` and ``b``.

    Used to find which streams a subscription can receive from without listing topics.
    A filter starting with a wildcard matches no ``$`` topic [MQTT-4.7.2-1], so it overlaps a
    filter whose first level is a literal ``$...`` only if that one is never matched, i.e. not.
    """
    a_levels = a.split("/")
    b_levels = b.split("/")
    a_dollar = a_levels[0][:1] == "$"
    b_dollar = b_levels[0][:1] == "$"
    if (a_dollar and b_levels[0] in ("+", "#")) or (b_dollar and a_levels[0] in ("+", "#")):
        return False
    for x, y in zip(a_levels, b_levels, strict=False):
        if x == "#" or y == "#":
            return True
        if x != "+" and y != "+" and x != y:
            return False
    if len(a_levels) == len(b_levels):
        return True
    longer = a_levels if len(a_levels) > len(b_levels) else b_levels
    shorter = min(len(a_levels), len(b_levels))
    # "a" and "a/#" overlap on topic "a" (s4.7.1.2); anything else longer needs a '#'.
    if len(longer) != shorter + 1 or longer[-1] != "#":
        return False
    # That witness is the shorter filter's levels. One empty level ("/#" against "+" or "")
    # would be the empty topic, which is no topic name [MQTT-4.7.3-1].
    return shorter > 1 or "" not in (a_levels[0], b_levels[0])
