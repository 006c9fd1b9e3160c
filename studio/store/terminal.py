"""Plain-text views of recorded runs for ``omni-studio history`` (a table of runs, one run in full)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from studio.store.records import OutputRecord, RunDetail, RunSummary

SHORT_ID = 12  # ids are shown shortened; `history show` takes any unique prefix


def local_time(value: datetime | None) -> str:
    """A stored (UTC) timestamp in this machine's time zone, to the second."""
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def seconds(value: float | None) -> str:
    return f"{value:.2f}s" if value is not None else "-"


def one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def size(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    if num_bytes < 1024**2:
        return f"{num_bytes / 1024:.1f} KB"
    return f"{num_bytes / 1024**2:.1f} MB"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(widths[i]) if i < len(headers) - 1 else cell for i, cell in enumerate(row))
        for row in cells
    ]
    return "\n".join(line.rstrip() for line in lines)


def ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


AUDIO_HEADERS = ("AUDIO", "TTFP", "RTF")  # a spoken run's length, time to first audio, real-time factor


def audio_cells(run: RunSummary) -> tuple[str, str, str]:
    """A run's AUDIO, TTFP and RTF cells (``-`` for a run that did not speak; TTFP to the millisecond)."""
    ttfp = f"{run.ttfp_seconds:.3f}s" if run.ttfp_seconds is not None else "-"
    return seconds(run.audio_seconds), ttfp, ratio(run.realtime_factor)


def format_run_table(runs: Sequence[RunSummary], total: int) -> str:
    """The history list: newest first, one line per run, and how many of how many are shown.

    When a listed run asked for audio, the AUDIO (seconds made), TTFP and RTF columns come before the
    prompt (docs/speech.md "Runs, files and the CLI"); a list of image and text runs has none.
    """
    if not runs:
        return "no runs recorded yet" if total == 0 else f"no runs on this page ({total} match)"
    spoken = any(r.audio_seconds is not None for r in runs)
    owned = any(r.owner for r in runs)  # a studio with accounts (docs/team.md): whose run it is
    rows = [
        (
            r.id[:SHORT_ID],
            local_time(r.created_at),
            r.source,
            *((r.owner or "-",) if owned else ()),
            r.status,
            r.model,
            seconds(r.seconds),
            r.image_count,
            *(audio_cells(r) if spoken else ()),
            one_line(r.prompt, 60),
        )
        for r in runs
    ]
    headers = ("ID", "CREATED", "SOURCE", *(("OWNER",) if owned else ()), "STATUS", "MODEL", "TIME", "IMAGES")
    body = table((*headers, *(AUDIO_HEADERS if spoken else ()), "PROMPT"), rows)
    return f"{body}\n{len(runs)} of {total} run{'s' if total != 1 else ''}"


def output_shape(output: OutputRecord) -> str:
    """An output's size as a person reads it: ``64x64`` for a picture, ``1.20s 24kHz`` for audio."""
    if output.width:
        return f"{output.width}x{output.height}"
    if output.duration_seconds is not None:
        rate = f" {output.sample_rate / 1000:g}kHz" if output.sample_rate else ""
        return f"{output.duration_seconds:.2f}s{rate}"
    return "-"


def audio_figures(run: RunDetail) -> str:
    """A spoken run's figures (docs/speech.md): audio seconds, time to first audio, real-time factor."""
    parts = [f"{run.audio_seconds:.2f}s made" if run.audio_seconds is not None else "none made"]
    if run.ttfp_seconds is not None:
        parts.append(f"first audio after {run.ttfp_seconds:.3f}s (TTFP)")
    if run.realtime_factor is not None:
        parts.append(f"real-time factor {run.realtime_factor:.3f}")
    return ", ".join(parts)


def format_run_detail(run: RunDetail) -> str:
    """One run in full: fields, parameters, per-stage timings, outputs, error and text."""
    config = "-"
    if run.config_hash:
        family = (run.config or {}).get("family", "")
        config = f"{run.config_hash[:8]} ({family})" if family else run.config_hash[:8]
    tokens = "-" if run.input_tokens is None else f"{run.input_tokens} in, {run.output_tokens} out"
    fields = [
        ("status", run.status),
        ("source", run.source),
        ("model", run.model),
        ("created", local_time(run.created_at)),
        ("started", local_time(run.started_at)),
        ("finished", local_time(run.finished_at)),
        ("duration", seconds(run.seconds)),
        ("prompt", run.prompt),
        ("seed", run.seed if run.seed is not None else "-"),
        ("fingerprint", run.fingerprint or "-"),
        ("config", config),
        ("tokens", tokens),
    ]
    if run.audio_seconds is not None:
        fields.append(("audio", audio_figures(run)))
    if run.replay_of:
        fields.append(("replay of", run.replay_of))
    if run.error:
        fields.append(("error", run.error))
    width = max(len(name) for name, _ in fields)
    lines = [f"run {run.id}"]
    lines += [f"  {name.ljust(width)}  {value}" for name, value in fields]
    if run.parameters:
        lines.append("parameters")
        pwidth = max(len(k) for k in run.parameters)
        lines += [f"  {k.ljust(pwidth)}  {json.dumps(v)}" for k, v in sorted(run.parameters.items())]
    if run.stages:
        lines.append("stages")
        rows = [
            (
                s.variant_index,
                s.stage_id,
                s.kind,
                s.status,
                seconds(s.queue_seconds),
                seconds(s.seconds),
                s.input_tokens,
                s.output_tokens,
                s.batch_size,
            )
            for s in run.stages
        ]
        body = table(
            ("VARIANT", "STAGE", "KIND", "STATUS", "QUEUED", "TIME", "TOKENS IN", "TOKENS OUT", "BATCH"), rows
        )
        lines += ["  " + line for line in body.splitlines()]
    if run.outputs:
        lines.append("outputs")
        output_rows: list[tuple[Any, ...]] = [
            (
                o.kind,
                o.index,
                output_shape(o),
                size(o.size_bytes),
                o.sha256[:12],
                o.path,
            )
            for o in run.outputs
        ]
        lines += [
            "  " + line
            for line in table(
                ("KIND", "#", "SIZE/LENGTH", "BYTES", "SHA256", "FILE"), output_rows
            ).splitlines()
        ]
    if run.text:
        lines.append("text")
        lines += ["  " + line for line in run.text.splitlines()]
    return "\n".join(lines)


def prune_history(store: Any, args: Any) -> str:
    """``history prune``: delete the finished runs the flags select, then orphaned files; what was done.

    ``args`` has ``older_than`` (days), ``status``, ``search``, ``model``, ``all``, ``dry_run``, ``vacuum``.
    Raises ``ValueError`` when nothing selects the runs (no filter and no ``--all``).
    """
    from studio.store.records import RunFilter

    selection = RunFilter(search=args.search, status=args.status, model=args.model)
    if args.older_than is None and selection == RunFilter() and not args.all:
        raise ValueError("history prune deletes runs: give a filter (--older-than, --status, ...) or --all")
    if args.dry_run:
        count = store.delete_runs(selection, older_than_days=args.older_than, dry_run=True)
        return f"would delete {count} run{'s' if count != 1 else ''} (dry run: nothing deleted)"
    deleted = store.delete_runs(selection, older_than_days=args.older_than)
    files, freed = store.prune_files()
    lines = [f"deleted {deleted} run{'s' if deleted != 1 else ''}"]
    if files:
        lines.append(f"removed {files} orphaned output file{'s' if files != 1 else ''} ({size(freed)})")
    store.maintain(vacuum=args.vacuum)
    if args.vacuum:
        bytes_now = store.database_bytes()
        lines.append("vacuumed" + (f": the database is now {size(bytes_now)}" if bytes_now else ""))
    return "; ".join(lines)
