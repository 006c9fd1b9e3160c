"""Scoring a GLM-Image model on the shapes world through the real engine (AR -> ar2diffusion -> DiT -> VAE).

Each caption runs as an ordinary request (``engine.run``); the picture that comes back is read by the
pixel classifier and compared with what the caption asked for.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tools.shapes.classify import ATTRIBUTES, Reading, classify
from tools.shapes.world import Scene, all_scenes, held_out_scenes, training_scenes

DEPLOY_PATH = Path(__file__).resolve().parents[2] / "assets" / "deploy" / "tiny-glm-shapes.yaml"


@dataclass
class SplitScore:
    """Accuracy of one set of prompts."""

    name: str
    total: int = 0
    correct: dict[str, int] = field(default_factory=lambda: dict.fromkeys((*ATTRIBUTES, "all"), 0))

    def add(self, scene: Scene, reading: Reading) -> bool:
        ok = reading.correct(scene)
        self.total += 1
        for attr, good in ok.items():
            self.correct[attr] += int(good)
        self.correct["all"] += int(all(ok.values()))
        return all(ok.values())

    def accuracy(self, key: str = "all") -> float:
        return self.correct[key] / self.total if self.total else 0.0

    def row(self) -> str:
        cells = "  ".join(f"{k} {self.accuracy(k):6.1%}" for k in (*ATTRIBUTES, "all"))
        return f"{self.name:<10} n={self.total:<4} {cells}"


@dataclass
class Evaluation:
    splits: dict[str, SplitScore]
    seconds_per_image: float
    failures: list[tuple[str, Reading]]

    def report(self) -> str:
        lines = [s.row() for s in self.splits.values()]
        lines.append(f"time per image {self.seconds_per_image:.3f} s (engine.run, warm)")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds_per_image": round(self.seconds_per_image, 4),
            **{
                name: {"n": s.total, **{k: round(s.accuracy(k), 4) for k in s.correct}}
                for name, s in self.splits.items()
            },
        }


def pick_scenes(held_out: int | None, training: int | None, seed: int = 0) -> list[Scene]:
    """Held-out and training scenes to score (None: all of that split; a number: a fixed random sample)."""
    rng = random.Random(seed)
    held, train = held_out_scenes(), training_scenes()
    if held_out is not None and held_out < len(held):
        held = rng.sample(held, held_out)
    if training is not None and training < len(train):
        train = rng.sample(train, training)
    return held + train


def evaluate_engine(
    engine: Any,
    scenes: Sequence[Scene],
    *,
    seed: int = 0,
    params: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Evaluation:
    """Run every scene's caption through ``engine`` (seed ``seed + i``, extra request ``params``) and score
    the pictures."""
    from engine.request import GenerationParams, GenerationRequest

    splits = {
        "held-out": SplitScore("held-out"),
        "training": SplitScore("training"),
        "all": SplitScore("all"),
    }
    failures: list[tuple[str, Reading]] = []
    engine.run(GenerationRequest(scenes[0].caption, GenerationParams(seed=seed)))  # warm-up
    elapsed = 0.0
    for i, scene in enumerate(scenes):
        request = GenerationRequest(
            scene.caption, GenerationParams(seed=seed + i, height=128, width=128, **(params or {}))
        )
        start = time.perf_counter()
        image = engine.run(request).images[0]
        elapsed += time.perf_counter() - start
        reading = classify(np.asarray(image.convert("RGB")))
        ok = splits["held-out" if scene.held_out else "training"].add(scene, reading)
        splits["all"].add(scene, reading)
        if not ok:
            failures.append((scene.caption, reading))
        if progress is not None:
            progress(i + 1, len(scenes))
    return Evaluation(splits, elapsed / max(1, len(scenes)), failures)


def evaluate_model(
    model: str | Path = "tiny-glm-shapes",
    deploy: str | Path | None = DEPLOY_PATH,
    scenes: Sequence[Scene] | None = None,
    *,
    data_dir: Path | None = None,
    seed: int = 0,
    params: dict[str, Any] | None = None,
    ar_backend: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Evaluation:
    """Build an engine for ``model`` (a built-in name or a checkpoint folder) and evaluate it."""
    import tempfile

    from engine.engine import build_engine

    engine = build_engine(
        str(model),
        str(deploy) if deploy else None,
        ar_backend=ar_backend,
        data_dir=data_dir or Path(tempfile.mkdtemp(prefix="shapes-eval-")),
    )
    try:
        return evaluate_engine(
            engine,
            list(scenes) if scenes is not None else all_scenes(),
            seed=seed,
            params=params,
            progress=progress,
        )
    finally:
        engine.close()
