"""Comparing one output of a run with the same output of its replay: images by their decoded pixels
(max / mean difference, PSNR), audio by its decoded samples (each one's length, max sample difference,
SNR: studio/media/audio_compare.py, the figures History's Compare shows too), text by a unified diff.

Comparing works on what the run store recorded: "identical bytes" compares the stored outputs' sha256,
and the statistics decode both stored files (so PNG or WAV metadata, such as the recipe naming the config
and fingerprint, cannot hide or fake a change). :mod:`studio.replay.report` makes the report of them.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the store (SQLAlchemy) is not needed to render a report, and the CLI parser imports this
    import numpy as np

    from studio.store.records import OutputRecord, RunDetail

# A run's "source" output is its input, the same file on both sides.
COMPARED_KINDS = ("image", "audio", "text")
MAX_TEXT_DIFF_LINES = 200  # a report stays readable; the replay run holds the whole text


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

    kind: str  # image | audio | text
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
    # Audio (studio/media/audio_compare.py): each one's length, the largest sample difference (full scale
    # 1.0) and the SNR of the replay against the original (inf: the same samples).
    before_seconds: float | None = None
    after_seconds: float | None = None
    max_sample_diff: float | None = None
    snr_db: float | None = None

    @property
    def bytes_identical(self) -> bool:
        return self.before_sha256 is not None and self.before_sha256 == self.after_sha256

    @property
    def identical(self) -> bool:
        """Same stored bytes; for images also same decoded pixels, for audio the same samples (the file
        may differ only in metadata: its recipe names the config and fingerprint)."""
        if self.bytes_identical:
            return True
        if self.kind == "audio":
            return self.max_sample_diff == 0 and self.before_seconds == self.after_seconds
        return self.kind == "image" and self.max_abs_diff == 0 and self.before_size == self.after_size

    @property
    def pair(self) -> tuple[str, str] | None:
        """(before, after) image files for a before/after view, when both exist and differ."""
        if self.kind == "image" and not self.identical and self.before_path and self.after_path:
            return self.before_path, self.after_path
        return None

    @property
    def audio_pair(self) -> tuple[str, str] | None:
        """(before, after) audio files to play side by side, when both were compared (identical or not)."""
        if self.kind == "audio" and self.before_seconds is not None and self.before_path and self.after_path:
            return self.before_path, self.after_path
        return None

    def audio_summary(self) -> str:
        """``"1.20 s -> 1.18 s · max sample difference 0.0123 · SNR 23.41 dB"`` (audio outputs)."""
        from studio.media.audio_compare import format_max, format_snr

        if self.before_seconds is None or self.after_seconds is None:
            return self.note or "not compared"
        lengths = (
            f"{self.before_seconds:.2f} s"
            if self.before_seconds == self.after_seconds
            else f"{self.before_seconds:.2f} s -> {self.after_seconds:.2f} s"
        )
        if self.max_sample_diff is None:
            return f"{lengths} · {self.note}"
        return (
            f"{lengths} · max sample difference {format_max(self.max_sample_diff)} · SNR "
            f"{format_snr(self.snr_db)} dB"
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["bytes_identical"] = self.bytes_identical
        data["identical"] = self.identical
        for key in ("psnr_db", "snr_db"):  # JSON has no infinity
            value = data[key]
            if value is not None and math.isinf(value):
                data[key] = "inf" if value > 0 else "-inf"
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
    if kind == "audio":
        return _compare_audio(base, before.path, after.path)
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


def _compare_audio(base: OutputComparison, before: Path, after: Path) -> OutputComparison:
    """The audio figures of two stored files, decoded (studio/media/audio_compare.py)."""
    from studio.media.audio_compare import file_difference

    difference = file_difference(before, after)
    return OutputComparison(
        **{
            **asdict(base),
            "before_seconds": difference.before_seconds,
            "after_seconds": difference.after_seconds,
            "max_sample_diff": difference.max_abs,
            "snr_db": difference.snr_db,
            "note": difference.note,
        }
    )


def compare_outputs(original: RunDetail, replay: RunDetail) -> list[OutputComparison]:
    """Every image, audio and text output of either run, paired by kind and index."""
    comparisons = []
    for kind in COMPARED_KINDS:
        before = {o.index: o for o in original.outputs if o.kind == kind}
        after = {o.index: o for o in replay.outputs if o.kind == kind}
        for index in sorted(set(before) | set(after)):
            comparisons.append(compare_output(kind, index, before.get(index), after.get(index)))
    return comparisons
