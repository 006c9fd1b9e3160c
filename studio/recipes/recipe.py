"""PNG recipes: what made a picture, written into the picture (docs/recipes.md).

Every PNG the studio writes carries two text chunks, attached once per output image by
:class:`studio.runs.service.RunService` (so the API, the UI, the CLI and the run store all write the same bytes):

- ``parameters``: A1111's plain-text form, which A1111, ComfyUI, InvokeAI and image viewers read::

      a red circle on a blue background
      Negative prompt: blurry
      Steps: 8, CFG scale: 1.0, Seed: 7, Size: 128x128, Model: tiny-glm-shapes

- ``omni_studio``: a JSON :class:`Recipe` (schema version :data:`RECIPE_VERSION`): the request (prompt,
  earlier chat turns, the source image's sha256), the resolved parameters of *this* image (its own seed,
  ``n`` 1), the model, the pipeline config snapshot and its hash, the fingerprint and the studio version.

No run id and no time stamp. SPEC §5 makes "same request + seed -> byte-identical PNGs" a tested contract,
and a per-run id or a clock value in the bytes would break it; the recipe holds only what decides the
picture, so a re-run (from History, the CLI or a replay) writes the very same file. The run a PNG came from
is found instead by the file's sha256 (outputs are content-addressed) and, for a re-saved or edited PNG,
by its recipe (``omni-studio history show --png``; :mod:`studio.recipes.runs`).

Spoken outputs carry the same JSON object in their WAV and FLAC files (docs/speech.md): the stamper
attaches it to each ``RunOutput`` with audio (:func:`audio_recipe` reads it), and every encoder of that
audio (the run store, ``omni-studio run --out``, the API) hands it to ``studio.media.audio.encode_audio``.

This module is the format: building a recipe, attaching it to an image, reading one back from PNG bytes
(ours, or A1111's ``parameters`` alone). It knows nothing of the run store, the UI or the CLI.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from PIL import Image, UnidentifiedImageError

from engine.config import PipelineConfig
from engine.events import EngineEvent, RunFinished, RunOutput
from engine.request import ResolvedRequest
from studio import __version__
from studio.media.images import attach_png_text, png_bytes

RECIPE_VERSION = 1  # bump when a field changes meaning; readers accept newer recipes with a note
RECIPE_KEY = "omni_studio"  # the JSON chunk
PARAMETERS_KEY = "parameters"  # A1111's text chunk
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

OMNI_STUDIO = "omni_studio"  # Recipe.origin: our JSON chunk
A1111 = "a1111"  # Recipe.origin: an A1111-style ``parameters`` chunk only


class RecipeError(ValueError):
    """A file that holds no readable recipe (not a PNG, no recipe chunk, a broken one); says which."""


@dataclass(frozen=True)
class Recipe:
    """What made one picture: enough to restore the Chat form or re-run it.

    ``parameters`` uses the engine's names (``num_inference_steps``, ``guidance_scale``, ``seed``,
    ``width``, ``height``, ``negative_prompt``, ``modalities``...): for our recipes the run's resolved
    parameters with this image's own seed and ``n`` 1; for an A1111 recipe only what maps (``unmapped``
    lists the rest, e.g. ``Sampler: Euler a``).
    """

    prompt: str
    parameters: dict[str, Any]
    origin: str = OMNI_STUDIO
    model: str | None = None
    config_hash: str | None = None
    config: dict[str, Any] | None = None  # the pipeline-config snapshot (PipelineConfig.to_dict())
    fingerprint: str | None = None
    studio_version: str | None = None
    history: tuple[tuple[str, str], ...] = ()  # earlier chat turns (role, text), oldest first
    source_image_sha256: str | None = None  # image-to-image: the sha256 of the source's PNG in the store
    version: int = RECIPE_VERSION
    unmapped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what a reader should know (a newer recipe version, a fallback)

    @property
    def seed(self) -> int | None:
        seed = self.parameters.get("seed")
        return seed if isinstance(seed, int) else None

    # -- writing ----------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The ``omni_studio`` chunk: canonical JSON (sorted keys, no spaces), so equal recipes are equal bytes."""
        request: dict[str, Any] = {"prompt": self.prompt}
        if self.history:
            request["history"] = [{"role": role, "text": text} for role, text in self.history]
        if self.source_image_sha256:
            request["source_image_sha256"] = self.source_image_sha256
        body = {
            "recipe": self.version,
            "studio_version": self.studio_version,
            "model": self.model,
            "request": request,
            "parameters": self.parameters,
            "config_hash": self.config_hash,
            "config": self.config,
            "fingerprint": self.fingerprint,
        }
        return json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)

    def a1111_text(self) -> str:
        """The ``parameters`` chunk in A1111's layout: prompt, ``Negative prompt:`` line, settings line."""
        p = self.parameters
        width, height = p.get("width"), p.get("height")
        settings = {
            "Steps": p.get("num_inference_steps"),
            "CFG scale": p.get("guidance_scale"),
            "Seed": p.get("seed"),
            "Size": f"{width}x{height}" if width and height else None,
            "Model": self.model,
        }
        line = ", ".join(f"{key}: {_quote(value)}" for key, value in settings.items() if value is not None)
        negative = p.get("negative_prompt")
        negative_line = f"\nNegative prompt: {negative}" if negative else ""
        return f"{self.prompt}{negative_line}\n{line}".strip()

    def as_object(self) -> dict[str, Any]:
        """The recipe as the JSON object the ``omni_studio`` chunk holds (what audio files carry)."""
        body: dict[str, Any] = json.loads(self.to_json())
        return body

    def chunks(self) -> tuple[tuple[str, str], ...]:
        """The PNG text chunks, A1111's first (readers that take the first text chunk find it)."""
        return ((PARAMETERS_KEY, self.a1111_text()), (RECIPE_KEY, self.to_json()))


# -- building recipes while a run goes ----------------------------------------------------------


@dataclass(frozen=True)
class RunRecipe:
    """The recipe of a run before its outputs exist; :meth:`for_seed` makes each image's own."""

    base: Recipe

    @classmethod
    def of(cls, resolved: ResolvedRequest, config: PipelineConfig, fingerprint: str | None) -> RunRecipe:
        """The recipe every output of ``resolved`` on ``config`` shares (all but the seed)."""
        request = resolved.request
        source = request.image
        # The source's PNG is the file the run store keeps for the run (same encoding, cached on the
        # image, so the recorder reuses it): its sha256 finds the file again when re-running.
        source_sha = hashlib.sha256(png_bytes(source)).hexdigest() if source is not None else None
        parameters = dict(resolved.parameters)
        parameters["n"] = 1
        return cls(
            Recipe(
                prompt=request.prompt,
                parameters=parameters,
                model=config.model_name,
                config_hash=config.config_hash(),
                config=config.to_dict(),
                fingerprint=fingerprint,
                studio_version=__version__,
                history=tuple((turn.role, turn.text) for turn in request.history),
                source_image_sha256=source_sha,
            )
        )

    def for_seed(self, seed: int) -> Recipe:
        """The recipe of the output made with ``seed`` (output ``i`` of a request uses seed + i)."""
        return replace(self.base, parameters={**self.base.parameters, "seed": seed})

    def stamp(self, event: RunFinished) -> None:
        """Attach each output image's recipe to it, and each spoken output's to the output (its
        ``extras``, read by :func:`audio_recipe`), before anything encodes them."""
        for output in event.outputs:
            if output.audio is not None:
                output.extras[AUDIO_RECIPE_EXTRA] = self.for_seed(output.seed).as_object()
            if not output.images:
                continue
            chunks = self.for_seed(output.seed).chunks()
            for image in output.images:
                attach_png_text(image, chunks)


AUDIO_RECIPE_EXTRA = "omni_studio_recipe"  # RunOutput.extras key of a spoken output's recipe


def audio_recipe(output: RunOutput) -> dict[str, Any] | None:
    """The recipe :class:`RecipeStamper` attached to a spoken output (``RunOutput.audio``), as the JSON
    object ``studio.media.audio.encode_audio`` writes into WAV and FLAC files; ``None`` when unstamped.

    Every encoder of a run's audio (the run store's WAV, the CLI's ``--out``, API responses) passes it,
    so the same samples give the same bytes wherever they are written (docs/speech.md).
    """
    recipe = output.extras.get(AUDIO_RECIPE_EXTRA)
    return recipe if isinstance(recipe, dict) else None


class RecipeStamper:
    """A run's tracker that writes the run's recipe into its output images as they pass.

    :class:`studio.runs.service.RunService` hands every caller (API, UI, CLI) this wrapper, and every engine event
    reaches the tracker before the caller sees it, so the images are stamped before any encoding: the
    one place the request, resolved parameters, config and fingerprint are known together.
    """

    def __init__(self, tracker: Any, recipe: RunRecipe) -> None:
        self.tracker = tracker
        self.recipe = recipe
        self.run_id: str = tracker.run_id

    def observe(self, event: EngineEvent) -> None:
        if isinstance(event, RunFinished):
            self.recipe.stamp(event)
        self.tracker.observe(event)

    def fail(self, message: str, cancelled: bool = False) -> bool:
        return bool(self.tracker.fail(message, cancelled=cancelled))

    def finished(self) -> bool:
        return bool(self.tracker.finished())

    def __getattr__(self, name: str) -> Any:  # anything else the wrapped tracker offers
        return getattr(self.tracker, name)


# -- reading recipes back -------------------------------------------------------------------------


def png_text_chunks(data: bytes, name: str = "the file") -> dict[str, str]:
    """The text chunks (tEXt, zTXt, iTXt) of PNG ``data``; :class:`RecipeError` if it is not a PNG."""
    if not data.startswith(PNG_SIGNATURE):
        raise RecipeError(f"{name} is not a PNG file")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # text chunks after the image data are read only here
            text = getattr(image, "text", None) or {}
            return {str(k): str(v) for k, v in text.items()}
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise RecipeError(f"{name} is not a readable PNG ({exc})") from exc


GRID_KEY = "grid"  # in a job grid's JSON chunk: the job spec (no single request to restore)


def grid_recipe_chunks(job_id: str, label: str, spec: dict[str, Any]) -> list[tuple[str, str]]:
    """The text chunks of a batch job's grid PNG: a ``parameters`` line naming the job and its axes (what
    A1111 readers show), and our JSON chunk holding the job spec, so the grid can be submitted again
    (``omni-studio batch``; docs/jobs.md). No clock: the same job and cells give the same bytes."""
    axes = [
        f"{name.upper()}: {axis.get('param')} {_quote(axis.get('values'))}"
        for name, axis in (("x", spec.get("x")), ("y", spec.get("y")))
        if isinstance(axis, dict)
    ]
    settings = [
        f"Grid: {label}",
        f"Prompts: {len(spec.get('prompts') or [])}",
        f"Seeds: {_quote(spec.get('seeds'))}",
        *axes,
    ]
    if spec.get("model"):
        settings.append(f"Model: {spec['model']}")
    body = {"recipe": RECIPE_VERSION, GRID_KEY: spec, "job": job_id, "studio_version": __version__}
    return [
        (PARAMETERS_KEY, f"grid of {label}\n" + ", ".join(settings)),
        (RECIPE_KEY, json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)),
    ]


def is_audio_file(data: bytes) -> bool:
    """WAV or FLAC bytes (the audio files that carry a recipe: docs/speech.md, "The recipe in WAV and FLAC")."""
    return (data[:4] == b"RIFF" and data[8:12] == b"WAVE") or data[:4] == b"fLaC"


def read_recipe(data: bytes, name: str = "the file") -> Recipe:
    """The recipe in ``data``: a PNG's ``omni_studio`` chunk, else its A1111 ``parameters`` chunk; a WAV's or
    FLAC's comment (a spoken run's file).

    Raises :class:`RecipeError` naming ``name`` when it is none of these or carries no recipe.
    """
    if is_audio_file(data):
        from studio.media.audio import read_audio_recipe

        body = read_audio_recipe(data)
        if body is None:
            raise RecipeError(
                f"{name} carries no recipe: WAV and FLAC files saved by Omni Studio keep one in their "
                "comment, and this one has none"
            )
        try:
            return parse_recipe_object(body)
        except RecipeError as exc:
            raise RecipeError(f"{name}: {exc}") from None
    if not data.startswith(PNG_SIGNATURE):
        raise RecipeError(f"{name} is not a PNG, WAV or FLAC file")
    chunks = png_text_chunks(data, name)
    notes: list[str] = []
    if RECIPE_KEY in chunks and _is_grid(chunks[RECIPE_KEY]):
        raise RecipeError(
            f"{name} is a batch job's grid: its '{RECIPE_KEY}' chunk holds the job, not one request; "
            "submit the job again with omni-studio batch or the Batch tab (docs/jobs.md)"
        )
    if RECIPE_KEY in chunks:
        try:
            return parse_recipe_json(chunks[RECIPE_KEY])
        except RecipeError as exc:
            if PARAMETERS_KEY not in chunks:
                raise RecipeError(f"{name}: {exc}") from None
            notes.append(f"{exc}; read the A1111 'parameters' chunk instead")
    if PARAMETERS_KEY in chunks:
        recipe = parse_a1111(chunks[PARAMETERS_KEY])
        return replace(recipe, notes=(*notes, *recipe.notes))
    raise RecipeError(
        f"{name} carries no recipe: it has no '{RECIPE_KEY}' or '{PARAMETERS_KEY}' text chunk "
        "(PNGs saved by Omni Studio or A1111 have one)"
    )


def _is_grid(text: str) -> bool:
    try:
        body = json.loads(text)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get(GRID_KEY), dict)


def parse_recipe_json(text: str) -> Recipe:
    """A :class:`Recipe` from the ``omni_studio`` chunk's JSON; :class:`RecipeError` when it is not one."""
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise RecipeError(f"the '{RECIPE_KEY}' chunk is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise RecipeError(f"the '{RECIPE_KEY}' chunk is not a JSON object")
    return parse_recipe_object(body)


def parse_recipe_object(body: dict[str, Any]) -> Recipe:
    """A :class:`Recipe` from the recipe's JSON object (a PNG's chunk, a WAV's or FLAC's comment)."""
    version = body.get("recipe")
    request = body.get("request")
    parameters = body.get("parameters")
    if not isinstance(version, int) or version < 1:
        raise RecipeError(f"the '{RECIPE_KEY}' chunk has no recipe version (field 'recipe')")
    if not isinstance(request, dict) or not isinstance(request.get("prompt"), str):
        raise RecipeError(f"the '{RECIPE_KEY}' chunk has no request.prompt")
    if not isinstance(parameters, dict):
        raise RecipeError(f"the '{RECIPE_KEY}' chunk has no parameters object")
    notes = []
    if version > RECIPE_VERSION:
        notes.append(
            f"recipe version {version} is newer than this studio reads ({RECIPE_VERSION}); "
            "fields it does not know were left out"
        )
    history = tuple(
        (str(turn.get("role", "user")), str(turn.get("text", "")))
        for turn in request.get("history") or []
        if isinstance(turn, dict)
    )
    config = body.get("config")
    return Recipe(
        prompt=request["prompt"],
        parameters=parameters,
        origin=OMNI_STUDIO,
        model=_str_or_none(body.get("model")),
        config_hash=_str_or_none(body.get("config_hash")),
        config=config if isinstance(config, dict) else None,
        fingerprint=_str_or_none(body.get("fingerprint")),
        studio_version=_str_or_none(body.get("studio_version")),
        history=history,
        source_image_sha256=_str_or_none(request.get("source_image_sha256")),
        version=version,
        notes=tuple(notes),
    )


# A1111's settings line: "Key: value, Key: value, ..."; a value holding ',', ':' or a newline is written as
# a JSON string (A1111's quote()), so it is read back with the JSON decoder.
_KEY = re.compile(r"\s*(\w[\w \-/]*?):\s*")
_JSON = json.JSONDecoder()
_SIZE = re.compile(r"^(\d+)x(\d+)$")
# A1111 setting -> (engine parameter, type); Size and Model are handled on their own.
_A1111_FIELDS: Mapping[str, tuple[str, type]] = {
    "Steps": ("num_inference_steps", int),
    "CFG scale": ("guidance_scale", float),
    "Seed": ("seed", int),
}
MIN_SETTINGS = 3  # a last line with fewer "Key: value" items is still prompt text (as A1111 reads it)


def _quote(value: Any) -> str:
    text = str(value)
    if "," in text or ":" in text or "\n" in text:
        return json.dumps(text, ensure_ascii=False)
    return text


def settings_line(line: str) -> list[tuple[str, str]]:
    """The ``Key: value`` items of an A1111 settings line, in order (quoted values decoded)."""
    items: list[tuple[str, str]] = []
    pos = 0
    while pos < len(line):
        match = _KEY.match(line, pos)
        if match is None:  # not an item: skip to the next separator
            comma = line.find(",", pos)
            if comma < 0:
                break
            pos = comma + 1
            continue
        key, pos = match.group(1).strip(), match.end()
        value: str
        if line.startswith('"', pos):
            try:
                decoded, pos = _JSON.raw_decode(line, pos)
                value = str(decoded)
            except ValueError:
                comma = line.find(",", pos)
                end = len(line) if comma < 0 else comma
                value, pos = line[pos:end].strip(), end
        else:
            comma = line.find(",", pos)
            end = len(line) if comma < 0 else comma
            value, pos = line[pos:end].strip(), end
        items.append((key, value))
        while pos < len(line) and line[pos] in " ,":
            pos += 1
    return items


def parse_a1111(text: str) -> Recipe:
    """A :class:`Recipe` from an A1111 ``parameters`` text: prompt, negative prompt and what maps
    (steps, CFG scale, seed, size, model); every other setting is listed in ``unmapped``."""
    lines = text.strip().split("\n")
    settings: list[tuple[str, str]] = []
    if lines and len(settings_line(lines[-1])) >= MIN_SETTINGS:
        settings = settings_line(lines.pop())
    prompt_lines: list[str] = []
    negative_lines: list[str] = []
    for line in lines:
        stripped = line.strip()
        if not negative_lines and stripped.startswith("Negative prompt:"):
            negative_lines.append(stripped[len("Negative prompt:") :].strip())
        elif negative_lines:
            negative_lines.append(stripped)
        else:
            prompt_lines.append(stripped)
    parameters: dict[str, Any] = {}
    negative = "\n".join(negative_lines).strip()
    if negative:
        parameters["negative_prompt"] = negative
    model: str | None = None
    unmapped: list[str] = []
    notes: list[str] = []
    for key, value in settings:
        if key in _A1111_FIELDS:
            name, kind = _A1111_FIELDS[key]
            try:
                parameters[name] = kind(value)
            except ValueError:
                notes.append(f"{key}: {value!r} is not a {'whole ' if kind is int else ''}number; left out")
        elif key == "Size" and (size := _SIZE.match(value)) is not None:
            parameters["width"], parameters["height"] = int(size.group(1)), int(size.group(2))
        elif key == "Model":
            model = value
        else:
            unmapped.append(f"{key}: {value}")
    return Recipe(
        prompt="\n".join(prompt_lines).strip(),
        parameters=parameters,
        origin=A1111,
        model=model,
        unmapped=tuple(unmapped),
        notes=tuple(notes),
    )


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


__all__ = [
    "A1111",
    "AUDIO_RECIPE_EXTRA",
    "OMNI_STUDIO",
    "PARAMETERS_KEY",
    "RECIPE_KEY",
    "RECIPE_VERSION",
    "Recipe",
    "RecipeError",
    "RecipeStamper",
    "RunRecipe",
    "audio_recipe",
    "parse_a1111",
    "parse_recipe_json",
    "png_text_chunks",
    "read_recipe",
    "settings_line",
]
