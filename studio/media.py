"""Encoding images once for everything that needs their bytes (API responses, the run store, downloads)."""

from __future__ import annotations

import contextlib
import io

from PIL import Image

# Attribute the encoded PNG is cached under. Engine images are never modified after the engine emits
# them, so the cached bytes stay valid; code that edits an image in place must call ``forget_png``.
_PNG_ATTR = "_omni_studio_png"


def png_bytes(image: Image.Image) -> bytes:
    """The image as PNG, encoded on the first call and cached on the image object.

    The API (base64 data URL) and the run store (content-addressed file) both ask for the same image's
    bytes; the cache makes that one encoding. The bytes are deterministic: no metadata, fixed compression,
    so the same pixels always give the same bytes and therefore the same sha256.
    """
    cached = getattr(image, _PNG_ATTR, None)
    if cached is not None:
        return cached
    buffer = io.BytesIO()
    # compress_level 6 is Pillow's default, spelled out because the bytes (and hashes) depend on it.
    image.save(buffer, format="PNG", compress_level=6)
    data = buffer.getvalue()
    # An image type that refuses new attributes still gets correct bytes, just not cached.
    with contextlib.suppress(AttributeError):
        setattr(image, _PNG_ATTR, data)
    return data


def forget_png(image: Image.Image) -> None:
    """Drop the cached PNG of an image that was changed in place."""
    if hasattr(image, _PNG_ATTR):
        delattr(image, _PNG_ATTR)
