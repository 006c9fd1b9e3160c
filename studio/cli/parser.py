"""The ``omni-studio`` command line's parser: every command's flags, and the one :class:`StudioSettings`
built from them (:func:`settings_from_args`). Module level stays light (argparse only)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.paths import default_data_dir
from engine.tiny import BUILTIN_MODELS, DEFAULT_MODEL
from studio.errors import UserError
from studio.startup.limits import InputLimits
from studio.startup.settings import StudioSettings

FINGERPRINT_MODES = ("full", "hash", "custom", "none")
AR_BACKENDS = ("auto", "vllm", "transformers")
SERVING_COMMANDS = ("ui", "serve")  # the commands that serve, and so check the fingerprint flags


# Limits a one-off run checks (the others bound what HTTP clients send).
RUN_LIMITS = ("max_prompt_chars", "max_n", "max_steps", "max_image_side")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples in a command's epilog as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=110)


def _options(groups: tuple[str, ...], defaults: bool, limits: tuple[str, ...] | None = None):
    """A parent parser with the flag groups a command uses: ``model``, ``serving``, ``limits``, ``storage``.

    Subcommands get them with ``defaults=False`` (SUPPRESS), so a flag given before the subcommand
    (``omni-studio --db X history ls``) is not overwritten by its default; the top-level parser, which
    takes every flag, supplies the defaults.
    """
    shared = argparse.ArgumentParser(add_help=False)

    def _d(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    if "model" in groups or "model-name" in groups:
        g = shared.add_argument_group("model and pipeline")
        g.add_argument(
            "--model",
            default=_d(None),
            metavar="NAME|PATH",
            help=f"built-in model ({', '.join(BUILTIN_MODELS)}; default {DEFAULT_MODEL}) or a local HF-format folder",
        )
        if "model" in groups:
            g.add_argument(
                "--deploy-config",
                default=_d(None),
                metavar="YAML",
                help="deploy config (stage settings; default: the model's preset)",
            )
        g.add_argument(
            "--ar-backend",
            choices=AR_BACKENDS,
            default=_d(None),
            help="backend of every AR stage (default: each stage's `backend`, else auto)",
        )
        g.add_argument(
            "--devices",
            default=_d(None),
            metavar="auto|cpu|GPUS",
            help="place every stage here, whatever the deploy config's `devices` say (e.g. cpu: run a GPU "
            "deploy config unchanged on this CPU)",
        )
    if "serving" in groups:
        s = shared.add_argument_group("serving")
        s.add_argument(
            "--served-model-name",
            default=_d(None),
            metavar="NAME",
            help="model name the API answers to (default: the model's name)",
        )
        s.add_argument("--host", default=_d("127.0.0.1"), help="address to listen on (default 127.0.0.1)")
        s.add_argument(
            "--ray-address",
            default=_d(None),
            metavar="ADDR",
            help="run each stage as Ray actors on this cluster ('auto', HOST:6379, ray://HOST:10001; "
            "needs omni-studio[ray]; docs/distributed.md)",
        )
        s.add_argument("--port", type=int, default=_d(7860), help="port to listen on (default 7860)")
        s.add_argument(
            "--share",
            action="store_true",
            default=_d(False),
            help="create a public Gradio share link (UI and API)",
        )
        s.add_argument("--auth", default=_d(None), metavar="USER:PASS", help="protect the UI with a login")
        s.add_argument(
            "--api-key", default=_d(None), metavar="KEY", help="require `Authorization: Bearer KEY` on /v1/*"
        )
        s.add_argument(
            "--forwarded-allow-ips",
            default=_d(None),
            metavar="IPS",
            help="proxies whose X-Forwarded-For names the client (uvicorn's meaning: comma-separated "
            "addresses or '*'; default $FORWARDED_ALLOW_IPS, else 127.0.0.1); the client address keys "
            "the fair queue and the throttles",
        )
        s.add_argument(
            "--fingerprint-mode",
            choices=FINGERPRINT_MODES,
            default=_d("full"),
            help="system_fingerprint in responses: full, hash, custom (needs --fingerprint-value) or none",
        )
        s.add_argument(
            "--fingerprint-value",
            default=_d(None),
            metavar="VALUE",
            help="the literal fingerprint for --fingerprint-mode custom",
        )
        s.add_argument(
            "--image-reply",
            choices=("content", "images"),
            default=_d("content"),
            help="chat image replies: 'content' (image_url parts in message.content, the default) or "
            "'images' (content a string, the parts in message.images); a request's image_reply overrides it",
        )
        s.add_argument(
            "--output-url-ttl",
            type=int,
            default=_d(3600),
            metavar="SECONDS",
            help="lifetime of the signed /v1/outputs URLs that response_format 'url' returns with an API key "
            "(default 3600)",
        )
    if "limits" in groups:
        title = "limits on requests (over a limit: 400/413 naming the field and the limit)"
        if limits is not None:
            title = "limits on this run's inputs"
        group = shared.add_argument_group(title)
        for name, default, help_text in InputLimits.options():
            if limits is not None and name not in limits:
                continue
            group.add_argument(
                InputLimits.flag(name),
                type=int,
                default=_d(default),
                metavar="N",
                help=f"{help_text} (default {default})",
            )
    if "storage" in groups:
        d = shared.add_argument_group("storage")
        d.add_argument(
            "--db",
            default=_d(None),
            metavar="URL",
            help="SQLAlchemy URL of the run store (default: SQLite in the data dir)",
        )
        d.add_argument(
            "--data-dir",
            default=_d(None),
            type=Path,
            metavar="DIR",
            help="where runs, outputs and built models live (default ~/.local/share/omni-studio)",
        )
        d.add_argument(
            "--outputs",
            default=_d(None),
            metavar="URL|DIR",
            help="where output files live: a folder, or an object store such as s3://bucket/prefix "
            "(default: outputs/ in the data dir; docs/distributed.md)",
        )
        d.add_argument(
            "--outputs-option",
            action="append",
            default=_d([]),
            metavar="KEY=VALUE",
            help="an fsspec storage option for --outputs, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable)",
        )
    return shared


ALL_GROUPS = ("model", "serving", "limits", "storage")
SERVING_GROUPS = ALL_GROUPS  # ui and serve
RUN_GROUPS = ("model", "limits", "storage")
VALIDATE_GROUPS = ("model-name",)  # --model and --ar-backend: the file is the deploy config
HISTORY_GROUPS = ("storage",)


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: the top-level parser sees every argument, so a new flag there (``--outputs``)
    # would make a subcommand's shorter one (``run --out``) ambiguous; and scripts stay valid as flags grow.
    parser = argparse.ArgumentParser(
        prog="omni-studio",
        allow_abbrev=False,
        description="Omni Studio: a web studio, OpenAI-compatible API and run history over a multi-stage "
        "(AR -> diffusion) engine. With no command: `ui`.",
        parents=[_options(ALL_GROUPS, defaults=True)],
        formatter_class=_HelpFormatter,
        epilog=_examples(
            "omni-studio --model tiny-glm-shapes        # the studio on http://127.0.0.1:7860",
            "omni-studio COMMAND --help                 # the flags of one command",
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, groups: tuple[str, ...], help_text: str, examples: tuple[str, ...], **kw: Any):
        return sub.add_parser(
            name,
            allow_abbrev=False,
            parents=[_options(groups, defaults=False, **kw)],
            help=help_text,
            description=help_text[0].upper() + help_text[1:] + ".",
            formatter_class=_HelpFormatter,
            epilog=_examples(*examples),
        )

    command(
        "ui",
        SERVING_GROUPS,
        "the studio: UI and API on one port (the default command)",
        ("omni-studio ui --model tiny-glm-shapes --port 7860", "omni-studio ui --share --api-key KEY"),
    )
    serve = command(
        "serve",
        SERVING_GROUPS,
        "the OpenAI-compatible API only",
        ("omni-studio serve tiny-glm-shapes --port 8000 --api-key KEY",),
    )
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help="same as --model")

    run = command(
        "run",
        RUN_GROUPS,
        "one run from the terminal, with a progress bar per stage (recorded in history)",
        (
            'omni-studio run "a red circle on a blue background, top left" --model tiny-glm-shapes --out x.png',
            'omni-studio run "make it blue" --image x.png --out blue.png --model tiny-glm-shapes',
            'omni-studio run "hello" --model tiny-chat',
            'omni-studio run "say hello" --model tiny-qwen-omni --out hi.wav --voice Ethan   # speech',
            "omni-studio run --recipe x.png --out again.png   # re-run a PNG's recipe (flags override it)",
        ),
        limits=RUN_LIMITS,
    )
    run.add_argument(
        "prompt", nargs="?", default=None, help="what to generate (default with --recipe: its prompt)"
    )
    r = run.add_argument_group("this run (omitted values: the model's defaults)")
    r.add_argument(
        "--image", default=None, metavar="SRC", help="source image (a file or a data: URL) for image-to-image"
    )
    r.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="where to write the result (PNG for images, required; audio for speech, required, its "
        "extension picks the format: .wav .flac .mp3 .ogg; text for chat)",
    )
    r.add_argument("--seed", type=int, default=None, metavar="N", help="random seed (default: a fresh one)")
    r.add_argument("--height", type=int, default=None, metavar="H", help="image height in pixels")
    r.add_argument("--width", type=int, default=None, metavar="W", help="image width in pixels")
    r.add_argument("--steps", type=int, default=None, metavar="N", help="denoising steps")
    r.add_argument("--guidance", type=float, default=None, metavar="G", help="guidance scale")
    r.add_argument("--negative-prompt", default=None, metavar="TEXT", help="what the image should not show")
    r.add_argument(
        "--max-tokens", type=int, default=None, metavar="N", help="tokens to generate (text models)"
    )
    r.add_argument("--temperature", type=float, default=None, metavar="T", help="sampling temperature (AR)")
    r.add_argument(
        "--voice",
        default=None,
        metavar="NAME",
        help="the speaker of a model that speaks (e.g. Chelsie, Ethan)",
    )
    r.add_argument(
        "--speak-text",
        default=None,
        metavar="TEXT",
        help="a model that speaks says TEXT word for word (as /v1/audio/speech's input; PROMPT: the "
        "instructions before it)",
    )
    r.add_argument(
        "--speed",
        type=float,
        default=None,
        metavar="X",
        help="tempo of the speech, the pitch kept: 0.25 to 4.0 (2: twice as fast); default: as spoken",
    )
    r.add_argument(
        "--modalities",
        default=None,
        metavar="M",
        help="what the run makes: text, image, audio or a combination (text+audio); default: the model's "
        "(text+audio for a model that speaks; text runs its thinker alone)",
    )
    r.add_argument(
        "--n", type=int, default=1, metavar="N", help="number of outputs (seeds seed, seed+1, ...)"
    )
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    r.add_argument(
        "--recipe",
        default=None,
        metavar="FILE",
        help="re-run the recipe in a PNG saved by Omni Studio or A1111, or a WAV or FLAC saved by Omni Studio "
        "(flags given override it; docs/recipes.md)",
    )

    validate = command(
        "validate",
        VALIDATE_GROUPS,
        "validate a deploy config against a model (exit 0, or 1 with every problem by stage)",
        (
            "omni-studio validate assets/deploy/glm-image-1gpu.yaml",
            "omni-studio validate my.yaml --model tiny-chat --check-devices",
        ),
    )
    validate.add_argument("file", metavar="DEPLOY.yaml", help="the deploy config to check")
    validate.add_argument(
        "--check-devices",
        action="store_true",
        help="also check that the GPUs named in `devices` exist on this machine and that each device holds "
        "its stages' memory, estimated from the checkpoint without loading it (docs/memory.md)",
    )

    history = command(
        "history",
        HISTORY_GROUPS,
        "list, show, export and import recorded runs",
        ("omni-studio history ls --status failed", "omni-studio history show 3f2a --json"),
    )
    hsub = history.add_subparsers(dest="history_command", metavar="ACTION", required=True)

    def action(name: str, help_text: str, example: str):
        return hsub.add_parser(
            name,
            allow_abbrev=False,
            parents=[_options(HISTORY_GROUPS, defaults=False)],
            help=help_text,
            description=help_text[0].upper() + help_text[1:] + ".",
            formatter_class=_HelpFormatter,
            epilog=_examples(example),
        )

    ls = action("ls", "list runs, newest first", "omni-studio history ls --search circle --limit 10")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.add_argument("--limit", type=int, default=50, metavar="N", help="at most N runs (default 50)")
    ls.add_argument("--status", default=None, help="only runs with this status (e.g. failed)")
    ls.add_argument("--search", default=None, metavar="TEXT", help="text in the prompt")
    ls.add_argument(
        "--user", default=None, metavar="NAME", help="only the runs of this account (docs/team.md)"
    )
    ls.add_argument(
        "--output",
        default=None,
        metavar="KIND",
        help="only runs with an output of this kind: audio (the runs that spoke), image, text, source",
    )
    show = action("show", "one run in full", "omni-studio history show 3f2a")
    show.add_argument(
        "run_id", nargs="?", default=None, metavar="ID", help="a run id or a unique prefix of one"
    )
    show.add_argument(
        "--file",
        "--png",
        dest="png",
        default=None,
        metavar="FILE",
        help="instead of an ID: the run(s) a PNG, WAV or FLAC came from (by its sha256, else by its recipe)",
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    export = action(
        "export",
        "write runs, config snapshots and output files to a bundle",
        "omni-studio history export runs.zip",
    )
    export.add_argument("file", metavar="FILE", help="the bundle to write")
    imp = action(
        "import", "import a bundle (runs already present are skipped)", "omni-studio history import runs.zip"
    )
    imp.add_argument("file", metavar="FILE", help="the bundle to read")
    prune = action(
        "prune",
        "delete finished runs matching filters, with the output files no run uses any more",
        "omni-studio history prune --older-than 90 --status failed --dry-run",
    )
    prune.add_argument(
        "--older-than", type=float, metavar="DAYS", help="only runs created DAYS ago or earlier"
    )
    prune.add_argument("--status", default=None, help="only runs with this status (e.g. failed)")
    prune.add_argument("--search", default=None, metavar="TEXT", help="only runs with TEXT in the prompt")
    prune.add_argument("--model", default=None, help="only runs of this model")
    prune.add_argument("--all", action="store_true", help="every finished run (when no filter is given)")
    prune.add_argument("--dry-run", action="store_true", help="print how many runs match; delete nothing")
    prune.add_argument("--vacuum", action="store_true", help="then give the space back (VACUUM; see docs)")

    from studio.cli.accounts import add_account_commands  # light: argparse only

    add_account_commands(
        lambda name, help_text, examples: command(name, HISTORY_GROUPS, help_text, examples),
        lambda: _options(HISTORY_GROUPS, defaults=False),
    )

    from studio.cli.replay import add_replay_arguments  # light: argparse only

    replay = command(
        "replay",
        ("model", "storage"),
        "re-run recorded runs with their exact parameters and report what changed "
        "(exit 0 all identical, 1 some changed, 2 some failed; docs/replay.md)",
        (
            "omni-studio replay --filter search=circle   # each run on its own recorded model and config",
            "omni-studio replay --filter model=tiny-glm-shapes --report report.md",
            "omni-studio replay --ids 3f2a 9c01 --deploy-config new.yaml --report report.json",
        ),
    )
    add_replay_arguments(replay)

    from studio.cli.batch import BATCH_EXAMPLES, add_batch_arguments  # light: argparse only

    batch = command(
        "batch",
        RUN_GROUPS,
        "run a batch job (prompts x seeds x x/y axes) with a progress bar; prints the grid's path "
        "(docs/jobs.md)",
        BATCH_EXAMPLES,
        limits=RUN_LIMITS,
    )
    add_batch_arguments(batch)
    return parser


def _model_arg(args: argparse.Namespace) -> str | None:
    return getattr(args, "model_arg", None) or args.model


def limits_from_args(args: argparse.Namespace) -> InputLimits:
    try:
        return InputLimits(**{name: getattr(args, name) for name, _, _ in InputLimits.options()})
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def storage_options(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    """``--outputs-option KEY=VALUE`` flags as pairs (a flag without ``=`` is an error naming it)."""
    options = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UserError(
                f"--outputs-option takes KEY=VALUE (e.g. endpoint_url=http://127.0.0.1:9000), got {pair!r}"
            )
        options.append((key.strip(), value))
    return tuple(options)


def settings_from_args(args: argparse.Namespace) -> StudioSettings:
    """The studio's settings, built once from the parsed command line (and the environment)."""
    auth: tuple[str, str] | None = None
    if args.auth:
        if ":" not in args.auth:
            raise UserError("--auth takes USER:PASS")
        user, password = args.auth.split(":", 1)
        auth = (user, password)
    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    if args.command != "validate":  # validating a file writes nothing
        data_dir.mkdir(parents=True, exist_ok=True)
    settings = StudioSettings(
        data_dir=data_dir,
        model=_model_arg(args),
        deploy_config=args.deploy_config,
        ar_backend=args.ar_backend,
        devices=args.devices,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        share=args.share,
        auth=auth,
        api_key=args.api_key,
        db_url=args.db,
        limits=limits_from_args(args),
        image_reply=getattr(args, "image_reply", "content"),
        output_url_ttl=getattr(args, "output_url_ttl", 3600),
        ray_address=getattr(args, "ray_address", None),
        outputs=getattr(args, "outputs", None),
        outputs_options=storage_options(getattr(args, "outputs_option", None) or []),
    )
    if settings.output_url_ttl < 1:
        raise UserError("--output-url-ttl must be at least 1 second")
    if args.command in SERVING_COMMANDS:  # refused before anything loads; a run serves no fingerprint
        from studio.api.fingerprint import FingerprintError, FingerprintSettings  # light: no torch

        try:
            fingerprint = FingerprintSettings(args.fingerprint_mode, args.fingerprint_value)
        except FingerprintError as exc:
            raise UserError(str(exc)) from exc
        settings = replace(settings, fingerprint=fingerprint)
    return settings
