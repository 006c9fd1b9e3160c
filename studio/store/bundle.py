"""History bundles: one portable zip of runs, their config snapshots and their output files.

Layout: ``manifest.json`` (format, version, counts), ``runs.json`` (run rows, each with its ``stages`` and
``outputs``), ``configs.json`` (``{hash: {body, family, model_name, created_at}}``) and
``files/<sha256><ext>``. Timestamps are ISO 8601 in UTC, so a bundle moves between SQLite and PostgreSQL.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import zipfile
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from studio.store.errors import BundleError, StoreError
from studio.store.files import extension
from studio.store.models import (
    ACTIVE_STATUSES,
    RUN_SOURCES,
    RUN_STATUSES,
    Output,
    Run,
    RunStage,
    table_of,
    utcnow,
)
from studio.store.records import ImportResult, RunFilter, as_datetime, iso

if TYPE_CHECKING:
    from studio.store.store import RunStore

BUNDLE_FORMAT = "omni-studio-runs"
BUNDLE_VERSION = 1
RUN_FIELDS = (
    "id",
    "source",
    "status",
    "created_at",
    "started_at",
    "finished_at",
    "prompt",
    "model",
    "request",
    "parameters",
    "seed",
    "config_hash",
    "fingerprint",
    "error",
    "text",
    "input_tokens",
    "output_tokens",
    "replay_of",  # absent in bundles written before replays existed: imported as None
    # Runs that speak (docs/speech.md); absent in bundles written before audio: imported as None.
    "ttfp_seconds",
    "audio_seconds",
    "realtime_factor",
    "user_name",  # the run's account (docs/team.md); absent in bundles written before accounts: None
)
STAGE_FIELDS = (
    "variant_index",
    "stage_id",
    "kind",
    "status",
    "started_at",
    "finished_at",
    "queue_seconds",
    "input_tokens",
    "output_tokens",
    "batch_size",
)
# duration_seconds, sample_rate: audio outputs (absent in older bundles: None).
OUTPUT_FIELDS = (
    "index",
    "kind",
    "sha256",
    "mime",
    "width",
    "height",
    "size_bytes",
    "duration_seconds",
    "sample_rate",
)
# Files whose format compresses already: deflating them again only costs time (WAV and text deflate).
_STORED_MIMES = ("image/", "audio/flac", "audio/mpeg", "audio/ogg")
TIME_FIELDS = {"created_at", "started_at", "finished_at"}


def _row(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: iso(getattr(obj, n)) if n in TIME_FIELDS else getattr(obj, n) for n in names}


def run_row(run: Run) -> dict[str, Any]:
    """A run as it appears in ``runs.json``."""
    row = _row(run, RUN_FIELDS)
    row["stages"] = [_row(s, STAGE_FIELDS) for s in run.stages]
    row["outputs"] = [_row(o, OUTPUT_FIELDS) for o in run.outputs]
    return row


def export_bundle(store: RunStore, path: Path | str, filter: RunFilter | None = None) -> int:
    """Write the runs of ``store`` matching ``filter`` (all by default) to one portable zip; returns how many.

    ``path`` is replaced atomically. The zip holds ``manifest.json``, ``runs.json`` (rows with their
    stages and outputs), ``configs.json`` (the snapshots they reference) and ``files/<sha256><ext>``.
    """
    path = Path(path)
    runs: list[dict[str, Any]] = []
    configs: dict[str, dict[str, Any]] = {}
    files: dict[str, str] = {}  # sha256 -> mime
    for run in store.iter_runs(filter):
        runs.append(run_row(run))
        if run.config is not None:
            configs[run.config.hash] = {
                "body": run.config.body,
                "family": run.config.family,
                "model_name": run.config.model_name,
                "created_at": iso(run.config.created_at),
            }
        for output in run.outputs:
            files.setdefault(output.sha256, output.mime)
    manifest = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "exported_at": iso(utcnow()),
        "runs": len(runs),
        "files": len(files),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("manifest.json", json.dumps(manifest, indent=1))
            archive.writestr("configs.json", json.dumps(configs))
            archive.writestr("runs.json", json.dumps(runs))
            for sha, mime in files.items():
                source = store.file_path(sha, mime)
                if not source.exists():
                    raise StoreError(f"output file {source} is missing from the data dir; cannot export it")
                compress = zipfile.ZIP_STORED if mime.startswith(_STORED_MIMES) else zipfile.ZIP_DEFLATED
                archive.write(source, f"files/{sha}{extension(mime)}", compress_type=compress)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(runs)


def _read_bundle(archive: zipfile.ZipFile, path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    try:
        manifest = json.loads(archive.read("manifest.json"))
        runs = json.loads(archive.read("runs.json"))
        configs = json.loads(archive.read("configs.json"))
    except (KeyError, ValueError) as exc:
        raise BundleError(f"{path}: not a history bundle ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{path}: not a history bundle (format {manifest.get('format')!r})")
    if int(manifest.get("version", 0)) > BUNDLE_VERSION:
        raise BundleError(
            f"{path}: bundle version {manifest['version']} is newer than this omni-studio reads"
        )
    if not isinstance(runs, list) or not isinstance(configs, dict):
        raise BundleError(f"{path}: runs.json must hold a list and configs.json a mapping")
    return runs, configs


def _when(value: str | None) -> datetime | None:
    return as_datetime(datetime.fromisoformat(value)) if value else None


def _insert_run(connection: Connection, run: dict[str, Any]) -> None:
    row = {name: run.get(name) for name in RUN_FIELDS}
    for name in TIME_FIELDS:
        row[name] = _when(row[name])
    if row["status"] not in RUN_STATUSES or row["source"] not in RUN_SOURCES:
        raise ValueError(f"run {row['id']}: unknown status {row['status']!r} or source {row['source']!r}")
    if row["status"] in ACTIVE_STATUSES:  # nothing will ever finish it here
        row["status"] = "interrupted"
        row["error"] = row["error"] or "interrupted: the run was still in progress when exported"
    row["request"], row["parameters"], row["owner"] = row["request"] or {}, row["parameters"] or {}, None
    connection.execute(table_of(Run).insert(), row)
    stages = [{**{n: s.get(n) for n in STAGE_FIELDS}, "run_id": row["id"]} for s in run.get("stages") or []]
    for stage in stages:
        stage["started_at"], stage["finished_at"] = _when(stage["started_at"]), _when(stage["finished_at"])
    if stages:
        connection.execute(table_of(RunStage).insert(), stages)
    outputs = [
        {**{n: o.get(n) for n in OUTPUT_FIELDS}, "run_id": row["id"]} for o in run.get("outputs") or []
    ]
    if outputs:
        connection.execute(table_of(Output).insert(), outputs)


def import_bundle(store: RunStore, path: Path | str) -> ImportResult:
    """Add a bundle's runs to ``store``; runs whose id is already there are skipped, files are stored once.

    Every file is checked against its sha256 before anything is written. Runs that were still
    queued/running when exported are imported as interrupted. Raises :class:`BundleError`.
    """
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise BundleError(f"{path}: not a history bundle ({exc})") from exc
    with archive:
        runs, configs = _read_bundle(archive, path)
        try:
            present = store.existing_ids([run["id"] for run in runs])
        except (KeyError, TypeError) as exc:
            raise BundleError(f"{path}: malformed run row ({exc.__class__.__name__}: {exc})") from exc
        new_runs = [run for run in runs if run["id"] not in present]
        names = {Path(n).name.split(".")[0]: n for n in archive.namelist() if n.startswith("files/")}
        # Files first, each verified: a row never points at a file that is not there.
        wanted = {o["sha256"]: o["mime"] for run in new_runs for o in run.get("outputs") or []}
        for sha, mime in wanted.items():
            if sha not in names:
                raise BundleError(f"{path}: file {sha} is referenced but missing from the bundle")
            if store.file_path(sha, mime).exists():
                continue
            data = archive.read(names[sha])
            if hashlib.sha256(data).hexdigest() != sha:
                raise BundleError(f"{path}: file {names[sha]} does not match its sha256 (corrupt bundle)")
            store.write_file(data, mime, sha)

    try:
        with store.write_transaction() as connection:
            for config_hash in sorted({run["config_hash"] for run in new_runs if run.get("config_hash")}):
                snapshot = configs.get(config_hash)
                if snapshot is None:
                    raise BundleError(f"{path}: config snapshot {config_hash} is referenced but missing")
                store.upsert_snapshot(
                    connection, config_hash, snapshot["body"], _when(snapshot.get("created_at"))
                )
            for run in new_runs:
                _insert_run(connection, run)
    except BundleError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{path}: malformed run row ({exc.__class__.__name__}: {exc})") from exc
    except IntegrityError as exc:  # another process imported the same runs at the same moment
        raise BundleError(
            f"{path}: import conflicted with concurrent writes; run it again ({exc.orig})"
        ) from exc
    return ImportResult(imported=len(new_runs), skipped=len(runs) - len(new_runs))
