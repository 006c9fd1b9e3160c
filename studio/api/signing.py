"""Signed output URLs: ``/v1/outputs/<sha>.png?exp=<unix time>&sig=<hex>`` (README.md, "The API").

With an API key set, ``response_format: "url"`` answers a URL that works without the bearer header (an
``<img src>``, a chat UI, a plain GET) until ``exp``: ``sig`` is HMAC-SHA256 over ``"<name>\\n<exp>"`` with a
server secret. The secret lives in the data dir (``url-signing.key``, 32 random bytes, mode 0600, made at
first use), so URLs survive a restart and every studio process on one data dir accepts them; deleting the
file revokes every URL handed out. Without a data dir (no ``url`` responses then) it is made per process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

SECRET_FILE = "url-signing.key"
DEFAULT_TTL_S = 3600


def load_secret(data_dir: Path | None) -> bytes:
    """The data dir's signing secret, made (atomically, 0600) if it is not there yet."""
    if data_dir is None:
        return secrets.token_bytes(32)
    path = Path(data_dir) / SECRET_FILE
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = secrets.token_bytes(32)
    temporary = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(fresh)
    try:
        os.link(temporary, path)  # fails if another process made it first: then use theirs
    except FileExistsError:
        pass
    finally:
        temporary.unlink()
    return path.read_bytes()


class URLSigner:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def signature(self, name: str, expires: int) -> str:
        message = f"{name}\n{expires}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def query(self, name: str, ttl_s: int, now: float | None = None) -> str:
        """``exp=...&sig=...`` for ``name``, valid for ``ttl_s`` seconds from now."""
        expires = int(now if now is not None else time.time()) + ttl_s
        return f"exp={expires}&sig={self.signature(name, expires)}"

    def problem(self, name: str, exp: str | None, sig: str | None, now: float | None = None) -> str | None:
        """Why ``exp``/``sig`` do not grant ``name`` (``None``: they do)."""
        if not exp or not sig:
            return "the URL is not signed"
        if not exp.isdigit() or len(exp) > 12:
            return "the URL's signature is not valid"
        if not hmac.compare_digest(sig.encode(errors="replace"), self.signature(name, int(exp)).encode()):
            return "the URL's signature is not valid"
        if int(exp) < (now if now is not None else time.time()):
            return "the signed URL has expired"
        return None
