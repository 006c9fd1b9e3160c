"""The History tab's Compare: what differs between two runs (request, parameters, config snapshot), their
first images side by side, and for spoken runs both players, both waveform pictures and the audio
figures: each one's length, the largest sample difference and the SNR of B against A in dB
(studio/media/audio_compare.py, the figures Replay reports too; docs/speech.md "In the studio")."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from typing import Any

import gradio as gr
import pandas as pd

from studio.accounts.identity import Identity
from studio.media.audio_compare import AudioDifference, file_difference, format_max, format_snr
from studio.ui.history_audio import WAVEFORM_SIZE, waveform_file

DIFF_COLUMNS = ["part", "key", "A", "B"]


def audio_figures_html(a: Any, b: Any, difference: AudioDifference | None) -> str:
    """The audio figures of A and B as a small table; its element carries them as data attributes."""
    if a is None and b is None:
        return ""
    if a is None or b is None:
        missing = "A" if a is None else "B"
        return f"<div id='omni-h-audio-diff' data-compared='false'><i>Run {missing} has no audio.</i></div>"
    assert difference is not None
    verdict = "identical samples" if difference.identical else "different samples"
    rows = [
        ("Length A", f"{difference.before_seconds:.3f} s", "seconds-a", f"{difference.before_seconds:.6f}"),
        ("Length B", f"{difference.after_seconds:.3f} s", "seconds-b", f"{difference.after_seconds:.6f}"),
        ("Max sample difference", format_max(difference.max_abs), "max", str(difference.max_abs)),
        ("SNR (B against A)", f"{format_snr(difference.snr_db)} dB", "snr", format_snr(difference.snr_db)),
    ]
    attributes = " ".join(f"data-{key}='{html.escape(value)}'" for _, _, key, value in rows)
    cells = "".join(f"<tr><th>{label}</th><td>{html.escape(text)}</td></tr>" for label, text, _, _ in rows)
    note = f"<div class='omni-h-audio-note'>{html.escape(difference.note)}</div>" if difference.note else ""
    return (
        f"<div id='omni-h-audio-diff' data-compared='true' data-identical='{str(difference.identical).lower()}' "
        f"{attributes}><b>Audio: {verdict}</b><table>{cells}</table>{note}</div>"
    )


def build_compare_section(
    store: Any, identity_of: Callable[[str | None], Identity] | None = None
) -> tuple[gr.Textbox, gr.Textbox]:
    """The Compare controls and results; returns the Run A and Run B boxes (the detail's "Compare as A /
    B" buttons fill them). ``identity_of`` (a login -> who they are) keeps each user to their own runs
    (docs/team.md)."""
    gr.Markdown("### Compare two runs")
    run_a = gr.Textbox(label="Run A", elem_id="omni-h-run-a")
    run_b = gr.Textbox(label="Run B", elem_id="omni-h-run-b")
    compare = gr.Button("Compare", elem_id="omni-h-compare")
    diff_table = gr.Dataframe(
        pd.DataFrame(columns=DIFF_COLUMNS), interactive=False, wrap=True, elem_id="omni-h-diff"
    )
    with gr.Row():
        image_a = gr.Image(label="A", type="filepath", interactive=False, height=160)
        image_b = gr.Image(label="B", type="filepath", interactive=False, height=160)
    audio_figures = gr.HTML("", elem_id="omni-h-audio-figures")
    audio_a = gr.Audio(label="A · audio", visible=False, interactive=False, elem_id="omni-h-audio-a")
    wave_a = gr.Image(
        label="A · waveform",
        type="filepath",
        height=WAVEFORM_SIZE[1] + 40,
        visible=False,
        interactive=False,
        elem_id="omni-h-wave-a",
    )
    audio_b = gr.Audio(label="B · audio", visible=False, interactive=False, elem_id="omni-h-audio-b")
    wave_b = gr.Image(
        label="B · waveform",
        type="filepath",
        height=WAVEFORM_SIZE[1] + 40,
        visible=False,
        interactive=False,
        elem_id="omni-h-wave-b",
    )

    def resolve(a: str, b: str, request: gr.Request | None) -> tuple[str, str]:
        try:
            found = store.resolve_run_id(a.strip()), store.resolve_run_id(b.strip())
        except LookupError as exc:
            raise gr.Error(str(exc)) from None
        if identity_of is not None:
            identity = identity_of(getattr(request, "username", None))
            for given, full in zip((a, b), found, strict=True):
                if not identity.may_see(store.get_run(full).owner):  # as if it did not exist
                    raise gr.Error(f"no run id starts with {given.strip()!r}")
        return found

    def first(outputs: list[Any]) -> Any:
        return next((o for o in outputs if o.path.exists()), None)

    def do_compare(a: str, b: str, request: gr.Request):
        full_a, full_b = resolve(a, b, request)
        diff = store.diff_runs(full_a, full_b)
        rows = [
            [part, key, json.dumps(va, default=str), json.dumps(vb, default=str)]
            for part, entries in diff.items()
            for key, (va, vb) in entries.items()
        ]
        frame = pd.DataFrame(rows or [["—", "no differences", "", ""]], columns=DIFF_COLUMNS)
        image_a, image_b = first(store.get_run(full_a).images), first(store.get_run(full_b).images)
        return frame, str(image_a.path) if image_a else None, str(image_b.path) if image_b else None

    def do_compare_audio(a: str, b: str, request: gr.Request):
        full_a, full_b = resolve(a, b, request)
        sound_a, sound_b = first(store.get_run(full_a).audio), first(store.get_run(full_b).audio)
        difference = file_difference(sound_a.path, sound_b.path) if sound_a and sound_b else None

        def player(output: Any, label: str) -> Any:
            if output is None:
                return gr.update(value=None, visible=False)
            seconds = f"{output.duration_seconds:.2f} s" if output.duration_seconds is not None else "? s"
            label = f"{label} · audio {output.index} · {seconds}"
            return gr.update(value=str(output.path), label=label, visible=True)

        def picture(output: Any, label: str) -> Any:
            if output is None:
                return gr.update(value=None, visible=False)
            return gr.update(value=waveform_file(output), label=f"{label} · waveform", visible=True)

        return (
            audio_figures_html(sound_a, sound_b, difference),
            player(sound_a, "A"),
            picture(sound_a, "A"),
            player(sound_b, "B"),
            picture(sound_b, "B"),
        )

    # The API's /compare keeps its three outputs; the audio follows as a second, private step.
    compare.click(do_compare, [run_a, run_b], [diff_table, image_a, image_b], api_name="compare").success(
        do_compare_audio,
        [run_a, run_b],
        [audio_figures, audio_a, wave_a, audio_b, wave_b],
        api_visibility="private",
    )
    return run_a, run_b
