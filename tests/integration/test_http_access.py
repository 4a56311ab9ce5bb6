"""The HTTP port behind the password file (issue 24's first hole): with allow_anonymous =
false every route but /healthz asks for HTTP Basic credentials, and the fetch API returns
only the records the caller's ACL lets it read."""

from __future__ import annotations

import base64
import os
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pyarrow as pa
import pytest

from tests.integration.clients import Client
from tests.integration.conftest import BrokerFactory, BrokerProcess, run_mqlog
from tests.integration.test_auth import make_password_file

ACL = """\
user alice
topic readwrite alice/#
user bob
topic readwrite bob/#
"""
ROUTES = [
    "/metrics",
    "/api/v1/streams",
    "/api/v1/streams/default/partitions",
    "/api/v1/streams/default/partitions/0/records?offset=0",
    "/api/v1/streams/default/partitions/0/offset?timestamp=0",
    "/api/v1/streams/$sessions/partitions/0/records?offset=0",
    "/api/v1/sessions",
]
RECORDS = "/api/v1/streams/default/partitions/0/records?offset=0"


def get(
    broker: BrokerProcess,
    path: str,
    user: str | None = None,
    password: str | None = None,
    json: bool = False,
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(broker.http_url + path)
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    if json:
        req.add_header("Accept", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture
def closed_broker(broker_factory: BrokerFactory, tmp_path: Path) -> BrokerProcess:
    """allow_anonymous = false; alice and bob, each reading only their own topics; one
    message of each in the default stream (one partition)."""
    pw = make_password_file(tmp_path / "passwd", {"alice": "a-pw", "bob": "b-pw"})
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    broker = broker_factory(
        config=(
            f'[auth]\nallow_anonymous = false\npassword_file = "{pw}"\nacl_file = "{acl}"\n'
            'failure_window = "1s"\nmax_failures = 100\n'
        )
    )
    for name in ("alice", "bob"):
        c = Client(broker.port, f"{name}-pub")
        c.paho.username_pw_set(name, f"{name[0]}-pw")
        assert c.connect() == 0
        c.publish(f"{name}/private", f"{name}'s secret", qos=1)
        c.disconnect()
    return broker


def test_every_http_route_but_healthz_needs_a_user(closed_broker: BrokerProcess) -> None:
    status, _, body = get(closed_broker, "/healthz")
    assert status == 200 and orjson.loads(body)["status"] == "ok"
    for path in ROUTES:
        status, headers, body = get(closed_broker, path)
        assert status == 401, (path, status, body)
        assert headers["WWW-Authenticate"].startswith('Basic realm="mqlog"'), path
        assert b"bob's secret" not in body
        status, headers, _ = get(closed_broker, path, "alice", "wrong")
        assert status == 401, (path, status)
        status, _, _ = get(closed_broker, path, "mallory", "m-pw")
        assert status == 401, (path, status)
        status, _, _ = get(closed_broker, path, "alice", "a-pw")
        assert status == 200, (path, status)
    assert "refused: bad user name or password for 'alice'" in closed_broker.log()


def test_fetch_returns_only_what_the_users_acl_reads(closed_broker: BrokerProcess) -> None:
    status, headers, body = get(closed_broker, RECORDS, "alice", "a-pw", json=True)
    assert status == 200
    data = orjson.loads(body)
    assert [r["topic"] for r in data["records"]] == ["alice/private"]
    assert data["next_offset"] == 2, "the withheld record is stepped over, not a stall"
    status, headers, body = get(closed_broker, RECORDS, "bob", "b-pw")
    assert status == 200
    table = pa.ipc.open_stream(body).read_all()
    assert table.column("topic").to_pylist() == ["bob/private"]
    assert table.column("payload").to_pylist() == [b"bob's secret"]
    assert headers["X-Mqlog-Next-Offset"] == "2"
    # Sessions are no one's topic: the ACL reads none of them.
    status, _, body = get(
        closed_broker, "/api/v1/streams/$sessions/partitions/0/records?offset=0", "bob", "b-pw"
    )
    assert status == 200 and pa.ipc.open_stream(body).read_all().num_rows == 0


def test_anonymous_http_allowed_by_default(broker: BrokerProcess) -> None:
    """allow_anonymous = true (the default) and no password file: no credentials needed,
    and user names sent are not checked (as on CONNECT)."""
    status, _, _ = get(broker, "/api/v1/streams")
    assert status == 200
    status, _, _ = get(broker, "/api/v1/streams", "anyone", "anything")
    assert status == 200


def test_cli_commands_take_a_user(closed_broker: BrokerProcess) -> None:
    """`mqlog streams` / `mqlog offsets` against a closed broker: one line saying what is
    wanted without --user, the tables with it (the password from $MQLOG_PASSWORD)."""
    for command in ("streams", "offsets"):
        cmd = [command, "--broker", closed_broker.http_url]
        out = run_mqlog(*cmd, timeout=60)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert "HTTP 401: the broker wants a user of its password file (--user NAME" in out.stderr
        env = {**os.environ, "MQLOG_PASSWORD": "a-pw"}
        out = run_mqlog(*cmd, "--user", "alice", env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert ("STREAM" if command == "streams" else "sessions (") in out.stdout
