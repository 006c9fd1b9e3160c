"""Autoregressive stages on vLLM: continuous batching, per-request seeds, DELTA streaming, abort on cancel.

The runner is ``concurrent``: the stage worker hands it each job as it arrives (up to the stage's
``max_num_seqs`` in flight) and vLLM's scheduler batches the running requests step by step. Each job
becomes one vLLM request with its own ``SamplingParams`` (seed, temperature/top-p/top-k/min-p,
repetition penalty, min/max tokens, stop ids, ``ignore_eos``, allowed ids) and ``output_kind=DELTA``;
every delta adds token ids and/or text to the job and reports progress; a cancelled job aborts its
request, which frees its slot at once.

This module is the family-independent part (sampling translation, drivers, threads, the
:class:`VllmARStage` base); each model family's runner subclasses it in
``engine/pipelines/<family>/ar_vllm.py`` and says how a job becomes a prompt.

Two ways to drive vLLM, same behaviour (see ``docs/vllm.md``):

* ``inproc`` (default on CPU): vLLM's ``LLMEngine`` with the engine core in this process, stepped by
  one driver thread. Starts in ~3 s on the tiny models. vLLM 0.32's ``AsyncLLM`` always puts the engine
  core in a child process (~23 s start on CPU), which is why CPU does not use it.
* ``async`` (default on GPU): vLLM's ``AsyncLLM`` (engine core in its own process, as ``vllm serve``
  runs it) on an asyncio loop in a driver thread.

``OMNI_STUDIO_VLLM_DRIVER=inproc|async`` overrides the choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# vLLM logs every engine start at INFO and reconfigures its loggers when an engine starts, so the level
# is set through its own variable (a user's setting wins).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

try:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
except Exception as exc:  # a broken install (e.g. a CUDA torchvision beside CPU torch) is "not importable"
    raise ImportError(f"vLLM is installed but does not import: {type(exc).__name__}: {exc}") from exc

from engine.config import ResolvedStage
from engine.events import FinishReason, StageStatus, TokenProgress
from engine.kv_cache import kv_bytes_per_token
from engine.modality import OutputModality
from engine.request import RequestError
from engine.stages.base import JobDone, StageJob, StageRunner

log = logging.getLogger(__name__)

_TORCH_SET_NUM_THREADS = torch.set_num_threads  # before an in-process vLLM CPU worker replaces it

PROGRESS_INTERVAL_S = 0.05
# Token-id stages (GLM-Image's image codes) get a delta every this many tokens instead of every token:
# nobody reads single codes, and vLLM building a per-step output for each request costs ~10-25% of the
# tiny model's batch-8 throughput on CPU. Text streams token by token.
TOKEN_ID_STREAM_INTERVAL = 64
CANCEL_POLL_S = 0.05
DRIVERS = ("inproc", "async")
MIN_CPU_KV_CACHE_BYTES = 64 << 20
# vLLM's CPU KV cache pages by blocks of this many tokens and keeps one block of the pool back: a cache
# of exactly max_num_seqs x max_model_len tokens is refused ("estimated maximum model length is" one
# block less), so every sequence gets one block more.
KV_BLOCK_TOKENS = 128


class VllmStartError(RuntimeError):
    """vLLM could not start this stage; the message says what to change."""


# -- what a job becomes -----------------------------------------------------------------------------


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
        detokenize=False,  # text is decoded by the runner (see emit_delta)
        output_kind=RequestOutputKind.DELTA,
        stream_interval=stream_interval,
    )


# -- one request in flight ----------------------------------------------------------------------------


class _LiveRequest:
    """A job's vLLM request: turns DELTA outputs into job outputs and events; calls ``done`` once."""

    def __init__(
        self,
        runner: VllmARStage,
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


# -- drivers ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _Driver:
    """Owns a vLLM engine and the requests in flight."""

    model_config: Any

    def add(self, live: _LiveRequest) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


# In-process engines share this process's vLLM globals: the torch.distributed groups (torn down by an
# engine core's shutdown) and the forward context that a model step sets. So steps of different
# in-process engines never overlap, and only the last engine to close tears the groups down.
_INPROC_ENGINES: set[_InprocDriver] = set()
_INPROC_LOCK = threading.Lock()
_INPROC_STEP_LOCK = threading.Lock()


class _InprocDriver(_Driver):
    """``LLMEngine`` with an in-process engine core, stepped by one thread (vLLM engines are not thread-safe)."""

    def __init__(self, engine_args: EngineArgs, name: str) -> None:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        # vLLM's CPU platform picks the multi-process executor unless this variable is "0" when the
        # config is made; set it for this engine only.
        with _environ(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
            vllm_config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
            self.engine = LLMEngine(
                vllm_config=vllm_config,
                executor_class=Executor.get_class(vllm_config),
                log_stats=False,
                multiprocess_mode=False,
            )
        with _INPROC_LOCK:
            _INPROC_ENGINES.add(self)
        self.model_config = self.engine.model_config
        self.commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.live: dict[str, _LiveRequest] = {}
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name=f"omni-vllm-{name}", daemon=True)
        self.thread.start()

    def add(self, live: _LiveRequest) -> None:
        self.commands.put(("add", live))

    def shutdown(self) -> None:
        self.stopping = True
        self.commands.put(("stop", None))
        self.thread.join(timeout=30)
        for live in list(self.live.values()):
            live.finish(StageStatus.CANCELLED)
        self.live.clear()
        with _INPROC_LOCK:
            _INPROC_ENGINES.discard(self)
            last = not _INPROC_ENGINES
        # The in-process client's private parts: vLLM offers no public way to release one engine only.
        client: Any = self.engine.engine_core
        try:
            if last:
                client.shutdown()
            elif client._finalizer.detach() is not None:
                # EngineCore.shutdown() also tears down the process's torch.distributed groups, which
                # the other in-process engines still use: release only this engine's own parts.
                core = client.engine_core
                core.structured_output_manager.clear_backend()
                core.model_executor.shutdown()
                core.scheduler.shutdown()
        except Exception:  # pragma: no cover - best effort at exit
            log.debug("vLLM engine shutdown failed", exc_info=True)

    def _apply(self, command: str, payload: Any) -> None:
        if command != "add":
            return
        live: _LiveRequest = payload
        if live.cancelled:
            live.finish(StageStatus.CANCELLED)
            return
        try:
            if live.prompt.source_grids:
                self.engine.collective_rpc(
                    "register_glm_image_source_grids", args=(live.prompt.token_ids, live.prompt.source_grids)
                )
            self.engine.add_request(
                live.request_id, TokensPrompt(prompt_token_ids=live.prompt.token_ids), live.params
            )
        except Exception as exc:
            live.finish(StageStatus.FAILED, exc)
            return
        self.live[live.request_id] = live

    def _loop(self) -> None:
        _TORCH_SET_NUM_THREADS(serving_threads())
        while not self.stopping:
            block = not self.live
            try:
                while True:
                    command, payload = self.commands.get(block=block, timeout=None)
                    block = False
                    if command == "stop":
                        return
                    self._apply(command, payload)
            except queue.Empty:
                pass
            aborted = [rid for rid, live in self.live.items() if live.cancelled]
            if aborted:
                self.engine.abort_request(aborted)
                for rid in aborted:
                    self.live.pop(rid).finish(StageStatus.CANCELLED)
            if not self.live:
                continue
            try:
                with _INPROC_STEP_LOCK:
                    outputs = self.engine.step()
            except Exception as exc:  # the engine is broken: fail what is in flight, keep taking requests
                log.exception("vLLM step failed")
                for live in list(self.live.values()):
                    live.finish(StageStatus.FAILED, exc)
                self.live.clear()
                continue
            for output in outputs:
                request = self.live.get(output.request_id)
                if request is None:
                    continue
                try:
                    request.on_output(output)
                except Exception as exc:
                    self.engine.abort_request([output.request_id])
                    request.finish(StageStatus.FAILED, exc)
                if output.finished or request.finished:
                    self.live.pop(output.request_id, None)


class _AsyncDriver(_Driver):
    """``AsyncLLM`` (engine core in a child process) on an asyncio loop of its own."""

    def __init__(self, engine_args: AsyncEngineArgs, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"omni-vllm-{name}", daemon=True)
        self.thread.start()
        self.live: dict[str, _LiveRequest] = {}
        self.engine = asyncio.run_coroutine_threadsafe(self._create(engine_args), self.loop).result()
        self.model_config = self.engine.model_config
        self._watch = asyncio.run_coroutine_threadsafe(self._watch_cancellations(), self.loop)

    @staticmethod
    async def _create(engine_args: AsyncEngineArgs) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(engine_args)

    def add(self, live: _LiveRequest) -> None:
        asyncio.run_coroutine_threadsafe(self._run(live), self.loop)

    async def _run(self, live: _LiveRequest) -> None:
        if live.cancelled:
            live.finish(StageStatus.CANCELLED)
            return
        self.live[live.request_id] = live
        try:
            if live.prompt.source_grids:
                await self.engine.collective_rpc(
                    "register_glm_image_source_grids", args=(live.prompt.token_ids, live.prompt.source_grids)
                )
            prompt = TokensPrompt(prompt_token_ids=live.prompt.token_ids)
            async for output in self.engine.generate(prompt, live.params, live.request_id):
                live.on_output(output)
                if live.finished:
                    break
        except asyncio.CancelledError:
            live.finish(StageStatus.CANCELLED)
        except Exception as exc:
            live.finish(StageStatus.FAILED, exc)
        finally:
            self.live.pop(live.request_id, None)
            if not live.finished:  # the stream ended without a finished output (aborted)
                live.finish(
                    StageStatus.CANCELLED if live.cancelled else StageStatus.FAILED,
                    None if live.cancelled else RuntimeError("vLLM ended the request without a result"),
                )

    async def _watch_cancellations(self) -> None:
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            aborted = [rid for rid, live in self.live.items() if live.cancelled and not live.finished]
            if aborted:
                await self.engine.abort(aborted)
                for rid in aborted:
                    live = self.live.get(rid)
                    if live is not None:
                        live.finish(StageStatus.CANCELLED)

    async def _shutdown(self) -> None:
        self._watch.cancel()
        for live in list(self.live.values()):
            live.finish(StageStatus.CANCELLED)
        self.engine.shutdown()

    def shutdown(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout=60)
        except Exception:  # pragma: no cover - best effort at exit
            log.debug("AsyncLLM shutdown failed", exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


# -- the runner -------------------------------------------------------------------------------------


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


def serving_threads() -> int:
    """Torch threads for an in-process vLLM CPU engine: the user's ``OMP_NUM_THREADS``, else 1."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS") or 1))
    except ValueError:
        return 1


class _HostThreads:
    """Torch's thread count around an in-process vLLM CPU engine.

    vLLM serves with one torch thread (OpenMP workers spin-waiting between its many small ops cost more
    than they bring; measured here: 30-500 tok/s, erratic, with 2 threads vs a steady 400-500 with 1),
    and its CPU attention checks that the count does not change between planning and running a step.
    Its CPU worker also replaces ``torch.set_num_threads`` with a no-op for the whole process. So the
    count is set before the engine is built (and again in the driver thread), and the real function is
    put back afterwards. Torch's count is process-wide: the other stages share it (the tiny pipeline's
    transformers and diffusers stages are faster with one thread too).
    """

    def __enter__(self) -> _HostThreads:
        self.set_num_threads = _TORCH_SET_NUM_THREADS
        self.set_num_threads(serving_threads())
        return self

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads = self.set_num_threads
        self.set_num_threads(serving_threads())


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
        self.driver: _Driver | None = None
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
                with _environ(**self.visible_devices()):
                    self.driver = _AsyncDriver(engine_args, f"stage{self.stage_id}")
            else:
                with _HostThreads():
                    self.driver = _InprocDriver(engine_args, f"stage{self.stage_id}")
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
        self.driver.add(_LiveRequest(self, job, done, request_id, prompt, params))

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
