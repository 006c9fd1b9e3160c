"""The running studio: one engine, the API's serving state over it, the run store, and pipeline changes.

The UI is a thin layer over this object (and the API and CLI call the same engine and store): nothing is
computed only in the UI. Applying a deploy config builds a new engine alongside the running one and
swaps it in only when it started; a config that fails validation or start-up leaves the old engine
serving. History survives because the store is independent of the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import json
import logging
import secrets
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine import GenerationRequest, OmniEngine, RequestError, ResolvedRequest
from engine.building import device_problems, pipeline_config_from_text
from engine.config import ConfigProblem, DeployConfigError, PipelineConfig, parse_deploy_yaml_text
from engine.engine import EngineBuildError, build_engine
from engine.events import EngineEvent, RunOutput
from engine.modality import OutputModality
from engine.models import ModelSource, describe_model
from engine.paths import DEPLOY_PRESETS_DIR
from engine.pipelines import UnknownModelFamily
from engine.tiny import BUILTIN_MODELS
from studio.accounts.identity import Identity
from studio.accounts.service import Accounts, identity_of_login
from studio.accounts.sessions import SessionUsers
from studio.api.state import ServingState
from studio.runs.service import Queued, RunRejected, RunService
from studio.store.files import WAV, OutputFiles

log = logging.getLogger("omni_studio")

PRESETS: dict[str, tuple[str | None, str]] = {
    # label -> (model the preset is for, file in assets/deploy); None: the running model's own preset
    "tiny demo (this model's CPU defaults)": (None, ""),
    "GLM-Image on 1 GPU": ("glm-image", "glm-image-1gpu.yaml"),
    "GLM-Image on 2 GPUs": ("glm-image", "glm-image-2gpu.yaml"),
}


@dataclass
class ValidationReport:
    ok: bool
    problems: list[ConfigProblem] = field(default_factory=list)
    config: PipelineConfig | None = None
    summary: str = ""

    def by_stage(self) -> dict[int | str | None, list[ConfigProblem]]:
        grouped: dict[int | str | None, list[ConfigProblem]] = {}
        for problem in self.problems:
            grouped.setdefault(problem.stage, []).append(problem)
        return grouped


@dataclass
class ShareInfo:
    requested: bool = False
    url: str | None = None
    username: str | None = None
    password: str | None = None
    api_key_generated: bool = False
    message: str = ""
    accounts: bool = False  # each user logs in with their own account (docs/team.md)


QUEUE_POLL_S = 0.25  # how often a waiting UI run reports its place in the queue


def generate_secret(nbytes: int = 12) -> str:
    return secrets.token_urlsafe(nbytes)


class Studio:
    """Owns the engine's lifecycle and everything the UI shows about it."""

    def __init__(
        self,
        engine: OmniEngine,
        serving: ServingState,
        data_dir: Path,
        recorder: Any | None = None,
        store: Any | None = None,
        deploy_text: str | None = None,
        ar_backend: str | None = None,
        devices: str | None = None,
    ) -> None:
        self.engine = engine
        self.serving = serving
        self.data_dir = Path(data_dir)
        self.recorder = recorder
        self.store = store
        self.ar_backend = ar_backend
        self.devices = devices  # --devices: kept across Apply
        self.deploy_text = deploy_text if deploy_text is not None else self.default_deploy_text(engine.model)
        files = store.files if store is not None else OutputFiles.in_data_dir(self.data_dir)
        self.runs = RunService(
            recorder,
            "ui",
            files,
            on_event=self._observe,
            limits=serving.options.limits,
            board=serving.board,
        )
        self.share = ShareInfo()
        self.admin_user: str | None = None  # the --auth login: may cancel and move anything (Queue tab)
        self.ui_users = SessionUsers()  # UI session -> the account logged in there (docs/team.md)
        self.base_url = ""
        self._apply_lock = threading.Lock()

    # -- model and deploy config ----------------------------------------------------------------

    @property
    def model(self) -> ModelSource:
        return self.engine.model

    @property
    def config(self) -> PipelineConfig:
        return self.engine.config

    @staticmethod
    def default_deploy_text(model: ModelSource) -> str:
        """The deploy YAML a model runs with when none is given (its preset, else the bare topology)."""
        if model.default_deploy_path is not None:
            return model.default_deploy_path.read_text()
        return "# built-in topology defaults; add per-stage keys to tune\nstages:\n" + "".join(
            f"- stage_id: {t.stage_id}\n" for t in model.family.templates
        )

    def preset_names(self) -> list[str]:
        return list(PRESETS)

    def preset_text(self, name: str) -> str:
        family, filename = PRESETS[name]
        if family is None:
            return self.default_deploy_text(self.model)
        path = DEPLOY_PRESETS_DIR / filename
        text = path.read_text()
        if family != self.model.family.name:
            text = (
                f"# note: this preset is for {family} models; the running model is {self.model.family.name}\n"
                + text
            )
        return text

    def validate_text(self, text: str, check_devices: bool = True) -> ValidationReport:
        """Validate deploy YAML against the running model (and, by default, this machine's devices and
        whether they hold each stage's memory, estimated from the checkpoint: docs/memory.md). The report's
        summary carries the memory table, beside the problems too when a device is short."""
        from engine.memory_estimate import CheckpointError, estimate_memory

        try:
            config = pipeline_config_from_text(self.model, text, self.ar_backend, self.devices)
            # On a Ray cluster a stage's devices are its node's, not this machine's (docs/distributed.md).
            local = check_devices and not self.engine.ray_address
            problems = device_problems(config) if local else []
        except DeployConfigError as exc:
            return ValidationReport(False, exc.problems)
        memory = ""
        if local and self.model.path is not None:
            # Free memory is measured now, beside the running engine: Apply builds the new engine before
            # it retires the old one (see _swap), so both must fit at once.
            try:
                estimate = estimate_memory(config, self.model.path)
                memory = estimate.report()
                problems += estimate.problems()
            except CheckpointError as exc:
                memory = f"memory not estimated: {exc}"
        if problems:
            return ValidationReport(False, problems, config, memory)
        return ValidationReport(True, [], config, "\n\n".join(filter(None, [config.summary(), memory])))

    def diff_text(self, text: str) -> str:
        """Unified diff of ``text`` against the running deploy YAML."""
        diff = difflib.unified_diff(
            self.deploy_text.splitlines(), text.splitlines(), "running", "edited", lineterm="", n=2
        )
        return "\n".join(diff) or "(no changes)"

    def apply_text(self, text: str) -> ValidationReport:
        """Rebuild the engine with ``text``; on any failure the running engine keeps serving."""
        report = self.validate_text(text)
        if not report.ok:
            return report
        try:
            self._swap(self.model, parse_deploy_yaml_text(text) or {})
        except ApplyFailed as exc:
            return ValidationReport(False, [ConfigProblem(None, "", f"the new engine did not start: {exc}")])
        self.deploy_text = text
        return report

    def switch_model(self, model: str) -> ValidationReport:
        """Serve another model (built-in name or folder) with its default deploy config."""
        try:
            source = describe_model(model)
            text = self.default_deploy_text(source)
            config = pipeline_config_from_text(source, text, self.ar_backend, self.devices)
        except DeployConfigError as exc:
            return ValidationReport(False, exc.problems)
        except (ValueError, UnknownModelFamily) as exc:
            return ValidationReport(False, [ConfigProblem(None, "model", str(exc))])
        try:
            self._swap(source, yaml.safe_load(text) or {})
        except ApplyFailed as exc:
            return ValidationReport(False, [ConfigProblem(None, "model", f"{model} did not start: {exc}")])
        self.deploy_text = text
        return ValidationReport(True, [], config, config.summary())

    def _swap(self, source: ModelSource, deploy: dict[str, Any]) -> None:
        """Start an engine for ``source`` with ``deploy`` (already validated) and serve it."""
        model = source.name if source.builtin else str(source.path)
        with self._apply_lock:
            try:
                new_engine = build_engine(
                    model,
                    deploy,
                    data_dir=self.data_dir,
                    ar_backend=self.ar_backend,
                    devices=self.devices,
                    max_pending=self.engine.max_pending,
                    ray_address=self.engine.ray_address,
                )
            except (EngineBuildError, DeployConfigError, ValueError) as exc:
                raise ApplyFailed(str(exc)) from exc
            old = self.engine
            self.engine = new_engine
            self.serving.set_engine(new_engine)  # re-applies the fingerprint mode over the new config hash
            threading.Thread(target=self._retire, args=(old,), daemon=True, name="omni-retire-engine").start()

    @staticmethod
    def _retire(engine: OmniEngine, grace_s: float = 120.0) -> None:
        """Let requests already running on the old engine finish, then release it."""
        import time

        deadline = time.monotonic() + grace_s
        while engine.in_flight and time.monotonic() < deadline:
            time.sleep(0.2)
        engine.close()

    # -- serving --------------------------------------------------------------------------------

    @property
    def system_fingerprint(self) -> str | None:
        handlers = self.serving.handlers
        return handlers.system_fingerprint if handlers else None

    def set_fingerprint(self, mode: str, value: str | None) -> str | None:
        return self.serving.set_fingerprint(mode, value)

    def set_api_key(self, key: str | None) -> None:
        self.serving.set_api_key(key)

    @property
    def api_key(self) -> str | None:
        return self.serving.options.api_key

    def endpoint_url(self) -> str:
        base = (self.share.url or self.base_url).rstrip("/")
        return f"{base}/v1"

    def snippet_parameters(self) -> dict[str, Any]:
        """What a request that gives nothing runs with on this model and deploy config (size, steps)."""
        keys = ("height", "width", "num_inference_steps") if self.config.family != "chat" else ("max_tokens",)
        try:
            resolved = self.engine.resolve(GenerationRequest(self.example_prompt()))
        except RequestError:
            return {}
        return {k: resolved.parameters[k] for k in keys if resolved.parameters.get(k) is not None}

    def example_prompt(self) -> str:
        return self.engine.card.example_prompt or (
            "Say hello in five words."
            if self.config.family == "chat"
            else "a red circle on a blue background"
        )

    def support_note(self, width: float | None, height: float | None, steps: float | None) -> str:
        """Markdown for the Chat tab: what the model supports, and a warning when the inputs are outside it."""
        card = self.engine.card
        supported = card.describe()
        if not supported:
            return ""
        values = {"width": width, "height": height, "num_inference_steps": steps}
        parameters = {k: int(v) for k, v in values.items() if v is not None}
        warnings = card.check(self.model.name, parameters)
        if warnings:
            return f"⚠️ **Outside what the model supports** — {warnings[0]}."
        return f"{self.model.name} supports {supported}."

    def snippets(self) -> tuple[str, str]:
        """Ready-to-paste curl and Python (openai SDK) calls against this server, for the running model."""
        parameters = self.snippet_parameters()
        if self.config.family == "chat":
            parameters = {"max_tokens": min(int(parameters.get("max_tokens", 32)), 32)}
        return api_snippets(
            self.endpoint_url(),
            self.serving.served_model_name,
            self.example_prompt(),
            parameters,
            makes_images=OutputModality.IMAGE in self.engine.family.final_modalities(self.config),
            api_key_set=bool(self.api_key),
            voice=next(iter(self.voices()), None),
        )

    # -- who is using the UI (docs/team.md) -----------------------------------------------------

    @property
    def accounts(self) -> Accounts | None:
        """The team accounts of the run store (``None`` without a store)."""
        return self.serving.accounts

    def identity(self, username: str | None) -> Identity:
        """Who a UI visitor logged in as ``username`` is, and what they may see."""
        return identity_of_login(self.accounts, username, self.admin_user)

    def admin_refusal(self, username: str | None, action: str) -> str | None:
        """Why the UI visitor logged in as ``username`` may not ``action`` (``None``: they may). With
        accounts only an admin changes what everyone runs: Apply, the model switch, a recipe's pipeline
        (docs/team.md, "What only an admin does"); without accounts everyone may, as before."""
        identity = self.identity(username)
        if not identity.accounts or identity.admin:
            return None
        who = f"logged in as {identity.name}" if identity.name else "not logged in to an account"
        return f"only an admin can {action}; {who}"

    # -- runs from the UI -----------------------------------------------------------------------

    def resolve(self, request: GenerationRequest) -> ResolvedRequest:
        return self.runs.resolve(self.engine, request)

    async def run(
        self,
        resolved: ResolvedRequest,
        payload: dict[str, Any],
        session: str | None = None,
        user: str | None = None,
    ) -> AsyncGenerator[tuple[str, EngineEvent | Queued], None]:
        """Run a UI request through the engine, recording it; yields (run id, event).

        While the request waits in a stage's queue it also yields :class:`Queued` (how many jobs are ahead
        of it) when that changes, checked every ``QUEUE_POLL_S``. ``session`` (the UI session) is held to ``--max-in-flight-per-client``:
        past it the run is recorded as refused and :class:`RunRejected` raised. ``user`` (by default the
        account logged in on ``session``) owns the run, and is the client it counts against (docs/team.md).
        """
        engine = self.engine
        user = user or self.ui_users.user_of(session)
        tracker = self.runs.start(
            engine, resolved, self.serving.served_model_name, self.system_fingerprint, payload, user=user
        )
        slots = self.serving.client_slots
        client = f"user:{user}" if user else (f"ui-session:{session}" if session else None)
        if client is not None and not slots.acquire(client):
            raise self.runs.reject(RunRejected("client_limit", slots.message()), tracker)
        stopped = "stopped from the studio"
        events = self.runs.events(engine, resolved, tracker, stopped=stopped, owner=client)
        pending: asyncio.Future[EngineEvent] | None = None
        try:
            last_ahead: int | None = None
            while True:
                pending = asyncio.ensure_future(events.__anext__())
                while True:
                    done, _ = await asyncio.wait({pending}, timeout=QUEUE_POLL_S)
                    if done:
                        break
                    ahead = engine.position(resolved.request_id)
                    if ahead is not None and ahead != last_ahead:
                        last_ahead = ahead
                        yield resolved.request_id, Queued(resolved.request_id, ahead)
                try:
                    event = await pending
                except StopAsyncIteration:
                    pending = None
                    return
                pending = None
                yield resolved.request_id, event
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, RunRejected):
                    await pending
            await events.aclose()
            tracker.fail(stopped, cancelled=True)  # a no-op when the run has its outcome already
            if client is not None:
                slots.release(client)

    def _observe(self, event: EngineEvent) -> None:
        """The studio's own runs in the speech figures, as the API's are (/metrics, the System tab)."""
        self.serving.metrics.speech.observe(self.serving.served_model_name, event)

    def keep_image(self, image: Any) -> str:
        """Write an output image to the run store's files (once per hash); returns its path."""
        kept = self.runs.keep_image(image)
        if kept is None:  # the studio's run service always has the output files
            raise RuntimeError("the studio has no output files")
        return str(kept[1])

    def keep_audio(self, output: RunOutput) -> str:
        """Write a spoken output as the run store's WAV (its recipe inside: the very file the recorder keeps
        for the run, once per hash; docs/speech.md); returns its path."""
        from studio.media.audio import encode_audio
        from studio.recipes.recipe import audio_recipe

        if output.audio is None or not output.sample_rate or self.runs.files is None:
            raise RuntimeError("no audio to keep, or the studio has no output files")
        data = encode_audio(output.audio, output.sample_rate, "wav", audio_recipe(output))
        return str(self.runs.files.write(data, WAV)[1])

    @property
    def speaks(self) -> bool:
        """Whether the running pipeline makes audio (the Chat tab then shows its speech controls)."""
        return OutputModality.AUDIO in self.engine.family.final_modalities(self.config)

    def voices(self) -> list[str]:
        """The running model's voices, the default first (empty: it does not speak)."""
        return list(self.engine.family.voices(self.model.path))

    def request_from_run(self, run_id: str) -> tuple[GenerationRequest, Any]:
        """The request that reproduces a recorded run: same prompt, parameters, seed and source image
        (what a replay sends: :func:`studio.replay.replayer.request_for_replay`)."""
        from studio.replay.replayer import request_for_replay

        if self.store is None:
            raise RuntimeError("the studio runs without a run store")
        detail = self.store.get_run(run_id)
        return request_for_replay(detail, self.config).request, detail

    def cancel(self, run_id: str | None) -> bool:
        return bool(run_id) and self.engine.cancel(run_id)

    def builtin_models(self) -> list[str]:
        names = list(BUILTIN_MODELS)
        if self.model.name not in names:
            names.append(str(self.model.path or self.model.name))
        return names

    def close(self) -> None:
        self.engine.close()
        if self.recorder is not None:
            self.recorder.close()


API_KEY_ENV = "OMNI_STUDIO_API_KEY"  # the snippets read the key from here instead of showing it


def api_snippets(
    url: str,
    model: str,
    prompt: str,
    parameters: dict[str, Any],
    *,
    makes_images: bool,
    api_key_set: bool,
    out: str = "image.png",
    voice: str | None = None,
) -> tuple[str, str]:
    """curl and Python (openai SDK) calls of ``POST {url}/chat/completions``.

    ``parameters`` are the model's defaults (size and steps, or ``max_tokens``), spelled out so a reader
    sees what to change; images are written to ``out``. With a ``voice`` (a model that speaks) the reply
    is asked for as text and audio in that voice and its audio written to ``reply.wav``. With an API key
    set, both read it from ``$OMNI_STUDIO_API_KEY`` (the key itself is never shown).
    """
    if voice is not None:
        return _speech_snippets(url, model, prompt, parameters, voice, api_key_set)
    fields = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in parameters.items())
    body = (
        f'{{"model": {json.dumps(model)}, "seed": 42,\n'
        f'       "messages": [{{"role": "user", "content": {json.dumps(prompt)}}}]'
        + (f",\n       {fields}}}" if fields else "}")
    )
    body = body.replace("'", "'\\''")  # inside the shell's single quotes
    auth = f'  -H "Authorization: Bearer ${API_KEY_ENV}" \\\n' if api_key_set else ""
    curl = f"curl -s {url}/chat/completions \\\n{auth}  -H 'Content-Type: application/json' \\\n  -d '{body}'"
    if makes_images:
        curl += (
            " \\\n  | python3 -c 'import base64, json, sys; "
            'url = json.load(sys.stdin)["choices"][0]["message"]["content"][-1]["image_url"]["url"]; '
            f'open("{out}", "wb").write(base64.b64decode(url.split(",", 1)[1]))\''
        )
    key = f'os.environ["{API_KEY_ENV}"]' if api_key_set else '"unused"'
    imports = ["import base64"] if makes_images else []
    if api_key_set:
        imports.append("import os")
    lines = [*imports, "", "from openai import OpenAI", ""] if imports else ["from openai import OpenAI", ""]
    lines += [
        f"client = OpenAI(base_url={json.dumps(url)}, api_key={key})",
        "response = client.chat.completions.create(",
        f"    model={json.dumps(model)},",
        f'    messages=[{{"role": "user", "content": {json.dumps(prompt)}}}],',
        "    seed=42,",
    ]
    if makes_images:
        lines.append(f"    extra_body={{{fields}}},")
    elif parameters:
        lines += [f"    {k}={v!r}," for k, v in parameters.items()]
    lines.append(")")
    if makes_images:
        lines += [
            'url = response.choices[0].message.content[-1]["image_url"]["url"]  # data:image/png;base64,...',
            f'with open("{out}", "wb") as f:',
            '    f.write(base64.b64decode(url.split(",", 1)[1]))',
        ]
    else:
        lines.append("print(response.choices[0].message.content)")
    return curl, "\n".join(lines) + "\n"


SPOKEN_REPLY = "reply.wav"


def _speech_snippets(
    url: str, model: str, prompt: str, parameters: dict[str, Any], voice: str, api_key_set: bool
) -> tuple[str, str]:
    """:func:`api_snippets` for a model that speaks: the reply's text printed, its audio in reply.wav."""
    audio = {"voice": voice, "format": "wav"}
    extra = {**parameters}
    fields = "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in extra.items())
    body = (
        f'{{"model": {json.dumps(model)}, "seed": 42{fields},\n'
        f'       "modalities": ["text", "audio"], "audio": {json.dumps(audio)},\n'
        f'       "messages": [{{"role": "user", "content": {json.dumps(prompt)}}}]}}'
    ).replace("'", "'\\''")
    auth = f'  -H "Authorization: Bearer ${API_KEY_ENV}" \\\n' if api_key_set else ""
    curl = (
        f"curl -s {url}/chat/completions \\\n{auth}  -H 'Content-Type: application/json' \\\n  -d '{body}' \\\n"
        "  | python3 -c 'import base64, json, sys; "
        'message = json.load(sys.stdin)["choices"][0]["message"]; print(message["content"]); '
        f'open("{SPOKEN_REPLY}", "wb").write(base64.b64decode(message["audio"]["data"]))\''
    )
    key = f'os.environ["{API_KEY_ENV}"]' if api_key_set else '"unused"'
    lines = ["import base64", *(["import os"] if api_key_set else []), "", "from openai import OpenAI", ""]
    lines += [
        f"client = OpenAI(base_url={json.dumps(url)}, api_key={key})",
        "response = client.chat.completions.create(",
        f"    model={json.dumps(model)},",
        f'    messages=[{{"role": "user", "content": {json.dumps(prompt)}}}],',
        '    modalities=["text", "audio"],',
        f"    audio={audio!r},",
        "    seed=42,",
    ]
    if extra:
        lines.append(f"    extra_body={extra!r},")
    lines += [
        ")",
        "message = response.choices[0].message",
        "print(message.content)",
        f'with open("{SPOKEN_REPLY}", "wb") as f:',
        "    f.write(base64.b64decode(message.audio.data))  # a WAV file",
    ]
    return curl, "\n".join(lines) + "\n"


class ApplyFailed(RuntimeError):
    """The new engine did not start; the old one is still serving."""
