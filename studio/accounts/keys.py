"""API keys of team accounts: ``omni_<id>_<secret>``.

The id (10 hex digits) is shown in lists and names the key in ``keys revoke``; the secret (32 random bytes,
url-safe) is shown once, when the key is made, and only its sha256 is stored: a key is random with 256 bits,
so a fast hash is as safe as a slow one for it, and a request costs one primary-key lookup and one
constant-time comparison (docs/team.md).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PREFIX = "omni_"


def new_key() -> tuple[str, str]:
    """A fresh ``(key id, the whole key)``."""
    key_id = secrets.token_hex(5)
    return key_id, f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def secret_digest(key: str) -> str:
    """What the store keeps of a key: the sha256 of the whole key."""
    return hashlib.sha256(key.encode(errors="replace")).hexdigest()


def key_id_of(key: str) -> str | None:
    """The id inside a key of this format (``None``: not one of ours, e.g. the ``--api-key``)."""
    if not key.startswith(PREFIX):
        return None
    key_id, sep, secret = key[len(PREFIX) :].partition("_")
    if not sep or len(key_id) != 10 or not secret or any(c not in "0123456789abcdef" for c in key_id):
        return None
    return key_id


def digest_matches(key: str, stored: str) -> bool:
    return hmac.compare_digest(secret_digest(key), stored)
