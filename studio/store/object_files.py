"""Output files in an object store (``--outputs s3://bucket/prefix``), shared by every studio process.

:class:`ObjectStoreFiles` keeps :class:`~studio.store.files.OutputFiles`' layout
(``<prefix>/<sha[:2]>/<sha><ext>``) in any fsspec filesystem (S3 through s3fs; GCS, Azure... through
theirs) and a local cache of it in the data dir, so everything that serves a file (``/v1/outputs``, the
History tab, bundles) keeps reading a local path: a file written here goes to the store first, then the
cache; a file another process wrote is fetched into the cache on first use, and checked against its hash.
Endpoint and credentials: fsspec storage options (``--outputs-option endpoint_url=...``) or the standard
AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``...); see
docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from studio.store.errors import StoreError
from studio.store.files import PNG, OutputFiles, extension, mime_for_extension

log = logging.getLogger("omni_studio.store")

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")


def is_object_store(location: str | None) -> bool:
    """Whether ``--outputs`` names an object store (a URL with a scheme) rather than a folder."""
    return bool(location) and bool(_URL.match(str(location))) and not str(location).startswith("file://")


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _modified(info: dict[str, Any]) -> float | None:
    """An object's last-modified time (Unix) from fsspec's listing (s3fs: ``LastModified``; local and
    memory filesystems: ``mtime`` or ``created``), or None when it reports none."""
    for key in ("LastModified", "last_modified", "mtime", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _option_value(value: str) -> Any:
    # Flags are text; fsspec backends want booleans and numbers for their switches (use_ssl=false).
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if re.fullmatch(r"-?\d+", value):
        return int(value)
    return value


def open_output_files(
    data_dir: Path, location: str | None = None, options: Iterable[tuple[str, str]] = ()
) -> OutputFiles:
    """The output files for ``--outputs``: a folder (default ``<data_dir>/outputs``) or an object store."""
    if not location:
        return OutputFiles.in_data_dir(data_dir)
    if not is_object_store(location):
        return OutputFiles(Path(str(location).removeprefix("file://")).expanduser())
    return ObjectStoreFiles(location, Path(data_dir) / "outputs-cache", dict(options))


class ObjectStoreFiles(OutputFiles):
    """The content-addressed tree in an object store, read through a local cache."""

    def __init__(self, url: str, cache_root: Path, options: dict[str, str] | None = None) -> None:
        try:
            from fsspec.core import url_to_fs
        except ImportError as exc:  # pragma: no cover - fsspec comes with the studio's dependencies
            raise StoreError(f"--outputs {url} needs fsspec: pip install 'omni-studio[ray]'") from exc
        self.url = url.rstrip("/")
        storage_options = {key: _option_value(value) for key, value in (options or {}).items()}
        try:
            self.fs, self.base = url_to_fs(self.url, **storage_options)
        except (ImportError, ValueError, TypeError) as exc:
            scheme = self.url.split("://", 1)[0]
            hint = " (pip install 'omni-studio[ray]' brings s3fs)" if isinstance(exc, ImportError) else ""
            raise StoreError(f"cannot use --outputs {self.url} ({scheme}): {exc}{hint}") from exc
        self.base = self.base.rstrip("/")
        # The cache is per store, so two stores never mix files under one folder.
        key = hashlib.sha256(self.url.encode()).hexdigest()[:12]
        self.cache = OutputFiles(Path(cache_root) / key)
        super().__init__(self.cache.root)
        self._check()

    def _check(self) -> None:
        """Fail at start-up, naming the store, when it cannot be listed (no bucket, no credentials...)."""
        try:
            self.fs.ls(self.base.split("/", 1)[0], detail=False)
        except Exception as exc:
            raise StoreError(
                f"cannot use --outputs {self.url}: {type(exc).__name__}: {exc}. Check the bucket, the endpoint "
                "(--outputs-option endpoint_url=... or AWS_ENDPOINT_URL) and the credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; docs/distributed.md)"
            ) from exc

    def remote_path(self, sha256: str, mime: str = PNG) -> str:
        """The object's path in the store."""
        return f"{self.base}/{sha256[:2]}/{sha256}{extension(mime)}"

    def path(self, sha256: str, mime: str = PNG) -> Path:
        """The file's local path: cached here, fetched from the store on first use (when it is there)."""
        local = self.cache.path(sha256, mime)
        if not local.exists():
            self._fetch(self.remote_path(sha256, mime), sha256, mime)
        return local

    def write(self, data: bytes, mime: str = PNG, sha256: str | None = None) -> tuple[str, Path]:
        """Put ``data`` in the store, then the cache (a cached file is always in the store)."""
        sha256 = sha256 or hashlib.sha256(data).hexdigest()
        local = self.cache.path(sha256, mime)
        if not local.exists():
            self.fs.pipe_file(self.remote_path(sha256, mime), data)
            self.cache.write(data, mime, sha256)
        return sha256, local

    def find(self, sha256: str) -> Path | None:
        found = self.cache.find(sha256)
        if found is not None:
            return found
        for remote in self._remote_matches(sha256):
            mime = mime_for_extension("." + remote.rsplit(".", 1)[-1])
            fetched = self._fetch(remote, sha256, mime or "application/octet-stream")
            if fetched is not None:
                return fetched
        return None

    def remove(self, sha256: str) -> None:
        self.cache.remove(sha256)
        for remote in self._remote_matches(sha256):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(remote)

    def stored(self, written_before: float) -> dict[str, int]:
        """Hash -> bytes of the objects in the store (and files in the cache) written before
        ``written_before``: what ``history prune`` may remove when no run refers to it. An object whose
        time the store does not report is left out (never removed on a guess)."""
        found = self.cache.stored(written_before)
        try:
            listing = self.fs.find(self.base, detail=True)
        except FileNotFoundError:  # nothing written yet
            return found
        for remote, info in listing.items():
            name = remote.rsplit("/", 1)[-1]
            sha = name.split(".", 1)[0]
            if name.startswith(".") or not _SHA256.fullmatch(sha) or info.get("type") == "directory":
                continue
            modified = _modified(info)
            if modified is not None and modified < written_before:
                found[sha] = found.get(sha, 0) + int(info.get("size") or 0)
        return found

    def _remote_matches(self, sha256: str) -> list[str]:
        try:
            return sorted(self.fs.glob(f"{self.base}/{sha256[:2]}/{sha256}.*"))
        except FileNotFoundError:
            return []

    def _fetch(self, remote: str, sha256: str, mime: str) -> Path | None:
        """Copy an object into the cache when it is in the store and matches its hash."""
        try:
            data = self.fs.cat_file(remote)
        except FileNotFoundError:
            return None
        except Exception as exc:  # the store is unreachable now: the file reads as missing (404), logged
            log.warning("cannot fetch %s from %s: %s", remote, self.url, exc)
            return None
        if hashlib.sha256(data).hexdigest() != sha256:
            log.error("%s in %s does not match its sha256; not serving it", remote, self.url)
            return None
        local = self.cache.path(sha256, mime)
        if not local.exists():
            self.cache.write(data, mime, sha256)
        return local
