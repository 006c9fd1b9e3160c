#!/usr/bin/env bash
# GPU check: GLM-Image T2I with both stages on the GPU (AR on vLLM, DiT + VAE on diffusers), per-stage times,
# greedy token parity vLLM vs transformers, the AR backend benchmark, batch throughput at 1 and 8
# clients over HTTP (bench/throughput.py), the speech sweep at 1-16 clients (bench/speech.py), then vLLM's own scale-out (tensor parallel over the GPUs with the
# mp and Ray executors; docs/vllm.md).
#
#   bash bench/gpu_check.sh                      # the tiny model (64x64, 4 steps)
#   bash bench/gpu_check.sh /models/GLM-Image    # a local GLM-Image checkpoint (1024x1024, 50 steps)
#   SIZE=512 STEPS=20 RUNS=3 bash bench/gpu_check.sh /models/GLM-Image
#
# Needs a machine where `nvidia-smi -L` lists a GPU. Installs what is missing with scripts/setup.sh
# (the GPU build of torch and vllm). Prints everything; exits non-zero when a run fails.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

nvidia-smi -L || { echo "no GPU: nvidia-smi -L found none" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
started=$SECONDS
bash scripts/setup.sh run
echo "[gpu_check] set-up: $((SECONDS - started)) s"

export MODEL="${1:-tiny-glm-image}"
export RUNS="${RUNS:-2}"
export HF_HUB_OFFLINE=1
if [ "$MODEL" = tiny-glm-image ]; then export SIZE="${SIZE:-64}" STEPS="${STEPS:-4}"; else export SIZE="${SIZE:-1024}" STEPS="${STEPS:-50}"; fi

.venv/bin/python - <<'PY'
import os
import time

import torch

from engine.engine import build_engine
from engine.events import RunFailed, RunFinished, StageFinished
from engine.request import GenerationParams, GenerationRequest

model, size, steps, runs = os.environ["MODEL"], int(os.environ["SIZE"]), int(os.environ["STEPS"]), int(os.environ["RUNS"])
print(f"[gpu_check] torch {torch.__version__}, cuda {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
deploy = {
    "stages": [
        # Real checkpoints are bf16: run them so (the tiny one stays float32 for the parity check).
        {"stage_id": 0, "devices": "0", "max_num_seqs": 4, "enforce_eager": False,
         **({"dtype": "bfloat16", "gpu_memory_utilization": 0.5} if model != "tiny-glm-image" else {"gpu_memory_utilization": 0.3})},
        {"stage_id": 1, "devices": "0", "max_num_seqs": 1,
         **({"dtype": "bfloat16"} if model != "tiny-glm-image" else {}),
         "default_sampling_params": {"height": size, "width": size, "num_inference_steps": steps, "guidance_scale": 1.5}},
    ]
}
token_ids = {}
for backend in ("vllm", "transformers"):
    started = time.perf_counter()
    engine = build_engine(model, {**deploy, "stages": [{**deploy["stages"][0], "final_output": True,
                                                        "final_output_type": "token_ids"}, deploy["stages"][1]]},
                          ar_backend=backend)
    print(f"[gpu_check] {backend}: engine start {time.perf_counter() - started:.1f} s "
          f"({type(engine.runners[0]).__name__}, driver {getattr(engine.runners[0], 'driver_name', '-')})")
    try:
        for run in range(runs + 1):  # the first run warms up
            request = GenerationRequest("a lighthouse on a cliff at dusk, \"GLM\" written on it",
                                        GenerationParams(seed=42, temperature=0.0, height=size, width=size))
            started = time.perf_counter()
            events = list(engine.stream(engine.resolve(request)))
            total = time.perf_counter() - started
            last = events[-1]
            if isinstance(last, RunFailed):
                raise SystemExit(f"[gpu_check] {backend} run failed: {last.message}")
            stages = {e.stage_id: e for e in events if isinstance(e, StageFinished)}
            ar, dit = stages[0], stages[1]
            label = "warm-up" if run == 0 else f"run {run}"
            print(f"[gpu_check] {backend} {label}: total {total:.2f} s | AR {ar.seconds:.2f} s "
                  f"({ar.output_tokens} tokens, {ar.output_tokens / max(ar.seconds, 1e-9):.0f} tok/s) | "
                  f"DiT+VAE {dit.seconds:.2f} s ({steps} steps, {size}x{size})")
            assert isinstance(last, RunFinished)
            token_ids[backend] = last.outputs[0].token_ids
            last.outputs[0].images[0].save(f"/tmp/gpu_check-{backend}.png")
    finally:
        engine.close()
same = token_ids["vllm"] == token_ids["transformers"]
first_diff = next((i for i, (a, b) in enumerate(zip(token_ids["vllm"], token_ids["transformers"]))
                   if a != b), None)
print(f"[gpu_check] greedy token ids vLLM == transformers: {same}"
      + ("" if same else f" (first difference at token {first_diff} of {len(token_ids['vllm'])}; GPU kernels "
                         "differ in rounding, and bf16 near-ties flip greedy picks)"))
print("[gpu_check] images: /tmp/gpu_check-vllm.png /tmp/gpu_check-transformers.png")
PY

if [ "$MODEL" = tiny-glm-image ]; then
  .venv/bin/python bench/ar_backends.py --repeat 3
else
  .venv/bin/python bench/ar_backends.py --model "$MODEL" --size "$SIZE" --repeat 2 --dtype bfloat16
fi
# Batch throughput at 1 and 8 clients over HTTP (the served preset, AR batching on), with the alone-bytes
# check: the same request and seed give the same PNG alone and among 8.
if [ "$MODEL" = tiny-glm-image ]; then
  .venv/bin/python bench/throughput.py --model tiny-glm-shapes --levels 1 8 --rounds 2
else
  .venv/bin/python bench/throughput.py --model "$MODEL" --levels 1 8 --rounds 1 --per-client 1
fi
# Speech for many listeners (docs/speech.md, "Many listeners"): tiny-qwen-omni's preset on GPU 0, streamed
# /v1/audio/speech at 1, 4, 8 and 16 clients (TTFP, RTF, audio throughput, underruns, each stream against
# its alone bytes) beside the one-shot generate.
.venv/bin/python bench/speech.py --rounds 2 --seeds 2 --levels 1 4 8 16 --devices 0
# vLLM's own scale-out (docs/vllm.md, "Scale-out"): the AR stage tensor-parallel over every GPU here, with
# vLLM's multiprocessing executor and with its Ray executor (a local Ray instance; one GPU: the Ray executor
# path at tensor_parallel_size 1). Token ids are compared with the single-GPU run above.
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[ray]"  # the ray extra; torch stays as is
.venv/bin/python - <<'PY'
import os
import tempfile

import torch

from engine.engine import build_engine
from engine.events import RunFailed, RunFinished
from engine.request import GenerationParams, GenerationRequest

model, size, steps = os.environ["MODEL"], int(os.environ["SIZE"]), int(os.environ["STEPS"])
gpus = torch.cuda.device_count()
request = GenerationRequest("a red circle on a blue background, top left",
                            GenerationParams(seed=42, temperature=0.0, height=size, width=size, num_inference_steps=steps))
ids = {}
for backend in ("none", "mp", "ray"):
    stage0 = {"stage_id": 0, "backend": "vllm", "devices": "0", "enforce_eager": False}
    if backend != "none":
        stage0.update(devices=",".join(map(str, range(gpus))), tensor_parallel_size=gpus,
                      distributed_executor_backend=backend)
    deploy = {"stages": [stage0, {"stage_id": 1, "devices": "0"}]}
    engine = build_engine(model, deploy, data_dir=tempfile.mkdtemp())
    try:
        last = list(engine.stream(engine.resolve(request)))[-1]
    finally:
        engine.close()
    if isinstance(last, RunFailed):
        raise SystemExit(f"[gpu_check] tensor_parallel_size {gpus} with {backend}: {last.message}")
    assert isinstance(last, RunFinished)
    ids[backend] = last.outputs[0].token_ids
    label = "one GPU, no executor key" if backend == "none" else f"tensor_parallel_size {gpus}, {backend}"
    print(f"[gpu_check] AR on vLLM, {label}: {len(ids[backend] or ())} tokens, "
          f"same ids as one GPU: {ids[backend] == ids['none']}")
PY
echo "[gpu_check] done in $((SECONDS - started)) s"
