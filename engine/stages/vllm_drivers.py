"""Driving vLLM: the engines, the threads that step them, and torch's thread count around them.

Two ways to drive vLLM, same behaviour (see ``docs/vllm.md``):

* ``inproc`` (default on CPU): vLLM's ``LLMEngine`` with the engine core in this process, stepped by
  one driver thread. Starts in ~3 s on the tiny models. vLLM 0.32's ``AsyncLLM`` always puts the engine
  core in a child process (~23 s start on CPU), which is why CPU does not use it.
* ``async`` (default on GPU): vLLM's ``AsyncLLM`` (engine core in its own process, as ``vllm serve``
  runs it) on an asyncio loop in a driver thread.

Either takes :class:`LiveRequest` s (``engine/stages/vllm_requests.py``) and aborts a cancelled one's
request, which frees its slot at once. ``engine/stages/ar_vllm.py`` chooses the driver and starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from engine.events import StageStatus
from engine.stages.vllm_api import AsyncEngineArgs, EngineArgs, TokensPrompt
from engine.stages.vllm_requests import LiveRequest

log = logging.getLogger(__name__)

_TORCH_SET_NUM_THREADS = torch.set_num_threads  # before an in-process vLLM CPU worker replaces it

CANCEL_POLL_S = 0.05


# -- threads ----------------------------------------------------------------------------------------


def serving_threads() -> int:
    """Torch threads for an in-process vLLM CPU engine: the user's ``OMP_NUM_THREADS``, else 1."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS") or 1))
    except ValueError:
        return 1


class HostThreads:
    """Torch's thread count around an in-process vLLM CPU engine.

    vLLM serves with one torch thread (OpenMP workers spin-waiting between its many small ops cost more
    than they bring; measured here: 30-500 tok/s, erratic, with 2 threads vs a steady 400-500 with 1),
    and its CPU attention checks that the count does not change between planning and running a step.
    Its CPU worker also replaces ``torch.set_num_threads`` with a no-op for the whole process. So the
    count is set before the engine is built (and again in the driver thread), and the real function is
    put back afterwards. Torch's count is process-wide: the other stages share it (the tiny pipeline's
    transformers and diffusers stages are faster with one thread too).
    """

    def __enter__(self) -> HostThreads:
        self.set_num_threads = _TORCH_SET_NUM_THREADS
        self.set_num_threads(serving_threads())
        return self

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads = self.set_num_threads
        self.set_num_threads(serving_threads())


# -- drivers ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def patched_environ(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the block, as it was afterwards."""
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


class Driver:
    """Owns a vLLM engine and the requests in flight."""

    model_config: Any

    def add(self, live: LiveRequest) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


# In-process engines share this process's vLLM globals: the torch.distributed groups (torn down by an
# engine core's shutdown) and the forward context that a model step sets. So steps of different
# in-process engines never overlap, and only the last engine to close tears the groups down.
_INPROC_ENGINES: set[InprocDriver] = set()
_INPROC_LOCK = threading.Lock()
_INPROC_STEP_LOCK = threading.Lock()


class InprocDriver(Driver):
    """``LLMEngine`` with an in-process engine core, stepped by one thread (vLLM engines are not thread-safe)."""

    def __init__(self, engine_args: EngineArgs, name: str) -> None:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        # vLLM's CPU platform picks the multi-process executor unless this variable is "0" when the
        # config is made; set it for this engine only.
        with patched_environ(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
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
        self.live: dict[str, LiveRequest] = {}
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name=f"omni-vllm-{name}", daemon=True)
        self.thread.start()

    def add(self, live: LiveRequest) -> None:
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
        live: LiveRequest = payload
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


class AsyncDriver(Driver):
    """``AsyncLLM`` (engine core in a child process) on an asyncio loop of its own."""

    def __init__(self, engine_args: AsyncEngineArgs, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"omni-vllm-{name}", daemon=True)
        self.thread.start()
        self.live: dict[str, LiveRequest] = {}
        self.engine = asyncio.run_coroutine_threadsafe(self._create(engine_args), self.loop).result()
        self.model_config = self.engine.model_config
        self._watch = asyncio.run_coroutine_threadsafe(self._watch_cancellations(), self.loop)

    @staticmethod
    async def _create(engine_args: AsyncEngineArgs) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(engine_args)

    def add(self, live: LiveRequest) -> None:
        asyncio.run_coroutine_threadsafe(self._run(live), self.loop)

    async def _run(self, live: LiveRequest) -> None:
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
