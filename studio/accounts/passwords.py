"""Passwords hashed with argon2id (``argon2-cffi``'s defaults, RFC 9106's low-memory choice); never kept,
printed or logged in clear (docs/team.md)."""

from __future__ import annotations

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

MIN_PASSWORD_CHARS = 8
_HASHER = PasswordHasher()  # argon2id, salted per hash; the hash string names its own parameters


class PasswordError(ValueError):
    """A password that may not be used (too short, or empty)."""


def check_new_password(password: str) -> None:
    """Raise :class:`PasswordError` for a password too weak to set."""
    if len(password) < MIN_PASSWORD_CHARS:
        raise PasswordError(f"the password must have at least {MIN_PASSWORD_CHARS} characters")


def hash_password(password: str) -> str:
    """The argon2id hash of ``password`` (``$argon2id$v=19$m=...``): what the store keeps."""
    check_new_password(password)
    return _HASHER.hash(password)


def password_matches(stored_hash: str, password: str) -> bool:
    """Whether ``password`` is the one ``stored_hash`` was made from (argon2's check is constant-time)."""
    try:
        return _HASHER.verify(stored_hash, password)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


# A hash of nothing anyone can type, checked when a login names no user, so an unknown name costs the
# same time as a wrong password (the login's answer does not tell which names exist).
_DUMMY_HASH = _HASHER.hash("not a password: no user has it")


def spend_check_time(password: str) -> None:
    """Spend one check's time for a login whose user does not exist."""
    password_matches(_DUMMY_HASH, password)
