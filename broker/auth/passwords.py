"""The password file: scrypt hashes, read, written and re-read when it changes.

Password file (``[auth] password_file``, managed with ``mqlog passwd FILE USER``): one
``user:$scrypt$n=N,r=R,p=P$<salt>$<hash>`` line per user (salt and hash base64). Passwords are
never stored in plain text; each hash has its own random 16-byte salt and carries its scrypt
parameters, so they can be raised later without invalidating existing entries.

Verification of a scrypt hash costs tens of milliseconds (about 70 ms at n=2^14 on one core),
so :func:`verify_login` runs in a thread executor (:mod:`broker.auth.service`).
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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

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


def hash_password(password: str, *, n: int = SCRYPT_N, r: int = SCRYPT_R, p: int = SCRYPT_P) -> str:
    """The stored form of ``password``: scrypt with a fresh random salt and its parameters."""
    salt = secrets.token_bytes(SALT_BYTES)
    digest = _scrypt(password.encode(), salt, n, r, p, HASH_BYTES)
    return (
        f"$scrypt$n={n},r={r},p={p}${base64.b64encode(salt).decode()}"
        f"${base64.b64encode(digest).decode()}"
    )


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
                "are not accepted; set it with `mqlog passwd FILE USER`)"
            )
        n, r, p = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if n < 2 or n & (n - 1) or n > _MAX_N or not 1 <= r <= _MAX_R or not 1 <= p <= _MAX_P:
            raise AuthFileError(
                f"{source}:{lineno}: user {user!r}: scrypt parameters out of "
                f"range (n a power of two <= {_MAX_N}, r <= {_MAX_R}, "
                f"p <= {_MAX_P})"
            )
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
