"""Autoregressive stages on vLLM: continuous batching, per-request seeds, DELTA streaming, abort on cancel.

The runner is ``concurrent``: the stage worker hands it each job as it arrives (up to the stage's
``max_num_seqs`` in flight) and vLLM's scheduler batches the running requests step by step. Each job
becomes one vLLM request (``engine/stages/vllm_requests.py``: sampling translation, DELTA outputs into job
outputs and events); a cancelled job aborts its request, which frees its slot at once.

This module is the family-independent stage: its engine args, start-up and shutdown, and submitting
jobs (the :class:`VllmARStage` base); each model family's runner subclasses it in
``engine/pipelines/<family>/ar_vllm.py`` and says how a job becomes a prompt. The two ways to drive vLLM
(``inproc``, the default on CPU; ``async``, the default on GPU; same behaviour, see ``docs/vllm.md``) are
``engine/stages/vllm_drivers.py``. ``OMNI_STUDIO_VLLM_DRIVER=inproc|async`` overrides the choice.
"""

from __future__ import annotations

import itertools
import os
from abc import abstractmethod
from pathlib import Path
from typing import Any

import torch

from engine.config import ResolvedStage
from engine.kv_cache import kv_bytes_per_token
from engine.modality import OutputModality
from engine.request import RequestError
from engine.stages.base import JobDone, StageJob, StageRunner
from engine.stages.vllm_api import AsyncEngineArgs, EngineArgs
from engine.stages.vllm_drivers import AsyncDriver, Driver, HostThreads, InprocDriver, patched_environ
from engine.stages.vllm_requests import TOKEN_ID_STREAM_INTERVAL, LiveRequest, VllmPrompt, sampling_params

DRIVERS = ("inproc", "async")
MIN_CPU_KV_CACHE_BYTES = 64 << 20
# vLLM's CPU KV cache pages by blocks of this many tokens and keeps one block of the pool back: a cache
# of exactly max_num_seqs x max_model_len tokens is refused ("estimated maximum model length is" one
# block less), so every sequence gets one block more.
KV_BLOCK_TOKENS = 128


class VllmStartError(RuntimeError):
    """vLLM could not start this stage; the message says what to change."""


# -- start-up ---------------------------------------------------------------------------------------


def choose_driver(device: torch.device) -> str:
    wanted = os.environ.get("OMNI_STUDIO_VLLM_DRIVER")
    if wanted:
        if wanted not in DRIVERS:
            raise VllmStartError(f"OMNI_STUDIO_VLLM_DRIVER={wanted!r}; use one of {', '.join(DRIVERS)}")
        return wanted
    return "inproc" if device.type == "cpu" else "async"


def default_cpu_kv_cache_bytes(
    hf_text_config: Any, dtype: torch.dtype, max_num_seqs: int, max_model_len: int
) -> int:
    """Room for every sequence at full length (and a block more, :data:`KV_BLOCK_TOKENS`), at least 64 MiB
    and at most a quarter of the memory."""
    wanted = kv_bytes_per_token(hf_text_config, dtype) * max_num_seqs * (max_model_len + KV_BLOCK_TOKENS)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(max(wanted, MIN_CPU_KV_CACHE_BYTES), total // 4))


class VllmARStage(StageRunner):
    """An AR stage on vLLM. Families say how a job becomes a prompt (:meth:`prepare`)."""

    kind = "ar"
    backend = "vllm"
    concurrent = True

    @property
    def decode_path(self) -> str:
        return "continuous batching (vLLM)"

    _counter = itertools.count()

    def __init__(self, stage: ResolvedStage, model_path: Path, device: torch.device) -> None:
        super().__init__(stage, model_path, device)
        self.driver: Driver | None = None
        self.driver_name = ""
        self.generation_defaults: dict[str, Any] = {}
        self.max_model_len = 0

    # family hooks --------------------------------------------------------------------------------

    @property
    @abstractmethod
    def vllm_model_path(self) -> Path:
        """The HF-format folder vLLM loads."""

    @property
    def tokenizer_path(self) -> Path | None:
        return None

    skip_tokenizer_init = False
    worker_extension_cls = ""

    def load_helpers(self) -> None:
        """Load what :meth:`prepare` needs besides vLLM (tokenizer, processor, vision tower)."""

    @abstractmethod
    def prepare(self, job: StageJob) -> VllmPrompt:
        """Turn a job into prompt ids and a token budget (raise ``RequestError`` for a bad request)."""

    # engine ---------------------------------------------------------------------------------------

    @property
    def modalities(self) -> tuple[OutputModality, ...]:
        return self.stage.output_modalities

    @property
    def wants_text(self) -> bool:
        return OutputModality.TEXT in self.modalities

    def engine_args(self, driver: str) -> EngineArgs:
        """The stage's engine args (vLLM names) as vLLM ``EngineArgs``."""
        args = self.stage.engine_args
        kwargs: dict[str, Any] = {
            "model": str(self.vllm_model_path),
            "tokenizer": str(self.tokenizer_path) if self.tokenizer_path else None,
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "dtype": str(self.torch_dtype).removeprefix("torch."),
            "enforce_eager": bool(args.enforce_eager),
            "max_num_seqs": self.max_batch_size,
            "enable_prefix_caching": bool(args.enable_prefix_caching),
            "trust_remote_code": bool(args.trust_remote_code),
            "tensor_parallel_size": args.tensor_parallel,
            "pipeline_parallel_size": args.pipeline_parallel,
            "seed": 0,
            "disable_log_stats": True,
            "use_tqdm_on_load": False,  # the studio's own progress bars own the terminal
        }
        for key, value in (
            ("max_model_len", args.max_model_len),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("kv_cache_memory_bytes", args.kv_cache_memory_bytes),
        ):
            if value is not None:
                kwargs[key] = int(value)
        if self.device.type == "cpu":
            if kwargs.get("kv_cache_memory_bytes") is None:
                kwargs["kv_cache_memory_bytes"] = self._default_kv_cache_bytes(kwargs.get("max_model_len"))
        elif args.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = float(args.gpu_memory_utilization)
        if args.distributed_executor_backend is not None:
            # vLLM's own scale-out (docs/vllm.md): "ray" places the tensor/pipeline-parallel workers on the
            # Ray cluster this process is connected to (RAY_ADDRESS), "mp" on this machine's GPUs.
            kwargs["distributed_executor_backend"] = args.distributed_executor_backend
        if self.worker_extension_cls:
            kwargs["worker_extension_cls"] = self.worker_extension_cls
        cls = AsyncEngineArgs if driver == "async" else EngineArgs
        return cls(**kwargs)

    def visible_devices(self) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` for vLLM's processes: the stage's ``devices`` (within any already set)."""
        gpus = self.stage.engine_args.placement.gpus
        if self.device.type != "cuda" or not gpus:
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return {"CUDA_VISIBLE_DEVICES": ",".join(physical[i] for i in gpus)}

    def _default_kv_cache_bytes(self, max_model_len: int | None) -> int:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.vllm_model_path)
        text = config.get_text_config()
        length = max_model_len or int(getattr(text, "max_position_embeddings", 4096))
        return default_cpu_kv_cache_bytes(text, self.torch_dtype, self.max_batch_size, length)

    def load(self) -> None:
        self.load_helpers()
        self.driver_name = choose_driver(self.device)
        try:
            engine_args = self.engine_args(self.driver_name)
            if isinstance(engine_args, AsyncEngineArgs):  # the async driver
                # The engine core starts in a child process: it sees only the stage's GPUs.
                with patched_environ(**self.visible_devices()):
                    self.driver = AsyncDriver(engine_args, f"stage{self.stage_id}")
            else:
                with HostThreads():
                    self.driver = InprocDriver(engine_args, f"stage{self.stage_id}")
        except Exception as exc:
            raise VllmStartError(
                f"vLLM ({self.driver_name}) could not start {self.vllm_model_path}: {type(exc).__name__}: {exc}. "
                "Run this stage on transformers instead with `backend: transformers` in the deploy config "
                "or `--ar-backend transformers`."
            ) from exc
        model_config = self.driver.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.generation_defaults = dict(model_config.get_diff_sampling_param())
        self.loaded = True

    def close(self) -> None:
        if self.driver is not None:
            driver, self.driver = self.driver, None
            driver.shutdown()
        super().close()

    def run(self, jobs: list[StageJob]) -> None:  # pragma: no cover - the engine calls submit()
        raise NotImplementedError("VllmARStage is concurrent: the engine calls submit()")

    # requests -------------------------------------------------------------------------------------

    def submit(self, job: StageJob, done: JobDone) -> None:
        if self.driver is None:
            raise RuntimeError(f"stage {self.stage_id}: the vLLM engine is not running")
        prompt = self.prepare(job)
        if len(prompt.token_ids) + prompt.max_tokens > self.max_model_len:
            raise RequestError(
                "max_tokens",
                f"prompt ({len(prompt.token_ids)} tokens) + max_tokens ({prompt.max_tokens}) exceeds the model "
                f"length {self.max_model_len}",
            )
        params = sampling_params(
            job.params,
            prompt,
            defaults=self.generation_defaults,
            stream_interval=None if self.wants_text else TOKEN_ID_STREAM_INTERVAL,
        )
        request_id = f"{job.request_id}-{job.index}-s{self.stage_id}-{next(self._counter)}"
        job.scratch["max_new_tokens"] = prompt.max_tokens
        self.driver.add(LiveRequest(self, job, done, request_id, prompt, params))

    def total_steps(self, job: StageJob) -> int:
        return int(job.scratch.get("max_new_tokens", 0))

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError(f"stage {self.stage_id} cannot produce text")

    def emit_delta(self, job: StageJob, new_ids: list[int], generated: list[int]) -> None:
        """Add one DELTA step: new token ids and/or new text, per the stage's output modalities.

        Text is the decoded difference of all generated ids, exactly as the transformers backend makes it
        (vLLM's incremental detokenizer spaces some tokenizers' first word differently).
        """
        delta: dict[str, Any] = {}
        if OutputModality.TOKEN_IDS in self.modalities:
            delta["token_ids"] = torch.tensor(new_ids, dtype=torch.long)
        if self.wants_text:
            piece = job.advance_text(self.stage_id, self.decode(generated))
            if piece:
                delta["text"] = piece
        if delta:
            job.add_output(delta)
