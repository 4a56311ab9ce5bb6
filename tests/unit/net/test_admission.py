"""broker/net/admission.py: the login, the session claim, and the input held meanwhile.

The applicant, the auth service's thread pool and the loop are fakes: the password check's
answer is handed over by the test, so each step is taken in a known order, without threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from broker.auth import LoginResult, PendingLogin
from broker.mqtt.packets import Connect, PingReq, Publish
from broker.mqtt.reason_codes import ReasonCode
from broker.net.admission import Admission
from broker.net.context import STATE


class Pool:
    """The auth executor: keeps the jobs; the test decides when each one ends."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Callable[[], bool], Future[bool]]] = []

    def submit(self, job: Callable[[], bool]) -> Future[bool]:
        future: Future[bool] = Future()
        self.jobs.append((job, future))
        return future


class Auth:
    """Logins with a password are pending; ``ok`` decides them."""

    def __init__(self) -> None:
        self.executor = Pool()

    def precheck(
        self,
        address: str,
        username: str | None,
        password: bytes | None,
        *,
        tls_identity: str | None,
        tls: bool,
    ) -> LoginResult | PendingLogin:
        if password is None:
            return LoginResult(0, username)
        return PendingLogin({}, username or "", password)

    def complete(self, address: str, pending: PendingLogin, ok: bool) -> LoginResult:
        if ok:
            return LoginResult(0, pending.username)
        return LoginResult(ReasonCode.BAD_USER_NAME_OR_PASSWORD, None, "bad password")


class Loop:
    """What admission asks of the loop before a claim: thread results, queued here."""

    def __init__(self) -> None:
        self.soon: list[tuple[Callable[..., None], tuple[Any, ...]]] = []

    def is_closed(self) -> bool:
        return False

    def call_soon_threadsafe(self, callback: Callable[..., None], *args: Any) -> None:
        self.soon.append((callback, args))

    def run(self) -> None:
        while self.soon:
            callback, args = self.soon.pop(0)
            callback(*args)


class Sessions:
    """The session directory: answers every claim with ``answer`` (or fails)."""

    def __init__(self, answer: bytes | Exception) -> None:
        self.answer = answer

    async def claim(self, client_id: str, adopt: Callable[[bytes], Any]) -> Any:
        # A task: this runs in a later iteration of the loop than the CONNECT.
        if isinstance(self.answer, Exception):
            raise self.answer
        return adopt(self.answer)


class Router:
    def __init__(self) -> None:
        self.adopted: list[tuple[str, bytes]] = []

    def adopt(self, client_id: str, state: bytes) -> None:
        self.adopted.append((client_id, state))


class Context:
    def __init__(self, loop: Any = None, session_claims: Sessions | None = None) -> None:
        self.auth = Auth()
        self.loop = loop if loop is not None else Loop()
        self.session_claims = session_claims
        self.handoff = None  # one worker: no hand-off
        self.router = Router()


class Applicant:
    """Records what admission asked of the connection."""

    peer = "10.0.0.1:5000"
    peer_host = "10.0.0.1"
    tls = False
    tls_identity = None

    def __init__(self) -> None:
        self.closing = False
        self.calls: list[tuple[Any, ...]] = []
        self.done = asyncio.Event()
        self.enter_fails = False
        self.reasons: list[str] = []  # the Reason String of each refusal

    def refuse(self, reason_code: int, reason: str = "") -> None:
        self.calls.append(("refuse", reason_code))
        self.reasons.append(reason)
        self.closing = True
        self.done.set()

    def enter(self, packet: Connect, username: str | None) -> None:
        if self.enter_fails:
            raise RuntimeError("a bug in the router")
        self.calls.append(("enter", packet.client_id, username))

    def admitted(self, held: list[Any], held_data: list[bytes]) -> None:
        self.calls.append(("admitted", held, held_data))
        self.done.set()

    def close(self, reason_code: int | None = None, reason: str = "") -> None:
        self.calls.append(("close", reason_code))
        self.closing = True
        self.done.set()


def password_check(ctx: Context, ok: bool) -> None:
    """The pool's thread ends the check; its answer reaches the loop, which runs it."""
    (_, future), *_ = ctx.auth.executor.jobs
    future.set_result(ok)
    assert isinstance(ctx.loop, Loop)
    ctx.loop.run()


CONNECT = Connect("dev-1", 4, username="alice", password=b"secret")
HELD = [Publish("t", b"1"), PingReq()]


def admission(ctx: Context, applicant: Applicant, packet: Connect = CONNECT) -> Admission:
    return Admission(ctx, applicant, packet)  # type: ignore[arg-type]


def test_a_login_decided_at_once_enters_without_holding() -> None:
    ctx, applicant = Context(), Applicant()
    assert admission(ctx, applicant, Connect("dev-1", 4)).start() is False
    assert applicant.calls == [("enter", "dev-1", None)]


def test_input_is_held_during_the_password_check_and_handed_back_in_order() -> None:
    ctx, applicant = Context(), Applicant()
    a = admission(ctx, applicant)
    assert a.start() is True and a.pending
    a.hold(HELD)
    a.hold_data(b"read 1")
    a.hold_data(b"read 2")
    assert applicant.calls == []  # nothing before the answer
    password_check(ctx, ok=True)
    assert applicant.calls == [
        ("enter", "dev-1", "alice"),
        ("admitted", HELD, [b"read 1", b"read 2"]),
    ]
    assert not a.pending


def test_a_bad_password_is_refused_with_its_reason() -> None:
    ctx, applicant = Context(), Applicant()
    a = admission(ctx, applicant)
    a.start()
    a.hold_data(b"read 1")
    password_check(ctx, ok=False)
    assert applicant.calls[0] == ("refuse", ReasonCode.BAD_USER_NAME_OR_PASSWORD)
    assert applicant.reasons[0] == "bad password"  # the login's message: 5.0's Reason String
    assert not any(call[0] == "enter" for call in applicant.calls)


def test_a_client_gone_during_the_check_is_left_alone() -> None:
    ctx, applicant = Context(), Applicant()
    admission(ctx, applicant).start()
    applicant.closing = True  # connection_lost meanwhile
    password_check(ctx, ok=True)
    assert applicant.calls == []


def test_a_failing_check_counts_as_a_bad_password() -> None:
    ctx, applicant = Context(), Applicant()
    admission(ctx, applicant).start()
    (_, future), *_ = ctx.auth.executor.jobs
    future.set_exception(OSError("scrypt: out of memory"))
    assert isinstance(ctx.loop, Loop)
    ctx.loop.run()
    assert applicant.calls[0] == ("refuse", ReasonCode.BAD_USER_NAME_OR_PASSWORD)


def test_a_bug_while_entering_closes_that_connection() -> None:
    ctx, applicant = Context(), Applicant()
    applicant.enter_fails = True
    admission(ctx, applicant).start()
    password_check(ctx, ok=True)
    assert applicant.calls == [("close", ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)]


def claim(answer: bytes | Exception, packet: Connect) -> tuple[Context, Applicant, Admission]:
    """Admit ``packet`` with several workers: the claim answers ``answer`` (or fails)."""

    async def run() -> tuple[Context, Applicant, Admission]:
        ctx = Context(asyncio.get_running_loop(), Sessions(answer))
        applicant = Applicant()
        a = admission(ctx, applicant, packet)
        assert a.start() is True  # the claim runs on the loop
        a.hold(HELD)
        a.hold_data(b"read 1")
        assert applicant.calls == []
        await asyncio.wait_for(applicant.done.wait(), 5)
        return ctx, applicant, a

    return asyncio.run(run())


def test_a_claimed_session_is_adopted_then_entered() -> None:
    ctx, applicant, a = claim(STATE + b"{}", Connect("dev-1", 4))
    assert ctx.router.adopted == [("dev-1", b"{}")]
    assert applicant.calls == [("enter", "dev-1", None), ("admitted", HELD, [b"read 1"])]
    assert not a.pending


def test_the_claim_follows_a_password_check() -> None:
    async def run() -> Applicant:
        loop = asyncio.get_running_loop()
        ctx = Context(loop, Sessions(b"N"))
        applicant = Applicant()
        a = admission(ctx, applicant)
        a.start()
        (_, future), *_ = ctx.auth.executor.jobs
        future.set_result(True)  # the thread's answer
        # Not handed back after the login: the claim is pending now.
        await asyncio.wait_for(applicant.done.wait(), 5)
        return applicant

    assert asyncio.run(run()).calls == [("enter", "dev-1", "alice"), ("admitted", [], [])]


def test_a_failed_claim_is_refused_as_server_unavailable() -> None:
    _, applicant, _ = claim(ConnectionError("home worker down"), Connect("dev-1", 5))
    assert applicant.calls == [("refuse", ReasonCode.SERVER_UNAVAILABLE)]


def test_an_empty_client_id_needs_no_claim() -> None:
    async def run() -> list[tuple[Any, ...]]:
        ctx = Context(asyncio.get_running_loop(), Sessions(b"N"))
        applicant = Applicant()
        assert admission(ctx, applicant, Connect("", 4)).start() is False
        return applicant.calls

    assert asyncio.run(run()) == [("enter", "", None)]
