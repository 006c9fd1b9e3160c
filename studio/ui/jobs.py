"""The Batch tab: submit a batch job (a form, or the YAML that ``omni-studio batch`` reads), follow its
progress and see its grid. Submitting calls :meth:`studio.jobs.service.JobService.submit`, the same as
``POST /v1/studio/jobs`` and the CLI; the job then waits in the queue like any other (Queue tab). A job
whose cells speak also shows its table of players (``studio/ui/job_players.py``)."""

from __future__ import annotations

import html
from typing import Any

import gradio as gr
import yaml

from studio.controller import Studio
from studio.jobs.runner import JobsUnavailable
from studio.jobs.service import JobService
from studio.jobs.spec import (
    AXIS_PARAMS,
    SPEC_EXAMPLE,
    JobSpecError,
    SpecProblem,
    load_job_file,
    parse_job_spec,
)
from studio.runs.queue import Viewer, owner_label
from studio.store.jobs import JobNotFound, JobRecord
from studio.ui.job_players import PlayerCache, players_html

NO_AXIS = "(none)"
JOB_COLUMNS = ["id", "name", "status", "progress", "output", "owner", "created"]
# The form's first values: a picture sweep, or for a model that speaks its voices across (docs/jobs.md).
IMAGE_FORM: dict[str, Any] = {
    "x": ("guidance", "1.0, 3.0"),
    "y": ("steps", "2, 4"),
    "size": "64x64",
    "steps": "",
}
SPEECH_FORM: dict[str, Any] = {"x": ("voice", ""), "y": (NO_AXIS, ""), "size": "", "steps": "4"}
SPEECH_EXAMPLE: dict[str, Any] = {
    "name": "voices x speed",
    "prompts": ["say hello"],
    "seeds": [7],
    "steps": 4,
    "x": {"param": "voice", "values": ["Chelsie", "Ethan"]},
    "y": {"param": "speed", "values": [1.0, 1.5]},
}
REFRESH_S = 1.5  # while the tab is open (app.py turns the timer on and off with the tab)


def viewer_of(studio: Studio, request: gr.Request | None) -> Viewer:
    """The UI visitor behind ``request`` (their session, their login, whether it is the admin login)."""
    username = getattr(request, "username", None)
    return Viewer.of_ui(
        getattr(request, "session_hash", None),
        username,
        getattr(studio, "admin_user", None),
        studio.identity(username),
    )


def job_service(studio: Studio) -> JobService | None:
    return getattr(studio.serving, "jobs", None)


def _values(text: str, name: str) -> list[Any]:
    """Comma-separated axis values, read as a YAML list (numbers stay numbers; quote text with commas)."""
    try:
        values = yaml.safe_load(f"[{text}]")
    except yaml.YAMLError as exc:
        raise JobSpecError([SpecProblem(f"{name}.values", f"not a list of values ({exc})")]) from None
    return list(values)


def _scalar(text: str, name: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobSpecError([SpecProblem(name, f"not a value ({exc})")]) from None


def form_document(
    prompts: str,
    seeds: str,
    x_param: str,
    x_values: str,
    y_param: str,
    y_values: str,
    size: str,
    steps: str,
    guidance: str,
    negative: str,
    name: str,
    voice: str = "",
    speed: str = "",
    say: bool = False,
) -> dict[str, Any]:
    """The job document the form describes (the same fields as the YAML and the API body)."""
    document: dict[str, Any] = {
        "prompts": [line.strip() for line in (prompts or "").splitlines() if line.strip()]
    }
    if seeds and seeds.strip():
        document["seeds"] = _values(seeds, "seeds")
    for axis, param, values in (("x", x_param, x_values), ("y", y_param, y_values)):
        if param and param != NO_AXIS:
            document[axis] = {"param": param, "values": _values(values or "", axis)}
    if size and size.strip():
        document["size"] = size.strip()
    for key, text in (("steps", steps), ("guidance", guidance)):
        if text and text.strip():  # read as YAML: "8" is a number, "eight" stays text (and is refused)
            document[key] = _scalar(text, key)
    if negative and negative.strip():
        document["negative_prompt"] = negative
    if voice and voice.strip():
        document["voice"] = voice.strip()
    if speed and speed.strip():
        document["speed"] = _scalar(speed, "speed")
    if say:
        document["say"] = True
    if name and name.strip():
        document["name"] = name.strip()
    return document


def problems_markdown(error: JobSpecError) -> str:
    items = "".join(
        f"<li><code>{html.escape(p.field or 'job')}</code>: {html.escape(p.message)}</li>"
        for p in error.problems
    )
    return f"<div class='omni-errors' id='omni-batch-errors'><b>The job was not submitted</b><ul>{items}</ul></div>"


def job_rows(service: JobService | None, viewer: Viewer | None = None) -> list[list[str]]:
    """The jobs list (``viewer``: only the jobs they may see, docs/team.md)."""
    if service is None:
        return []
    rows = []
    for job in service.list_jobs(limit=30):
        if viewer is not None and not viewer.sees(job.owner):
            continue
        progress = f"{job.succeeded}/{job.total}"
        notes = [f"{n} {what}" for n, what in ((job.failed, "failed"), (job.cancelled, "cancelled")) if n]
        if notes:
            progress += f" ({', '.join(notes)})"
        rows.append(
            [
                job.id[:12],
                job.label,
                job.status,
                progress,
                service.output_of(job),
                owner_label(job.owner),
                f"{job.created_at:%H:%M:%S}",
            ]
        )
    return rows


def job_detail(
    service: JobService | None,
    job_id: str | None,
    players: PlayerCache | None = None,
    viewer: Viewer | None = None,
) -> tuple[str, str | None, str]:
    """Markdown about one job, its grid's path once it has one, and its table of players (speech jobs)."""
    if service is None:
        return "Jobs are not available in this studio.", None, ""
    if not job_id:
        return "Submit a job, or click one in the list.", None, ""
    try:
        job: JobRecord = service.get(job_id, items=True)
    except JobNotFound:
        return f"No job {job_id[:12]}.", None, ""
    if viewer is not None and not viewer.sees(job.owner):  # another user's job: as if there were none
        return f"No job {job_id[:12]}.", None, ""
    position = service.positions().get(job.id)
    lines = [
        f"**{html.escape(job.label)}** · `{job.id[:12]}` · **{job.status}**"
        + (f" · #{position} in the queue" if position else "")
        + f" · {html.escape(service.output_of(job))}",
        f"{job.done}/{job.total} cells done: {job.succeeded} succeeded"
        + (f", {job.failed} failed" if job.failed else "")
        + (f", {job.cancelled} cancelled" if job.cancelled else ""),
    ]
    running = [i for i in job.items if i.status == "running"]
    if running:
        lines.append(f"running: cells {', '.join(str(i.index) for i in running)}")
    for item in job.items:
        if item.status == "failed" and item.error:
            lines.append(f"- cell {item.index}: {html.escape(item.error)}")
    if job.error and job.status != "succeeded":
        lines.append(f"_{html.escape(job.error)}_")
    grid = service.grid_path(job)
    if grid is not None and job.grid_run_id:
        lines.append(f"grid: run `{job.grid_run_id[:12]}` in History")
    table = players_html(job, players or PlayerCache(service.store))
    return "\n\n".join(lines), str(grid) if grid is not None else None, table


def build_batch_tab(studio: Studio) -> dict[str, Any]:
    speaks = bool(getattr(studio, "speaks", False))
    first = SPEECH_FORM if speaks else IMAGE_FORM
    voices = ", ".join(studio.voices()) if speaks else ""
    example = SPEECH_EXAMPLE if speaks else SPEC_EXAMPLE
    players = PlayerCache(getattr(job_service(studio), "store", None))
    with gr.Row(equal_height=False):
        with gr.Column(scale=2):
            gr.Markdown(
                "Every prompt with every seed at every X and Y value is one cell: each runs through the "
                "engine like any request (it appears in History) and the cells make one labelled grid; a "
                "model that speaks gives a table of players.",
                elem_id="omni-batch-intro",
            )
            prompts = gr.Textbox(
                label="Prompts (one per line)",
                lines=3,
                value=example["prompts"][0],
                elem_id="omni-batch-prompts",
            )
            seeds = gr.Textbox(
                label="Seeds (comma-separated; empty: one random seed)", value="7", elem_id="omni-batch-seeds"
            )
            with gr.Row():
                x_param = gr.Dropdown(
                    [NO_AXIS, *AXIS_PARAMS], value=first["x"][0], label="X axis", elem_id="omni-batch-x-param"
                )
                x_values = gr.Textbox(
                    label="X values (comma-separated)",
                    value=first["x"][1] or voices,
                    elem_id="omni-batch-x-values",
                )
            with gr.Row():
                y_param = gr.Dropdown(
                    [NO_AXIS, *AXIS_PARAMS], value=first["y"][0], label="Y axis", elem_id="omni-batch-y-param"
                )
                y_values = gr.Textbox(
                    label="Y values (comma-separated)", value=first["y"][1], elem_id="omni-batch-y-values"
                )
            with gr.Row():
                size = gr.Textbox(
                    label="Size (WxH; empty: the model's)", value=first["size"], elem_id="omni-batch-size"
                )
                steps = gr.Textbox(
                    label="Steps (empty: the model's)", value=first["steps"], elem_id="omni-batch-steps"
                )
                guidance = gr.Textbox(label="Guidance (empty: the model's)", elem_id="omni-batch-guidance")
            negative = gr.Textbox(label="Negative prompt", elem_id="omni-batch-negative")
            with gr.Row():
                voice = gr.Textbox(
                    label=f"Voice (speech; empty: the model's first{': ' + voices if voices else ''})",
                    elem_id="omni-batch-voice",
                )
                speed = gr.Textbox(
                    label="Speed (speech: 0.25-4.0; empty: as spoken)", elem_id="omni-batch-speed"
                )
                say = gr.Checkbox(
                    label="Say the prompts (speech: the words to say, audio only)", elem_id="omni-batch-say"
                )
            name = gr.Textbox(
                label="Name", placeholder="shown in the queue and on the grid", elem_id="omni-batch-name"
            )
            submit = gr.Button("Submit job", variant="primary", elem_id="omni-batch-submit")
            with gr.Accordion("…or paste a job file (the YAML of omni-studio batch)", open=False):
                document = gr.Code(
                    yaml.safe_dump(example, sort_keys=False),
                    language="yaml",
                    label="Job YAML",
                    elem_id="omni-batch-yaml",
                )
                submit_yaml = gr.Button("Submit YAML", elem_id="omni-batch-submit-yaml")
            status = gr.HTML("", elem_id="omni-batch-status")
        with gr.Column(scale=3):
            jobs_table = gr.Dataframe(
                headers=JOB_COLUMNS,
                value=job_rows(job_service(studio)),
                interactive=False,
                label="Jobs (click one)",
                elem_id="omni-batch-jobs",
            )
            detail = gr.Markdown("Submit a job, or click one in the list.", elem_id="omni-batch-detail")
            table = gr.HTML("", elem_id="omni-batch-players")
            grid = gr.Image(
                label="Grid", type="filepath", interactive=False, elem_id="omni-batch-grid", height=520
            )
    selected = gr.State(None)
    shown = gr.State(None)  # (grid, players) on screen: a tick sends them again only when they change
    timer = gr.Timer(REFRESH_S, active=False)
    nothing = (gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip())

    def submitted(spec_document: dict[str, Any] | str, request: gr.Request):
        service = job_service(studio)
        if service is None:
            return (gr.skip(), "Jobs are not available in this studio.", *nothing)
        try:
            if isinstance(spec_document, str):
                spec = load_job_file(spec_document, limits=service.limits)
            else:
                spec = parse_job_spec(spec_document, service.limits)
            viewer = viewer_of(studio, request)
            job = service.submit(spec, "ui", viewer.job_owner)
        except JobSpecError as exc:
            return (gr.skip(), problems_markdown(exc), *nothing)
        except JobsUnavailable as exc:
            return (gr.skip(), f"<b>Not submitted</b>: {html.escape(str(exc))}", *nothing)
        text, path, players_table = job_detail(service, job.id, players, viewer)
        note = f"Submitted job <code>{job.id[:12]}</code> ({job.total} cells); it runs in queue order (Queue tab)."
        return job.id, note, job_rows(service, viewer), text, path, players_table, (path, players_table)

    def submit_form(
        prompts_v: str,
        seeds_v: str,
        x_param_v: str,
        x_values_v: str,
        y_param_v: str,
        y_values_v: str,
        size_v: str,
        steps_v: str,
        guidance_v: str,
        negative_v: str,
        voice_v: str,
        speed_v: str,
        say_v: bool,
        name_v: str,
        request: gr.Request,
    ):
        try:
            spec_document = form_document(
                prompts_v,
                seeds_v,
                x_param_v,
                x_values_v,
                y_param_v,
                y_values_v,
                size_v,
                steps_v,
                guidance_v,
                negative_v,
                name_v,
                voice=voice_v,
                speed=speed_v,
                say=say_v,
            )
        except JobSpecError as exc:
            return (gr.skip(), problems_markdown(exc), *nothing)
        return submitted(spec_document, request)

    def submit_text(text: str, request: gr.Request):
        return submitted(text or "", request)

    outputs = [selected, status, jobs_table, detail, grid, table, shown]
    form = [
        prompts,
        seeds,
        x_param,
        x_values,
        y_param,
        y_values,
        size,
        steps,
        guidance,
        negative,
        voice,
        speed,
        say,
        name,
    ]
    submit.click(submit_form, form, outputs, api_name="batch_submit")
    submit_yaml.click(submit_text, [document], outputs, api_name="batch_submit_yaml")

    def refresh(job_id: str | None, on_screen: tuple[str | None, str] | None, request: gr.Request):
        service = job_service(studio)
        viewer = viewer_of(studio, request)
        text, path, players_table = job_detail(service, job_id, players, viewer)
        if on_screen is not None and tuple(on_screen) == (path, players_table):
            return job_rows(service, viewer), text, gr.skip(), gr.skip(), gr.skip()
        return job_rows(service, viewer), text, path, players_table, (path, players_table)

    def pick(evt: gr.SelectData, request: gr.Request):
        service = job_service(studio)
        viewer = viewer_of(studio, request)
        row = evt.row_value if isinstance(evt.row_value, list) else None
        prefix = str(row[0]) if row else ""
        match = next(
            (job for job in (service.list_jobs(limit=30) if service else []) if job.id.startswith(prefix)),
            None,
        )
        if match is None or not prefix:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        text, path, players_table = job_detail(service, match.id, players, viewer)
        return match.id, text, path, players_table, (path, players_table)

    jobs_table.select(pick, None, [selected, detail, grid, table, shown], api_name="batch_select")
    timer.tick(
        refresh,
        [selected, shown],
        [jobs_table, detail, grid, table, shown],
        api_name="batch_tick",
        api_visibility="private",
        show_progress="hidden",
    )
    return {
        "timer": timer,
        "refresh": refresh,
        "refresh_inputs": [selected, shown],
        "refresh_outputs": [jobs_table, detail, grid, table, shown],
    }
