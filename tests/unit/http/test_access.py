"""broker/http/access.py: the HTTP Basic header (RFC 7617), parsed or refused with a reason."""

from __future__ import annotations

import base64

import pytest

from broker.http.access import HttpRefused, basic_credentials


def basic(raw: bytes) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(raw).decode()}


def test_no_header_is_no_credentials() -> None:
    assert basic_credentials({}) is None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"alice:a-pw", ("alice", b"a-pw")),
        (b"alice:pw:with:colons", ("alice", b"pw:with:colons")),  # the first ':' splits
        (b"alice:", ("alice", b"")),
        ("zoë:ünïcode".encode(), ("zoë", "ünïcode".encode())),
    ],
)
def test_user_and_password(raw: bytes, expected: tuple[str, bytes]) -> None:
    assert basic_credentials(basic(raw)) == expected


@pytest.mark.parametrize(
    ("headers", "words"),
    [
        ({"Authorization": "Bearer abc"}, "unsupported authorization scheme 'Bearer'"),
        ({"Authorization": "Basic !!!"}, "not base64"),
        (basic(b"no-colon"), "no ':' between user and password"),
        (basic(b"\xff\xfe:pw"), "user name not UTF-8"),
    ],
)
def test_malformed_credentials_are_refused_with_the_reason(
    headers: dict[str, str], words: str
) -> None:
    with pytest.raises(HttpRefused, match=words):
        basic_credentials(headers)
