"""The History tab's replay action: replay the selected run, or the runs the filters match, on the running
engine, then show the regression report, a before/after slider for each changed image and, for each
spoken output, the original's and the replay's players with their waveforms and figures (each length, the
largest sample difference, SNR in dB: studio/media/audio_compare.py, as History's Compare shows them).

The replaying and the report are :mod:`studio.replay.replayer` and :mod:`studio.replay.report`, the same code
``omni-studio replay`` runs; this module only wires them to components (docs/replay.md).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import gradio as gr

from studio.accounts.identity import act_as, stop_acting
from studio.controller import Studio
from studio.replay.replayer import Replayer, ReplaySelectionError, ReplayTarget, select_runs
from studio.replay.report import PARAMETER_MODES, ReplayReport, write_report
from studio.ui.history_audio import WAVEFORM_SIZE, waveform_file

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
        "outputs: identical bytes, or the pixel difference and PSNR (audio: each length, the max sample "
        "difference and SNR, with both to play). Apply another deploy config or model first (Pipeline, "
        "Chat) to check what it changes.",
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
    with gr.Group(visible=False, elem_id="omni-h-replay-audio") as audio_group:
        audio_pick = gr.Dropdown([], label="Spoken output", elem_id="omni-h-replay-audio-pick")
        audio_figures = gr.Markdown("", elem_id="omni-h-replay-audio-figures")
        with gr.Row(equal_height=False):
            with gr.Column():
                before_audio = gr.Audio(
                    label="Before (original)", interactive=False, elem_id="omni-h-replay-before"
                )
                before_wave = gr.Image(
                    label="Before · waveform",
                    type="filepath",
                    interactive=False,
                    height=WAVEFORM_SIZE[1] + 40,
                )
            with gr.Column():
                after_audio = gr.Audio(
                    label="After (replay)", interactive=False, elem_id="omni-h-replay-after"
                )
                after_wave = gr.Image(
                    label="After · waveform", type="filepath", interactive=False, height=WAVEFORM_SIZE[1] + 40
                )
    report_md = gr.Markdown("", elem_id="omni-h-replay-report")
    pairs_state = gr.State({})
    audio_state = gr.State({})

    async def do_replay(
        run_id_v: str,
        scope_v: str,
        parameters_v: str,
        search_v: Any,
        status_v: Any,
        model_v: Any,
        fingerprint_v: Any,
        config_v: Any,
        since_v: Any,
        until_v: Any,
        output_v: Any,
        request: gr.Request,
    ):
        if store is None or studio.recorder is None:
            raise gr.Error("Replay needs the run store, which this process does not have.")
        filter_values = (search_v, status_v, model_v, fingerprint_v, config_v, since_v, until_v, output_v)
        identity = studio.identity(getattr(request, "username", None))
        try:
            if scope_v == FILTERED:
                # A user replays their own runs only (docs/team.md).
                chosen_filter = replace(run_filter(*filter_values), user=identity.run_user)
                selection = select_runs(store, chosen_filter, limit=UI_REPLAY_LIMIT)
            else:
                chosen = (run_id_v or "").strip()
                if not chosen:
                    raise gr.Error("Pick a run first (click a row), or replay the runs matching the filters.")
                selection = select_runs(store, ids=[chosen])
                if not all(identity.may_see(run.owner) for run in selection.runs):
                    raise gr.Error(f"no run with id {chosen!r}")
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
                {},
            )
            # The replay is the visitor's run: the run path records it as theirs (set and reset within this
            # step of the generator, so no other event's context keeps it).
            acting = act_as(identity if identity.accounts else None)
            try:
                report.entries.append(await replayer.replay(original, target))
            finally:
                stop_acting(acting)
        folder = Path(tempfile.mkdtemp(prefix="omni-replay-"))
        paths = [str(write_report(report, folder / f"replay-report{suffix}")) for suffix in (".md", ".json")]
        pairs = {label: (before, after) for label, before, after in report.pairs}
        first = next(iter(pairs), None)
        sounds = {label: audio_view(output) for label, output in report.audio_pairs}
        yield (
            report.to_markdown(),
            gr.update(choices=list(pairs), value=first, visible=bool(pairs)),
            gr.update(value=pairs[first] if first else None, visible=bool(pairs)),
            gr.update(value=paths, visible=True),
            pairs,
            sounds,
        )

    def audio_view(output: Any) -> dict[str, Any]:
        """What the before/after players show of one compared audio output."""
        from studio.store.records import OutputRecord

        def picture(path: str, sha256: str | None) -> str | None:
            if not sha256:
                return None
            record = OutputRecord(0, "audio", sha256, "audio/wav", None, None, 0, Path(path))
            try:
                return waveform_file(record)
            except OSError:  # a file removed by retention meanwhile
                return None

        verdict = "**identical samples**" if output.identical else "**changed**"
        return {
            "figures": f"{verdict} · {output.audio_summary()}",
            "before": output.before_path,
            "after": output.after_path,
            "before_wave": picture(output.before_path, output.before_sha256),
            "after_wave": picture(output.after_path, output.after_sha256),
        }

    audio_outputs = [audio_figures, before_audio, before_wave, after_audio, after_wave]

    def show_audio(label: str | None, sounds: dict[str, dict[str, Any]]):
        view = sounds.get(label or "")
        if view is None:
            return [gr.skip()] * len(audio_outputs)
        return view["figures"], view["before"], view["before_wave"], view["after"], view["after_wave"]

    def show_sounds(sounds: dict[str, dict[str, Any]]):
        first = next(iter(sounds), None)
        return gr.update(visible=bool(sounds)), gr.update(choices=list(sounds), value=first)

    # The API's /replay keeps its outputs; the spoken outputs' players follow as a private step.
    start.click(
        do_replay,
        [run_id, scope, parameters, *filters],
        [report_md, pair, slider, files, pairs_state, audio_state],
        api_name="replay",
        concurrency_id="generate",
    ).success(show_sounds, [audio_state], [audio_group, audio_pick], api_visibility="private")
    audio_pick.change(show_audio, [audio_pick, audio_state], audio_outputs, api_visibility="private")

    def show_pair(label: str | None, pairs: dict[str, tuple[str, str]]):
        return gr.update(value=pairs.get(label)) if label in pairs else gr.skip()

    pair.change(show_pair, [pair, pairs_state], [slider], api_visibility="private")
