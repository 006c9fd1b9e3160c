"""What a replay found: per run, identical or changed (pixel statistics, audio figures, a text diff), the
config hash and fingerprint before and after, failures with their error, and a summary; as Markdown or
JSON.

Each output is compared from what the run store recorded (:mod:`studio.replay.outputs`). The service that
runs replays is :mod:`studio.replay.replayer`; docs/replay.md explains every field of the report.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.replay.outputs import COMPARED_KINDS as COMPARED_KINDS  # re-exported (older callers)
from studio.replay.outputs import OutputComparison, compare_outputs
from studio.replay.outputs import PixelDifference as PixelDifference
from studio.replay.outputs import compare_output as compare_output
from studio.replay.outputs import pixel_difference as pixel_difference
from studio.replay.outputs import text_diff as text_diff

if TYPE_CHECKING:  # the store (SQLAlchemy) is not needed to render a report, and the CLI parser imports this
    from studio.store.records import RunDetail

# How a replay picks the parameters it runs with (studio/replay/replayer.py, docs/replay.md): every request-level
# parameter as recorded, or the target config's defaults for those the original took from its own config.
PARAMETER_MODES = ("recorded", "config")
VERDICTS = ("identical", "changed", "failed")
# Exit status of `omni-studio replay`, as diff(1) has it: 0 all identical, 1 something changed, 2 trouble.
EXIT_IDENTICAL, EXIT_CHANGED, EXIT_FAILED = 0, 1, 2
REPORT_FORMATS = (".md", ".json")


class ReportFormatError(ValueError):
    """A report path whose extension is neither ``.md`` nor ``.json``."""


# -- one replayed run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayEntry:
    """One original run, its replay (``replay_id``; None when nothing could be recorded) and the verdict."""

    original_id: str
    replay_id: str | None
    prompt: str
    verdict: str  # identical | changed | failed
    seed: int | None
    original_status: str
    replay_status: str | None
    model_before: str
    model_after: str | None
    config_hash_before: str | None
    config_hash_after: str | None
    fingerprint_before: str | None
    fingerprint_after: str | None
    outputs: tuple[OutputComparison, ...] = ()
    error: str | None = None  # why the replay failed
    notes: tuple[str, ...] = ()

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """(before, after) image files of every changed image."""
        return [pair for pair in (o.pair for o in self.outputs) if pair is not None]

    @property
    def audio(self) -> list[OutputComparison]:
        """The audio outputs compared sample for sample (identical or not)."""
        return [o for o in self.outputs if o.audio_pair is not None]

    def image_stats(self) -> tuple[int | None, float | None, float | None]:
        """Over the run's compared images: the largest max difference, the mean of the mean differences
        and the lowest PSNR (None where no image pair was comparable)."""
        images = [o for o in self.outputs if o.kind == "image" and o.max_abs_diff is not None]
        if not images:
            return None, None, None
        mean_values = [o.mean_abs_diff for o in images if o.mean_abs_diff is not None]
        psnr_values = [o.psnr_db for o in images if o.psnr_db is not None]
        return (
            max(o.max_abs_diff for o in images if o.max_abs_diff is not None),
            sum(mean_values) / len(mean_values) if mean_values else None,
            min(psnr_values) if psnr_values else None,
        )

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k not in ("outputs", "notes")}
        data["outputs"] = [o.to_dict() for o in self.outputs]
        data["notes"] = list(self.notes)
        return data


def compare_runs(original: RunDetail, replay: RunDetail, notes: Sequence[str] = ()) -> ReplayEntry:
    """The entry for a recorded replay: failed unless it succeeded; identical when every output is."""
    outputs = tuple(compare_outputs(original, replay)) if replay.status == "succeeded" else ()
    notes = list(notes)
    if replay.status != "succeeded":
        verdict, error = "failed", replay.error or f"the replay ended {replay.status}"
    else:
        error = None
        identical = all(o.identical for o in outputs)
        if original.status != "succeeded":
            notes.append(
                f"the original run {original.status}" + (f": {original.error}" if original.error else "")
            )
            identical = False
        verdict = "identical" if identical else "changed"
        if identical and not all(o.bytes_identical for o in outputs if o.kind == "image"):
            notes.append(
                "pixels identical, files not: the PNGs differ outside the pixels (their recipe chunks name "
                "the config and fingerprint)"
            )
        if identical and not all(o.bytes_identical for o in outputs if o.kind == "audio"):
            notes.append(
                "samples identical, files not: the WAVs differ outside the samples (their recipes name the "
                "config and fingerprint)"
            )
    return ReplayEntry(
        original_id=original.id,
        replay_id=replay.id,
        prompt=original.prompt,
        verdict=verdict,
        seed=original.seed,
        original_status=original.status,
        replay_status=replay.status,
        model_before=original.model,
        model_after=replay.model,
        config_hash_before=original.config_hash,
        config_hash_after=replay.config_hash,
        fingerprint_before=original.fingerprint,
        fingerprint_after=replay.fingerprint,
        outputs=outputs,
        error=error,
        notes=tuple(notes),
    )


def failed_entry(
    original: RunDetail,
    error: str,
    replay_id: str | None = None,
    model_after: str | None = None,
    config_hash_after: str | None = None,
    fingerprint_after: str | None = None,
    notes: Sequence[str] = (),
) -> ReplayEntry:
    """The entry for a replay that never ran (refused request, engine that did not start)."""
    return ReplayEntry(
        original_id=original.id,
        replay_id=replay_id,
        prompt=original.prompt,
        verdict="failed",
        seed=original.seed,
        original_status=original.status,
        replay_status="failed" if replay_id else None,
        model_before=original.model,
        model_after=model_after,
        config_hash_before=original.config_hash,
        config_hash_after=config_hash_after,
        fingerprint_before=original.fingerprint,
        fingerprint_after=fingerprint_after,
        error=error,
        notes=tuple(notes),
    )


# -- the whole report ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplaySummary:
    total: int
    identical: int
    changed: int
    failed: int

    @classmethod
    def of(cls, entries: Iterable[ReplayEntry]) -> ReplaySummary:
        """The counts of some entries (a finished report, or one in progress)."""
        counts = {verdict: 0 for verdict in VERDICTS}
        for entry in entries:
            counts[entry.verdict] += 1
        return cls(sum(counts.values()), counts["identical"], counts["changed"], counts["failed"])

    @property
    def text(self) -> str:
        """``"3 runs: 1 identical, 2 changed, 0 failed"``."""
        return (
            f"{self.total} run{'s' if self.total != 1 else ''}: {self.identical} identical, "
            f"{self.changed} changed, {self.failed} failed"
        )


def _now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat()


@dataclass
class ReplayReport:
    """Every replayed run, what they were replayed on, and the summary."""

    target: str  # what the runs were replayed on, in words
    parameters: str  # recorded | config (studio/replay/replayer.py PARAMETER_MODES)
    entries: list[ReplayEntry] = field(default_factory=list)
    selection: str = ""  # which runs were picked, in words
    created_at: str = field(default_factory=_now)

    @property
    def summary(self) -> ReplaySummary:
        return ReplaySummary.of(self.entries)

    @property
    def exit_code(self) -> int:
        """0 every run identical, 1 some changed (none failed), 2 some failed."""
        summary = self.summary
        if summary.failed:
            return EXIT_FAILED
        return EXIT_CHANGED if summary.changed else EXIT_IDENTICAL

    @property
    def pairs(self) -> list[tuple[str, str, str]]:
        """(label, before, after) for every changed image, in report order (the UI's slider)."""
        return [
            (f"{entry.original_id[:12]} -> {(entry.replay_id or '')[:12]} #{i}", before, after)
            for entry in self.entries
            for i, (before, after) in enumerate(entry.pairs)
        ]

    @property
    def audio_pairs(self) -> list[tuple[str, OutputComparison]]:
        """(label, comparison) for every audio output compared, identical or not, in report order (the
        UI's before/after players)."""
        return [
            (
                f"{entry.original_id[:12]} -> {(entry.replay_id or '')[:12]} audio {o.index}: "
                + ("identical" if o.identical else "changed"),
                o,
            )
            for entry in self.entries
            for o in entry.audio
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "omni-studio-replay-report",
            "version": 1,
            "created_at": self.created_at,
            "target": self.target,
            "parameters": self.parameters,
            "selection": self.selection,
            "summary": asdict(self.summary),
            "exit_code": self.exit_code,
            "runs": [entry.to_dict() for entry in self.entries],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def to_markdown(self) -> str:
        return render_markdown(self)


# -- Markdown -----------------------------------------------------------------------------------------

_VERDICT_MARK = {"identical": "✅ identical", "changed": "⚠️ changed", "failed": "❌ failed"}


def _cell(value: Any) -> str:
    """A Markdown table cell: one line, no pipe characters breaking the row."""
    text = "—" if value is None or value == "" else str(value)
    return " ".join(text.split()).replace("|", "\\|")


def _short(value: str | None, width: int = 12) -> str | None:
    return value[:width] if value else value


def format_psnr(value: float | None) -> str | None:
    if value is None:
        return None
    return "inf" if math.isinf(value) else f"{value:.2f}"


def _before_after(before: str | None, after: str | None) -> str:
    if before == after:
        return f"`{_cell(before)}` (same)"
    return f"`{_cell(before)}` → `{_cell(after)}`"


def _prompt(prompt: str, width: int = 48) -> str:
    flat = " ".join(prompt.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def render_markdown(report: ReplayReport) -> str:
    """The report for people: summary, one table row per run, then the details of what changed or failed."""
    summary = report.summary
    lines = [
        "# Replay report",
        "",
        f"- **Replayed on:** {report.target}",
        f"- **Parameters:** {report.parameters}",
    ]
    if report.selection:
        lines.append(f"- **Runs:** {report.selection}")
    lines += [
        f"- **Created:** {report.created_at}",
        "",
        f"**Summary: {summary.text}.**",
        "",
    ]
    if not report.entries:
        lines.append("No runs were replayed.")
        return "\n".join(lines) + "\n"
    # The audio column (length, max sample difference, SNR) only in reports with spoken runs.
    spoken = any(entry.audio for entry in report.entries)
    audio_header = " audio (length · max sample diff · SNR) |" if spoken else ""
    lines += [
        "| original | replay | prompt | result | max diff | mean diff | PSNR (dB) |"
        + audio_header
        + " config hash | fingerprint |",
        "|---|---|---|---|---|---|---|" + ("---|" if spoken else "") + "---|---|",
    ]
    for entry in report.entries:
        max_abs, mean_abs, psnr = entry.image_stats()
        audio = [_cell("; ".join(o.audio_summary() for o in entry.audio))] if spoken else []
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{entry.original_id[:12]}`",
                    f"`{entry.replay_id[:12]}`" if entry.replay_id else "—",
                    _cell(_prompt(entry.prompt)),
                    _VERDICT_MARK[entry.verdict],
                    _cell(max_abs),
                    _cell(None if mean_abs is None else f"{mean_abs:.3f}"),
                    _cell(format_psnr(psnr)),
                    *audio,
                    _before_after(_short(entry.config_hash_before, 8), _short(entry.config_hash_after, 8)),
                    _before_after(entry.fingerprint_before, entry.fingerprint_after),
                ]
            )
            + " |"
        )
    details = [entry for entry in report.entries if entry.verdict != "identical" or entry.notes]
    if details:
        lines += ["", "## Details"]
    for entry in details:
        lines += _entry_details(entry)
    return "\n".join(lines) + "\n"


def _entry_details(entry: ReplayEntry) -> list[str]:
    lines = [
        "",
        f"### `{entry.original_id[:12]}` → `{(entry.replay_id or 'not recorded')[:12]}`: {entry.verdict}",
        "",
        f"Prompt: {_cell(entry.prompt)} · seed {entry.seed} · model {_before_after(entry.model_before, entry.model_after)}",
    ]
    if entry.error:
        lines += ["", f"**Error:** {_cell(entry.error)}"]
    for note in entry.notes:
        lines += ["", f"Note: {_cell(note)}"]
    for output in entry.outputs:
        if output.identical:
            continue
        label = f"{output.kind} #{output.index}"
        if output.kind == "image":
            if output.note:
                lines += ["", f"- {label}: {output.note}"]
            else:
                lines += [
                    "",
                    f"- {label} ({output.before_size}): max diff {output.max_abs_diff}, mean diff "
                    f"{output.mean_abs_diff:.3f}, PSNR {format_psnr(output.psnr_db)} dB; sha256 "
                    f"`{_short(output.before_sha256)}` → `{_short(output.after_sha256)}`",
                ]
        elif output.kind == "audio" and output.before_seconds is not None:
            lines += [
                "",
                f"- {label}: {output.audio_summary()}; sha256 `{_short(output.before_sha256)}` → "
                f"`{_short(output.after_sha256)}`",
            ]
        else:
            lines += ["", f"- {label}: " + (output.note or "changed")]
            if output.diff:
                lines += ["", "```diff", output.diff, "```"]
    return lines


def write_report(report: ReplayReport, path: Path | str) -> Path:
    """Write the report as Markdown (``.md``) or JSON (``.json``), by the file's extension."""
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in REPORT_FORMATS:
        raise ReportFormatError(
            f"--report {path}: the extension picks the format; use {' or '.join(REPORT_FORMATS)}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    text = report.to_json() if suffix == ".json" else report.to_markdown()
    target.write_text(text + ("\n" if suffix == ".json" else ""), encoding="utf-8")
    return target
