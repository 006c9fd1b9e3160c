"""The Pipeline tab: the running deploy config as YAML and as a per-stage form, validation with errors
beside each stage, Apply (in-process engine rebuild; a failure keeps the old engine; with accounts, an
admin's only: docs/team.md), presets, diff.

Each stage is named by its hand-offs as the CLI's bars are (``thinker``, ``talker``, ``code2wav`` for
Qwen2.5-Omni) and shows its kind's sampling defaults: an AR stage's temperature, top_p, top_k, max_tokens
and repetition_penalty; a diffusion stage's steps and guidance, and its size unless it makes audio. A
stage that renders its source in chunks while it generates (code2wav) also shows ``chunk_size``
(docs/speech.md, "Streaming"): empty is the whole utterance at once."""

from __future__ import annotations

import html
from typing import Any

import gradio as gr
import yaml

from engine.config.deploy import CHUNK_SIZE_MAX, ARSamplingParams, DiffusionSamplingParams
from engine.config.pipeline import PRODUCIBLE_BY_KIND
from engine.modality import format_output_modalities
from studio.cli.progress import stage_labels
from studio.controller import Studio, ValidationReport

MAX_STAGES = 3
AR_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "repetition_penalty")
DIFFUSION_FIELDS = ("num_inference_steps", "guidance_scale", "height", "width")
AUDIO_FIELDS = ("num_inference_steps", "guidance_scale")  # code2wav: no picture size
SLOTS = max(len(AR_FIELDS), len(DIFFUSION_FIELDS))  # sampling boxes per stage
INTEGER_FIELDS = ("top_k", "max_tokens", "num_inference_steps", "height", "width")
CHUNK_LABEL = f"chunk_size (1-{CHUNK_SIZE_MAX} codes a chunk; empty: the whole utterance at once)"


def sampling_fields(row: dict[str, Any]) -> tuple[str, ...]:
    """The sampling defaults a stage's form shows (by its kind, and whether it makes audio)."""
    if row["kind"] == "ar":
        return AR_FIELDS
    if "audio" in str(row.get("engine_output_type") or "").split("+"):
        return AUDIO_FIELDS
    return DIFFUSION_FIELDS


def stage_header(row: dict[str, Any], name: str | None) -> str:
    """``**stage 2** · code2wav · diffusion · talker2code2wav · final``."""
    named = f" · {name}" if name and name != row["kind"] else ""
    return (
        f"**stage {row['stage_id']}**{named} · {row['kind']}"
        + (f" · {row['input_processor']}" if row["input_processor"] else "")
        + (" · final" if row["final_output"] else "")
    )


def output_choices(kind: str, current: str | None = None) -> list[str]:
    """Every canonical spelling a stage of ``kind`` may declare (single names and ``+`` pairs), and the
    stage's own when its family's topology declares another (``text+latent``, ``audio``)."""
    names = [m.value for m in PRODUCIBLE_BY_KIND[kind]]
    pairs = [
        format_output_modalities((a, b))
        for a in PRODUCIBLE_BY_KIND[kind]
        for b in PRODUCIBLE_BY_KIND[kind]
        if a != b
    ]
    choices = names + pairs
    return choices + [current] if current and current not in choices else choices


def field_help(kind: str, name: str) -> str:
    model = ARSamplingParams if kind == "ar" else DiffusionSamplingParams
    info = model.model_fields[name]
    bounds = [
        f"{m.__class__.__name__.lower()} {getattr(m, m.__class__.__name__.lower(), '')}"
        for m in info.metadata
    ]
    return f"{name} ({', '.join(bounds)})" if bounds else name


def overlay_raw_values(text: str, rows: list[dict[str, Any]]) -> None:
    """Show what the YAML says even where it does not validate (so an error sits beside its value)."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return
    entries = {s.get("stage_id"): s for s in data.get("stages") or [] if isinstance(s, dict)}
    for row in rows:
        entry = entries.get(row["stage_id"])
        if not entry:
            continue
        for key in ("engine_output_type", "backend"):
            if key in entry:
                row[key] = entry[key]
        for key in ("max_num_seqs", "devices", "chunk_size"):
            if key in entry:
                row["engine_args"][key] = entry[key]
        if isinstance(entry.get("default_sampling_params"), dict):
            row["default_sampling_params"] = {
                **row["default_sampling_params"],
                **entry["default_sampling_params"],
            }


def render_problems(problems: list[Any]) -> str:
    if not problems:
        return ""
    items = "".join(
        f"<li><code>{html.escape(p.key or '-')}</code>: {html.escape(p.message)}</li>" for p in problems
    )
    return f"<div class='omni-errors'><ul>{items}</ul></div>"


def build_pipeline_tab(studio: Studio) -> dict[str, Any]:
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            with gr.Row():
                preset = gr.Dropdown(studio.preset_names(), label="Preset", value=None, scale=3)
                load_preset = gr.Button("Load preset", scale=1)
                reset = gr.Button("Reset to running", scale=1)
            editor = gr.Code(
                studio.deploy_text,
                language="yaml",
                label="Deploy config (YAML)",
                lines=22,
                interactive=True,
                elem_id="omni-deploy-yaml",
            )
            with gr.Row():
                validate = gr.Button("Validate", elem_id="omni-validate")
                apply = gr.Button("Apply", variant="primary", elem_id="omni-apply")
            result = gr.HTML("", elem_id="omni-pipeline-result")
            diff = gr.Code(
                "(no changes)",
                language=None,
                label="Diff against the running config",
                interactive=False,
                lines=8,
                elem_id="omni-deploy-diff",
            )
        with gr.Column(scale=2):
            gr.Markdown("### Stages\nEdit a field, then **Form → YAML** to write it into the config.")
            stage_boxes = []
            for index in range(MAX_STAGES):
                with gr.Group(visible=False) as group:
                    header = gr.Markdown(elem_id=f"omni-stage{index}-header")
                    with gr.Row():
                        output_type = gr.Dropdown(
                            [],
                            label="engine_output_type",
                            allow_custom_value=True,
                            elem_id=f"omni-stage{index}-output",
                        )
                        backend = gr.Dropdown(["auto", "vllm", "transformers"], label="backend (ar)")
                    with gr.Row():
                        max_num_seqs = gr.Number(label="max_num_seqs (1-1024)", precision=0)
                        devices = gr.Textbox(label="devices (auto, cpu, 0, 0,1)")
                    sampling = []
                    for first in range(0, SLOTS, 2):
                        with gr.Row():
                            sampling += [
                                gr.Number(label=f"sampling {i}", elem_id=f"omni-stage{index}-sampling{i}")
                                for i in range(first, min(first + 2, SLOTS))
                            ]
                            if first + 2 >= SLOTS:
                                chunk_size = gr.Number(
                                    label=CHUNK_LABEL,
                                    precision=0,
                                    visible=False,
                                    elem_id=f"omni-stage{index}-chunk-size",
                                )
                    errors = gr.HTML("", elem_id=f"omni-stage{index}-errors")
                stage_boxes.append(
                    {
                        "group": group,
                        "header": header,
                        "output_type": output_type,
                        "backend": backend,
                        "max_num_seqs": max_num_seqs,
                        "devices": devices,
                        "sampling": sampling,
                        "chunk_size": chunk_size,
                        "errors": errors,
                    }
                )
            form_to_yaml = gr.Button("Form → YAML", elem_id="omni-form-to-yaml")

    def stage_rows(text: str) -> list[dict[str, Any]]:
        report = studio.validate_text(text, check_devices=False)
        config = report.config or studio.config
        return [s.to_dict() for s in config.stages][:MAX_STAGES]

    def stage_names() -> dict[int, str]:
        return stage_labels(studio.config.stages)[0]

    def chunks(row: dict[str, Any], entry: dict[str, Any] | None = None) -> bool:
        """Whether a stage shows chunk_size: its runner renders chunks (code2wav), or it is set."""
        runner = getattr(studio.engine, "runners", {}).get(row["stage_id"])
        return (
            bool(getattr(runner, "consumes_chunks", False))
            or row["engine_args"].get("chunk_size") is not None
            or bool(entry and "chunk_size" in entry)
        )

    def form_updates(text: str, report: ValidationReport | None = None) -> list[Any]:
        try:
            rows = stage_rows(text)
        except Exception:
            rows = [s.to_dict() for s in studio.config.stages]
        # A valid config's own output types join the choices; what the YAML says (overlaid) need not be.
        declared = {row["stage_id"]: row["engine_output_type"] for row in rows}
        overlay_raw_values(text, rows)
        grouped = report.by_stage() if report else {}
        names = stage_names()
        updates: list[Any] = []
        for index, box in enumerate(stage_boxes):
            if index >= len(rows):
                updates += [gr.update(visible=False), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()]
                updates += [gr.skip()] * len(box["sampling"]) + [gr.skip(), ""]
                continue
            row = rows[index]
            kind = row["kind"]
            fields = sampling_fields(row)
            sampling = row["default_sampling_params"]
            updates += [
                gr.update(visible=True),
                stage_header(row, names.get(row["stage_id"])),
                gr.update(
                    choices=output_choices(kind, declared.get(row["stage_id"])),
                    value=row["engine_output_type"],
                ),
                gr.update(value=row["backend"], interactive=kind == "ar"),
                row["engine_args"].get("max_num_seqs"),
                row["engine_args"].get("devices"),
            ]
            for slot in range(len(box["sampling"])):
                if slot < len(fields):
                    name = fields[slot]
                    updates.append(
                        gr.update(label=field_help(kind, name), value=sampling.get(name), visible=True)
                    )
                else:
                    updates.append(gr.update(value=None, visible=False))
            updates.append(gr.update(value=row["engine_args"].get("chunk_size"), visible=chunks(row)))
            updates.append(render_problems(grouped.get(row["stage_id"], [])))
        return updates

    form_outputs: list[Any] = []
    for box in stage_boxes:
        form_outputs += [
            box["group"],
            box["header"],
            box["output_type"],
            box["backend"],
            box["max_num_seqs"],
            box["devices"],
            *box["sampling"],
            box["chunk_size"],
            box["errors"],
        ]

    def report_html(report: ValidationReport, applied: bool = False) -> str:
        if report.ok:
            verb = "Applied: the engine was rebuilt." if applied else "Valid."
            return f"<div class='omni-ok'><b>{verb}</b><pre>{html.escape(report.summary)}</pre></div>"
        general = [p for p in report.problems if p.stage is None]
        head = "Not applied — the running engine keeps serving." if applied else "Invalid."
        count = len(report.problems)
        return (
            f"<div class='omni-invalid'><b>{head}</b> {count} problem(s); each stage's problems are shown "
            f"beside its form.{render_problems(general)}</div>"
        )

    def on_validate(text: str):
        report = studio.validate_text(text)
        shown = report_html(report)
        if not report.ok and report.summary:  # the memory table beside the problems (docs/memory.md)
            shown += f"<pre class='omni-memory'>{html.escape(report.summary)}</pre>"
        return [shown, studio.diff_text(text), *form_updates(text, report)]

    def on_apply(text: str, request: gr.Request):
        # With accounts only an admin rebuilds the engine everyone runs on (docs/team.md); Validate is open.
        refused = studio.admin_refusal(getattr(request, "username", None), "apply a deploy config")
        if refused:
            shown = (
                f"<div class='omni-invalid omni-refused'><b>Not applied</b> — {html.escape(refused)}.</div>"
            )
            return [shown, studio.diff_text(text), *[gr.skip()] * len(form_outputs)]
        report = studio.apply_text(text)
        return [report_html(report, applied=True), studio.diff_text(text), *form_updates(text, report)]

    validate.click(on_validate, [editor], [result, diff, *form_outputs], api_name="validate_config")
    apply_event = apply.click(
        on_apply, [editor], [result, diff, *form_outputs], api_name="apply_config", concurrency_id="generate"
    )

    def on_preset(name: str | None):
        """The preset in the editor, its diff, and the stage form showing its values (a form left on the
        running config would write those back over the preset on Form -> YAML)."""
        if not name:
            return [gr.skip()] * (2 + len(form_outputs))
        text = studio.preset_text(name)
        return [text, studio.diff_text(text), *form_updates(text)]

    def on_reset():
        text = studio.deploy_text
        return [text, "(no changes)", *form_updates(text)]

    load_preset.click(on_preset, [preset], [editor, diff, *form_outputs], api_name="load_preset")
    reset.click(on_reset, None, [editor, diff, *form_outputs], api_visibility="private")
    editor.change(
        lambda text: studio.diff_text(text),
        [editor],
        [diff],
        api_visibility="private",
        show_progress="hidden",
    )

    def on_form_to_yaml(text: str, *values: Any):
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            return (
                gr.skip(),
                f"<div class='omni-invalid'>The YAML does not parse: {html.escape(str(exc))}</div>",
            )
        rows = stage_rows(text)
        per_box = 4 + SLOTS + 1
        stages = data.setdefault("stages", [])
        for index, row in enumerate(rows):
            output_type, backend, max_num_seqs, devices, *sampling, chunk_size = values[
                index * per_box : (index + 1) * per_box
            ]
            entry = next(
                (s for s in stages if isinstance(s, dict) and s.get("stage_id") == row["stage_id"]), None
            )
            if entry is None:
                entry = {"stage_id": row["stage_id"]}
                stages.append(entry)
            changes = {"engine_output_type": output_type, "max_num_seqs": max_num_seqs, "devices": devices}
            if row["kind"] == "ar":
                changes["backend"] = backend
            for key, value in changes.items():
                if value in (None, ""):
                    continue
                value = int(value) if key == "max_num_seqs" else value
                # Keys the file already spells are always rewritten; others only when they differ from
                # the running value (the file then carries just what the user tuned).
                if key in entry or value != row.get(key, row["engine_args"].get(key)):
                    entry[key] = value
            if chunks(row, entry):
                if chunk_size in (None, ""):  # empty: the whole utterance at once (the key unset)
                    entry.pop("chunk_size", None)
                elif "chunk_size" in entry or chunk_size != row["engine_args"].get("chunk_size"):
                    entry["chunk_size"] = int(chunk_size)
            names = sampling_fields(row)
            params = entry.setdefault("default_sampling_params", {})
            for name, value in zip(names, sampling[: len(names)], strict=True):
                if value is None:
                    continue
                value = int(value) if name in INTEGER_FIELDS else float(value)
                if name in params or value != row["default_sampling_params"].get(name):
                    params[name] = value
            if not params:
                entry.pop("default_sampling_params")
        new_text = yaml.safe_dump(data, sort_keys=False)
        return new_text, ""

    form_inputs: list[Any] = []
    for box in stage_boxes:
        form_inputs += [
            box["output_type"],
            box["backend"],
            box["max_num_seqs"],
            box["devices"],
            *box["sampling"],
            box["chunk_size"],
        ]
    form_to_yaml.click(on_form_to_yaml, [editor, *form_inputs], [editor, result], api_name="form_to_yaml")

    def refresh():
        return [studio.deploy_text, "(no changes)", *form_updates(studio.deploy_text)]

    return {
        "editor": editor,
        "refresh": refresh,
        "refresh_outputs": [editor, diff, *form_outputs],
        "apply_event": apply_event,
    }
