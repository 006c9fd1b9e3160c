"""Fixed-seed pictures are the same pixels on every machine of a kind: a recipe shared between colleagues
redraws the same picture (docs/recipes.md, "Same picture on another machine").

The pixel sha256 is of the decoded RGB, not of the file (the PNG's recipe chunk names library versions).
Each value below was measured with `omni-studio run` on the machines named beside it; where a value
depends on the machine, the table says on what, and a machine of a kind never measured is skipped with
that reason rather than judged by another kind's value.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from engine.kernels import cpu_vendor, vector_class

SHAPES = (
    ["a red circle on a blue background, top left", "--model", "tiny-glm-shapes"],
    ["--height", "128", "--width", "128", "--seed", "7"],
)
LIGHTHOUSE = (
    ["a lighthouse", "--model", "tiny-glm-image"],
    ["--height", "64", "--width", "64", "--steps", "4", "--seed", "7"],
)
SHAPES_RGB = "de0e13b2b38e8801249fa8d669681c0ced829191c045ad7dac7fb1175dec07a8"
LIGHTHOUSE_RGB = "45d09814410321628d2a1dd247263dc56798aeda162df4237a1507e157f7b6aa"
# tiny-glm-image samples its tokens (temperature 1): a last-bit change of a logit can pick another token.
# Intel's MKL on an AVX2-only CPU fails the 8-row tile check and decodes at 16 rows (docs/batching.md).
LIGHTHOUSE_INTEL_AVX2_RGB = "a6116a1244ef93f2d15ff24ba2821ba9723f86f84c95c09bb5f3202b266041ba"

# (vector class, CPU vendor) -> expected RGB sha256. Measured: Intel Xeon AVX-512 + AMX (on main before
# the tiles), AMD EPYC Zen 4 (AVX-512), and on that AMD MKL's Intel code paths (AVX-512, and AVX2 with
# ATen and oneDNN capped at AVX2) and an AVX2-only AMD (ATen and oneDNN capped).
PINNED = {
    "tiny-glm-shapes": {("avx512", "*"): SHAPES_RGB, ("avx2", "*"): SHAPES_RGB},
    "tiny-glm-image": {
        ("avx512", "*"): LIGHTHOUSE_RGB,
        ("avx2", "AuthenticAMD"): LIGHTHOUSE_RGB,
        ("avx2", "GenuineIntel"): LIGHTHOUSE_INTEL_AVX2_RGB,
    },
}


def expected(model: str) -> str:
    table, kind, vendor = PINNED[model], vector_class(), cpu_vendor()
    value = table.get((kind, vendor)) or table.get((kind, "*"))
    if value is None:
        pytest.skip(f"no {model} picture measured on a {kind} {vendor or 'unknown-vendor'} CPU yet")
    return value


def rgb_sha256(path: Path) -> str:
    with Image.open(path) as image:
        return hashlib.sha256(image.convert("RGB").tobytes()).hexdigest()


@pytest.mark.parametrize(("model", "command"), [("tiny-glm-shapes", SHAPES), ("tiny-glm-image", LIGHTHOUSE)])
def test_a_fixed_seed_draws_the_pinned_pixels(tmp_path: Path, model: str, command: tuple) -> None:
    prompt, options = command
    out = tmp_path / "out.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "studio.cli",
            "--data-dir",
            str(tmp_path),
            "run",
            *prompt,
            *options,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert rgb_sha256(out) == expected(model)
