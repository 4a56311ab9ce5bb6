"""Authentication and authorization: the password file, ACLs and the login rate limiter.

Password file (``[auth] password_file``, managed with ``mqlog passwd FILE USER``): one
``user:$scrypt$n=N,r=R,p=P$<salt>$<hash>`` line per user (salt and hash base64). Passwords are
never stored in plain text; each hash has its own random 16-byte salt and carries its scrypt
parameters, so they can be raised later without invalidating existing entries.

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

Verification of a scrypt hash costs tens of milliseconds (measured: ~70 ms at n=2^14), so the
transport runs :meth:`Authenticator.verify` in a thread executor; everything else here is
cheap and called on the event loop.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from broker.mqtt.errors import TopicFilterInvalid
from broker.mqtt.reason_codes import ReasonCode
from broker.mqtt.topics import topic_matches, validate_topic_filter

if TYPE_CHECKING:
    from broker.config import AuthConfig

log = logging.getLogger("broker.auth")

#: scrypt cost parameters for new hashes: 16 MiB of memory, ~70 ms on one core.
SCRYPT_N = 1 << 14
SCRYPT_R = 8
SCRYPT_P = 1
SALT_BYTES = 16
HASH_BYTES = 32
#: Upper bounds accepted when reading a file, so a crafted line cannot exhaust memory.
_MAX_N = 1 << 20
_MAX_R = 32
_MAX_P = 16
_USER_RE = re.compile(r"^[^:\s]{1,256}$")
_HASH_RE = re.compile(r"^\$scrypt\$n=(\d+),r=(\d+),p=(\d+)\$([A-Za-z0-9+/=]+)\$([A-Za-z0-9+/=]+)$")


class AuthFileError(Exception):
    """A password or ACL file cannot be read or parsed; the message names file and line."""


# ==================================================================== passwords


def hash_password(password: str, *, n: int = SCRYPT_N, r: int = SCRYPT_R,
                  p: int = SCRYPT_P) -> str:
    """The stored form of ``password``: scrypt with a fresh random salt and its parameters."""
    salt = secrets.token_bytes(SALT_BYTES)
    digest = _scrypt(password.encode(), salt, n, r, p, HASH_BYTES)
    return (f"$scrypt$n={n},r={r},p={p}${base64.b64encode(salt).decode()}"
            f"${base64.b64encode(digest).decode()}")


def verify_password(password: bytes, encoded: str) -> bool:
    """True if ``password`` matches the stored hash (constant-time compare). Slow: ~70 ms."""
    m = _HASH_RE.match(encoded)
    if m is None:
        return False
    n, r, p = int(m.group(1)), int(m.group(2)), int(m.group(3))
    salt = base64.b64decode(m.group(4))
    expected = base64.b64decode(m.group(5))
    digest = _scrypt(password, salt, n, r, p, len(expected))
    return hmac.compare_digest(digest, expected)


def _scrypt(password: bytes, salt: bytes, n: int, r: int, p: int, dklen: int) -> bytes:
    # OpenSSL's default memory cap (32 MiB) is just under what n=2^14, r=8 needs with
    # its bookkeeping; allow the parameters' own need plus slack.
    maxmem = 128 * r * (n + p + 2) + (1 << 20)
    return hashlib.scrypt(password, salt=salt, n=n, r=r, p=p, dklen=dklen, maxmem=maxmem)


#: A hash of a random password: verified for unknown users so that the answer takes as long
#: as for a known user with a wrong password (no user enumeration by timing).
_DUMMY_HASH = hash_password(secrets.token_hex(16))


def parse_password_file(text: str, source: str) -> dict[str, str]:
    """``{user: encoded hash}``; raises :class:`AuthFileError` naming the line."""
    users: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, encoded = line.partition(":")
        if not sep or not _USER_RE.match(user):
            raise AuthFileError(f"{source}:{lineno}: expected 'user:$scrypt$...'")
        m = _HASH_RE.match(encoded)
        if m is None:
            raise AuthFileError(
                f"{source}:{lineno}: user {user!r}: not an scrypt hash (plain-text passwords "
                "are not accepted; set it with `mqlog passwd FILE USER`)")
        n, r, p = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if n < 2 or n & (n - 1) or n > _MAX_N or not 1 <= r <= _MAX_R or not 1 <= p <= _MAX_P:
            raise AuthFileError(f"{source}:{lineno}: user {user!r}: scrypt parameters out of "
                                f"range (n a power of two <= {_MAX_N}, r <= {_MAX_R}, "
                                f"p <= {_MAX_P})")
        users[user] = encoded
    return users


def read_password_file(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise AuthFileError(f"{path}: cannot read password file: {e.strerror}") from None
    except UnicodeDecodeError:
        raise AuthFileError(f"{path}: password file is not UTF-8") from None
    return parse_password_file(text, str(path))


def write_password_file(path: Path, users: dict[str, str]) -> None:
    """Replace ``path`` atomically (temp file + rename), readable by its owner only."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for user in sorted(users):
                f.write(f"{user}:{users[user]}\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def valid_user_name(user: str) -> bool:
    return bool(_USER_RE.match(user))


# ==================================================================== ACL

READ = 1
WRITE = 2
DENY = 4
_ACCESS = {"read": READ, "write": WRITE, "readwrite": READ | WRITE, "deny": DENY}


@dataclass(frozen=True, slots=True)
class AclRule:
    access: int       # READ, WRITE, READ | WRITE or DENY
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
                raise AuthFileError(f"{where}: unknown directive {word!r} (expected user, "
                                    "client, topic or pattern)")
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


# ==================================================================== rate limiting


class LoginLimiter:
    """Per source address: after ``max_failures`` failed logins within ``window`` seconds,
    refuse every CONNECT from it for ``lockout`` seconds, without checking a password.

    ``clock`` is a monotonic clock in seconds (injected for tests). Memory is bounded: at
    most ``max_tracked`` addresses are remembered; the oldest is forgotten first.
    """

    def __init__(self, max_failures: int, window: float, lockout: float,
                 clock: Callable[[], float], max_tracked: int = 100_000) -> None:
        self.max_failures = max_failures
        self.window = window
        self.lockout = lockout
        self.clock = clock
        self.max_tracked = max_tracked
        self._failures: dict[str, deque[float]] = {}
        self._blocked_until: dict[str, float] = {}

    def blocked(self, address: str) -> bool:
        until = self._blocked_until.get(address)
        if until is None:
            return False
        if self.clock() < until:
            return True
        del self._blocked_until[address]
        return False

    def failure(self, address: str) -> bool:
        """Record a failed login; True if the address is now locked out."""
        now = self.clock()
        times = self._failures.get(address)
        if times is None:
            if len(self._failures) >= self.max_tracked:
                del self._failures[next(iter(self._failures))]
            times = self._failures[address] = deque()
        times.append(now)
        while times and times[0] <= now - self.window:
            times.popleft()
        if len(times) >= self.max_failures:
            del self._failures[address]
            if len(self._blocked_until) >= self.max_tracked:
                del self._blocked_until[next(iter(self._blocked_until))]
            self._blocked_until[address] = now + self.lockout
            return True
        return False

    def success(self, address: str) -> None:
        self._failures.pop(address, None)


# ==================================================================== the broker's view


@dataclass(frozen=True, slots=True)
class LoginResult:
    """``reason`` 0 = accepted (MQTT 5 reason code otherwise); ``username`` the identity."""

    reason: int
    username: str | None
    message: str = ""


class PasswordStore:
    """The password file, re-read when its modification time changes (``mqlog passwd``
    on a running broker takes effect at the next CONNECT)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._mtime: int | None = None
        self.users: dict[str, str] = {}
        self.reload()

    def reload(self) -> None:
        st = self.path.stat() if self.path.exists() else None
        self.users = read_password_file(self.path)
        self._mtime = st.st_mtime_ns if st else None

    def current(self) -> dict[str, str]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return self.users  # keep the last good copy; the error was logged on change
        if mtime != self._mtime:
            try:
                self.reload()
                log.info("%s: password file reloaded (%d users)", self.path, len(self.users))
            except AuthFileError as e:
                self._mtime = mtime
                log.error("%s; keeping the previous %d users", e, len(self.users))
        return self.users


def verify_login(users: dict[str, str], username: str, password: bytes | None) -> bool:
    """Slow (scrypt): call from a worker thread. Unknown users cost the same time."""
    encoded = users.get(username)
    if encoded is None or password is None:
        verify_password(password or b"", _DUMMY_HASH)
        return False
    return verify_password(password, encoded)


class AuthService:
    """The broker's login decisions and ACL, built once from ``[auth]``.

    :meth:`precheck` is cheap and runs on the event loop: it answers at once (locked-out
    address, anonymous, TLS identity) or returns a :class:`PendingLogin` whose
    :meth:`PendingLogin.run` (scrypt) the transport runs in :attr:`executor`, then hands to
    :meth:`complete` back on the loop.
    """

    def __init__(self, config: AuthConfig, monotonic: Callable[[], float]) -> None:
        self.config = config
        self.passwords = PasswordStore(config.password_file) if config.password_file else None
        self.acl = Acl.load(config.acl_file) if config.acl_file else None
        self.limiter = LoginLimiter(config.max_failures, config.failure_window / 1000,
                                    config.lockout / 1000, monotonic)
        # A small pool: scrypt holds 16 MiB per call; a flood of CONNECTs queues here
        # (and is cut short by the limiter) instead of exhausting memory.
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mqlog-scrypt")
        self.failures = 0   # refused logins (metrics)
        #: Told of each failed login counted against its address (other workers count it).
        self.on_failure: Callable[[str], None] | None = None
        self.lockouts = 0   # addresses locked out (metrics)

    def precheck(self, address: str, username: str | None, password: bytes | None, *,
                 tls_identity: str | None, tls: bool) -> LoginResult | PendingLogin:
        cfg = self.config
        if self.limiter.blocked(address):
            return self._fail(address, ReasonCode.BANNED,
                              "too many failed logins from this address", count=False)
        if cfg.use_identity_as_username and tls:
            if tls_identity is None:
                return self._fail(address, ReasonCode.NOT_AUTHORIZED,
                                  "no client certificate (use_identity_as_username)")
            return LoginResult(0, tls_identity)
        if username is None:
            if cfg.allow_anonymous:
                return LoginResult(0, None)
            return self._fail(address, ReasonCode.NOT_AUTHORIZED,
                              "anonymous access is disabled (allow_anonymous = false)")
        if self.passwords is None:
            if cfg.allow_anonymous:
                return LoginResult(0, username)  # no password file: names are not checked
            return self._fail(address, ReasonCode.NOT_AUTHORIZED, "no password file")
        return PendingLogin(self.passwords.current(), username, password)

    def complete(self, address: str, pending: PendingLogin, ok: bool) -> LoginResult:
        """The scrypt answer for ``pending``, back on the event loop."""
        if ok:
            self.limiter.success(address)
            return LoginResult(0, pending.username)
        return self._fail(address, ReasonCode.BAD_USER_NAME_OR_PASSWORD,
                          f"bad user name or password for {pending.username!r}")

    def _fail(self, address: str, reason: int, message: str, *, count: bool = True) -> LoginResult:
        self.failures += 1
        if count:
            if self.on_failure is not None:
                self.on_failure(address)
            if self.limiter.failure(address):
                self.lockouts += 1
                log.warning("%s: %d failed logins within %.0fs; refusing it for %.0fs",
                            address, self.limiter.max_failures, self.limiter.window,
                            self.limiter.lockout)
        return LoginResult(reason, None, message)

    def peer_failure(self, address: str) -> None:
        """Another worker refused a login from ``address``: it counts here too (the limit
        is the broker's, whichever worker a connection lands on)."""
        self.limiter.failure(address)

    def authorizer(self, username: str | None, client_id: str) -> Authorizer | None:
        """The client's resolved ACL, or None when there is no acl file (all allowed)."""
        if self.acl is None:
            return None
        return Authorizer(self.acl.rules_for(username, client_id))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class PendingLogin:
    """A password check to run off the event loop."""

    users: dict[str, str]
    username: str
    password: bytes | None

    def run(self) -> bool:
        return verify_login(self.users, self.username, self.password)
