"""Who may use the HTTP port: HTTP Basic authentication against the broker's password file.

The rule, the MQTT listener's own ([auth]):

- ``allow_anonymous = false``: every route but ``GET /healthz`` (a load balancer's probe)
  needs ``Authorization: Basic`` with a user and password from ``password_file``; anything
  else is answered ``401`` with ``WWW-Authenticate: Basic realm="mqlog"`` (a browser asks).
- ``allow_anonymous = true``: a request without credentials is served as the anonymous user;
  credentials that are sent are still checked (a wrong password is a 401, as on CONNECT).

Every check goes through :meth:`broker.auth.AuthService.precheck`, so a failed HTTP login
counts against its address exactly as a failed CONNECT does (the lockout covers both), and a
locked-out address is refused without a password check. A request carrying no credentials at
all is not a failed login: a browser's first request never has any.

scrypt costs tens of milliseconds, and a Spark job fetches many times a second with the same
credentials: a successful check is remembered (keyed by the user and an HMAC of the password
under a per-process random key, never the password itself) for as long as the password file
the broker holds is the same object, i.e. until ``mqlog passwd`` changes it.

The user found is kept on the request (:data:`USER`); the fetch API applies its ACL read rules
to the records it returns (:class:`HttpUser.authorizer`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import orjson
from aiohttp import web

from broker.auth import Authorizer, AuthService, LoginResult

log = logging.getLogger("broker.http")

#: Routes served to anyone: a health probe carries no credentials.
OPEN_PATHS = frozenset({"/healthz"})
#: The request key under which :meth:`HttpAccess.middleware` leaves the :class:`HttpUser`.
USER = "mqlog.user"
#: Successful checks remembered (oldest forgotten first).
MAX_REMEMBERED = 1024
REALM = 'Basic realm="mqlog", charset="UTF-8"'

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class HttpUser:
    """An authenticated HTTP caller. ``name`` None: anonymous (allow_anonymous = true).
    ``authorizer`` None: no ACL file, every topic readable."""

    name: str | None
    authorizer: Authorizer | None

    def can_read(self, topic: str) -> bool:
        return self.authorizer is None or self.authorizer.can_read(topic)


class HttpRefused(Exception):
    """The request's credentials are missing or wrong; the message says which."""


def basic_credentials(headers: Mapping[str, str]) -> tuple[str, bytes] | None:
    """``(user, password)`` from an ``Authorization: Basic`` header; None when there is no
    such header. Raises :class:`HttpRefused` for a malformed one (RFC 7617: base64 of
    ``user:password``, UTF-8)."""
    value = headers.get("Authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "basic":
        raise HttpRefused(f"unsupported authorization scheme {scheme!r} (use Basic)")
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise HttpRefused("malformed Basic credentials (not base64)") from None
    user, sep, password = decoded.partition(b":")
    if not sep:
        raise HttpRefused("malformed Basic credentials (no ':' between user and password)")
    try:
        return user.decode("utf-8"), password
    except UnicodeDecodeError:
        raise HttpRefused("malformed Basic credentials (user name not UTF-8)") from None


class HttpAccess:
    """The HTTP port's authentication, built on the broker's :class:`AuthService`.

    Runs on the event loop that serves HTTP; the scrypt check runs in the service's executor.
    """

    def __init__(self, auth: AuthService) -> None:
        self.auth = auth
        self._key = secrets.token_bytes(32)
        self._remembered: dict[tuple[str, bytes], dict[str, str]] = {}

    @property
    def required(self) -> bool:
        """True when every route but the open ones needs a user (allow_anonymous = false)."""
        return not self.auth.config.allow_anonymous

    async def authenticate(self, headers: Mapping[str, str], peer: str = "") -> HttpUser:
        """The caller named by ``headers``; raises :class:`HttpRefused` with the reason when
        it may not use the HTTP API. ``peer`` is the address failures count against."""
        credentials = basic_credentials(headers)
        if credentials is None:
            if self.required:
                raise HttpRefused("credentials required (allow_anonymous = false)")
            return self._user(None)
        user, password = credentials
        answer = self.auth.precheck(peer, user, password, tls_identity=None, tls=False)
        if not isinstance(answer, LoginResult):  # a scrypt check, unless remembered
            key = (user, hmac.new(self._key, password, hashlib.sha256).digest())
            if self._remembered.get(key) is answer.users:
                answer = LoginResult(0, user)
            else:
                loop = asyncio.get_running_loop()
                ok = await loop.run_in_executor(self.auth.executor, answer.run)
                if ok:
                    if len(self._remembered) >= MAX_REMEMBERED:
                        del self._remembered[next(iter(self._remembered))]
                    self._remembered[key] = answer.users
                answer = self.auth.complete(peer, answer, ok)
        if answer.reason:
            raise HttpRefused(answer.message)
        return self._user(answer.username)

    def _user(self, name: str | None) -> HttpUser:
        return HttpUser(name, self.auth.authorizer(name, ""))

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Authenticate every request but :data:`OPEN_PATHS`; the user goes to
        ``request[USER]``."""
        if request.path in OPEN_PATHS:
            return await handler(request)
        peer = request.remote or ""
        try:
            request[USER] = await self.authenticate(request.headers, peer)
        except HttpRefused as e:
            log.info("%s: HTTP %s %s refused: %s", peer or "-", request.method, request.path, e)
            return unauthorized(str(e))
        return await handler(request)


def unauthorized(message: str) -> web.Response:
    """401 with the challenge a browser or curl answers (``curl -u user:password``)."""
    return web.Response(
        body=orjson.dumps({"error": message}),
        status=401,
        content_type="application/json",
        headers={"WWW-Authenticate": REALM},
    )


def request_user(request: web.Request) -> HttpUser | None:
    """The user :meth:`HttpAccess.middleware` found (None on an open route)."""
    user: HttpUser | None = request.get(USER)
    return user
