"""Reading the run store: one run, pages and counts of runs, prompt search, diffs, output files."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, Connection, func, literal_column, select, text, tuple_
from sqlalchemy.orm import Session, joinedload, selectinload

from studio.store import search
from studio.store.base import COUNT_CAP, FTS_DRIVE_LIMIT, StoreBase
from studio.store.errors import AmbiguousRunId, RunNotFound
from studio.store.models import OUTPUT_KINDS, RUN_SOURCES, RUN_STATUSES, ConfigSnapshot, Output, Run
from studio.store.records import (
    OutputRecord,
    RunCount,
    RunDetail,
    RunFilter,
    RunPage,
    RunSummary,
    StageRecord,
    as_datetime,
    diff_mappings,
    flatten,
    storable,
)


class RunQueries(StoreBase):
    """Reading runs (see :class:`studio.store.store.RunStore`)."""

    # reading --------------------------------------------------------------------------------------

    def _detail(self, run: Run) -> RunDetail:
        return RunDetail(
            id=run.id,
            source=run.source,
            status=run.status,
            created_at=run.created_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
            prompt=run.prompt,
            model=run.model,
            request=run.request,
            parameters=run.parameters,
            seed=run.seed,
            config_hash=run.config_hash,
            fingerprint=run.fingerprint,
            error=run.error,
            text=run.text,
            input_tokens=run.input_tokens,
            output_tokens=run.output_tokens,
            stages=[
                StageRecord(
                    s.variant_index,
                    s.stage_id,
                    s.kind,
                    s.status,
                    s.started_at,
                    s.finished_at,
                    s.queue_seconds,
                    s.input_tokens,
                    s.output_tokens,
                    s.batch_size,
                )
                for s in run.stages
            ],
            outputs=[
                OutputRecord(
                    o.index,
                    o.kind,
                    o.sha256,
                    o.mime,
                    o.width,
                    o.height,
                    o.size_bytes,
                    self.file_path(o.sha256, o.mime),
                    o.duration_seconds,
                    o.sample_rate,
                )
                for o in run.outputs
            ],
            config=run.config.body if run.config is not None else None,
            replay_of=run.replay_of,
            ttfp_seconds=run.ttfp_seconds,
            audio_seconds=run.audio_seconds,
            realtime_factor=run.realtime_factor,
            owner=run.user_name,
        )

    @staticmethod
    def _load_runs(session: Session, ids: Sequence[str]) -> list[Run]:
        runs = (
            session.scalars(
                select(Run)
                .where(Run.id.in_(ids))
                .options(selectinload(Run.stages), selectinload(Run.outputs), joinedload(Run.config))
            )
            .unique()
            .all()
        )
        order = {run_id: i for i, run_id in enumerate(ids)}
        return sorted(runs, key=lambda r: order[r.id])

    def get_run(self, run_id: str) -> RunDetail:
        """Everything about one run (``run_id`` exact); raises :class:`RunNotFound`."""
        with self._read() as session:
            runs = self._load_runs(session, [run_id])
            if not runs:
                raise RunNotFound(f"no run with id {run_id!r}")
            return self._detail(runs[0])

    def iter_runs(self, filter: RunFilter | None = None, chunk: int = 500) -> Iterator[Run]:
        """Every matching run, oldest first, loaded with stages, outputs and snapshot (for export)."""
        with self._read() as session:
            ids = list(
                session.scalars(
                    self._filtered(select(Run.id), filter, session).order_by(Run.created_at, Run.id)
                )
            )
        for start in range(0, len(ids), chunk):
            with self._read() as session:
                yield from self._load_runs(session, ids[start : start + chunk])

    def resolve_run_id(self, prefix: str) -> str:
        """The full id of the one run whose id starts with ``prefix`` (ids are shown shortened)."""
        prefix = prefix.strip().lower()
        if not prefix:
            raise RunNotFound("no run id given")
        with self._read() as session:
            if session.get(Run, prefix) is not None:
                return prefix
            ids = session.scalars(
                select(Run.id).where(Run.id.startswith(prefix, autoescape=True)).order_by(Run.id).limit(3)
            ).all()
        if not ids:
            raise RunNotFound(f"no run id starts with {prefix!r}")
        if len(ids) > 1:
            raise AmbiguousRunId(
                f"{prefix!r} matches several runs ({', '.join(ids[:2])}, ...); give more digits"
            )
        return ids[0]

    def _search_condition(self, connection: Connection | Session, term: str) -> list[ColumnElement[bool]]:
        """The prompt-search conditions: the plain substring test, plus the index as a candidate filter.

        The substring test alone decides (the index only narrows which rows it sees), so an indexed search
        answers exactly what a scan answers. On SQLite the FTS candidates drive the query only when there
        are few of them: a common term is found sooner newest first, through the other filters' indexes.
        """
        # Stored text has unstorable characters escaped (records.storable); so has the search term.
        term = storable(term)
        if len(term) < search.MIN_INDEXED_TERM:
            # Below a trigram: the index could only be read whole. `prompt || ''` keeps the PostgreSQL
            # planner off it; filters' indexes (or a newest-first scan stopping at the page) serve instead.
            return [(Run.prompt + "").icontains(term, autoescape=True)]
        conditions: list[ColumnElement[bool]] = [Run.prompt.icontains(term, autoescape=True)]
        if not self.search_indexed:
            return conditions
        if self.dialect == "postgresql":
            # The trigram index serves the ILIKE itself. For a term in many prompts the planner still
            # ANDs the index in (reading every match from it) where the other filters' indexes alone
            # are cheaper; its own row estimate says which case this is.
            pattern = "%" + term.replace("/", "//").replace("%", "/%").replace("_", "/_") + "%"
            plan = connection.execute(
                text("EXPLAIN (FORMAT JSON) SELECT 1 FROM runs WHERE prompt ILIKE :pattern ESCAPE '/'"),
                {"pattern": pattern},
            ).scalar()
            estimate = plan[0]["Plan"]["Plan Rows"] if isinstance(plan, list) and plan else 0
            if estimate > FTS_DRIVE_LIMIT:
                return [(Run.prompt + "").icontains(term, autoescape=True)]
            return conditions
        if self.dialect != "sqlite":
            return conditions
        phrase = '"' + term.replace('"', '""') + '"'
        candidates = connection.execute(
            text(
                f"SELECT count(*) FROM (SELECT 1 FROM {search.FTS_TABLE} "
                f"WHERE {search.FTS_TABLE} MATCH :phrase LIMIT :cap)"
            ),
            {"phrase": phrase, "cap": FTS_DRIVE_LIMIT + 1},
        ).scalar()
        if (candidates or 0) <= FTS_DRIVE_LIMIT:
            conditions.append(
                literal_column("runs.rowid").in_(
                    text(
                        f"SELECT rowid FROM {search.FTS_TABLE} WHERE {search.FTS_TABLE} MATCH :phrase"
                    ).bindparams(phrase=phrase)
                )
            )
        return conditions

    def _filtered(self, statement: Any, flt: RunFilter | None, connection: Connection | Session) -> Any:
        if flt is None:
            return statement
        conditions: list[ColumnElement[bool]] = []
        # SQLite plans without value statistics, and a status is a poor narrower (most runs succeed): with
        # a model, fingerprint or config filter, `status || ''` leaves that filter's index to drive.
        narrower = bool(flt.model or flt.fingerprint or flt.config_hash or flt.user)
        for column, value, allowed in (
            (Run.status, flt.status, RUN_STATUSES),
            (Run.source, flt.source, RUN_SOURCES),
        ):
            if value is None:
                continue
            values = [value] if isinstance(value, str) else list(value)
            unknown = [v for v in values if v not in allowed]
            if unknown:
                raise ValueError(f"unknown {column.key} {unknown[0]!r}; one of: {', '.join(allowed)}")
            if column is Run.status and narrower and self.dialect == "sqlite":
                conditions.append((Run.status + "").in_(values))
            else:
                conditions.append(column.in_(values))
        if flt.model:
            conditions.append(Run.model == storable(flt.model))
        if flt.fingerprint:
            conditions.append(Run.fingerprint == storable(flt.fingerprint))
        if flt.config_hash:
            # Every config_hash of a run is a snapshot's hash (foreign key): finding the few full hashes
            # with this prefix among the snapshots lets the (config_hash, created_at) index serve.
            prefix = Run.config_hash.in_(
                select(ConfigSnapshot.hash).where(
                    ConfigSnapshot.hash.startswith(flt.config_hash.lower(), autoescape=True)
                )
            )
            conditions.append(prefix)
        if flt.replay_of:
            conditions.append(Run.replay_of == flt.replay_of)
        if flt.user:
            conditions.append(Run.user_name == storable(flt.user))
        if flt.replays is not None:
            conditions.append(Run.replay_of.is_not(None) if flt.replays else Run.replay_of.is_(None))
        if flt.output_kind is not None:
            kinds = [flt.output_kind] if isinstance(flt.output_kind, str) else list(flt.output_kind)
            unknown = [k for k in kinds if k not in OUTPUT_KINDS]
            if unknown:
                raise ValueError(f"unknown output kind {unknown[0]!r}; one of: {', '.join(OUTPUT_KINDS)}")
            # A correlated EXISTS on outputs(run_id): the run's own few outputs are looked at.
            conditions.append(
                select(Output.id).where(Output.run_id == Run.id, Output.kind.in_(kinds)).exists()
            )
        if flt.since is not None:
            conditions.append(Run.created_at >= as_datetime(flt.since))
        if flt.until is not None:
            conditions.append(Run.created_at <= as_datetime(flt.until))
        if flt.search:  # last: the substring test is the costliest per row
            conditions.extend(self._search_condition(connection, flt.search))
        return statement.where(*conditions) if conditions else statement

    @staticmethod
    def _cursor_of(run: RunSummary) -> str:
        return f"{run.created_at.isoformat()}|{run.id}"

    @staticmethod
    def _parse_cursor(cursor: str) -> tuple[datetime, str]:
        stamp, sep, run_id = cursor.rpartition("|")
        parsed = as_datetime(datetime.fromisoformat(stamp)) if sep else None
        if parsed is None or not run_id:
            raise ValueError(f"not a history cursor: {cursor!r}")
        return parsed, run_id

    def list_runs(
        self,
        filter: RunFilter | None = None,
        limit: int = 50,
        offset: int = 0,
        after: str | None = None,
    ) -> list[RunSummary]:
        """Runs matching ``filter``, newest first: ``limit`` of them after the cursor ``after`` (see
        :meth:`list_page`) or, for small histories, from ``offset``."""
        columns = (
            Run.id,
            Run.source,
            Run.status,
            Run.created_at,
            Run.started_at,
            Run.finished_at,
            Run.prompt,
            Run.model,
            Run.seed,
            Run.fingerprint,
            Run.config_hash,
            Run.error,
            Run.replay_of,
            Run.ttfp_seconds,
            Run.audio_seconds,
            Run.realtime_factor,
            Run.user_name.label("owner"),
        )
        with self._read() as session:
            statement = self._filtered(select(*columns), filter, session)
            if after:
                created, run_id = self._parse_cursor(after)
                # Keyset pagination: continue strictly after the last row shown, in the index's order.
                statement = statement.where(tuple_(Run.created_at, Run.id) < tuple_(created, run_id))
            statement = statement.order_by(Run.created_at.desc(), Run.id.desc()).limit(max(0, limit))
            if offset:
                statement = statement.offset(max(0, offset))
            rows = session.execute(statement).all()
            ids = [row.id for row in rows]
            # Per kind (image, audio): how many outputs each run has, and its first one's file.
            counts: dict[tuple[str, str], int] = {}
            firsts: dict[tuple[str, str], str] = {}
            if ids:
                shown = session.execute(
                    select(Output.run_id, Output.kind, Output.index, Output.sha256).where(
                        Output.run_id.in_(ids), Output.kind.in_(("image", "audio"))
                    )
                ).all()
                for run_id, kind, index, sha in shown:
                    counts[run_id, kind] = counts.get((run_id, kind), 0) + 1
                    if index == 0:
                        firsts[run_id, kind] = sha
        return [
            RunSummary(
                **row._asdict(),
                image_count=counts.get((row.id, "image"), 0),
                thumbnail_sha256=firsts.get((row.id, "image")),
                audio_count=counts.get((row.id, "audio"), 0),
                audio_sha256=firsts.get((row.id, "audio")),
            )
            for row in rows
        ]

    def list_page(
        self, filter: RunFilter | None = None, limit: int = 50, cursor: str | None = None
    ) -> RunPage:
        """One page of the history, newest first, and the cursor of the next (``None`` after the last).

        Keyset pagination: each page costs the same however deep it is (OFFSET would read every row
        before it). Runs recorded meanwhile do not shift later pages.
        """
        runs = self.list_runs(filter, limit=limit + 1, after=cursor)
        more = len(runs) > limit
        runs = runs[:limit]
        return RunPage(runs, self._cursor_of(runs[-1]) if more and runs else None)

    def count_runs(self, filter: RunFilter | None = None) -> int:
        """How many runs match ``filter``, exactly (walks every match; the History tab uses
        :meth:`count_matching`)."""
        with self._read() as session:
            return int(session.scalar(self._filtered(select(func.count(Run.id)), filter, session)) or 0)

    def count_matching(self, filter: RunFilter | None = None, cap: int = COUNT_CAP) -> RunCount:
        """How many runs match ``filter``: exact up to ``cap``; beyond it ``RunCount(cap, exact=False)``."""
        with self._read() as session:
            matches = self._filtered(select(Run.id), filter, session).limit(cap + 1).subquery()
            found = int(session.scalar(select(func.count()).select_from(matches)) or 0)
        return RunCount(cap, False) if found > cap else RunCount(found, True)

    def diff_runs(self, a: str, b: str) -> dict[str, dict[str, tuple[Any, Any]]]:
        """What differs between two runs: ``{"run": ..., "parameters": ..., "config": ...}``.

        Each part maps a key to ``(value in a, value in b)``; config keys are flattened
        (``stages.1.default_sampling_params.num_inference_steps``). A key missing on one side shows None.
        """
        run_a, run_b = self.get_run(a), self.get_run(b)
        fields_a = {
            k: getattr(run_a, k)
            for k in ("prompt", "model", "source", "status", "fingerprint", "config_hash")
        }
        fields_b = {k: getattr(run_b, k) for k in fields_a}
        return {
            "run": diff_mappings(fields_a, fields_b),
            "parameters": diff_mappings(run_a.parameters, run_b.parameters),
            "config": diff_mappings(flatten(run_a.config or {}), flatten(run_b.config or {})),
        }

    def output_file(self, sha256: str) -> Path:
        """The path of the stored file with this hash; raises ``FileNotFoundError``."""
        with self._read() as session:
            mime = session.scalar(select(Output.mime).where(Output.sha256 == sha256).limit(1))
        if mime is not None:
            path = self.file_path(sha256, mime)
            if path.exists():
                return path
        found = self.files.find(sha256)
        if found is not None:
            return found
        raise FileNotFoundError(f"no stored output with sha256 {sha256}")

    def runs_with_output(self, sha256: str, kind: str = "image") -> list[str]:
        """Ids of the runs with an output (of ``kind``) whose file has this sha256, newest first.

        Outputs are content-addressed, so a file that came out of the studio unchanged is found here:
        ``omni-studio history show --png`` (studio/recipes/runs.py).
        """
        made = select(Output.run_id).where(Output.sha256 == sha256, Output.kind == kind)
        with self._read() as session:
            query = select(Run.id).where(Run.id.in_(made)).order_by(Run.created_at.desc(), Run.id.desc())
            return list(session.scalars(query))
