"""broker/auth/: password hashes and file, ACL matching, the login rate limiter."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from broker.auth import (
    Acl,
    AuthFileError,
    Authorizer,
    AuthService,
    LoginLimiter,
    LoginResult,
    PendingLogin,
    filter_covers,
    hash_password,
    read_password_file,
    verify_login,
    verify_password,
    write_password_file,
)
from broker.auth.passwords import parse_password_file
from broker.config import AuthConfig
from broker.mqtt import ReasonCode

# ------------------------------------------------------------------ passwords

FAST = {"n": 1 << 4, "r": 1, "p": 1}  # cheap parameters keep the unit tests fast


def test_hash_round_trip_and_salt() -> None:
    a = hash_password("s3cret", **FAST)
    b = hash_password("s3cret", **FAST)
    assert a != b, "each hash has its own random salt"
    assert "s3cret" not in a
    assert a.startswith("$scrypt$n=16,r=1,p=1$")
    assert verify_password(b"s3cret", a)
    assert verify_password(b"s3cret", b)
    assert not verify_password(b"s3cret!", a)
    assert not verify_password(b"", a)
    assert not verify_password(b"s3cret", "not a hash")


def test_default_parameters_cost_is_measured() -> None:
    encoded = hash_password("pw")
    assert encoded.startswith("$scrypt$n=16384,r=8,p=1$")
    started = time.perf_counter()
    assert verify_password(b"pw", encoded)
    cost_ms = (time.perf_counter() - started) * 1000
    # Why the transport runs it in a thread: far above the ~1-2 ms a loop can afford.
    assert cost_ms > 2, cost_ms


def test_password_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    users = {"alice": hash_password("a", **FAST), "bob": hash_password("b", **FAST)}
    write_password_file(path, users)
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_password_file(path) == users
    assert verify_login(users, "alice", b"a")
    assert not verify_login(users, "alice", b"b")
    assert not verify_login(users, "carol", b"a")
    assert not verify_login(users, "alice", None)


@pytest.mark.parametrize(
    "line, message",
    [
        ("alice:secret", "plain-text passwords are not accepted"),
        ("alice", "expected 'user:$scrypt$...'"),
        ("alice:$scrypt$n=3,r=8,p=1$AAAA$AAAA", "parameters out of range"),
        ("alice:$scrypt$n=1073741824,r=8,p=1$AAAA$AAAA", "parameters out of range"),
    ],
)
def test_password_file_errors_name_the_line(line: str, message: str) -> None:
    with pytest.raises(AuthFileError) as e:
        parse_password_file(f"# users\n\n{line}\n", "pw.txt")
    assert str(e.value).startswith("pw.txt:3:")
    assert message in str(e.value)


# ------------------------------------------------------------------ ACL

ACL = """
# anonymous clients
topic read public/#
user alice
topic readwrite alice/#
topic deny alice/secret/#
topic write log/alice
topic sensors/+/temp
client probe-1
topic read probes/#
pattern read devices/%c/cmd/#
pattern write devices/%u/data/#
"""


def authz(user: str | None, client: str) -> Authorizer:
    return Authorizer(Acl.parse(ACL, "acl").rules_for(user, client))


def test_user_rules_and_deny() -> None:
    a = authz("alice", "c1")
    assert a.can_write("alice/x")
    assert a.can_read("alice/x/y")
    assert not a.can_read("alice/secret/key")
    assert not a.can_write("alice/secret/key")
    assert a.can_write("log/alice") and not a.can_read("log/alice")
    assert a.can_read("sensors/1/temp") and a.can_write("sensors/1/temp")  # no word: readwrite
    assert not a.can_read("public/news"), "anonymous rules are not alice's"
    assert not a.can_write("bob/x")


def test_anonymous_rules() -> None:
    a = authz(None, "anon")
    assert a.can_read("public/news")
    assert not a.can_write("public/news")
    assert not a.can_read("alice/x")


def test_patterns_substitute_user_and_client() -> None:
    a = authz("alice", "dev7")
    assert a.can_read("devices/dev7/cmd/reboot")
    assert not a.can_read("devices/dev8/cmd/reboot")
    assert a.can_write("devices/alice/data/t")
    assert not a.can_write("devices/bob/data/t")
    anon = authz(None, "dev7")
    assert anon.can_read("devices/dev7/cmd/x")
    assert not anon.can_write("devices/None/data/t"), "%u never applies to anonymous"


def test_patterns_refuse_wildcards_and_slashes_in_names() -> None:
    for cid in ("+", "#", "a/b"):
        a = authz("alice", cid)
        assert not a.can_read(f"devices/{cid}/cmd/x")
        assert not a.can_subscribe("devices/+/cmd/#")


def test_client_rules() -> None:
    assert authz(None, "probe-1").can_read("probes/a")
    assert not authz(None, "probe-2").can_read("probes/a")


def test_subscribe_needs_a_covering_read_rule() -> None:
    a = authz("alice", "dev7")
    assert a.can_subscribe("alice/#")
    assert a.can_subscribe("alice/+/x")
    assert a.can_subscribe("sensors/+/temp")
    assert a.can_subscribe("sensors/3/temp")
    assert not a.can_subscribe("sensors/#")
    assert not a.can_subscribe("#")
    assert not a.can_subscribe("alice/secret/#"), "covered by a deny rule"
    assert not a.can_subscribe("alice/secret/x")
    assert not a.can_subscribe("log/alice"), "write-only"


@pytest.mark.parametrize(
    "outer, inner, expected",
    [
        ("#", "a/b", True),
        ("#", "$SYS/x", False),
        ("$SYS/#", "$SYS/broker/+", True),
        ("a/+", "a/b", True),
        ("a/+", "a/+", True),
        ("a/+", "a/#", False),
        ("a/b", "a/+", False),
        ("a/#", "a", True),
        ("a/+/c", "a/b/c", True),
        ("a/+/c", "a/b/c/d", False),
        ("a/b", "a/b/c", False),
    ],
)
def test_filter_covers(outer: str, inner: str, expected: bool) -> None:
    assert filter_covers(outer, inner) is expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("topic read a/#/b", "acl:1:"),
        ("grant read a", "unknown directive 'grant'"),
        ("user", "'user' needs a user name"),
        ("topic read", "missing topic filter"),
    ],
)
def test_acl_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(AuthFileError, match=message):
        Acl.parse(text, "acl")


# ------------------------------------------------------------------ rate limiter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limiter_locks_out_after_failures_within_window() -> None:
    clock = FakeClock()
    lim = LoginLimiter(max_failures=3, window=60, lockout=30, clock=clock)
    assert not lim.failure("10.0.0.1")
    clock.now += 10
    assert not lim.failure("10.0.0.1")
    assert not lim.blocked("10.0.0.1")
    assert lim.failure("10.0.0.1"), "third failure within the window locks out"
    assert lim.blocked("10.0.0.1")
    assert not lim.blocked("10.0.0.2"), "per address"
    clock.now += 29.9
    assert lim.blocked("10.0.0.1")
    clock.now += 0.2
    assert not lim.blocked("10.0.0.1"), "lockout over"
    assert not lim.failure("10.0.0.1"), "counting starts again"


def test_limiter_window_slides_and_success_resets() -> None:
    clock = FakeClock()
    lim = LoginLimiter(max_failures=3, window=60, lockout=30, clock=clock)
    lim.failure("a")
    lim.failure("a")
    clock.now += 61
    assert not lim.failure("a"), "the first two fell out of the window"
    lim.success("a")
    assert not lim.failure("a")
    assert not lim.failure("a")
    assert lim.failure("a")


def test_limiter_memory_is_bounded() -> None:
    clock = FakeClock()
    lim = LoginLimiter(max_failures=2, window=60, lockout=30, clock=clock, max_tracked=10)
    for i in range(1000):
        lim.failure(f"10.0.{i // 256}.{i % 256}")
    assert len(lim._failures) <= 10


def _login(auth: AuthService, address: str, user: str, password: bytes) -> int:
    """One CONNECT through the service as the transport drives it: precheck, then the
    password check (run here instead of in the executor), then complete."""
    answer = auth.precheck(address, user, password, tls_identity=None, tls=False)
    if isinstance(answer, LoginResult):
        return answer.reason
    assert isinstance(answer, PendingLogin)
    return auth.complete(address, answer, answer.run()).reason


def test_service_lockout_refuses_the_right_password_until_it_expires(tmp_path: Path) -> None:
    """The broker's view of the limiter, on its injected clock: after ``max_failures`` bad
    passwords even the right one is refused (Banned, before any password check) until
    ``lockout`` has passed; then it is accepted. (tests/integration/test_auth.py checks
    the lockout on a real broker; its expiry is checked here, without waiting for it.)"""
    path = tmp_path / "passwd"
    write_password_file(path, {"alice": hash_password("wonderland", **FAST)})
    clock = FakeClock()
    config = AuthConfig(allow_anonymous=False, password_file=path, max_failures=3, lockout=3000)
    auth = AuthService(config, clock)
    try:
        for _ in range(3):
            assert (
                _login(auth, "10.0.0.1", "alice", b"guess") == ReasonCode.BAD_USER_NAME_OR_PASSWORD
            )
        assert auth.lockouts == 1
        assert _login(auth, "10.0.0.1", "alice", b"wonderland") == ReasonCode.BANNED
        assert _login(auth, "10.0.0.2", "alice", b"wonderland") == 0, "per address"
        clock.now += 2.9
        assert _login(auth, "10.0.0.1", "alice", b"wonderland") == ReasonCode.BANNED
        clock.now += 0.2
        assert _login(auth, "10.0.0.1", "alice", b"wonderland") == 0, "lockout expired"
        # Failures another worker saw count here too, and their lockout expires the same way.
        for _ in range(3):
            auth.peer_failure("10.0.0.3")
        assert _login(auth, "10.0.0.3", "alice", b"wonderland") == ReasonCode.BANNED
        clock.now += 3.0
        assert _login(auth, "10.0.0.3", "alice", b"wonderland") == 0
    finally:
        auth.close()
