"""``omni-studio replay``: replay recorded runs in this process and report what changed.

Which engine a run is replayed on: with ``--model`` and/or ``--deploy-config``, that model (default: the
run's own built-in model) with that deploy config (default: the model's preset); with neither, the run's
own model and pipeline config, rebuilt from its recorded snapshot (what "did upgrading the libraries
change my outputs?" needs). One engine is built per distinct target, in this process, and closed after
its runs. Exit status as diff(1): 0 every run identical, 1 some changed, 2 some failed or a usage error.
See docs/replay.md.

Module level stays light (argparse only): ``studio/cli/parser.py`` builds every command's parser at start.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.errors import StartupError, UserError
from studio.replay.report import PARAMETER_MODES, REPORT_FORMATS, ReportFormatError

if TYPE_CHECKING:
    from engine import OmniEngine
    from studio.replay.replayer import Replayer, ReplayTarget
    from studio.replay.report import ReplayEntry
    from studio.startup.settings import StudioSettings
    from studio.store import RunDetail, RunFilter

# --filter KEY=VALUE: the History filters (`omni-studio history ls --status/--search`, the History tab).
FILTER_KEYS = {
    "search": "search",
    "status": "status",
    "model": "model",
    "source": "source",
    "fingerprint": "fingerprint",
    "config-hash": "config_hash",
    "since": "since",
    "until": "until",
    "output": "output_kind",  # output=audio: the runs that spoke
}


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``omni-studio replay`` beyond the model and storage groups."""
    pick = parser.add_argument_group("which runs (default: the newest --limit succeeded runs)")
    pick.add_argument(
        "--filter",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help=f"History filter, repeatable; keys: {', '.join(FILTER_KEYS)} (dates YYYY-MM-DD)",
    )
    pick.add_argument(
        "--ids", nargs="+", default=None, metavar="ID", help="these runs (ids or unique prefixes)"
    )
    pick.add_argument(
        "--limit",
        type=int,
        default=50,
        metavar="N",
        help="at most N runs of a filter, newest first (default 50)",
    )
    how = parser.add_argument_group("replay and report")
    how.add_argument(
        "--params",
        choices=PARAMETER_MODES,
        default="recorded",
        help="recorded: every request parameter as recorded (default); config: the target config's defaults "
        "for those the run took from its own config's defaults",
    )
    how.add_argument(
        "--report",
        default=None,
        metavar="FILE",
        help=f"write the report to FILE ({' or '.join(REPORT_FORMATS)}, by extension); else print it",
    )
    how.add_argument("--quiet", action="store_true", help="no progress bar")


def _date(key: str, value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise UserError(f"--filter {key}={value}: dates are YYYY-MM-DD (or an ISO time)") from None
    if key == "until" and len(value) == 10:  # a whole day
        parsed = parsed.replace(hour=23, minute=59, second=59)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def parse_filter(items: list[str] | None) -> RunFilter:
    """``["status=failed", "search=circle"]`` as a :class:`RunFilter` (a usage error names a bad item)."""
    from studio.store import RunFilter

    values: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in FILTER_KEYS:
            raise UserError(f"--filter {item!r}: expected KEY=VALUE with KEY one of {', '.join(FILTER_KEYS)}")
        if not value:
            raise UserError(f"--filter {key}=: the value is empty")
        values[FILTER_KEYS[key]] = _date(key, value) if key in ("since", "until") else value
    return RunFilter(**values)


# -- engines ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetSpec:
    """Which model and deploy config a run is replayed on; runs with equal keys share one engine."""

    model: str
    deploy: Any  # a deploy YAML path, a deploy document rebuilt from a snapshot, or None (the preset)
    key: tuple[str, str]
    label: str


def _recorded_builtin(original: RunDetail) -> str | None:
    from engine.tiny import BUILTIN_MODELS

    name = ((original.config or {}).get("model") or {}).get("name")
    return name if name in BUILTIN_MODELS else None


def target_spec(original: RunDetail, settings: StudioSettings) -> TargetSpec | str:
    """The target of ``original`` under the command line, or why there is none (an error message)."""
    from studio.replay.replayer import deploy_from_snapshot

    model = settings.model or _recorded_builtin(original)
    if model is None:
        what = "no pipeline config" if original.config is None else "a model folder (not a built-in model)"
        return f"the original run recorded {what}; pass --model NAME|PATH to replay it"
    if settings.model or settings.deploy_config:
        deploy = settings.deploy_config
        label = f"model {model}, deploy config {deploy or 'the model preset'}"
        return TargetSpec(model, deploy, (model, f"file:{deploy}"), label)
    assert original.config is not None  # a built-in model name came from it
    label = f"model {model}, the recorded pipeline config {(original.config_hash or '')[:8]}"
    return TargetSpec(
        model, deploy_from_snapshot(original.config), (model, f"hash:{original.config_hash}"), label
    )


def build_target(spec: TargetSpec, settings: StudioSettings) -> ReplayTarget:
    """Start the engine of ``spec`` (raises :class:`StartupError` with the reason)."""
    from engine.config import DeployConfigError
    from engine.engine import EngineBuildError, build_engine
    from engine.models import ModelNotFound
    from engine.pipelines import UnknownModelFamily
    from studio.replay.replayer import ReplayTarget

    try:
        engine: OmniEngine = build_engine(
            spec.model,
            spec.deploy,
            data_dir=settings.data_dir,
            ar_backend=settings.ar_backend,
            devices=settings.devices,
        )
    except DeployConfigError as exc:
        raise StartupError(exc.render()) from exc
    except (ModelNotFound, UnknownModelFamily, EngineBuildError, ValueError) as exc:
        raise StartupError(str(exc)) from exc
    # Nothing is served here: each replay records its original's fingerprint as the original's settings
    # would give it on this config (studio.replay.replayer.unserved_fingerprint).
    return ReplayTarget(engine, settings.served_model_name or engine.config.model_name, served=False)


def describe_target(settings: StudioSettings) -> str:
    if settings.model or settings.deploy_config:
        model = f"model {settings.model}" if settings.model else "each run's own built-in model"
        return f"{model}, deploy config {settings.deploy_config or 'the model preset'} (omni-studio replay)"
    return "each run's own model and recorded pipeline config, rebuilt in this process (omni-studio replay)"


# -- the command -----------------------------------------------------------------------------------


def replay_command(args: argparse.Namespace, settings: StudioSettings) -> int:
    """Run ``omni-studio replay``; returns the exit status (0 identical, 1 changed, 2 failed)."""
    from studio.replay.replayer import Replayer, ReplaySelectionError, select_runs
    from studio.replay.report import ReplayReport, write_report
    from studio.runs.service import RunService
    from studio.startup.launch import close_recorder, open_recorder

    if args.report and Path(args.report).suffix.lower() not in REPORT_FORMATS:
        raise UserError(f"--report {args.report}: the extension picks the format; use .md or .json")
    if args.ids and args.filter:
        raise UserError("--ids and --filter pick runs two ways; give one of them")
    selection_filter = parse_filter(args.filter)
    try:
        recorder = open_recorder(settings)
    except StartupError as exc:
        raise UserError(str(exc)) from exc
    try:
        try:
            selection = select_runs(recorder.store, selection_filter, args.ids or (), args.limit)
        except ReplaySelectionError as exc:
            raise UserError(f"{'--ids' if args.ids else '--filter'}: {exc}") from exc
        if not selection.runs:
            raise UserError(f"no runs to replay: {selection.description}")
        runs = RunService(recorder, "cli", recorder.store.files, limits=settings.limits)
        replayer = Replayer(runs, recorder, args.params)
        report = ReplayReport(describe_target(settings), args.params, selection=selection.description)
        print(f"omni-studio replay: {selection.description}", file=sys.stderr)
        report.entries = replay_all(replayer, selection.runs, settings, quiet=args.quiet)
    finally:
        close_recorder(recorder)
    if args.report:
        try:
            path = write_report(report, args.report)
        except (ReportFormatError, OSError) as exc:
            raise UserError(str(exc)) from exc
        print(f"{report.summary.text}; report written to {path}")
    else:
        print(report.to_markdown())
    return report.exit_code


def replay_all(
    replayer: Replayer, originals: list[RunDetail], settings: StudioSettings, quiet: bool = False
) -> list[ReplayEntry]:
    """Replay every run, one engine per target at a time, with a progress bar; entries in the order of
    ``originals``. A target given on the command line that does not start is a usage error."""
    from tqdm import tqdm

    from studio.replay.report import ReplaySummary

    specs: dict[str, TargetSpec | str] = {run.id: target_spec(run, settings) for run in originals}
    groups: dict[tuple[str, str], list[RunDetail]] = {}
    entries: dict[str, ReplayEntry] = {}
    bar = tqdm(total=len(originals), desc="replay", unit="run", file=sys.stderr, disable=quiet, leave=True)

    def done(entry: ReplayEntry) -> None:
        entries[entry.original_id] = entry
        summary = ReplaySummary.of(entries.values())
        bar.set_postfix_str(
            f"{summary.identical} identical, {summary.changed} changed, {summary.failed} failed"
        )
        bar.update(1)

    try:
        for run in originals:
            spec = specs[run.id]
            if isinstance(spec, str):
                done(replayer.cannot_run(run, spec, settings.model))
            else:
                groups.setdefault(spec.key, []).append(run)
        for group in groups.values():
            spec = specs[group[0].id]
            assert isinstance(spec, TargetSpec)
            try:
                target = build_target(spec, settings)
            except StartupError as exc:
                if settings.model or settings.deploy_config:  # the command line is wrong: say so once
                    raise UserError(f"{spec.label} did not start: {exc}") from exc
                for run in group:
                    done(replayer.cannot_run(run, f"{spec.label} did not start: {exc}", spec.model))
                continue
            try:
                for run in group:
                    done(replayer.replay_blocking(run, target))
            finally:
                target.engine.close()
    finally:
        bar.close()
    return [entries[run.id] for run in originals]
