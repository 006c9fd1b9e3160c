"""The content-addressed output files of the run store: ``<data_dir>/outputs/<sha[:2]>/<sha><ext>``.

:class:`OutputFiles` is the only code that knows this layout; the store, the API (``/v1/outputs/...``,
``response_format: url``) and the UI (chat images) ask it for paths and writes.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

_EXTENSIONS = {
    "image/png": ".png",
    "image/jpeg": ".jpg",
    "image/webp": ".webp",
    "text/plain": ".txt",
    # Audio, with the content types of studio/media/audio.py (docs/speech.md "Audio files").
    "audio/wav": ".wav",
    "audio/flac": ".flac",
    "audio/mpeg": ".mp3",
    "audio/ogg": ".ogg",
}
PNG = "image/png"
WAV = "audio/wav"  # the format a run's audio is stored in (it carries the recipe, as PNGs do)
# What ``GET /v1/outputs/<sha256><ext>`` serves: pictures and sound; text outputs stay in the run's record.
SERVED_MIMES = (PNG, WAV, "audio/flac", "audio/mpeg", "audio/ogg")
_OUTPUT_NAME = re.compile(r"^([0-9a-f]{64})(\.[a-z0-9]{1,5})$")


def extension(mime: str) -> str:
    """The file extension outputs of this type are stored with."""
    return _EXTENSIONS.get(mime.split(";")[0].strip(), ".bin")


def mime_for_extension(ext: str) -> str | None:
    """The content type files with this extension (``.wav``) are stored as; ``None`` for one we never write."""
    return next((mime for mime, known in _EXTENSIONS.items() if known == ext.lower()), None)


def served_output(name: str) -> tuple[str, str] | None:
    """``(sha256, mime)`` of an output file name ``<sha256><ext>`` that ``/v1/outputs`` serves, else ``None``."""
    match = _OUTPUT_NAME.match(name)
    if match is None:
        return None
    mime = mime_for_extension(match.group(2))
    return (match.group(1), mime) if mime in SERVED_MIMES else None


class OutputFiles:
    """One content-addressed tree of output files; each file is stored once per hash."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> OutputFiles:
        return cls(Path(data_dir) / "outputs")

    def path(self, sha256: str, mime: str = PNG) -> Path:
        """Where the file with this hash and type lives."""
        return self.root / sha256[:2] / f"{sha256}{extension(mime)}"

    def write(self, data: bytes, mime: str = PNG, sha256: str | None = None) -> tuple[str, Path]:
        """Put ``data`` in the tree (once per hash); returns its sha256 and path."""
        sha256 = sha256 or hashlib.sha256(data).hexdigest()
        path = self.path(sha256, mime)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # Write aside and rename: a reader (or a crash) never sees half a file under the final name.
            fd, tmp = tempfile.mkstemp(prefix=f".{sha256[:8]}-", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return sha256, path

    def find(self, sha256: str) -> Path | None:
        """The stored file with this hash, whatever its type; ``None`` when there is none."""
        for path in (self.root / sha256[:2]).glob(f"{sha256}.*"):
            return path
        return None

    def remove(self, sha256: str) -> None:
        """Delete the file(s) with this hash."""
        for path in (self.root / sha256[:2]).glob(f"{sha256}.*"):
            path.unlink(missing_ok=True)

    def stored(self, written_before: float) -> dict[str, int]:
        """Hash -> bytes of every stored file last written before ``written_before`` (a Unix time).

        Files being written (dot-named temporaries) and names that are not ours are left out.
        """
        found: dict[str, int] = {}
        if not self.root.is_dir():
            return found
        for path in self.root.glob("??/*"):
            if path.name.startswith(".") or not path.is_file():
                continue
            try:
                info = path.stat()
            except OSError:  # removed meanwhile
                continue
            if info.st_mtime < written_before:
                sha = path.name.split(".", 1)[0]
                found[sha] = found.get(sha, 0) + info.st_size
        return found
