"""Authentication against the real broker: password file, wrong passwords, anonymous access,
the per-address rate limiter, `mqlog passwd`, and MQTT 5 enhanced authentication refusals."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import BrokerFactory, BrokerProcess, run_mqlog
from tests.integration.rawclient import RawClient, read_packet, wait_closed
from tests.mqttbytes import CONNACK, connect5, packet, utf8, varint

# paho reports a 3.1.1 CONNACK return code as the equivalent 5.0 reason code (4 -> 0x86,
# 5 -> 0x87); test_311_return_codes_on_the_wire checks the 3.1.1 bytes themselves.
BAD_CREDENTIALS_311 = 0x86
NOT_AUTHORIZED_311 = 0x87
BAD_CREDENTIALS_5 = 0x86
NOT_AUTHORIZED_5 = 0x87
BANNED_5 = 0x8A


def passwd(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_mqlog("passwd", *args, input=stdin)


#: Password files made by ``mqlog passwd``, by their users: one ``mqlog passwd`` run (a
#: Python start and an scrypt hash, a second or more under load) per user and test process,
#: instead of per user and test.
_made: dict[tuple[tuple[str, str], ...], str] = {}


def make_password_file(path: Path, users: dict[str, str]) -> Path:
    """A password file for ``users`` (name: password) written by ``mqlog passwd``; the same
    users a second time get a copy of the first file (0600, as ``mqlog passwd`` makes it)."""
    key = tuple(users.items())
    if key in _made:
        path.write_text(_made[key])
        path.chmod(0o600)
        return path
    for user, password in users.items():
        result = passwd(str(path), user, stdin=password + "\n")
        assert result.returncode == 0, result.stderr
    _made[key] = path.read_text()
    return path


def login(
    broker: BrokerProcess,
    user: str | None,
    password: str | None,
    protocol: int = V311,
    client_id: str = "c",
) -> int:
    c = Client(broker.port, client_id, protocol)
    if user is not None:
        c.paho.username_pw_set(user, password)
    try:
        return c.connect()
    finally:
        c.disconnect()


def secured(broker_factory: BrokerFactory, tmp_path: Path, extra: str = "") -> BrokerProcess:
    pw = make_password_file(tmp_path / "passwd", {"alice": "wonderland", "bob": "builder"})
    return broker_factory(
        config=f'[auth]\nallow_anonymous = false\npassword_file = "{pw}"\n' + extra
    )


def test_passwords_checked_311_and_5(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    broker = secured(broker_factory, tmp_path, "max_failures = 100\n")
    assert login(broker, "alice", "wonderland") == 0
    assert login(broker, "bob", "builder", V5) == 0
    assert login(broker, "alice", "builder") == BAD_CREDENTIALS_311
    assert login(broker, "alice", "wrong", V5) == BAD_CREDENTIALS_5
    assert login(broker, "mallory", "wonderland") == BAD_CREDENTIALS_311, "unknown user"
    assert login(broker, "alice", None, V5) == BAD_CREDENTIALS_5, "no password"
    assert login(broker, None, None) == NOT_AUTHORIZED_311, "anonymous refused"
    assert login(broker, None, None, V5) == NOT_AUTHORIZED_5
    log = broker.log()
    assert "login refused: bad user name or password for 'alice'" in log
    assert "anonymous access is disabled" in log
    assert "wonderland" not in (tmp_path / "passwd").read_text()


def connect311_bytes(client_id: str, user: str | None, password: str | None) -> bytes:
    flags = 0x02 | (0x80 if user is not None else 0) | (0x40 if password is not None else 0)
    body = utf8("MQTT") + bytes([4, flags]) + (30).to_bytes(2, "big") + utf8(client_id)
    if user is not None:
        body += utf8(user)
    if password is not None:
        body += utf8(password)
    return packet(0x10, body)


def test_311_return_codes_on_the_wire(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    broker = secured(broker_factory, tmp_path)
    for user, password, code in (("alice", "wonderland", 0), ("alice", "x", 4), (None, None, 5)):
        c = RawClient(broker.port)
        c.send(connect311_bytes("raw", user, password))
        assert c.expect(CONNACK).body == bytes([0, code]), (user, password)
        if code:
            assert c.closed_by_broker() is None, "refused: closed after the CONNACK"
        c.close()


def test_anonymous_allowed_by_default(broker: BrokerProcess) -> None:
    assert login(broker, None, None) == 0
    assert login(broker, None, None, V5) == 0
    # Without a password file user names are taken as given (mosquitto does the same). Its
    # own client id: the anonymous "c" above may not have ended yet when this CONNECT is read
    # (its DISCONNECT comes on another socket), and a session is refused to another user.
    assert login(broker, "anyone", "anything", client_id="c-anyone") == 0
    assert "auth: anonymous ALLOWED" in broker.log()


def test_anonymous_alongside_passwords(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    pw = make_password_file(tmp_path / "passwd", {"alice": "wonderland"})
    broker = broker_factory(config=f'[auth]\nallow_anonymous = true\npassword_file = "{pw}"\n')
    assert login(broker, None, None) == 0
    assert login(broker, "alice", "wonderland") == 0
    assert login(broker, "alice", "nope") == BAD_CREDENTIALS_311, "a given name is checked"


def test_failed_logins_are_rate_limited(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    broker = secured(broker_factory, tmp_path, 'max_failures = 3\nlockout = "3s"\n')
    for _ in range(3):
        assert login(broker, "alice", "guess") == BAD_CREDENTIALS_311
    # Locked out: even the right password is refused, before any password check.
    assert login(broker, "alice", "wonderland") == NOT_AUTHORIZED_311
    assert login(broker, "alice", "wonderland", V5) == BANNED_5
    log = broker.log()
    assert "3 failed logins within 60s; refusing it for 3s" in log
    assert log.count("login refused: too many failed logins from this address") == 2
    # Its expiry is checked on the service's injected clock, not by waiting 3 s here:
    # tests/unit/auth/test_auth.py::test_service_lockout_refuses_the_right_password_until_it_expires


def test_passwd_file_round_trip_and_reload(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    assert passwd(str(path), "alice", stdin="one\n").returncode == 0
    assert passwd(str(path), "bob", "--password", "two").returncode == 0
    text = path.read_text()
    assert text.startswith("alice:$scrypt$n=16384,r=8,p=1$")
    assert "one" not in text.split("\n")[0].split("$")[-3:] and "two" not in text
    assert path.stat().st_mode & 0o777 == 0o600
    broker = broker_factory(config=f'[auth]\nallow_anonymous = false\npassword_file = "{path}"\n')
    assert login(broker, "alice", "one") == 0
    assert login(broker, "bob", "two") == 0
    # Change and delete while the broker runs: the next CONNECT sees the new file.
    assert passwd(str(path), "alice", "--password", "three").returncode == 0
    assert passwd(str(path), "bob", "-D").returncode == 0
    assert login(broker, "alice", "one") == BAD_CREDENTIALS_311
    assert login(broker, "alice", "three") == 0
    assert login(broker, "bob", "two") == BAD_CREDENTIALS_311
    assert "password file reloaded (1 users)" in broker.log()
    # Errors are clear and change nothing.
    missing = passwd(str(path), "carol", "-D")
    assert missing.returncode == 1 and "no user 'carol'" in missing.stderr
    bad = passwd(str(path), "a:b", "--password", "x")
    assert bad.returncode == 1 and "invalid user name" in bad.stderr
    empty = passwd(str(path), "dave", stdin="\n")
    assert empty.returncode == 1 and "empty password" in empty.stderr
    assert path.read_text().count("\n") == 1


def test_plain_text_password_file_refused_at_start(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "passwd"
    path.write_text("alice:wonderland\n")
    broker = broker_factory(config=f'[auth]\npassword_file = "{path}"\n', start=False)
    try:
        broker.start(timeout=10)
    except RuntimeError as e:
        assert f"{path}:1: user 'alice': not an scrypt hash" in str(e)
    else:
        raise AssertionError("the broker started with a plain-text password file")


def test_packets_behind_connect_wait_for_the_password_check(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    """CONNECT, SUBSCRIBE and PUBLISH in one write: processed in order once scrypt is done."""
    broker = secured(broker_factory, tmp_path)
    body = (
        utf8("MQTT")
        + bytes([4, 0x02 | 0x80 | 0x40])
        + (30).to_bytes(2, "big")
        + utf8("pipelined")
        + utf8("alice")
        + utf8("wonderland")
    )
    subscribe = packet(0x82, (1).to_bytes(2, "big") + utf8("pipe/#") + b"\x01")
    publish = packet(0x32, utf8("pipe/a") + (2).to_bytes(2, "big") + b"hello")
    c = RawClient(broker.port)
    c.send(packet(0x10, body) + subscribe + publish)
    assert c.expect(CONNACK).body == b"\x00\x00"
    assert c.expect(0x9).body == b"\x00\x01\x01"  # SUBACK granted QoS 1
    assert c.expect(0x4).packet_id == 2  # PUBACK
    d = c.deliveries(1)[0]
    assert (d.topic, d.payload) == ("pipe/a", b"hello")
    c.close()


def test_unsupported_authentication_method(broker: BrokerProcess) -> None:
    """5.0 enhanced authentication (s4.12): an unknown method gets CONNACK 0x8C."""
    props = b"\x15" + utf8("SCRAM-SHA-1")  # Authentication Method
    c = RawClient(broker.port, 5)
    c.send(connect5("enh", props=props))
    p = c.expect(CONNACK)
    assert p.body[:2] == b"\x00\x8c"
    assert c.closed_by_broker() is None


def test_auth_packet_without_method_is_a_protocol_error(broker: BrokerProcess) -> None:
    """AUTH when no method was agreed at CONNECT: DISCONNECT 0x82 Protocol Error."""
    c = RawClient(broker.port, 5)
    c.send(connect5("enh2"))
    assert c.expect(CONNACK).body[:2] == b"\x00\x00"
    c.send(bytes([0xF0]) + varint(2) + b"\x18\x00")  # AUTH: continue authentication
    first, body = read_packet(c.sock)
    assert first == 0xE0 and body[0] == 0x82, (hex(first), body.hex())
    data, _ = wait_closed(c.sock)
    assert data == b""
