"""AR backends on the tiny GLM-Image model: our vLLM stage runner vs vLLM's own ``LLM.generate`` vs transformers.

Prints, for the AR stage alone (image-code generation, greedy, the same prompts everywhere):
  * engine start time of each backend;
  * tokens/s at batch 1 (requests one after another) and batch 8 (8 requests at once);
  * mean latency of 16 requests arriving 50 ms apart;
  * ratios: our runner vs vLLM's own throughput (target >= 0.9: our overhead <= 10%), and vs transformers.

Usage: ``.venv/bin/python bench/ar_backends.py [--size 64] [--repeat 5]``. On tiny CPU models framework
overhead dominates (transformers' plain loop beats vLLM's scheduler); vLLM's advantage shows on a GPU
with a real checkpoint (``bench/gpu_check.sh``). ``--model PATH`` takes a local GLM-Image checkpoint.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

BATCH = 8
ARRIVALS = 16
ARRIVAL_GAP_S = 0.05
GPU_SHARE = 0.4  # of GPU memory for each of the two vLLM engines


def make_jobs(count: int, size: int, offset: int = 0) -> list[Any]:
    from engine.events import EngineEvent
    from engine.modality import OutputAccumulator, OutputModality
    from engine.processors import grid_layout
    from engine.stages.base import StageJob

    budget = grid_layout(size, size, text_to_image=True).max_new_tokens
    jobs = []
    for i in range(offset, offset + count):
        params = {"height": size, "width": size, "seed": i, "temperature": 0.0, "max_tokens": budget}

        def ignore(event: EngineEvent) -> None:
            pass

        jobs.append(
            StageJob(
                f"bench-{i}",
                0,
                {"prompt": f"a tiny lighthouse number {i}", "image": None},
                params,
                ignore,
                OutputAccumulator((OutputModality.TOKEN_IDS,)),
            )
        )
    return jobs


def submit_all(runner: Any, jobs: list[Any], gap_s: float = 0.0) -> tuple[float, list[float]]:
    """Hand jobs to a concurrent runner (``gap_s`` apart); returns (wall seconds, per-job latencies)."""
    done = threading.Semaphore(0)
    latencies: list[float] = [0.0] * len(jobs)
    started = time.perf_counter()
    for i, job in enumerate(jobs):
        target = started + i * gap_s
        while (now := time.perf_counter()) < target:
            time.sleep(min(0.005, target - now))
        submitted = time.perf_counter()

        def finished(status: str, error: Exception | None, i: int = i, submitted: float = submitted) -> None:
            if status != "succeeded":
                print(f"job {i} {status}: {error}", file=sys.stderr)
            latencies[i] = time.perf_counter() - submitted
            done.release()

        runner.submit(job, finished)
    for _ in jobs:
        done.acquire()
    return time.perf_counter() - started, latencies


def run_sequential_worker(runner: Any, jobs: list[Any], gap_s: float = 0.0) -> tuple[float, list[float]]:
    """The transformers backend as the engine drives it: one worker thread, one job at a time, in arrival order."""
    import queue

    pending: queue.Queue = queue.Queue()
    latencies: list[float] = [0.0] * len(jobs)

    def worker() -> None:
        for _ in jobs:
            i, job, submitted = pending.get()
            runner.run([job])
            latencies[i] = time.perf_counter() - submitted

    thread = threading.Thread(target=worker)
    started = time.perf_counter()
    thread.start()
    for i, job in enumerate(jobs):
        target = started + i * gap_s
        while (now := time.perf_counter()) < target:
            time.sleep(min(0.005, target - now))
        pending.put((i, job, time.perf_counter()))
    thread.join()
    return time.perf_counter() - started, latencies


def tokens(jobs: list[Any]) -> int:
    return sum(int(job.deliver_outputs()["token_ids"].numel()) for job in jobs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-glm-image", help="built-in name or a local GLM-Image folder")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (multiple of 32)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per measurement (the median is shown)")
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="AR weights (auto: float32, like the transformers backend)",
    )
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from engine.building import build_pipeline_config, resolve_device
    from engine.config import DevicePlacement
    from engine.environment import quiet_libraries
    from engine.models import describe_model, materialize
    from engine.paths import default_data_dir, model_cache_dir
    from engine.pipelines.glm_image import GlmImageARStage
    from engine.pipelines.glm_image.ar_vllm import VllmGlmImageARStage

    quiet_libraries()
    source = describe_model(args.model)
    device = resolve_device(DevicePlacement.parse("auto"))
    stage0: dict[str, Any] = {
        "stage_id": 0,
        "max_num_seqs": BATCH,
        "enforce_eager": True,
        "dtype": args.dtype,
    }
    if device.type == "cuda":  # two vLLM engines share the GPU here
        stage0["gpu_memory_utilization"] = GPU_SHARE
    stage = build_pipeline_config(source, {"stages": [stage0]}).stage(0)
    source = materialize(source, model_cache_dir(args.data_dir or default_data_dir()))
    print(f"model {source.name} at {source.path}, {args.size}x{args.size}, device {device}")

    results: dict[str, dict[str, Any]] = {}

    # -- start both vLLM engines (ours and vLLM's own LLM), in-process on CPU ---------------------------
    t = time.perf_counter()
    ours = VllmGlmImageARStage(stage, source.path, device)
    ours.load()
    results["ours"] = {"start": time.perf_counter() - t, "b1": [], "b8": []}
    submit_all(ours, make_jobs(2, args.size, 1000))  # warm-up
    prompts = [ours.prepare(job).token_ids for job in make_jobs(BATCH, args.size)]
    budget = make_jobs(1, args.size)[0].params["max_tokens"]

    from vllm import LLM, SamplingParams, TokensPrompt

    engine_args = ours.engine_args("inproc")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if device.type == "cpu" else "1"
    t = time.perf_counter()
    llm = LLM(
        model=engine_args.model,
        tokenizer=engine_args.tokenizer,
        skip_tokenizer_init=True,
        dtype=engine_args.dtype,
        enforce_eager=engine_args.enforce_eager,
        max_num_seqs=BATCH,
        seed=0,
        kv_cache_memory_bytes=engine_args.kv_cache_memory_bytes,
        **({"gpu_memory_utilization": GPU_SHARE} if device.type == "cuda" else {}),
    )
    results["vllm"] = {"start": time.perf_counter() - t, "b1": [], "b8": []}
    params = SamplingParams(temperature=0.0, max_tokens=budget, detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(batch[:2], params, use_tqdm=False)  # warm-up

    def vllm_run(prompt_batches: list[list[Any]]) -> tuple[int, float]:
        count, started = 0, time.perf_counter()
        for prompt_batch in prompt_batches:
            outputs = llm.generate(prompt_batch, params, use_tqdm=False)
            count += sum(len(o.outputs[0].token_ids) for o in outputs)
        return count, time.perf_counter() - started

    def ours_run(jobs: list[Any], together: bool) -> tuple[int, float]:
        seconds = submit_all(ours, jobs)[0] if together else sum(submit_all(ours, [job])[0] for job in jobs)
        return tokens(jobs), seconds

    # Rounds alternate between the two so that load from elsewhere on the machine hits both alike.
    for _ in range(args.repeat):
        for key, batch_key, measure in (
            ("ours", "b1", lambda: ours_run(make_jobs(BATCH, args.size), together=False)),
            ("vllm", "b1", lambda: vllm_run([[p] for p in batch])),
            ("ours", "b8", lambda: ours_run(make_jobs(BATCH, args.size), together=True)),
            ("vllm", "b8", lambda: vllm_run([batch])),
        ):
            count, seconds = measure()
            results[key][batch_key].append(count / seconds)
    _, latencies = submit_all(ours, make_jobs(ARRIVALS, args.size, 5000), ARRIVAL_GAP_S)
    results["ours"]["latency"] = statistics.mean(latencies)
    ours.close()
    llm = None  # free it before the transformers runs

    # -- transformers (the reference backend) --------------------------------------------------------
    t = time.perf_counter()
    reference = GlmImageARStage(stage, source.path, device)
    reference.load()
    results["transformers"] = {"start": time.perf_counter() - t, "b1": []}
    reference.run(make_jobs(1, args.size, 1000))  # warm-up
    for _ in range(args.repeat):
        jobs = make_jobs(BATCH, args.size)
        seconds = run_sequential_worker(reference, jobs)[0]
        results["transformers"]["b1"].append(tokens(jobs) / seconds)
    results["transformers"]["b8"] = results["transformers"]["b1"]  # it runs one job at a time
    _, latencies = run_sequential_worker(reference, make_jobs(ARRIVALS, args.size, 5000), ARRIVAL_GAP_S)
    results["transformers"]["latency"] = statistics.mean(latencies)
    for row in results.values():
        for key in ("b1", "b8"):
            row[key] = statistics.median(row[key])

    # -- report -------------------------------------------------------------------------------------
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} torch thread(s); {budget} tokens per request"
    )
    print(f"{'backend':<34}{'start s':>9}{'b1 tok/s':>11}{'b8 tok/s':>11}{'16@50ms mean latency s':>25}")
    names = {"ours": "our vLLM stage runner", "vllm": "vLLM LLM.generate", "transformers": "transformers"}
    for key, label in names.items():
        row = results[key]
        latency = f"{row['latency']:.3f}" if "latency" in row else "-"
        print(f"{label:<34}{row['start']:>9.2f}{row['b1']:>11.0f}{row['b8']:>11.0f}{latency:>25}")
    for batch_key in ("b1", "b8"):
        ours_rate, vllm_rate, ref_rate = (results[k][batch_key] for k in ("ours", "vllm", "transformers"))
        print(
            f"{batch_key}: ours / vLLM own = {ours_rate / vllm_rate:.2f} (target >= 0.90), "
            f"ours / transformers = {ours_rate / ref_rate:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
