"""What the History tab shows of spoken runs (docs/speech.md "In the studio"): the audio figures of the runs
list (seconds made, TTFP, real-time factor), a player for each spoken run of the list, and for a run's
detail a player and a waveform picture per audio output.

The waveform pictures are ``waveform_png`` (studio/media/audio.py), drawn once per stored file (its
sha256 names the picture). Compare and Replay show the same pictures (studio/ui/compare.py,
studio/ui/replay.py).
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from pathlib import Path
from typing import Any

import gradio as gr

from studio.media.audio import waveform_png
from studio.media.audio_compare import read_samples

WAVEFORM_SIZE = (640, 120)  # pixels of a run's waveform picture
LIST_PLAYERS = 20  # players under the runs list: the newest spoken runs shown; a row's detail has the rest
OUTPUT_KINDS = ["any", "audio", "image", "text"]  # the History filter "Output" (RunFilter.output_kind)


def seconds_text(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f} s" if value is not None else "—"


def audio_cells(run: Any) -> list[Any]:
    """A runs-list row's audio columns: seconds of audio made, TTFP (s), RTF; None for a run that did not
    ask for audio (the store's figures, docs/speech.md "Runs, files and the CLI")."""
    return [
        None if run.audio_seconds is None else round(run.audio_seconds, 2),
        None if run.ttfp_seconds is None else round(run.ttfp_seconds, 3),
        None if run.realtime_factor is None else round(run.realtime_factor, 2),
    ]


def figures_text(run: Any) -> str:
    """``"1.20 s · TTFP 0.312 s · RTF 0.26"``: a spoken run's figures in words."""
    parts = [seconds_text(run.audio_seconds)]
    if run.ttfp_seconds is not None:
        parts.append(f"TTFP {run.ttfp_seconds:.3f} s")
    if run.realtime_factor is not None:
        parts.append(f"RTF {run.realtime_factor:.2f}")
    return " · ".join(parts)


def list_players(store: Any, runs: list[Any]) -> list[dict[str, Any]]:
    """The players under the runs list: the first audio of each spoken run shown (at most
    :data:`LIST_PLAYERS`), labelled with its id, prompt and figures."""
    items = []
    for r in runs:
        if r.audio_sha256 is None:
            continue
        with contextlib.suppress(FileNotFoundError):  # a file removed by retention meanwhile
            prompt = r.prompt if len(r.prompt) <= 40 else r.prompt[:39] + "…"
            items.append(
                {
                    "id": r.id,
                    "path": str(store.output_file(r.audio_sha256)),
                    "label": f"{r.id[:12]} · {prompt} · {figures_text(r)}",
                }
            )
        if len(items) == LIST_PLAYERS:
            break
    return items


def waveform_file(output: Any) -> str:
    """A PNG of an audio output's waveform (``waveform_png``), drawn once per file."""
    target = Path(tempfile.gettempdir()) / "omni-studio-waveforms" / f"{output.sha256}.png"
    if not target.exists():
        samples, rate = read_samples(output.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.stem}.{uuid.uuid4().hex}.tmp")  # whole pictures only
        partial.write_bytes(waveform_png(samples.astype("float32"), rate, *WAVEFORM_SIZE))
        partial.replace(target)
    return str(target)


def audio_items(detail: Any) -> list[dict[str, Any]]:
    """What the detail shows of each audio output: its file, a label with its length, its waveform."""
    items = []
    for o in detail.audio:
        seconds = f"{o.duration_seconds:.2f} s" if o.duration_seconds is not None else "? s"
        rate = f" · {o.sample_rate / 1000:g} kHz" if o.sample_rate else ""
        with contextlib.suppress(FileNotFoundError, OSError):  # a file removed by retention meanwhile
            waveform = waveform_file(o)
            items.append(
                {"path": str(o.path), "label": f"audio {o.index} · {seconds}{rate}", "waveform": waveform}
            )
    return items


def render_detail_audio(items: list[dict[str, Any]]) -> None:
    """Inside ``gr.render``: a player beside a waveform picture per audio output of the run's detail."""
    for item in items:
        with gr.Row(elem_classes="omni-h-audio", equal_height=True):
            gr.Audio(item["path"], label=item["label"], interactive=False, scale=2)
            gr.Image(
                item["waveform"],
                label=f"Waveform · {item['label']}",
                type="filepath",
                interactive=False,
                height=WAVEFORM_SIZE[1] + 40,
                scale=3,
                elem_classes="omni-h-waveform",
            )


def render_list_players(items: list[dict[str, Any]]) -> None:
    """Inside ``gr.render``: the runs list's players, two a row."""
    if not items:
        return
    more = f"; the first {LIST_PLAYERS} shown" if len(items) == LIST_PLAYERS else ""
    gr.Markdown(f"**Spoken runs in this list** ({len(items)}{more})", elem_id="omni-h-list-audio-title")
    for start in range(0, len(items), 2):
        with gr.Row(equal_height=True):
            for item in items[start : start + 2]:
                gr.Audio(
                    item["path"],
                    label=item["label"],
                    interactive=False,
                    elem_classes="omni-h-list-audio",
                    scale=1,
                )
