"""Terminal progress bars for a run: one bar per stage (tokens or codes for AR stages, steps for diffusion)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

from engine.events import DiffusionStep, EngineEvent, StageFinished, StageStarted, TextDelta, TokenProgress


def stage_labels(stages: Iterable[Any]) -> tuple[dict[int, str], dict[int, str]]:
    """Each stage's name and the unit its bar counts, from a pipeline config's ``stages``.

    A hand-off named ``<from>2<to>`` (``ar2diffusion``, ``thinker2talker``, ``talker2code2wav``) names both
    ends: the stage it feeds is ``<to>``, the stage it reads is ``<from>``; a stage no hand-off names
    is called by its kind. AR stages count tokens, except those whose tokens a stage turns into audio
    (a talker's codec ids: ``code``); diffusion stages count steps.
    """
    stages = list(stages)
    names = {s.stage_id: str(s.kind) for s in stages}
    units = {s.stage_id: "tok" if s.kind == "ar" else "step" for s in stages}
    for stage in stages:
        processor = stage.input_processor or ""
        source, sep, target = processor.partition("2")
        if not sep or not source or not target:
            continue
        names[stage.stage_id] = target
        for upstream in stage.input_sources:
            names[upstream] = source
            if units.get(upstream) == "tok" and "audio" in str(stage.engine_output_type).split("+"):
                units[upstream] = "code"
    return names, units


class StageProgressBars:
    """Feed it a run's events; it draws and closes a tqdm bar per stage and variant."""

    def __init__(
        self,
        stage_names: dict[int, str],
        stream: TextIO | None = None,
        show_text: bool = False,
        units: dict[int, str] | None = None,
    ) -> None:
        self.stage_names = stage_names
        self.units = units or {}
        self.stream = stream or sys.stderr
        self.show_text = show_text
        self.bars: dict[tuple[int, int], tqdm] = {}
        self.texted = False  # whether any text was written to stdout

    def __call__(self, event: EngineEvent) -> None:
        key = (getattr(event, "stage_id", -1), event.index)
        if isinstance(event, StageStarted):
            unit = self.units.get(event.stage_id) or ("tok" if event.kind == "ar" else "step")
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
            self.texted = True
        elif isinstance(event, StageFinished) and key in self.bars:
            bar = self.bars.pop(key)
            if event.status != "succeeded":
                bar.set_postfix_str(event.status)
            bar.close()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()
