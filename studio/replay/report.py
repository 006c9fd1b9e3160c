"""What a replay found: per run, identical or changed (pixel statistics, a text diff), the config hash and
fingerprint before and after, failures with their error, and a summary; as Markdown or JSON.

Comparing works on what the run store recorded, never on what the engine handed back: "identical bytes"
compares the stored outputs' sha256, and the pixel statistics decode both stored PNGs (so PNG metadata
cannot hide or fake a change). The service that runs replays is :mod:`studio.replay.replayer`; docs/replay.md
explains every field of the report.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the store (SQLAlchemy) is not needed to render a report, and the CLI parser imports this
    import numpy as np

    from studio.store.records import OutputRecord, RunDetail

# How a replay picks the parameters it runs with (studio/replay/replayer.py, docs/replay.md): every request-level
# parameter as recorded, or the target config's defaults for those the original took from its own config.
PARAMETER_MODES = ("recorded", "config")
VERDICTS = ("identical", "changed", "failed")
# Exit status of `omni-studio replay`, as diff(1) has it: 0 all identical, 1 something changed, 2 trouble.
EXIT_IDENTICAL, EXIT_CHANGED, EXIT_FAILED = 0, 1, 2
REPORT_FORMATS = (".md", ".json")
COMPARED_KINDS = ("image", "text")  # a run's "source" output is its input, the same file on both sides
MAX_TEXT_DIFF_LINES = 200  # a report stays readable; the replay run holds the whole text


class ReportFormatError(ValueError):
    """A report path whose extension is neither ``.md`` nor ``.json``."""


# -- comparing two outputs -------------------------------------------------------------------------


@dataclass(frozen=True)
class PixelDifference:
    """How two decoded images differ: absolute differences of 8-bit channel values and PSNR in dB.

    ``psnr_db`` is ``inf`` for identical pixels. Images of different sizes are not compared pixel by
    pixel: the statistics are ``None`` and ``same_size`` is False.
    """

    before_size: tuple[int, int]  # (width, height)
    after_size: tuple[int, int]
    max_abs: int | None
    mean_abs: float | None
    psnr_db: float | None

    @property
    def same_size(self) -> bool:
        return self.before_size == self.after_size

    @property
    def identical(self) -> bool:
        return self.same_size and self.max_abs == 0


def _pixels(path: Path) -> np.ndarray:
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        # RGBA keeps an alpha channel in the comparison; RGB images get an opaque one on both sides.
        return np.asarray(image.convert("RGBA"), dtype=np.int16)


def pixel_difference(before: Path, after: Path) -> PixelDifference:
    """Max / mean absolute difference and PSNR (peak 255) of two image files, decoded."""
    a, b = _pixels(before), _pixels(after)
    size_a, size_b = (a.shape[1], a.shape[0]), (b.shape[1], b.shape[0])
    if size_a != size_b:
        return PixelDifference(size_a, size_b, None, None, None)
    diff = abs(a - b)
    mse = float((diff.astype("float64") ** 2).mean())
    psnr = math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)
    return PixelDifference(size_a, size_b, int(diff.max()), float(diff.mean()), psnr)


def text_diff(before: str, after: str, before_label: str = "original", after_label: str = "replay") -> str:
    """A unified diff of two texts ('' when they are equal), cut at :data:`MAX_TEXT_DIFF_LINES` lines."""
    lines = list(
        difflib.unified_diff(
            before.splitlines(), after.splitlines(), before_label, after_label, lineterm="", n=2
        )
    )
    if len(lines) > MAX_TEXT_DIFF_LINES:
        lines = [*lines[:MAX_TEXT_DIFF_LINES], f"... ({len(lines) - MAX_TEXT_DIFF_LINES} more diff lines)"]
    return "\n".join(lines)


@dataclass(frozen=True)
class OutputComparison:
    """One output of the original next to the replay's output of the same kind and index."""

    kind: str  # image | text
    index: int
    before_sha256: str | None  # None: the original has no such output
    after_sha256: str | None  # None: the replay has no such output
    before_path: str | None = None
    after_path: str | None = None
    before_size: str | None = None  # "WxH" (images)
    after_size: str | None = None
    max_abs_diff: int | None = None
    mean_abs_diff: float | None = None
    psnr_db: float | None = None  # inf: identical pixels
    diff: str | None = None  # unified diff (text outputs that changed)
    note: str | None = None  # why there are no numbers (sizes differ, an output missing, a file gone)

    @property
    def bytes_identical(self) -> bool:
        return self.before_sha256 is not None and self.before_sha256 == self.after_sha256

    @property
    def identical(self) -> bool:
        """Same stored bytes; for images also same decoded pixels (the file may differ only in metadata)."""
        if self.bytes_identical:
            return True
        return self.kind == "image" and self.max_abs_diff == 0 and self.before_size == self.after_size

    @property
    def pair(self) -> tuple[str, str] | None:
        """(before, after) image files for a before/after view, when both exist and differ."""
        if self.kind == "image" and not self.identical and self.before_path and self.after_path:
            return self.before_path, self.after_path
        return None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["bytes_identical"] = self.bytes_identical
        data["identical"] = self.identical
        if self.psnr_db is not None and math.isinf(self.psnr_db):
            data["psnr_db"] = "inf"  # JSON has no infinity
        return data


def _size(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def compare_output(
    kind: str, index: int, before: OutputRecord | None, after: OutputRecord | None
) -> OutputComparison:
    """Compare one output pair from the run store (either side may be missing)."""
    base = OutputComparison(
        kind,
        index,
        before.sha256 if before else None,
        after.sha256 if after else None,
        str(before.path) if before else None,
        str(after.path) if after else None,
    )
    if before is None or after is None:
        note = "only in the replay" if before is None else "missing from the replay"
        return OutputComparison(**{**asdict(base), "note": note})
    missing = [label for label, o in (("original", before), ("replay", after)) if not o.path.exists()]
    if missing:
        return OutputComparison(
            **{**asdict(base), "note": f"the {' and '.join(missing)} file is gone from the data dir"}
        )
    if kind == "text":
        if base.bytes_identical:
            return base
        old = before.path.read_text(encoding="utf-8", errors="replace")
        new = after.path.read_text(encoding="utf-8", errors="replace")
        return OutputComparison(**{**asdict(base), "diff": text_diff(old, new) or None})
    difference = pixel_difference(before.path, after.path)
    values = {
        **asdict(base),
        "before_size": _size(difference.before_size),
        "after_size": _size(difference.after_size),
        "max_abs_diff": difference.max_abs,
        "mean_abs_diff": difference.mean_abs,
        "psnr_db": difference.psnr_db,
    }
    if not difference.same_size:
        values["note"] = (
            f"sizes differ ({_size(difference.before_size)} -> {_size(difference.after_size)}): "
            "no pixel statistics"
        )
    return OutputComparison(**values)


def compare_outputs(original: RunDetail, replay: RunDetail) -> list[OutputComparison]:
    """Every image and text output of either run, paired by kind and index."""
    comparisons = []
    for kind in COMPARED_KINDS:
        before = {o.index: o for o in original.outputs if o.kind == kind}
        after = {o.index: o for o in replay.outputs if o.kind == kind}
        for index in sorted(set(before) | set(after)):
            comparisons.append(compare_output(kind, index, before.get(index), after.get(index)))
    return comparisons


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
        if identical and not all(o.bytes_identical for o in outputs):
            notes.append(
                "pixels identical, files not: the PNGs differ outside the pixels (their recipe chunks name "
                "the config and fingerprint)"
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
    lines += [
        "| original | replay | prompt | result | max diff | mean diff | PSNR (dB) | config hash | fingerprint |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in report.entries:
        max_abs, mean_abs, psnr = entry.image_stats()
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
