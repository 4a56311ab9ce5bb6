"""The broker's login decisions: the login rate limiter and the service the transport asks.

:meth:`AuthService.precheck` is cheap and runs on the event loop; the scrypt check it may hand
back (:class:`PendingLogin`) runs in a small thread pool.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.auth.acl import Acl, Authorizer
from broker.auth.passwords import PasswordStore, verify_login
from broker.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    from broker.config import AuthConfig

log = logging.getLogger("broker.auth")

# ==================================================================== rate limiting


class LoginLimiter:
    """Per source address: after ``max_failures`` failed logins within ``window`` seconds,
    refuse every CONNECT from it for ``lockout`` seconds, without checking a password.

    ``clock`` is a monotonic clock in seconds (injected for tests). Memory is bounded: at
    most ``max_tracked`` addresses are remembered; the oldest is forgotten first.
    """

    def __init__(
        self,
        max_failures: int,
        window: float,
        lockout: float,
        clock: Callable[[], float],
        max_tracked: int = 100_000,
    ) -> None:
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
        self.limiter = LoginLimiter(
            config.max_failures, config.failure_window / 1000, config.lockout / 1000, monotonic
        )
        # A small pool: scrypt holds 16 MiB per call; a flood of CONNECTs queues here
        # (and is cut short by the limiter) instead of exhausting memory.
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mqlog-scrypt")
        self.failures = 0  # refused logins (metrics)
        #: Told of each failed login counted against its address (other workers count it).
        self.on_failure: Callable[[str], None] | None = None
        self.lockouts = 0  # addresses locked out (metrics)

    def precheck(
        self,
        address: str,
        username: str | None,
        password: bytes | None,
        *,
        tls_identity: str | None,
        tls: bool,
    ) -> LoginResult | PendingLogin:
        cfg = self.config
        if self.limiter.blocked(address):
            return self._fail(
                address, ReasonCode.BANNED, "too many failed logins from this address", count=False
            )
        if cfg.use_identity_as_username and tls:
            if tls_identity is None:
                return self._fail(
                    address,
                    ReasonCode.NOT_AUTHORIZED,
                    "no client certificate (use_identity_as_username)",
                )
            return LoginResult(0, tls_identity)
        if username is None:
            if cfg.allow_anonymous:
                return LoginResult(0, None)
            return self._fail(
                address,
                ReasonCode.NOT_AUTHORIZED,
                "anonymous access is disabled (allow_anonymous = false)",
            )
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
        return self._fail(
            address,
            ReasonCode.BAD_USER_NAME_OR_PASSWORD,
            f"bad user name or password for {pending.username!r}",
        )

    def _fail(self, address: str, reason: int, message: str, *, count: bool = True) -> LoginResult:
        self.failures += 1
        if count:
            if self.on_failure is not None:
                self.on_failure(address)
            if self.limiter.failure(address):
                self.lockouts += 1
                log.warning(
                    "%s: %d failed logins within %.0fs; refusing it for %.0fs",
                    address,
                    self.limiter.max_failures,
                    self.limiter.window,
                    self.limiter.lockout,
                )
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
