"""The run store's journal: writes the database refused, kept in the data dir until they can be made.

When the database stays unavailable (locked, read-only, server down) after the recorder's retries, the
write is appended to ``<data_dir>/journal/<pid>-<token>.jsonl`` instead of being lost. Line 1 is a header
``{"journal": 1, "owner": "<store owner>"}``; each further line is one write, flushed and fsync'd:
``{"op": "create_run" | "mark_running" | "add_stage" | "add_output_file" | "finish_run", "run": "<run id>",
"args": {...keyword arguments of that RunStore method...}}``. Output files are written to the
content-addressed tree first (that needs no database), so a line names the file by its sha256.

A journal's writer holds an exclusive ``flock`` on it while open. :func:`replay_journals` (called by
``open_store``, before anything is served) replays every journal nobody holds: run by run, each in one
transaction, idempotently (:meth:`RunStore.apply_journaled`), and removes what it replayed; runs it could
not write stay in the file for the next start. See README.md, "Run store".
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from studio.store.records import jsonable

if TYPE_CHECKING:
    from studio.store.store import RunStore

log = logging.getLogger(__name__)

VERSION = 1
SUFFIX = ".jsonl"


def journal_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "journal"


def _line(value: Mapping[str, Any]) -> bytes:
    # ensure_ascii: lone surrogates are written as JSON escapes (valid UTF-8) and read back as they were.
    return (json.dumps(jsonable(dict(value)), ensure_ascii=True, separators=(",", ":")) + "\n").encode()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_entries(handle: BinaryIO) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A journal's header and its writes; a torn last line (a crash mid-append) is ignored."""
    handle.seek(0)
    header: dict[str, Any] = {}
    entries: list[dict[str, Any]] = []
    for number, raw in enumerate(handle.read().splitlines()):
        try:
            value = json.loads(raw)
        except ValueError:
            log.warning(
                "run journal %s: line %d is not JSON (a torn write?); skipped", handle.name, number + 1
            )
            continue
        if number == 0 and isinstance(value, dict) and "journal" in value:
            header = value
        elif (
            isinstance(value, dict)
            and isinstance(value.get("op"), str)
            and isinstance(value.get("args"), dict)
        ):
            entries.append(value)
    return header, entries


class Journal:
    """One process's journal file, created at the first write it takes and locked while open."""

    def __init__(self, data_dir: Path, owner: str) -> None:
        self.directory = journal_dir(data_dir)
        self.owner = owner
        self.path: Path | None = None
        self._handle: BinaryIO | None = None
        self.count = 0  # writes in the file now

    def _open(self) -> BinaryIO:
        self.directory.mkdir(parents=True, exist_ok=True)
        # Created under a name replay ignores and locked before it gets its real name, so a replaying
        # process never takes (and removes) a journal that is just being started.
        fd, tmp = tempfile.mkstemp(prefix=".new-", suffix=".tmp", dir=self.directory)
        handle = os.fdopen(fd, "r+b")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            handle.write(_line({"journal": VERSION, "owner": self.owner}))
            handle.flush()
            os.fsync(handle.fileno())
            path = self.directory / f"{os.getpid()}-{uuid.uuid4().hex[:12]}{SUFFIX}"
            os.replace(tmp, path)
            _fsync_dir(self.directory)
        except BaseException:
            handle.close()
            Path(tmp).unlink(missing_ok=True)
            raise
        self.path, self._handle = path, handle
        return handle

    def append(self, op: str, run_id: str, args: Mapping[str, Any]) -> None:
        """Add one write; on disk (fsync'd) when this returns."""
        handle = self._handle or self._open()
        handle.seek(0, os.SEEK_END)
        handle.write(_line({"op": op, "run": run_id, "args": dict(args)}))
        handle.flush()
        os.fsync(handle.fileno())
        self.count += 1

    def entries(self) -> list[dict[str, Any]]:
        if self._handle is None:
            return []
        return read_entries(self._handle)[1]

    def clear(self) -> None:
        """Everything in it is recorded: remove the file (a later write starts a new one)."""
        if self._handle is None:
            return
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self._handle.close()
        self._handle, self.path, self.count = None, None, 0

    def close(self) -> None:
        """Release the file (kept, with its lock dropped, for the next start to replay)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def apply_entries(store: RunStore, entries: list[dict[str, Any]], owner: str | None) -> list[str]:
    """Replay ``entries`` run by run (one transaction each, in their order); returns the runs that failed."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        by_run.setdefault(str(entry.get("run")), []).append(entry)
    failed: list[str] = []
    for run_id, writes in by_run.items():
        try:
            with store.batch():
                for entry in writes:
                    store.apply_journaled(entry["op"], entry["args"], owner)
        except Exception as exc:
            log.warning(
                "run journal: run %s could not be written yet (%s: %s); kept for the next try",
                run_id,
                exc.__class__.__name__,
                exc,
            )
            failed.append(run_id)
    return failed


def replay_journals(store: RunStore) -> int:
    """Replay every journal in the store's data dir that no live writer holds; returns the runs written."""
    directory = journal_dir(store.data_dir)
    if not directory.is_dir():
        return 0
    replayed = 0
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        try:
            handle = open(path, "r+b")  # noqa: SIM115 - closed below, after the lock is no longer needed
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its writer is alive (this or another process) and replays it itself
            if not path.exists():
                continue  # replayed and removed by another process between our open and our lock
            header, entries = read_entries(handle)
            owner = header.get("owner") if isinstance(header.get("owner"), str) else None
            failed = set(apply_entries(store, entries, owner))
            replayed += len({str(e.get("run")) for e in entries} - failed)
            if not failed:
                path.unlink()
                continue
            remaining = [e for e in entries if str(e.get("run")) in failed]
            fd, tmp = tempfile.mkstemp(prefix=".rest-", suffix=".tmp", dir=directory)
            with os.fdopen(fd, "wb") as rest:
                rest.write(_line(header or {"journal": VERSION, "owner": owner}))
                for entry in remaining:
                    rest.write(_line(entry))
                rest.flush()
                os.fsync(rest.fileno())
            os.replace(tmp, path)
        finally:
            handle.close()
    if replayed:
        log.warning(
            "run store: %d run(s) written from the journal of writes the database had refused", replayed
        )
    return replayed
