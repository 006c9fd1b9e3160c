"""The Queue tab: what this studio has queued and running (jobs and single requests from the UI, the API
and the CLI, and the cells of running jobs), with source, owner, place and progress; cancel what is
yours (everything with the admin login) and move your jobs up or down. The rows and the rules are
:class:`studio.runs.queue.QueueView`'s; this module renders them."""

from __future__ import annotations

import html
from typing import Any

import gradio as gr

from studio.controller import Studio
from studio.runs.queue import COLUMNS, QueueError, QueueView, Viewer
from studio.ui.jobs import job_service, viewer_of

REFRESH_S = 1.0  # while the tab is open (app.py turns the timer on and off with the tab)


def queue_view(studio: Studio) -> QueueView:
    return QueueView(studio.serving.board, job_service(studio))


def who_note(viewer: Viewer) -> str:
    if viewer.admin:
        return "Signed in as the admin login: you may cancel and move everything."
    if not viewer.sees_all:  # a user of a studio with accounts (docs/team.md)
        return "You see your own requests and jobs (from the UI and your API keys); you may cancel them and move your jobs."
    return "You may cancel what you submitted from this browser session, and move your own jobs."


def tab_timers(evt: gr.SelectData) -> tuple[gr.Timer, gr.Timer]:
    """The Batch and Queue tabs' refresh timers: on while their tab is shown, off otherwise."""
    shown = str(evt.value)
    return gr.Timer(active=shown == "Batch"), gr.Timer(active=shown == "Queue")


def build_queue_tab(studio: Studio) -> dict[str, Any]:
    intro = gr.Markdown("", elem_id="omni-queue-who")
    table = gr.Dataframe(
        headers=COLUMNS,
        value=[],
        interactive=False,
        label="Queued and running (click a row to pick it)",
        elem_id="omni-queue-table",
        wrap=True,
    )
    with gr.Row():
        chosen = gr.Textbox(label="Picked (id)", scale=3, elem_id="omni-queue-selected")
        cancel = gr.Button("Cancel", variant="stop", scale=1, elem_id="omni-queue-cancel")
        up = gr.Button("Move up", scale=1, elem_id="omni-queue-up")
        down = gr.Button("Move down", scale=1, elem_id="omni-queue-down")
        refresh_button = gr.Button("Refresh", scale=1, elem_id="omni-queue-refresh")
    status = gr.HTML("", elem_id="omni-queue-status")
    timer = gr.Timer(REFRESH_S, active=False)

    def rows(request: gr.Request) -> tuple[list[list[str]], str]:
        viewer = viewer_of(studio, request)
        found = queue_view(studio).rows(viewer)
        jobs = sum(1 for row in found if row.kind == "job")
        summary = (
            f"{jobs} job(s) and {len(found) - jobs} request(s) queued or running."
            if found
            else "Nothing is queued or running."
        )
        return [row.cells() for row in found], f"{summary} {who_note(viewer)}"

    def pick(evt: gr.SelectData, request: gr.Request):
        row = evt.row_value if isinstance(evt.row_value, list) else None
        if not row:
            return gr.skip()
        prefix = str(row[COLUMNS.index("id")])
        viewer = viewer_of(studio, request)
        match = next((r for r in queue_view(studio).rows(viewer) if r.id.startswith(prefix)), None)
        return match.id if match is not None else prefix

    def act(action: str, ident: str, request: gr.Request):
        viewer = viewer_of(studio, request)
        view = queue_view(studio)
        try:
            if action == "cancel":
                message = view.cancel(viewer, ident)
            else:
                message = view.move(viewer, ident, -1 if action == "up" else 1)
            note = f"<span class='omni-ok' id='omni-queue-done'>{html.escape(message)}</span>"
        except QueueError as exc:
            note = f"<span class='omni-invalid' id='omni-queue-refused'>{html.escape(str(exc))}</span>"
        table_rows, who = rows(request)
        return note, table_rows, who

    def cancel_picked(ident: str, request: gr.Request):
        return act("cancel", ident, request)

    def move_up(ident: str, request: gr.Request):
        return act("up", ident, request)

    def move_down(ident: str, request: gr.Request):
        return act("down", ident, request)

    table.select(pick, None, [chosen], api_name="queue_select")
    cancel.click(cancel_picked, [chosen], [status, table, intro], api_name="queue_cancel")
    up.click(move_up, [chosen], [status, table, intro], api_name="queue_move_up")
    down.click(move_down, [chosen], [status, table, intro], api_name="queue_move_down")
    refresh_button.click(rows, None, [table, intro], api_name="queue_refresh")
    timer.tick(
        rows, None, [table, intro], api_name="queue_tick", api_visibility="private", show_progress="hidden"
    )
    return {"timer": timer, "refresh": rows, "refresh_outputs": [table, intro]}
