"""The History tab's replay action: replay the selected run, or the runs the filters match, on the running
engine, then show the regression report and a before/after slider for each changed image.

The replaying and the report are :mod:`studio.replay.replayer` and :mod:`studio.replay.report`, the same code
``omni-studio replay`` runs; this module only wires them to components (docs/replay.md).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gradio as gr

from studio.controller import Studio
from studio.replay.replayer import Replayer, ReplaySelectionError, ReplayTarget, select_runs
from studio.replay.report import PARAMETER_MODES, ReplayReport, write_report

UI_REPLAY_LIMIT = 20  # runs per replay from the UI; `omni-studio replay` takes any number
SELECTED, FILTERED = "the selected run", "the runs matching the filters"


def build_replay_section(
    studio: Studio,
    run_id: gr.Textbox,
    filters: Sequence[gr.components.Component],
    run_filter: Callable[..., Any],
) -> None:
    """The replay controls, report, slider and report files; ``run_filter`` turns the History filter
    values into a ``RunFilter``."""
    store = studio.store
    gr.Markdown(
        "### Replay (regression check)\n"
        "Re-run with the exact recorded parameters and seed on the running engine, then compare the "
        "outputs: identical bytes, or the pixel difference and PSNR. Apply another deploy config or model "
        "first (Pipeline, Chat) to check what it changes.",
        elem_id="omni-h-replay-intro",
    )
    with gr.Row():
        scope = gr.Radio([SELECTED, FILTERED], value=SELECTED, label="Replay", elem_id="omni-h-replay-scope")
        parameters = gr.Radio(
            list(PARAMETER_MODES),
            value="recorded",
            label="Parameters",
            info="recorded: as the run had them; config: this config's defaults where the run used its "
            "config's defaults",
            elem_id="omni-h-replay-params",
        )
        start = gr.Button("Replay", variant="primary", elem_id="omni-h-replay")
    with gr.Row(equal_height=False):
        with gr.Column(scale=2):
            pair = gr.Dropdown([], label="Changed image", visible=False, elem_id="omni-h-replay-pair")
            slider = gr.ImageSlider(
                label="Before (original) / after (replay)",
                type="filepath",
                format="png",  # exact pixels: the default webp would re-encode them lossily
                interactive=False,
                visible=False,
                max_height=320,
                elem_id="omni-h-replay-slider",
            )
        with gr.Column(scale=1):
            files = gr.File(
                label="Report (Markdown, JSON)",
                file_count="multiple",
                interactive=False,
                visible=False,
                elem_id="omni-h-replay-files",
            )
    report_md = gr.Markdown("", elem_id="omni-h-replay-report")
    pairs_state = gr.State({})

    async def do_replay(run_id_v: str, scope_v: str, parameters_v: str, *filter_values: Any):
        if store is None or studio.recorder is None:
            raise gr.Error("Replay needs the run store, which this process does not have.")
        try:
            if scope_v == FILTERED:
                selection = select_runs(store, run_filter(*filter_values), limit=UI_REPLAY_LIMIT)
            else:
                chosen = (run_id_v or "").strip()
                if not chosen:
                    raise gr.Error("Pick a run first (click a row), or replay the runs matching the filters.")
                selection = select_runs(store, ids=[chosen])
        except ReplaySelectionError as exc:
            raise gr.Error(str(exc)) from None
        if not selection.runs:
            raise gr.Error(f"No runs to replay: {selection.description}.")
        description = selection.description
        if selection.matched > len(selection.runs):
            description += f"; the studio replays at most {UI_REPLAY_LIMIT} (`omni-studio replay` takes more)"
        engine = studio.engine
        target = ReplayTarget(engine, studio.serving.served_model_name, studio.system_fingerprint)
        report = ReplayReport(
            f"the running engine: {target.model_name}, config {engine.config.hash8}",
            parameters_v,
            selection=description,
        )
        replayer = Replayer(studio.runs, studio.recorder, parameters_v)
        hidden = gr.update(visible=False)
        for index, original in enumerate(selection.runs):
            yield (
                f"Replaying {index + 1} of {len(selection.runs)} ({report.summary.text}) — {description}",
                hidden,
                hidden,
                hidden,
                {},
            )
            report.entries.append(await replayer.replay(original, target))
        folder = Path(tempfile.mkdtemp(prefix="omni-replay-"))
        paths = [str(write_report(report, folder / f"replay-report{suffix}")) for suffix in (".md", ".json")]
        pairs = {label: (before, after) for label, before, after in report.pairs}
        first = next(iter(pairs), None)
        yield (
            report.to_markdown(),
            gr.update(choices=list(pairs), value=first, visible=bool(pairs)),
            gr.update(value=pairs[first] if first else None, visible=bool(pairs)),
            gr.update(value=paths, visible=True),
            pairs,
        )

    start.click(
        do_replay,
        [run_id, scope, parameters, *filters],
        [report_md, pair, slider, files, pairs_state],
        api_name="replay",
        concurrency_id="generate",
    )

    def show_pair(label: str | None, pairs: dict[str, tuple[str, str]]):
        return gr.update(value=pairs.get(label)) if label in pairs else gr.skip()

    pair.change(show_pair, [pair, pairs_state], [slider], api_visibility="private")
