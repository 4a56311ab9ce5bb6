"""Authorization: the ACL file and the per-client decisions it gives.

ACL file (``[auth] acl_file``), mosquitto style::

    # comment lines start with '#'; rules before the first `user` are for anonymous clients
    topic read $SYS/#
    # the `topic` lines after `user NAME` apply to that user, after `client ID` to that id
    user alice
    topic readwrite alice/#
    topic deny alice/secret/#
    client sensor-7
    topic write devices/sensor-7/#
    # `pattern` lines apply to every client: %u = its user name, %c = its client id
    pattern read devices/%c/cmd/#
    pattern write devices/%u/#

Access is granted when a rule for the action matches and no applicable ``deny`` rule does.
``topic`` with no access word means ``readwrite``. A pattern whose ``%u`` / ``%c`` would
expand to a value containing ``+``, ``#`` or ``/`` does not apply (it could widen the grant),
and ``%u`` patterns never apply to anonymous clients. Without an acl file everything is
allowed. A subscription is allowed when one read rule covers every topic its filter can match
and no deny rule covers the whole filter; a deny rule that only overlaps the filter is applied
per message at delivery.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from broker.auth.passwords import AuthFileError
from broker.mqtt.errors import TopicFilterInvalid
from broker.mqtt.topics import topic_matches, validate_topic_filter

if TYPE_CHECKING:
    pass

log = logging.getLogger("broker.auth")

# ==================================================================== ACL

READ = 1
WRITE = 2
DENY = 4
_ACCESS = {"read": READ, "write": WRITE, "readwrite": READ | WRITE, "deny": DENY}


@dataclass(frozen=True, slots=True)
class AclRule:
    access: int  # READ, WRITE, READ | WRITE or DENY
    topic_filter: str  # may hold %u / %c when it comes from a `pattern` line


@dataclass
class Acl:
    """Parsed ACL file. See the module docstring for the format and the decision rule."""

    anonymous: list[AclRule] = field(default_factory=list)
    users: dict[str, list[AclRule]] = field(default_factory=dict)
    clients: dict[str, list[AclRule]] = field(default_factory=dict)
    patterns: list[AclRule] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str, source: str) -> Acl:
        acl = cls()
        current = acl.anonymous
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):  # '#' inside a line is a wildcard
                continue
            word, _, rest = line.partition(" ")
            rest = rest.strip()
            where = f"{source}:{lineno}"
            if word == "user":
                if not rest:
                    raise AuthFileError(f"{where}: 'user' needs a user name")
                current = acl.users.setdefault(rest, [])
            elif word == "client":
                if not rest:
                    raise AuthFileError(f"{where}: 'client' needs a client id")
                current = acl.clients.setdefault(rest, [])
            elif word in ("topic", "pattern"):
                rule = _parse_rule(rest, where, pattern=word == "pattern")
                (acl.patterns if word == "pattern" else current).append(rule)
            else:
                raise AuthFileError(
                    f"{where}: unknown directive {word!r} (expected user, client, topic or pattern)"
                )
        return acl

    @classmethod
    def load(cls, path: Path) -> Acl:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise AuthFileError(f"{path}: cannot read ACL file: {e.strerror}") from None
        except UnicodeDecodeError:
            raise AuthFileError(f"{path}: ACL file is not UTF-8") from None
        return cls.parse(text, str(path))

    def rules_for(self, username: str | None, client_id: str) -> list[AclRule]:
        """Every rule that applies to this client, patterns expanded."""
        rules = list(self.anonymous if username is None else self.users.get(username, ()))
        rules.extend(self.clients.get(client_id, ()))
        for rule in self.patterns:
            f = rule.topic_filter
            if "%u" in f:
                if username is None or not _safe_substitute(username):
                    continue
                f = f.replace("%u", username)
            if "%c" in f:
                if not _safe_substitute(client_id):
                    continue
                f = f.replace("%c", client_id)
            rules.append(AclRule(rule.access, f))
        return rules


def _safe_substitute(value: str) -> bool:
    return bool(value) and not any(c in value for c in "+#/")


def _parse_rule(rest: str, where: str, *, pattern: bool) -> AclRule:
    access_word, _, topic = rest.partition(" ")
    if access_word in _ACCESS:
        topic = topic.strip()
        access = _ACCESS[access_word]
    else:
        topic, access = rest, READ | WRITE  # mosquitto: no access word = readwrite
    if not topic:
        raise AuthFileError(f"{where}: missing topic filter")
    check = topic.replace("%u", "u").replace("%c", "c") if pattern else topic
    try:
        validate_topic_filter(check)
    except TopicFilterInvalid as e:
        raise AuthFileError(f"{where}: {topic!r}: {e}") from None
    return AclRule(access, topic)


def filter_covers(outer: str, inner: str) -> bool:
    """True if every topic ``inner`` can match is matched by ``outer`` (both filters).

    Wildcards in the first level do not match ``$`` topics [MQTT-4.7.2-1], so ``#`` does
    not cover ``$SYS/#``.
    """
    o = outer.split("/")
    i = inner.split("/")
    if o[0] in ("#", "+") and i[0].startswith("$"):
        return False
    for k, level in enumerate(o):
        if level == "#":
            return True
        if k >= len(i):
            return False
        if i[k] == "#":
            return False
        if level == "+":
            continue
        if i[k] != level:  # a literal covers only the same literal (not '+')
            return False
    return len(i) == len(o)


class Authorizer:
    """Decides read / write / subscribe for one client, with its rules resolved once."""

    __slots__ = ("_cache", "rules")

    def __init__(self, rules: list[AclRule]) -> None:
        self.rules = rules
        self._cache: dict[tuple[int, str], bool] = {}

    def _allowed(self, access: int, topic: str) -> bool:
        granted = False
        for rule in self.rules:
            if topic_matches(rule.topic_filter, topic):
                if rule.access & DENY:
                    return False
                if rule.access & access:
                    granted = True
        return granted

    def can_write(self, topic: str) -> bool:
        key = (WRITE, topic)
        ok = self._cache.get(key)
        if ok is None:
            ok = self._allowed(WRITE, topic)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = ok
        return ok

    def can_read(self, topic: str) -> bool:
        """Per delivered topic (the router caches the answer per subscription)."""
        return self._allowed(READ, topic)

    def can_subscribe(self, topic_filter: str) -> bool:
        granted = False
        for rule in self.rules:
            if filter_covers(rule.topic_filter, topic_filter):
                if rule.access & DENY:
                    return False
                if rule.access & READ:
                    granted = True
        return granted
