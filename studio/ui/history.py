"""The History tab: every run from the UI, the API and the CLI — search and filters (the prompt, status,
model, the kind of output: "audio" keeps the runs that spoke), the runs list with a spoken run's audio
seconds, TTFP and real-time factor and a player per spoken run (studio/ui/history_audio.py), a gallery,
run detail with per-stage timings (a spoken run's audio: a player and a waveform per output), Re-run with
the exact parameters, Compare two runs (studio/ui/compare.py), export/import (bundles carry the images
and the audio), delete, and Replay with a regression report (studio/ui/replay.py)."""

from __future__ import annotations

import contextlib
import html
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd
import yaml

from engine.events import RunFailed, RunFinished
from studio.accounts.identity import Identity
from studio.controller import Studio
from studio.media.images import png_bytes
from studio.store.errors import RunNotFound
from studio.ui.compare import build_compare_section
from studio.ui.history_audio import (
    OUTPUT_KINDS,
    audio_cells,
    audio_items,
    list_players,
    render_detail_audio,
    render_list_players,
)
from studio.ui.replay import build_replay_section

PAGE_SIZE = 50
COLUMNS = [
    "id",
    "created",
    "source",
    "status",
    "model",
    "prompt",
    "seconds",
    "audio s",  # a spoken run's figures (docs/speech.md "Runs, files and the CLI"); empty otherwise
    "TTFP s",
    "RTF",
    "seed",
    "fingerprint",
    "config",
]
STATUSES = ["any", "queued", "running", "succeeded", "failed", "cancelled", "interrupted"]


def _date(value: str, end: bool = False) -> datetime | None:
    value = (value or "").strip()
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise gr.Error(f"Dates are YYYY-MM-DD (or an ISO time), got {value!r}") from None
    if end and len(value) == 10:
        parsed = parsed.replace(hour=23, minute=59, second=59)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def run_filter(search, status, model, fingerprint, config_hash, since, until, output="any"):
    from studio.store import RunFilter

    if output not in (None, "", *OUTPUT_KINDS):
        raise gr.Error(f"Output: one of {', '.join(OUTPUT_KINDS)}, got {output!r}")
    return RunFilter(
        output_kind=None if output in (None, "", "any") else output,
        search=search or None,
        status=None if status in (None, "", "any") else status,
        model=None if model in (None, "", "any") else model,
        fingerprint=fingerprint or None,
        config_hash=config_hash or None,
        since=_date(since),
        until=_date(until, end=True),
    )


def rows_of(runs: list[Any]) -> pd.DataFrame:
    """The History table; with an ``owner`` column when any listed run belongs to an account (docs/team.md)."""
    table = pd.DataFrame(
        [
            [
                r.id[:12],
                r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                r.source,
                r.status,
                r.model,
                (r.prompt[:60] + "…") if len(r.prompt) > 60 else r.prompt,
                None if r.seconds is None else round(r.seconds, 2),
                *audio_cells(r),
                r.seed,
                r.fingerprint or "",
                (r.config_hash or "")[:8],
            ]
            for r in runs
        ],
        columns=COLUMNS,
    )
    if any(getattr(r, "owner", None) for r in runs):
        table.insert(3, "owner", [r.owner or "-" for r in runs])
    return table


def timings_chart(detail: Any) -> str:
    """Per-stage time as a horizontal bar chart (queue wait, then run time), one bar per stage and variant."""
    stages = list(detail.stages)
    if not stages:
        return "<div class='omni-chart'><i>No stage timings recorded.</i></div>"
    longest = max((s.queue_seconds or 0) + (s.seconds or 0) for s in stages) or 1.0
    rows = []
    for s in stages:
        label = f"stage {s.stage_id} · {s.kind}" + (f" · #{s.variant_index}" if s.variant_index else "")
        queue = 100 * (s.queue_seconds or 0) / longest
        run = 100 * (s.seconds or 0) / longest
        rows.append(
            f"<div class='omni-chart-row' data-stage='{s.stage_id}'><span class='omni-chart-label'>{label}</span>"
            f"<span class='omni-chart-track'><span class='omni-chart-queue' style='width:{queue:.1f}%'></span>"
            f"<span class='omni-chart-bar {s.status}' style='width:{run:.1f}%'></span></span>"
            f"<span class='omni-chart-value'>{(s.seconds or 0):.3f} s"
            + (f" (+{s.queue_seconds:.3f} s queued)" if (s.queue_seconds or 0) >= 0.001 else "")
            + (f" · {s.output_tokens} tokens" if s.output_tokens else "")
            + "</span></div>"
        )
    return (
        "<div class='omni-chart'><div class='omni-chart-title'>Per-stage time</div>"
        + "".join(rows)
        + "</div>"
    )


def detail_markdown(detail: Any) -> str:
    seconds = f"{detail.seconds:.2f} s" if detail.seconds is not None else "—"
    lines = [
        f"### Run `{detail.id}`",
        f"**{detail.status}** · {detail.source} · {detail.model} · {detail.created_at:%Y-%m-%d %H:%M:%S} UTC · "
        f"{seconds}",
        f"**Prompt:** {html.escape(detail.prompt)}",
        f"**Seed** {detail.seed} · **fingerprint** `{detail.fingerprint or 'none'}` · **config** "
        f"`{(detail.config_hash or '')[:8]}`",
    ]
    if detail.replay_of:
        lines.append(f"**Replay of** `{detail.replay_of}`")
    if detail.text:
        lines.append(f"**Text output:** {html.escape(detail.text[:2000])}")
    if detail.audio_seconds is not None:  # a run that spoke (docs/speech.md "Runs, files and the CLI")
        figures = [f"**Audio** {detail.audio_seconds:.2f} s"]
        if detail.ttfp_seconds is not None:
            figures.append(f"**TTFP** {detail.ttfp_seconds:.3f} s")
        if detail.realtime_factor is not None:
            figures.append(f"**RTF** {detail.realtime_factor:.2f}")
        lines.append(" · ".join(figures))
    if detail.error:
        lines.append(f"<div class='omni-invalid'><b>Error:</b> {html.escape(detail.error)}</div>")
    return "\n\n".join(lines)


def build_history_tab(studio: Studio) -> dict[str, Any]:
    store = studio.store
    if store is None:
        gr.Markdown("The run store is not available in this process.")
        return {}
    with gr.Row():
        search = gr.Textbox(label="Prompt contains", scale=3, elem_id="omni-h-search")
        status = gr.Dropdown(STATUSES, value="any", label="Status", scale=1)
        model = gr.Dropdown(["any"], value="any", label="Model", allow_custom_value=True, scale=1)
        output = gr.Dropdown(
            OUTPUT_KINDS,
            value="any",
            label="Output",
            info="audio: the runs that spoke",
            scale=1,
            elem_id="omni-h-output",
        )
    with gr.Row():
        fingerprint = gr.Textbox(label="Fingerprint", scale=2)
        config_hash = gr.Textbox(label="Config hash (prefix)", scale=1)
        since = gr.Textbox(label="From (YYYY-MM-DD)", scale=1)
        until = gr.Textbox(label="To (YYYY-MM-DD)", scale=1)
        find = gr.Button("Search", variant="primary", scale=1, elem_id="omni-h-find")
    count = gr.Markdown("", elem_id="omni-h-count")
    table = gr.Dataframe(rows_of([]), interactive=False, wrap=True, max_height=320, elem_id="omni-h-table")
    more = gr.Button("Load more", visible=False, size="sm", elem_id="omni-h-more")
    players_state = gr.State([])

    @gr.render(inputs=[players_state])
    def list_audio(items: list[dict[str, Any]]) -> None:
        render_list_players(items)

    gallery = gr.Gallery(
        label="Images of these runs",
        columns=10,
        height=130,
        allow_preview=False,
        object_fit="contain",
        elem_id="omni-h-gallery",
    )
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            run_id = gr.Textbox(label="Run id (click a row)", elem_id="omni-h-run-id")
            detail = gr.Markdown("", elem_id="omni-h-detail")
            timings = gr.HTML("", elem_id="omni-h-timings")
            outputs = gr.Gallery(label="Outputs", columns=4, height=220, elem_id="omni-h-outputs")
            audio_state = gr.State([])

            @gr.render(inputs=[audio_state])
            def audio_players(items: list[dict[str, Any]]) -> None:
                render_detail_audio(items)

            with gr.Accordion("Request, parameters and config snapshot", open=False):
                request_json = gr.JSON(label="Request as received")
                parameters_json = gr.JSON(label="Resolved parameters")
                config_yaml = gr.Code(language="yaml", label="Pipeline config snapshot", interactive=False)
            with gr.Row():
                rerun = gr.Button("Re-run (exact parameters)", variant="primary", elem_id="omni-h-rerun")
                set_a = gr.Button("Compare as A")
                set_b = gr.Button("Compare as B")
                delete = gr.Button("Delete run", variant="stop")
            rerun_result = gr.Markdown("", elem_id="omni-h-rerun-result")
            rerun_image = gr.Image(label="Re-run output", type="filepath", interactive=False, height=200)
        with gr.Column(scale=2):
            run_a, run_b = build_compare_section(store, studio.identity)
            gr.Markdown("### Export / import")
            export = gr.Button("Export these runs", elem_id="omni-h-export")
            export_file = gr.File(
                label="Bundle (runs, images and audio)", interactive=False, elem_id="omni-h-bundle"
            )
            import_file = gr.File(
                label="Import a bundle", file_types=[".zip"], type="filepath", elem_id="omni-h-import"
            )
            import_status = gr.Markdown("", elem_id="omni-h-import-status")

    # The Output filter comes last: the API's history endpoints keep their first seven inputs.
    filters = [search, status, model, fingerprint, config_hash, since, until, output]
    build_replay_section(studio, run_id, filters, run_filter)  # full width, below run detail and compare
    ids_state = gr.State([])
    # What "Load more" continues: the filter as searched, the runs and thumbnails shown, the keyset cursor.
    page_state = gr.State(None)

    def thumbnails(runs: list[Any]) -> list[tuple[str, str]]:
        images = []
        for r in runs:
            if r.thumbnail_sha256:
                with contextlib.suppress(FileNotFoundError):  # a file removed by retention meanwhile
                    images.append(
                        (str(store.output_file(r.thumbnail_sha256)), f"{r.id[:8]} · {r.prompt[:30]}")
                    )
        return images

    def count_text(total: Any, shown: int) -> str:
        if total.exact:
            return f"{total.value:,} run(s) match; showing {shown:,}."
        return (
            f"{total.text} runs match (counted up to {total.value:,}; narrow the filters for an exact "
            f"count); showing {shown:,}."
        )

    def account_of(identity: Identity) -> str | None:
        return identity.name if identity.accounts else None  # no accounts: runs belong to no one

    def visitor(request: gr.Request | None) -> Identity:
        return studio.identity(getattr(request, "username", None))

    def visible_run(run_id_v: str, request: gr.Request | None) -> str:
        """The full id of a run this visitor may see (another user's: as if there were none, docs/team.md)."""
        full = store.resolve_run_id((run_id_v or "").strip())
        identity = visitor(request)
        if not identity.sees_all and store.get_run(full).owner != identity.name:
            raise RunNotFound(f"no run with id {run_id_v.strip()!r}")
        return full

    def do_search(
        search_v, status_v, model_v, fingerprint_v, config_v, since_v, until_v, output_v, request: gr.Request
    ):
        flt = run_filter(search_v, status_v, model_v, fingerprint_v, config_v, since_v, until_v, output_v)
        flt = replace(flt, user=visitor(request).run_user)  # a user sees their own runs only
        page = store.list_page(flt, limit=PAGE_SIZE)
        total = store.count_matching(flt)
        runs, images = page.runs, thumbnails(page.runs)
        models = sorted({"any", studio.serving.served_model_name, *(r.model for r in runs)})
        return (
            rows_of(runs),
            images,
            count_text(total, len(runs)),
            [r.id for r in runs],
            gr.update(choices=models),
            {"filter": flt, "runs": runs, "images": images, "cursor": page.next_cursor, "total": total},
            gr.update(visible=page.next_cursor is not None),
            list_players(store, runs),
        )

    def load_more(state: dict[str, Any] | None):
        if not state or not state.get("cursor"):
            return [gr.skip()] * 7
        page = store.list_page(state["filter"], limit=PAGE_SIZE, cursor=state["cursor"])
        runs = [*state["runs"], *page.runs]
        images = [*state["images"], *thumbnails(page.runs)]
        state = {**state, "runs": runs, "images": images, "cursor": page.next_cursor}
        return (
            rows_of(runs),
            images,
            count_text(state["total"], len(runs)),
            [r.id for r in runs],
            state,
            gr.update(visible=page.next_cursor is not None),
            list_players(store, runs),
        )

    search_outputs = [table, gallery, count, ids_state, model, page_state, more, players_state]
    more.click(
        load_more,
        [page_state],
        [table, gallery, count, ids_state, page_state, more, players_state],
        api_name="history_more",
    )
    find.click(do_search, filters, search_outputs, api_name="history_search")
    search.submit(do_search, filters, search_outputs, api_visibility="private")
    output.change(do_search, filters, search_outputs, api_visibility="private")

    def show(run_id_v: str, request: gr.Request):
        run_id_v = (run_id_v or "").strip()
        if not run_id_v:
            return [gr.skip()] * 8
        try:
            full = visible_run(run_id_v, request)
            d = store.get_run(full)
        except LookupError as exc:
            return [str(exc), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), []]
        images = [(str(o.path), f"{o.kind} {o.index}") for o in d.outputs if o.mime.startswith("image/")]
        return (
            detail_markdown(d),
            timings_chart(d),
            images,
            d.request,
            d.parameters,
            yaml.safe_dump(d.config or {}, sort_keys=False),
            full,
            audio_items(d),
        )

    detail_outputs = [
        detail,
        timings,
        outputs,
        request_json,
        parameters_json,
        config_yaml,
        run_id,
        audio_state,
    ]
    run_id.submit(show, [run_id], detail_outputs, api_name="run_detail")

    def on_select(ids: list[str], evt: gr.SelectData):
        row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        return ids[row] if 0 <= row < len(ids) else gr.skip()

    table.select(on_select, [ids_state], [run_id], api_visibility="private").then(
        show, [run_id], detail_outputs, api_visibility="private"
    )

    async def do_rerun(run_id_v: str, request: gr.Request):
        run_id_v = (run_id_v or "").strip()
        if not run_id_v:
            yield "Pick a run first.", None
            return
        try:
            full = visible_run(run_id_v, request)
        except LookupError as exc:
            yield str(exc), None
            return
        engine_request, original = studio.request_from_run(full)
        resolved = studio.resolve(engine_request)
        yield f"Re-running `{full[:12]}` with seed {resolved.seed}…", None
        runs = studio.run(
            resolved,
            {"rerun_of": full, "parameters": original.parameters},
            session=request.session_hash,
            user=account_of(visitor(request)),
        )
        async for rid, event in runs:
            if isinstance(event, RunFinished):
                new_hashes = []
                path = None
                for image in event.images:
                    import hashlib

                    data = png_bytes(image)
                    new_hashes.append(hashlib.sha256(data).hexdigest())
                    target = Path(tempfile.mkdtemp()) / "rerun.png"
                    target.write_bytes(data)
                    path = str(target)
                old_hashes = [o.sha256 for o in original.images]
                if old_hashes:
                    same = (
                        "identical bytes ✓"
                        if new_hashes == old_hashes
                        else "different bytes ✗ (config changed?)"
                    )
                else:
                    same = "the original had no image to compare"
                yield f"Re-run `{rid[:12]}` finished: {same}.", path
            elif isinstance(event, RunFailed):
                yield f"Re-run failed: {event.message}", None

    rerun.click(do_rerun, [run_id], [rerun_result, rerun_image], api_name="rerun", concurrency_id="generate")

    set_a.click(lambda r: r, [run_id], [run_a], api_visibility="private")
    set_b.click(lambda r: r, [run_id], [run_b], api_visibility="private")

    def do_delete(
        run_id_v, search_v, status_v, model_v, fp_v, config_v, since_v, until_v, output_v, request: gr.Request
    ):
        full = visible_run(run_id_v, request)
        store.delete_run(full)
        found = do_search(search_v, status_v, model_v, fp_v, config_v, since_v, until_v, output_v, request)
        return (f"Deleted run `{full[:12]}`.", "", [], *found)

    delete.click(
        do_delete, [run_id, *filters], [detail, run_id, audio_state, *search_outputs], api_name="delete_run"
    )

    def do_export(
        search_v, status_v, model_v, fp_v, config_v, since_v, until_v, output_v, request: gr.Request
    ):
        from studio.store import export_bundle

        target = Path(tempfile.mkdtemp()) / f"omni-studio-history-{time.strftime('%Y%m%d-%H%M%S')}.zip"
        flt = run_filter(search_v, status_v, model_v, fp_v, config_v, since_v, until_v, output_v)
        export_bundle(store, target, replace(flt, user=visitor(request).run_user))
        return str(target)

    export.click(do_export, filters, [export_file], api_name="export_history")

    def do_import(
        path, search_v, status_v, model_v, fp_v, config_v, since_v, until_v, output_v, request: gr.Request
    ):
        if not path:
            return gr.skip(), *[gr.skip()] * len(search_outputs)
        if not visitor(request).sees_all:  # a bundle's runs name their accounts: only an admin brings them in
            return "Only an admin may import runs in a studio with accounts.", *[gr.skip()] * len(
                search_outputs
            )
        from studio.store import import_bundle

        result = import_bundle(store, path)
        return (
            f"Imported {result.imported} run(s); {result.skipped} already present.",
            *do_search(search_v, status_v, model_v, fp_v, config_v, since_v, until_v, output_v, request),
        )

    import_file.upload(
        do_import, [import_file, *filters], [import_status, *search_outputs], api_name="import_history"
    )

    def refresh(request: gr.Request):
        return do_search("", "any", "any", "", "", "", "", "any", request)

    return {"refresh": refresh, "refresh_outputs": search_outputs}
