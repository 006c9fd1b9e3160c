"""Encoding images once for everything that needs their bytes (API responses, the run store, downloads).

An image may carry PNG text chunks (the run's recipe, attached once by ``studio.runs.service.RunService``; see
docs/recipes.md): every writer encodes through :func:`png_bytes`, so every copy of a picture carries them.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence

from PIL import Image
from PIL.PngImagePlugin import PngInfo

# Attribute the encoded PNG is cached under. Engine images are never modified after the engine emits
# them, so the cached bytes stay valid; code that edits an image in place must call ``forget_png``.
_PNG_ATTR = "_omni_studio_png"
# Attribute holding the (keyword, text) chunks written into the image's PNG.
_TEXT_ATTR = "_omni_studio_png_text"


def png_bytes(image: Image.Image) -> bytes:
    """The image as PNG, encoded on the first call and cached on the image object.

    The API (base64 data URL) and the run store (content-addressed file) both ask for the same image's
    bytes; the cache makes that one encoding. The bytes are deterministic: fixed compression and only the
    text chunks attached with :func:`attach_png_text` (no time stamps), so the same pixels and text always
    give the same bytes and therefore the same sha256.
    """
    cached = getattr(image, _PNG_ATTR, None)
    if cached is not None:
        return cached
    info = PngInfo()
    for keyword, text in png_text(image):
        # tEXt when the text is Latin-1, else iTXt (UTF-8): what A1111 and most PNG readers expect.
        info.add_text(keyword, text)
    buffer = io.BytesIO()
    # compress_level 6 is Pillow's default, spelled out because the bytes (and hashes) depend on it.
    image.save(buffer, format="PNG", compress_level=6, pnginfo=info)
    data = buffer.getvalue()
    # An image type that refuses new attributes still gets correct bytes, just not cached.
    with contextlib.suppress(AttributeError):
        setattr(image, _PNG_ATTR, data)
    return data


def attach_png_text(image: Image.Image, chunks: Sequence[tuple[str, str]]) -> None:
    """Write ``chunks`` ((keyword, text) pairs, in order) into every PNG of ``image`` from now on.

    Drops an encoding cached before (it lacks them). An image type that refuses new attributes is
    encoded without them.
    """
    with contextlib.suppress(AttributeError):
        setattr(image, _TEXT_ATTR, tuple(chunks))
    forget_png(image)


def png_text(image: Image.Image) -> tuple[tuple[str, str], ...]:
    """The text chunks attached to ``image`` (empty when none)."""
    return getattr(image, _TEXT_ATTR, ())


def forget_png(image: Image.Image) -> None:
    """Drop the cached PNG of an image that was changed in place."""
    if hasattr(image, _PNG_ATTR):
        delattr(image, _PNG_ATTR)
