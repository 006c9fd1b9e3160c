"""What of a request's payload a run keeps: inline images described instead of stored, and a refused
request's long strings cut (docs/run-store.md); the prompt a history row shows.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["MAX_INLINE_DATA_URL", "REFUSED_TEXT_KEPT", "compact_payload", "prompt_of"]

MAX_INLINE_DATA_URL = 1024  # longer data: URLs in a request are replaced by a short description
# A refused request's strings are kept up to this many characters: a client sending megabyte prompts
# (refused by --max-prompt-chars) must not fill the database or make every refusal index a megabyte of
# prompt text for search; the cut keeps the start, the length and a hash (docs/run-store.md).
REFUSED_TEXT_KEPT = 4000


def compact_payload(value: Any, max_text: int | None = None) -> Any:
    """The request as received, with inline images (long ``data:`` URLs) replaced by a description, and
    strings longer than ``max_text`` (when given) cut to their start, length and hash.

    Base64 images would make every history row megabytes; the decoded source image is stored as the
    run's ``source`` output instead.
    """
    if isinstance(value, dict):
        return {k: compact_payload(v, max_text) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [compact_payload(v, max_text) for v in value]
    if isinstance(value, str) and value.startswith("data:") and len(value) > MAX_INLINE_DATA_URL:
        header = value.split(",", 1)[0]
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return f"{header},<{len(value)} characters omitted; sha256 {digest}>"
    if isinstance(value, str) and max_text is not None and len(value) > max_text:
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return f"{value[:max_text]}…<{len(value)} characters in all, {len(value) - max_text} omitted; sha256 {digest}>"
    return value


def prompt_of(payload: Any) -> str:
    """The newest user text of a chat payload, or an images payload's prompt (best effort)."""
    if not isinstance(payload, dict):
        return ""
    if isinstance(payload.get("prompt"), str):
        return payload["prompt"]
    messages = payload.get("messages")
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, str):
                    return content
                if isinstance(content, list):
                    return " ".join(
                        p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
                    )
    return ""
