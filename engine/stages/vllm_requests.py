"""What a job becomes on vLLM, and one request in flight (docs/vllm.md).

Each job becomes one vLLM request with its own ``SamplingParams`` (seed, temperature/top-p/top-k/min-p,
repetition penalty, min/max tokens, stop ids, ``ignore_eos``, allowed ids) and ``output_kind=DELTA``;
every delta adds token ids and/or text to the job and reports progress. The drivers that step the
requests are ``engine/stages/vllm_drivers.py``; the stage is ``engine/stages/ar_vllm.py``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.events import FinishReason, StageStatus, TokenProgress
from engine.stages.base import JobDone, StageJob
from engine.stages.vllm_api import RequestOutputKind, SamplingParams

PROGRESS_INTERVAL_S = 0.05
# Token-id stages (GLM-Image's image codes) get a delta every this many tokens instead of every token:
# nobody reads single codes, and vLLM building a per-step output for each request costs ~10-25% of the
# tiny model's batch-8 throughput on CPU. Text streams token by token.
TOKEN_ID_STREAM_INTERVAL = 64


@dataclass
class VllmPrompt:
    """A job prepared for vLLM: prompt ids, token budget, and what to add to the outputs at the end."""

    token_ids: list[int]
    max_tokens: int
    extra_outputs: dict[str, Any] = field(default_factory=dict)
    # GLM-Image I2I: (t, h, w) per source image, registered with the model before the request.
    source_grids: list[list[int]] | None = None


def sampling_params(
    params: dict[str, Any],
    prompt: VllmPrompt,
    *,
    defaults: dict[str, Any],
    stream_interval: int | None = None,
) -> SamplingParams:
    """Stage parameters (vLLM ``SamplingParams`` names) -> ``SamplingParams`` with DELTA outputs.

    ``defaults`` are the model's generation-config defaults (what ``generate`` falls back to in the
    transformers backend); explicit parameters win. ``temperature: 0`` is greedy.
    """
    kwargs: dict[str, Any] = {k: v for k, v in defaults.items() if k not in ("max_tokens", "max_new_tokens")}
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if params.get(key) is not None:
            kwargs[key] = params[key]
    if kwargs.get("temperature") == 0:
        for key in ("top_p", "top_k", "min_p"):  # greedy: sampling filters do not apply
            kwargs.pop(key, None)
    if kwargs.get("top_k") is not None:
        kwargs["top_k"] = int(kwargs["top_k"]) if int(kwargs["top_k"]) > 0 else -1
    if params.get("min_tokens"):
        kwargs["min_tokens"] = int(params["min_tokens"])
    stop_ids = [int(i) for i in params.get("stop_token_ids") or []]
    if stop_ids:
        kwargs["stop_token_ids"] = stop_ids
    if params.get("ignore_eos"):
        kwargs["ignore_eos"] = True
    allowed = params.get("allowed_token_ids")
    if allowed:
        kwargs["allowed_token_ids"] = sorted({int(i) for i in allowed} | set(stop_ids))
    return SamplingParams(
        **kwargs,
        max_tokens=prompt.max_tokens,
        seed=int(params["seed"]) if params.get("seed") is not None else None,
        detokenize=False,  # text is decoded by the runner (see VllmARStage.emit_delta)
        output_kind=RequestOutputKind.DELTA,
        stream_interval=stream_interval,
    )


class DeltaSink(Protocol):
    """What a request in flight needs from its stage (``VllmARStage``): where its deltas go."""

    @property
    def stage_id(self) -> int: ...

    def emit_delta(self, job: StageJob, new_ids: list[int], generated: list[int]) -> None: ...


class LiveRequest:
    """A job's vLLM request: turns DELTA outputs into job outputs and events; calls ``done`` once."""

    def __init__(
        self,
        runner: DeltaSink,
        job: StageJob,
        done: JobDone,
        request_id: str,
        prompt: VllmPrompt,
        params: SamplingParams,
    ) -> None:
        self.runner = runner
        self.job = job
        self._done = done
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.ids: list[int] = []
        self.generated = 0
        self.last_report = 0.0
        self.finished = False
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled

    def on_output(self, output: Any) -> None:
        """One DELTA ``RequestOutput``."""
        completion = output.outputs[0] if output.outputs else None
        if completion is not None and completion.token_ids:
            new_ids = list(completion.token_ids)
            self.ids.extend(new_ids)
            self.runner.emit_delta(self.job, new_ids, self.ids)
            self.generated = len(self.ids)
        now = time.monotonic()
        if output.finished or now - self.last_report >= PROGRESS_INTERVAL_S:
            self.last_report = now
            self.job.emit(
                TokenProgress(
                    self.job.request_id,
                    self.job.index,
                    self.runner.stage_id,
                    step=self.generated,
                    total=self.prompt.max_tokens,
                )
            )
        if output.finished:
            reason = completion.finish_reason if completion is not None else None
            if reason == "abort" or self.job.cancelled:
                self.finish(StageStatus.CANCELLED)
                return
            self.job.finish_reason = FinishReason.LENGTH if reason == "length" else FinishReason.STOP
            try:
                if self.prompt.extra_outputs:
                    self.job.add_output(self.prompt.extra_outputs)
            except Exception as exc:
                self.finish(StageStatus.FAILED, exc)
                return
            self.finish(StageStatus.SUCCEEDED)

    def finish(self, status: StageStatus, error: Exception | None = None) -> None:
        with self._lock:
            if self.finished:
                return
            self.finished = True
        self.job.input_tokens = len(self.prompt.token_ids)
        self.job.output_tokens = self.generated
        self._done(status, error)
