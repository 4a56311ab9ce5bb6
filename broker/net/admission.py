"""CONNECT admission: whether the client may log in, and where its session lives.

One :class:`Admission` per CONNECT, driven by the connection it admits (an
:class:`Applicant`, :class:`~broker.net.transport.MQTTProtocol`):

1. The login (:meth:`broker.auth.AuthService.precheck`) is decided at once (anonymous,
   refused, rate-limited, the TLS certificate's identity) or needs a password check: scrypt
   takes tens of milliseconds, so it runs in the auth service's thread pool and its answer
   comes back on the loop (:meth:`~broker.auth.AuthService.complete`).
2. When several workers share the clients, the session's home worker decides whether it is
   new, already here or handed over (:meth:`broker.workers.sessions.SessionDirectory.claim`);
   on a cluster node, a claim in the replicated log does
   (:meth:`broker.workers.replicated_sessions.ClusterSessions.claim`); a handed-over state
   is adopted by the router before the session connects.
3. The applicant connects the session (:meth:`Applicant.enter`, the router's ``connect``).

While step 1 or 2 is pending the admission is :attr:`~Admission.pending` and holds the
applicant's input in arrival order: packets decoded in the CONNECT's read, and reads not
decoded yet. When it ends the applicant takes them back (:meth:`Applicant.admitted`) and
processes them in that order. A refusal is a CONNACK with the reason, then a close
[MQTT-3.2.2-7]. A 5.0 CONNECT naming an authentication method (enhanced authentication,
s4.12) skips the login: the router refuses the method (0x8C).

Everything here runs on the worker's loop thread, except the password check itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol

from broker.auth import LoginResult, PendingLogin
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import ReasonCode
from broker.net.context import STATE

if TYPE_CHECKING:
    import asyncio

    from broker.mqtt.decode import PubAckRun
    from broker.mqtt.packets import Connect, Packet
    from broker.net.context import EdgeContext

log = logging.getLogger("broker.net.admission")

P = ParamSpec("P")


class Applicant(Protocol):
    """What admission needs of the connection it admits."""

    @property
    def peer(self) -> str:
        """For the log: ``host:port``."""
        ...

    @property
    def peer_host(self) -> str:
        """The host: what the login rate limiter counts."""
        ...

    #: Came in over TLS; the verified certificate's Common Name, if any.
    tls: bool
    tls_identity: str | None

    @property
    def closing(self) -> bool:
        """The client went away, or the connection is being closed."""
        ...

    def refuse(self, reason_code: int, reason: str = "") -> None:
        """Answer the CONNECT with a CONNACK refusing it (5.0 ``reason_code`` and Reason
        String ``reason``), then close."""

    def enter(self, packet: Connect, username: str | None) -> None:
        """Connect the session of ``packet`` for the authenticated ``username`` (the router
        answers the CONNACK, or refuses it and the connection closes)."""

    def admitted(self, held: list[Packet | PubAckRun], held_data: list[bytes]) -> None:
        """A pending admission ended: process the input it held, in this order."""

    def close(self, reason_code: int | None = None, reason: str = "") -> None:
        """Close the connection (after a bug in admitting it)."""


class Admission:
    """The admission of one CONNECT (module docstring): :meth:`start` it once."""

    __slots__ = ("_applicant", "_ctx", "_held", "_held_data", "_packet", "pending")

    def __init__(self, ctx: EdgeContext[Any], applicant: Applicant, packet: Connect) -> None:
        self._ctx = ctx
        self._applicant = applicant
        self._packet = packet
        #: The login or the session claim is running: the applicant's input waits here.
        self.pending = False
        self._held: list[Packet | PubAckRun] = []
        self._held_data: list[bytes] = []

    def start(self) -> bool:
        """Admit the client as far as can be done now; True when the rest is pending: the
        applicant then holds its input here until :meth:`Applicant.admitted`."""
        packet = self._packet
        if packet.protocol_level == 5 and PropertyId.AUTHENTICATION_METHOD in packet.properties:
            self._claim(None)
            return self.pending
        applicant = self._applicant
        auth = self._ctx.auth
        decision = auth.precheck(
            applicant.peer_host,
            packet.username,
            packet.password,
            tls_identity=applicant.tls_identity,
            tls=applicant.tls,
        )
        if isinstance(decision, PendingLogin):
            self.pending = True
            loop = self._ctx.loop

            def done(future: Future[bool]) -> None:  # runs in the pool's thread
                if not loop.is_closed():
                    loop.call_soon_threadsafe(self._verified, decision, future)

            auth.executor.submit(decision.run).add_done_callback(done)
            return True
        self._login_decided(decision)
        return self.pending

    def hold(self, packets: list[Packet | PubAckRun]) -> None:
        """Packets decoded after the CONNECT in its read, kept while :attr:`pending`."""
        self._held.extend(packets)

    def hold_data(self, data: bytes) -> None:
        """A read arrived while :attr:`pending`: decoded after the held packets."""
        self._held_data.append(data)

    # ---------------------------------------------------------------- login

    def _verified(self, pending: PendingLogin, future: Future[bool]) -> None:
        """Back on the loop with the password check's answer."""
        self.pending = False
        applicant = self._applicant
        if applicant.closing:
            return  # the client went away meanwhile
        try:
            ok = future.result()
        except Exception:
            log.exception(
                "bug while verifying the password of %s (%s)", pending.username, applicant.peer
            )
            ok = False
        result = self._ctx.auth.complete(applicant.peer_host, pending, ok)
        if self._guarded(self._login_decided, result) and not self.pending:
            self._end()

    def _login_decided(self, result: LoginResult) -> None:
        if result.reason:
            log.info(
                "%s (%s): login refused: %s (reason 0x%02X)",
                self._packet.client_id or "-",
                self._applicant.peer,
                result.message,
                result.reason,
            )
            self._applicant.refuse(result.reason, result.message)  # [MQTT-3.2.2-7]
            return
        self._claim(result.username)

    # ---------------------------------------------------------------- session claim

    def _claim(self, username: str | None) -> None:
        claims = self._ctx.session_claims
        packet = self._packet
        if claims is None or not packet.client_id:
            self._applicant.enter(packet, username)
            return
        # One of several workers, or a cluster node: the session may be held by another one.
        # Its home worker (broker.workers.sessions) or the claims in the cluster's log
        # (broker.workers.replicated_sessions) decide; the input waits meanwhile.
        self.pending = True
        claim = claims.claim(packet.client_id, lambda answer: self._claimed(answer, username))
        self._ctx.loop.create_task(claim).add_done_callback(self._claim_failed)

    def _claimed(self, answer: bytes, username: str | None) -> None:
        """The session is this worker's now (``answer``: see ``SessionDirectory.claim``):
        adopt a handed-over state, then connect. Runs inside the claim, so that a release
        of the session asked of this worker meanwhile finds it adopted."""
        self.pending = False
        packet = self._packet
        if answer[:1] == STATE:
            self._ctx.router.adopt(packet.client_id, answer[1:])
        if self._applicant.closing:
            return  # the client went away meanwhile; the session stays here, offline
        if self._guarded(self._applicant.enter, packet, username):
            self._end()

    def _claim_failed(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("%s: cannot take the session over: %s", self._applicant.peer, task.exception())
        self.pending = False
        if not self._applicant.closing:
            self._applicant.refuse(
                ReasonCode.SERVER_UNAVAILABLE, "the session could not be claimed"
            )

    # ---------------------------------------------------------------- end

    def _guarded(self, step: Callable[P, None], *args: P.args, **kwargs: P.kwargs) -> bool:
        """Run a step resumed on the loop: a bug closes this one connection (False)."""
        try:
            step(*args, **kwargs)
        except Exception:
            log.exception(
                "bug while connecting %s (%s); closing that connection",
                self._packet.client_id or "?",
                self._applicant.peer,
            )
            self._applicant.close(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR, "internal error")
            return False
        return True

    def _end(self) -> None:
        """Hand the held input back to the applicant (once: the lists are emptied)."""
        held, self._held = self._held, []
        held_data, self._held_data = self._held_data, []
        self._applicant.admitted(held, held_data)
