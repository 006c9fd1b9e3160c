"""The Chat tab's "Load recipe": drop a PNG saved by the studio (or by A1111), or a WAV or FLAC of a spoken
run, and the prompt and parameters (a voice, what to reply with) come back into the form; the recipe's
model and deploy config are one click away (with accounts, an admin's click: docs/team.md). The note names
the recorded run(s) the file came from that the visitor may see: a user's own, every run for an admin.

Reading the PNG is ``studio.recipes.recipe.read_recipe`` (the same call as ``omni-studio run --recipe``);
switching the pipeline is ``studio.recipes.runs.restore_pipeline`` over the controller. See docs/recipes.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from studio.accounts.identity import Identity
from studio.controller import Studio
from studio.recipes.recipe import A1111, Recipe, RecipeError, read_recipe
from studio.recipes.runs import BY_FILE, restore_pipeline, runs_for_file

# The Chat form's ranges (studio/ui/chat.py): a recipe value outside them is set to the nearest end, and said.
FORM_RANGES = {
    "width": (32, 1024),
    "height": (32, 1024),
    "num_inference_steps": (1, 100),
    "guidance_scale": (0.0, 20.0),
}
MODALITY_CHOICES = ("text", "image", "token_ids")
SHOWN_RUNS = 5  # run ids named in the note (newest first)
SWITCH = "switch the studio to a recipe's model and deploy config"


@dataclass
class RecipeDrop:
    """The components of the recipe drop (placed in the Chat tab's layout)."""

    upload: gr.File
    note: gr.Markdown
    apply: gr.Button
    recipe: gr.State


def build_recipe_drop() -> RecipeDrop:
    """The upload area, its note and the "use the recipe's model and deploy config" button."""
    upload = gr.File(
        label="Load recipe (drop a PNG saved here or by A1111, or a WAV or FLAC of a spoken run)",
        file_types=[".png", ".wav", ".flac"],
        type="filepath",
        height=110,
        elem_id="omni-recipe",
    )
    note = gr.Markdown("", elem_id="omni-recipe-note")
    apply = gr.Button(
        "Use the recipe's model and deploy config", visible=False, size="sm", elem_id="omni-recipe-apply"
    )
    return RecipeDrop(upload, note, apply, gr.State(None))


def form_values(recipe: Recipe) -> tuple[dict[str, Any], list[str]]:
    """The Chat form values (engine parameter names) a recipe restores, and notes on values the form
    cannot hold as they are."""
    values: dict[str, Any] = {}
    notes: list[str] = []
    p = recipe.parameters
    for key, (low, high) in FORM_RANGES.items():
        value = p.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if value < low or value > high:
            clamped = min(max(value, low), high)
            notes.append(f"{key} {value} is outside this form's range ({low}–{high}); set to {clamped}")
            value = clamped
        values[key] = value
    if isinstance(p.get("seed"), int):
        values["seed"] = p["seed"]
    if isinstance(p.get("negative_prompt"), str):
        values["negative_prompt"] = p["negative_prompt"]
    modalities = p.get("modalities")
    if isinstance(modalities, list) and "audio" in modalities:  # a spoken run: the speech controls
        values["reply_as"] = "+".join(m for m in ("text", "audio") if m in modalities)
        if isinstance(p.get("voice"), str):
            values["voice"] = p["voice"]
        if isinstance(p.get("max_tokens"), int):
            values["max_tokens"] = min(max(p["max_tokens"], 1), 1024)
        if isinstance(p.get("speak_text"), str):
            notes.append(
                "the recipe spoke given text word for word (the Speech tab or /v1/audio/speech); "
                "here the model answers the prompt in its own words — say it again from the Speech tab"
            )
    elif isinstance(modalities, list):
        values["modalities"] = [m for m in modalities if m in MODALITY_CHOICES]
    return values, notes


def describe(
    recipe: Recipe, studio: Studio, restored: dict[str, Any], refused: str | None = None
) -> tuple[str, bool]:
    """Markdown for the drop's note, and whether the model/deploy-config button applies (``refused``: why
    this visitor may not switch, docs/team.md; the note says so instead of offering the button)."""
    labels = {
        "seed": "seed",
        "width": "size",
        "num_inference_steps": "steps",
        "guidance_scale": "guidance",
        "negative_prompt": "negative prompt",
        "modalities": "modalities",
        "voice": "voice",
        "reply_as": "reply with",
        "max_tokens": "max tokens",
    }
    parts = ["prompt", *(label for key, label in labels.items() if key in restored)]
    source = "an Omni Studio recipe" if recipe.origin != A1111 else "an A1111 recipe"
    lines = [f"✓ Restored from {source}: {', '.join(parts)}."]
    can_switch = False
    if recipe.origin == A1111:
        if recipe.unmapped:
            lines.append("Not used here: " + "; ".join(recipe.unmapped) + ".")
        if recipe.model:
            lines.append(
                f"The A1111 model `{recipe.model}` is not one of this studio's; the running model stays."
            )
    else:
        made = f"Made with **{recipe.model}**, deploy config `{(recipe.config_hash or '?')[:8]}`"
        running_hash = studio.config.config_hash()
        if recipe.model == studio.model.name and recipe.config_hash == running_hash:
            lines.append(f"{made} — the running model and config.")
        elif recipe.model in studio.builtin_models() and recipe.config is not None:
            then = (
                f"{refused[0].upper()}{refused[1:]}."
                if refused
                else "Use the button below to switch to the recipe's."
            )
            lines.append(f"{made}; the studio runs **{studio.model.name}** `{running_hash[:8]}`. {then}")
            can_switch = refused is None
        else:
            lines.append(f"{made}; that model is not known to this studio, so the running model stays.")
    if recipe.history:
        lines.append(
            f"The recipe continued a conversation of {len(recipe.history)} turn(s); only its prompt is restored."
        )
    lines += [f"Note: {note}." for note in recipe.notes]
    return "\n\n".join(lines), can_switch


def runs_line(studio: Studio, identity: Identity, data: bytes, recipe: Recipe) -> str:
    """The note's line naming the recorded runs ``data`` came from (``studio.recipes.runs.runs_for_file``:
    by the file's sha256, else by its recipe), only those ``identity`` may see: a user's own, every run for
    an admin or in a studio without accounts (docs/team.md). Empty when there are none to name."""
    if studio.store is None:
        return ""
    found = runs_for_file(studio.store, data, recipe)
    accounts = studio.accounts
    ids = [
        run_id
        for run_id in found.run_ids
        if identity.sees_all or (accounts is not None and accounts.may_see_run(identity, run_id))
    ]
    if not ids:
        return "None of your runs made this file." if not identity.sees_all else ""
    names = []
    for run_id in ids[:SHOWN_RUNS]:
        # An admin sees whose each run is; a user's are all their own.
        owner = accounts.rows.run_user(run_id) if identity.admin and accounts is not None else None
        names.append(f"`{run_id[:12]}`" + (f" ({owner})" if owner else ""))
    more = f" and {len(ids) - SHOWN_RUNS} more" if len(ids) > SHOWN_RUNS else ""
    runs = f"run{'s' if len(ids) > 1 else ''} {', '.join(names)}{more}"
    if found.matched_by == BY_FILE:
        return f"This file is an output of {runs} (History shows it)."
    return f"Its recipe matches {runs} (the file itself was changed or re-saved)."


def connect_recipe_drop(studio: Studio, drop: RecipeDrop, fields: dict[str, Any]) -> None:
    """Wire the drop to the Chat form: ``fields`` maps ``message``, ``seed``, ``width``, ``height``,
    ``steps``, ``guidance``, ``negative``, ``modalities``, ``voice``, ``reply_as``, ``max_tokens`` and
    ``model`` to their components."""
    restored_outputs = [
        fields["message"],
        fields["seed"],
        fields["width"],
        fields["height"],
        fields["steps"],
        fields["guidance"],
        fields["negative"],
        fields["modalities"],
        fields["voice"],
        fields["reply_as"],
        fields["max_tokens"],
    ]
    # The drop zone is emptied again after each file, ready for the next one.
    outputs = [*restored_outputs, drop.note, drop.apply, drop.recipe, drop.upload]

    def load(path: str | None, request: gr.Request):
        unchanged = [gr.skip()] * len(restored_outputs)
        if not path:
            return *unchanged, "", gr.update(visible=False), None, None
        name = Path(path).name
        data = Path(path).read_bytes()
        try:
            recipe = read_recipe(data, name)
        except RecipeError as exc:
            return *unchanged, f"⚠️ {exc}.", gr.update(visible=False), None, None
        username = getattr(request, "username", None)
        identity = studio.identity(username)
        values, notes = form_values(recipe)
        files: list[str] = []
        if recipe.source_image_sha256:
            found = studio.runs.files.find(recipe.source_image_sha256) if studio.runs.files else None
            if found is not None and may_read(identity, recipe.source_image_sha256):
                files.append(str(found))
            else:  # another user's source image reads as one the studio does not have (docs/team.md)
                notes.append("its source image is not in this studio's history; attach it for image-to-image")
        text, can_switch = describe(recipe, studio, values, studio.admin_refusal(username, SWITCH))
        runs = runs_line(studio, identity, data, recipe)
        text += f"\n\n{runs}" if runs else ""
        text += "".join(f"\n\nNote: {note}." for note in notes)

        def value(key: str) -> Any:
            return values[key] if key in values else gr.skip()

        return (
            {"text": recipe.prompt, "files": files},
            value("seed"),
            value("width"),
            value("height"),
            value("num_inference_steps"),
            value("guidance_scale"),
            values.get("negative_prompt", ""),
            value("modalities"),
            value("voice"),
            value("reply_as"),
            value("max_tokens"),
            text,
            gr.update(visible=can_switch),
            recipe,
            None,
        )

    drop.upload.upload(load, [drop.upload], outputs, api_name="load_recipe", show_progress="hidden")

    def may_read(identity: Identity, sha256: str) -> bool:
        accounts = studio.accounts
        return identity.sees_all or (accounts is not None and accounts.may_read_output(identity, sha256))

    def use_pipeline(recipe: Recipe | None, request: gr.Request):
        if recipe is None:
            return "Load a recipe first.", gr.update(visible=False), gr.skip()
        refused = studio.admin_refusal(getattr(request, "username", None), SWITCH)
        if refused:  # with accounts only an admin changes what everyone runs (docs/team.md)
            return f"**Not switched** — {refused}.", gr.update(visible=False), gr.skip()
        message = restore_pipeline(studio, recipe)
        return message, gr.update(visible=False), gr.update(value=studio.model.name)

    drop.apply.click(
        use_pipeline,
        [drop.recipe],
        [drop.note, drop.apply, fields["model"]],
        api_name="use_recipe_pipeline",
        concurrency_id="generate",  # like the Pipeline tab's Apply: not while a run holds the engine
    )
