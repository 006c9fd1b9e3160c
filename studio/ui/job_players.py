"""The Batch tab's table of players: a speech job's grid as the browser plays it (docs/jobs.md, "The grid").

A job whose cells speak (a model with audio, docs/speech.md) gets, beside its recorded waveform grid, an
HTML table laid out like that grid (``studio/jobs/grid.py`` ``grid_layout``: X values across, prompts,
seeds and Y values down): one cell per combination with an ``<audio>`` player of the run store's WAV, its
label and its length; a cell not done yet shows its status. The files are served from the run store's
outputs folder, which the studio's Gradio app allows (``studio/startup/launch.py``).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from studio.jobs.grid import grid_layout
from studio.jobs.spec import JobSpec
from studio.store.jobs import JobItemRecord, JobRecord
from studio.store.store import RunStore

STYLE = """<style>
.omni-players{border-collapse:collapse;font-size:.9em;margin:6px 0}
.omni-players th,.omni-players td{border:1px solid var(--border-color-primary);padding:6px 8px;vertical-align:top}
.omni-players thead th{text-align:center}
.omni-players tbody th{text-align:left;white-space:pre-line;font-weight:600}
.omni-player audio{width:240px;display:block}
.omni-player-label{font-size:.85em;color:var(--body-text-color-subdued)}
.omni-player[data-status=failed] .omni-player-label{color:#c0392b}
</style>"""


@dataclass(frozen=True)
class Heard:
    """A succeeded cell's audio: where its WAV is and how long it plays."""

    path: Path
    seconds: float | None


class PlayerCache:
    """Succeeded cells' audio by run id: a succeeded run's outputs never change, so each is read once."""

    def __init__(self, store: RunStore | None) -> None:
        self.store = store
        self._heard: dict[str, Heard | None] = {}

    def audio_of(self, item: JobItemRecord) -> Heard | None:
        from studio.store.errors import RunNotFound

        if item.status != "succeeded" or item.run_id is None or self.store is None:
            return None
        if item.run_id not in self._heard:
            try:
                run = self.store.get_run(item.run_id)
            except RunNotFound:
                return None
            audio = next((o for o in run.outputs if o.kind == "audio"), None)
            self._heard[item.run_id] = Heard(audio.path, audio.duration_seconds) if audio else None
        return self._heard[item.run_id]


def file_url(path: Path) -> str:
    """The page-relative URL Gradio serves an allowed file at."""
    return "gradio_api/file=" + quote(str(path))


def cell_label(rows: list[str], columns: list[str], place: tuple[int, int]) -> str:
    """A cell's own label: its row's and its column's values (``seed 3 · voice Chelsie``)."""
    row, column = place
    parts = [*rows[row].split("\n"), columns[column]]
    return " · ".join(part for part in parts if part)


def players_html(job: JobRecord, cache: PlayerCache) -> str:
    """The table of players of ``job`` (items included); empty when none of its cells spoke."""
    spec = JobSpec.model_validate(job.spec)
    heard = {item.index: cache.audio_of(item) for item in job.items}
    if not any(heard.values()):
        return ""
    layout = grid_layout(spec, job.label)
    items = {item.index: item for item in job.items}
    by_place = {place: index for index, place in layout.places.items()}
    head = "".join(f"<th>{html.escape(label)}</th>" for label in layout.columns)
    body = []
    for r, row_label in enumerate(layout.rows):
        cells = []
        for c in range(len(layout.columns)):
            index = by_place.get((r, c))
            item = items.get(index) if index is not None else None
            if item is None:
                cells.append("<td></td>")
                continue
            label = cell_label(layout.rows, layout.columns, (r, c)) or f"cell {item.index}"
            audio = heard.get(item.index)
            if audio is not None:
                length = f"{audio.seconds:.2f} s" if audio.seconds is not None else "? s"
                player = (
                    f"<audio controls preload='metadata' src='{html.escape(file_url(audio.path))}'></audio>"
                )
                note = f"{html.escape(label)} · {length}"
            else:
                player = ""
                why = item.error if item.status == "failed" and item.error else item.status
                if item.status == "succeeded":
                    why = "nothing was said"
                note = f"{html.escape(label)} · {html.escape(why)}"
            cells.append(
                f"<td class='omni-player' data-index='{item.index}' data-status='{item.status}'>"
                f"{player}<div class='omni-player-label'>{note}</div></td>"
            )
        body.append(f"<tr><th>{html.escape(row_label)}</th>{''.join(cells)}</tr>")
    return (
        STYLE
        + f"<div class='omni-players-title'><b>{html.escape(layout.title)}</b></div>"
        + f"<table class='omni-players' id='omni-batch-players-table'><thead><tr><th></th>{head}</tr></thead>"
        + f"<tbody>{''.join(body)}</tbody></table>"
    )
