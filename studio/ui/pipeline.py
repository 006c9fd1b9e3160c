"""The Pipeline tab: the running deploy config as YAML and as a per-stage form, validation with errors
beside each stage, Apply (in-process engine rebuild; a failure keeps the old engine), presets, diff."""

from __future__ import annotations

import html
from typing import Any

import gradio as gr
import yaml

from engine.config.deploy import ARSamplingParams, DiffusionSamplingParams
from engine.config.pipeline import PRODUCIBLE_BY_KIND
from engine.modality import format_output_modalities
from studio.controller import Studio, ValidationReport

MAX_STAGES = 3
AR_FIELDS = ("temperature", "top_p", "top_k", "max_tokens")
DIFFUSION_FIELDS = ("num_inference_steps", "guidance_scale", "height", "width")


def output_choices(kind: str) -> list[str]:
    """Every canonical spelling a stage of ``kind`` may declare (single names and ``+`` pairs)."""
    names = [m.value for m in PRODUCIBLE_BY_KIND[kind]]
    pairs = [
        format_output_modalities((a, b))
        for a in PRODUCIBLE_BY_KIND[kind]
        for b in PRODUCIBLE_BY_KIND[kind]
        if a != b
    ]
    return names + pairs


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
        for key in ("max_num_seqs", "devices"):
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
                    header = gr.Markdown()
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
                    for pair in (DIFFUSION_FIELDS[:2], DIFFUSION_FIELDS[2:]):
                        with gr.Row():
                            sampling += [gr.Number(label=name) for name in pair]
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
                        "errors": errors,
                    }
                )
            form_to_yaml = gr.Button("Form → YAML", elem_id="omni-form-to-yaml")

    def stage_rows(text: str) -> list[dict[str, Any]]:
        report = studio.validate_text(text, check_devices=False)
        config = report.config or studio.config
        return [s.to_dict() for s in config.stages][:MAX_STAGES]

    def form_updates(text: str, report: ValidationReport | None = None) -> list[Any]:
        try:
            rows = stage_rows(text)
        except Exception:
            rows = [s.to_dict() for s in studio.config.stages]
        overlay_raw_values(text, rows)
        grouped = report.by_stage() if report else {}
        updates: list[Any] = []
        for index, box in enumerate(stage_boxes):
            if index >= len(rows):
                updates += [gr.update(visible=False), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()]
                updates += [gr.skip()] * len(box["sampling"]) + [""]
                continue
            row = rows[index]
            kind = row["kind"]
            names = AR_FIELDS if kind == "ar" else DIFFUSION_FIELDS
            sampling = row["default_sampling_params"]
            updates += [
                gr.update(visible=True),
                f"**stage {row['stage_id']}** · {kind}"
                + (f" · {row['input_processor']}" if row["input_processor"] else "")
                + (" · final" if row["final_output"] else ""),
                gr.update(choices=output_choices(kind), value=row["engine_output_type"]),
                gr.update(value=row["backend"], interactive=kind == "ar"),
                row["engine_args"].get("max_num_seqs"),
                row["engine_args"].get("devices"),
            ]
            updates += [gr.update(label=field_help(kind, name), value=sampling.get(name)) for name in names]
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

    def on_apply(text: str):
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
        per_box = 4 + len(DIFFUSION_FIELDS)
        stages = data.setdefault("stages", [])
        for index, row in enumerate(rows):
            output_type, backend, max_num_seqs, devices, *sampling = values[
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
            names = AR_FIELDS if row["kind"] == "ar" else DIFFUSION_FIELDS
            params = entry.setdefault("default_sampling_params", {})
            for name, value in zip(names, sampling, strict=True):
                if value is None:
                    continue
                integer = name in ("top_k", "max_tokens", "num_inference_steps", "height", "width")
                value = int(value) if integer else float(value)
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
