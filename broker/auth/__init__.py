"""Who may connect and what they may do: passwords, ACLs, the login rate limiter.

- :mod:`broker.auth.passwords`: the scrypt password file (``mqlog passwd``).
- :mod:`broker.auth.acl`: the mosquitto-style ACL file and per-client decisions.
- :mod:`broker.auth.service`: the login decisions the transport asks for on CONNECT.

Imports :mod:`broker.mqtt` (topic matching, reason codes) and nothing else of the broker's.
"""

from broker.auth.acl import Acl, AclRule, Authorizer, filter_covers
from broker.auth.passwords import (
    AuthFileError,
    PasswordStore,
    hash_password,
    read_password_file,
    valid_user_name,
    verify_login,
    verify_password,
    write_password_file,
)
from broker.auth.service import AuthService, LoginLimiter, LoginResult, PendingLogin

__all__ = [
    "Acl",
    "AclRule",
    "AuthFileError",
    "AuthService",
    "Authorizer",
    "LoginLimiter",
    "LoginResult",
    "PasswordStore",
    "PendingLogin",
    "filter_covers",
    "hash_password",
    "read_password_file",
    "valid_user_name",
    "verify_login",
    "verify_password",
    "write_password_file",
]
