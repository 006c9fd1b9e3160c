"""Terminal progress bars for a run: one bar per stage (tokens for AR stages, steps for diffusion)."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

from engine.events import DiffusionStep, EngineEvent, StageFinished, StageStarted, TextDelta, TokenProgress


class StageProgressBars:
    """Feed it a run's events; it draws and closes a tqdm bar per stage and variant."""

    def __init__(
        self, stage_names: dict[int, str], stream: TextIO | None = None, show_text: bool = False
    ) -> None:
        self.stage_names = stage_names
        self.stream = stream or sys.stderr
        self.show_text = show_text
        self.bars: dict[tuple[int, int], tqdm] = {}

    def __call__(self, event: EngineEvent) -> None:
        key = (getattr(event, "stage_id", -1), event.index)
        if isinstance(event, StageStarted):
            unit = "tok" if event.kind == "ar" else "step"
            label = f"stage {event.stage_id} {self.stage_names.get(event.stage_id, event.kind)}"
            if event.index:
                label += f" #{event.index}"
            self.bars[key] = tqdm(
                total=event.total or None,
                desc=label,
                unit=unit,
                file=self.stream,
                leave=True,
                dynamic_ncols=True,
            )
        elif isinstance(event, (TokenProgress, DiffusionStep)) and key in self.bars:
            bar = self.bars[key]
            bar.update(max(0, event.step - bar.n))
        elif isinstance(event, TextDelta) and self.show_text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, StageFinished) and key in self.bars:
            bar = self.bars.pop(key)
            if event.status != "succeeded":
                bar.set_postfix_str(event.status)
            bar.close()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()
