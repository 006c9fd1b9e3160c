"""Recording into the run store: a run, its stages, outputs and config snapshot, and its end."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, select

from studio.store.base import (
    _FINISH,
    _MARK_RUNNING,
    TERMINAL_STATUSES,
    _kind_for_mime,
    _outputs,
    _runs,
    _snapshots,
    _stages,
)
from studio.store.models import OUTPUT_KINDS, RUN_SOURCES, RUN_STATUSES, ConfigSnapshot, utcnow
from studio.store.queries import RunQueries
from studio.store.records import as_datetime, config_hash_of, jsonable


class RunWrites(RunQueries):
    """Recording runs (see :class:`studio.store.store.RunStore`)."""

    def upsert_snapshot(
        self,
        connection: Connection,
        config_hash: str,
        body: Mapping[str, Any],
        created_at: datetime | None = None,
    ) -> None:
        """Add a config snapshot unless one with this hash exists (inside ``connection``'s transaction)."""
        if config_hash in self._known_snapshots:
            return
        found = body.get("model")
        model: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        values = {
            "hash": config_hash,
            "body": jsonable(dict(body)),
            "family": str(body.get("family") or ""),
            "model_name": str(model.get("name") or ""),
            "created_at": created_at or utcnow(),
        }
        if self._upsert_snapshot_statement is not None:
            connection.execute(self._upsert_snapshot_statement, values)
        elif connection.scalar(select(ConfigSnapshot.hash).where(ConfigSnapshot.hash == config_hash)) is None:
            connection.execute(_snapshots.insert(), values)

    def create_run(
        self,
        *,
        source: str,
        prompt: str,
        model: str,
        request: Mapping[str, Any],
        parameters: Mapping[str, Any],
        seed: int | None = None,
        config: Mapping[str, Any] | None = None,
        config_hash: str | None = None,
        fingerprint: str | None = None,
        run_id: str | None = None,
        status: str = "queued",
        created_at: datetime | float | None = None,
        owner: str | None = None,
        replay_of: str | None = None,
        user_name: str | None = None,
    ) -> str:
        """Record a new run and return its id (``run_id`` when given, else a fresh uuid hex).

        ``config`` is the pipeline config's ``to_dict()``; it is snapshotted once per hash. ``owner`` is the
        store instance recording the run (this one by default; a journal replay passes the journal's).
        ``replay_of`` is the id of the run this one replays (``omni-studio replay``, docs/replay.md).
        ``user_name`` is the account the run belongs to (docs/team.md); ``None`` without accounts.
        """
        if source not in RUN_SOURCES:
            raise ValueError(f"source must be one of {', '.join(RUN_SOURCES)}, got {source!r}")
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
        run_id = run_id or uuid.uuid4().hex
        if config is not None and config_hash is None:
            config_hash = config_hash_of(config)
        row = {
            "id": run_id,
            "source": source,
            "created_at": as_datetime(created_at) or utcnow(),
            "status": status,
            "prompt": prompt,
            "model": model,
            "request": jsonable(dict(request)),
            "parameters": jsonable(dict(parameters)),
            "seed": seed,
            "config_hash": config_hash,
            "fingerprint": fingerprint,
            "owner": owner or self.owner,
            "replay_of": replay_of,
            "user_name": user_name,
        }
        with self._write() as connection:
            if config is not None and config_hash is not None:  # the hash is computed above
                self.upsert_snapshot(connection, config_hash, config)
            connection.execute(_runs.insert(), row)
        if config_hash is not None and config is not None:
            # Only once committed: a batch rolled back would otherwise leave us skipping a missing snapshot.
            self._after_commit(lambda: self._known_snapshots.add(config_hash))
        return run_id

    def mark_running(self, run_id: str, at: datetime | float | None = None) -> bool:
        """queued -> running (the first stage started). False when the run is not queued."""
        with self._write() as connection:
            result = connection.execute(_MARK_RUNNING, {"p_id": run_id, "p_at": as_datetime(at) or utcnow()})
            return bool(result.rowcount)

    def add_stage(
        self,
        run_id: str,
        *,
        stage_id: int,
        kind: str,
        status: str,
        started_at: datetime | float | None,
        finished_at: datetime | float | None,
        queue_seconds: float = 0.0,
        input_tokens: int = 0,
        output_tokens: int = 0,
        batch_size: int = 1,
        variant_index: int = 0,
    ) -> None:
        """Record one finished stage of one variant (timings are datetimes or ``time.time()`` stamps)."""
        row = {
            "run_id": run_id,
            "variant_index": variant_index,
            "stage_id": stage_id,
            "kind": kind,
            "status": status,
            "started_at": as_datetime(started_at),
            "finished_at": as_datetime(finished_at),
            "queue_seconds": float(queue_seconds),
            "input_tokens": int(input_tokens),
            "output_tokens": int(output_tokens),
            "batch_size": int(batch_size),
        }
        with self._write() as connection:
            connection.execute(_stages.insert(), row)

    def add_output(
        self,
        run_id: str,
        index: int,
        data: bytes,
        mime: str,
        width: int | None = None,
        height: int | None = None,
        kind: str | None = None,
        duration_seconds: float | None = None,
        sample_rate: int | None = None,
    ) -> str:
        """Store a run's output file (once per content hash) and its row; returns the sha256.

        ``kind`` defaults from ``mime`` (image/* -> image, text/* -> text, audio/* -> audio); ``source``
        records the input image of an image-to-image run. ``index`` counts within the kind. An audio
        output records its length and rate (``duration_seconds``, ``sample_rate``).
        """
        kind = kind or _kind_for_mime(mime)
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(OUTPUT_KINDS)}, got {kind!r}")
        sha256, _path = self.write_file(data, mime)
        return self.add_output_file(
            run_id, index, sha256, mime, width, height, kind, len(data), data, duration_seconds, sample_rate
        )

    def add_output_file(
        self,
        run_id: str,
        index: int,
        sha256: str,
        mime: str,
        width: int | None = None,
        height: int | None = None,
        kind: str | None = None,
        size_bytes: int = 0,
        data: bytes | None = None,
        duration_seconds: float | None = None,
        sample_rate: int | None = None,
    ) -> str:
        """Record an output whose file is already in the tree (:meth:`write_file`); returns its sha256.

        ``data`` (the file's bytes, when still at hand) rewrites the file if retention in another process
        removed it between the file write and this row.
        """
        kind = kind or _kind_for_mime(mime)
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(OUTPUT_KINDS)}, got {kind!r}")
        row = {
            "run_id": run_id,
            "index": index,
            "kind": kind,
            "sha256": sha256,
            "mime": mime,
            "width": width,
            "height": height,
            "size_bytes": size_bytes,
            "duration_seconds": None if duration_seconds is None else float(duration_seconds),
            "sample_rate": None if sample_rate is None else int(sample_rate),
        }
        with self._write() as connection:
            connection.execute(_outputs.insert(), row)
        if data is not None and not self.file_path(sha256, mime).exists():
            self.write_file(data, mime, sha256)
        return sha256

    def finish_run(
        self,
        run_id: str,
        status: str,
        error: str | None = None,
        text: str | None = None,
        usage: Mapping[str, int] | None = None,
        at: datetime | float | None = None,
        audio: Mapping[str, float | None] | None = None,
    ) -> bool:
        """Record a run's outcome. The first outcome wins: False when the run had already finished.

        ``usage`` holds ``input_tokens`` and ``output_tokens``; ``audio`` (runs that speak) holds
        ``ttfp_seconds``, ``audio_seconds`` and ``realtime_factor`` (docs/run-store.md). A run marked
        interrupted by mistake (its owner looked dead) still takes the real outcome.
        """
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"a run finishes as one of {', '.join(TERMINAL_STATUSES)}, not {status!r}")
        usage = usage or {}
        params = {
            "p_id": run_id,
            "p_status": status,
            "p_error": error,
            "p_at": as_datetime(at) or utcnow(),
            "p_text": text,
            "p_in": usage.get("input_tokens"),
            "p_out": usage.get("output_tokens"),
            "p_ttfp": (audio or {}).get("ttfp_seconds"),
            "p_audio": (audio or {}).get("audio_seconds"),
            "p_rtf": (audio or {}).get("realtime_factor"),
        }
        with self._write() as connection:
            return bool(connection.execute(_FINISH, params).rowcount)

    def apply_journaled(self, op: str, args: Mapping[str, Any], owner: str | None = None) -> None:
        """Make one journaled write (:mod:`studio.store.journal`), skipping what is already recorded.

        Idempotent, so a journal replayed twice (a crash between its commit and its removal) records
        nothing twice: an existing run, stage (variant, stage id) or output (kind, index) is left as is,
        and a run's first outcome wins anyway.
        """
        args = dict(args)
        with self._write() as connection:
            if op == "create_run":
                if connection.scalar(select(_runs.c.id).where(_runs.c.id == args["run_id"])) is None:
                    self.create_run(**args, owner=owner)
            elif op == "add_stage":
                found = connection.scalar(
                    select(_stages.c.id).where(
                        _stages.c.run_id == args["run_id"],
                        _stages.c.variant_index == args.get("variant_index", 0),
                        _stages.c.stage_id == args["stage_id"],
                    )
                )
                if found is None:
                    self.add_stage(**args)
            elif op == "add_output_file":
                kind = args.get("kind") or _kind_for_mime(args["mime"])
                found = connection.scalar(
                    select(_outputs.c.id).where(
                        _outputs.c.run_id == args["run_id"],
                        _outputs.c.kind == kind,
                        _outputs.c.index == args["index"],
                    )
                )
                if found is None:
                    self.add_output_file(**args)
            elif op == "mark_running":
                self.mark_running(**args)
            elif op == "finish_run":
                self.finish_run(**args)
            else:
                raise ValueError(f"unknown journaled write {op!r}")
