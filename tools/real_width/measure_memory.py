"""Where a GLM-Image build's memory goes, one component at a time (docs/memory.md, "Measured").

Each component runs in a process of its own (run this once per component, never two at once on a small
machine); every phase reports the process's resident set (``VmRSS``, split into anonymous memory and
mapped files) after it and its own peak (``VmHWM``, reset before the phase through
``/proc/self/clear_refs``):

    .venv/bin/python -m tools.real_width.measure_memory ar   MODEL [--deploy YAML] [--size 1024]
    .venv/bin/python -m tools.real_width.measure_memory dit  MODEL [--deploy YAML] [--size 1024] [--steps 1]
    .venv/bin/python -m tools.real_width.measure_memory sdpa [--tokens 4096] [--heads 64] [--head-dim 40]

``ar``: stage 0 as the deploy YAML places it (vLLM on the CPU for the seed YAML): its load (vLLM's
weights, KV cache, the transformers vision tower and VQ, the processor), then an image-to-image prompt at
``--size`` (the vision tower over the source) and its whole decode. ``dit``: stage 1's load, the glyph
encode, the denoising loop at ``--size`` with CFG (latents out), the VAE decode of those latents, and an
image-to-image call (the VAE encode of a source and the DiT's KV cache of it). ``sdpa``: torch's CPU
``scaled_dot_product_attention`` at the DiT's shape, without and with a mask. One JSON line per phase.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SEED_DEPLOY = ROOT / "tools" / "real_width" / "seed_deploy.yaml"
MIB = 1 << 20


def status() -> dict[str, int]:
    """The process's memory fields of /proc/self/status, in bytes."""
    wanted = {"VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"}
    out = {}
    with open("/proc/self/status") as file:
        for line in file:
            key, _, value = line.partition(":")
            if key in wanted:
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # resets VmHWM to the current RSS


def report(phase: str, started: float, **extra: Any) -> None:
    s = status()
    line = {
        "phase": phase,
        "seconds": round(time.perf_counter() - started, 1),
        "rss_mib": s["VmRSS"] // MIB,
        "anon_mib": s["RssAnon"] // MIB,
        "file_mib": s["RssFile"] // MIB,
        "peak_mib": s["VmHWM"] // MIB,
        **extra,
    }
    print(json.dumps(line), flush=True)


def phase(name: str):
    """A context manager: reset the peak, run the block, report."""
    import contextlib

    @contextlib.contextmanager
    def run():
        reset_peak()
        started = time.perf_counter()
        extra: dict[str, Any] = {}
        yield extra
        report(name, started, **extra)

    return run()


def stage_of(model: str, deploy: Path, kind: str):
    from engine.building import build_pipeline_config
    from engine.models import describe_model

    source = describe_model(model)
    config = build_pipeline_config(source, deploy, None, "cpu")
    stage = next(s for s in config.stages if s.kind == kind)
    return source, stage


def source_picture(size: int):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (236, 232, 220))
    ImageDraw.Draw(image).ellipse((size // 4, size // 4, 3 * size // 4, 3 * size // 4), fill=(40, 90, 170))
    return image


def measure_ar(args: argparse.Namespace) -> None:
    import torch

    from engine.modality import OutputAccumulator
    from engine.stages.base import StageJob

    source, stage = stage_of(args.model, args.deploy, "ar")
    device = torch.device("cpu")
    with phase("imports") as extra:
        runner = source.family.create_runner(stage, Path(args.model), device)
        extra["runner"] = type(runner).__name__
    with phase("load helpers (processor, transformers vision tower + VQ)"):
        runner.load_helpers()
    runner.load_helpers = lambda: None  # done: what follows is vLLM's own load
    with phase("load vLLM (weights, CPU GEMM packing, KV cache, warm-up)"):
        runner.load()
    with phase("malloc_trim (what the C heap holds freed)"):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    if args.load_only:
        return
    params = {**stage.default_sampling_params, "height": args.size, "width": args.size}
    job = StageJob(
        "measure", 0, {"prompt": "A painting", "image": source_picture(args.size)}, params,
        lambda event: None, OutputAccumulator(stage.output_modalities),
    )  # fmt: skip
    with phase("prepare (processor, vision tower + VQ over the source)") as extra:
        prompt = runner.prepare(job)
        extra["prompt_tokens"] = len(prompt.token_ids)
    done = threading.Event()
    with phase("decode (prefill + every new token)") as extra:
        runner.submit(job, lambda status, error: done.set())
        done.wait()
        extra["new_tokens"] = runner.total_steps(job)
    runner.close()


def measure_dit(args: argparse.Namespace) -> None:
    import torch

    source, stage = stage_of(args.model, args.deploy, "diffusion")
    torch.set_num_threads(args.threads)
    with phase("imports"):
        runner = source.family.create_runner(stage, Path(args.model), torch.device("cpu"))
    with phase("load"):
        runner.load()
    pipe = runner.pipeline
    tokens = (args.size // 16) ** 2
    generator = torch.Generator().manual_seed(0)
    prior = torch.randint(0, 16384, (1, tokens), generator=generator)
    call = {"height": args.size, "width": args.size, "guidance_scale": 1.5, "num_inference_steps": args.steps}
    with torch.inference_mode():
        with phase("glyph encode") as extra:
            embeds = pipe._get_glyph_embeds(['"Omni"'], device=torch.device("cpu"), dtype=pipe.dtype)
            extra["glyph_tokens"] = int(embeds.shape[1])
        with phase("denoise (t2i, CFG, latents out)") as extra:
            latents = pipe(
                'A sign that says "Omni"', prior_token_ids=prior, output_type="latent", **call
            ).images
            extra["latents"] = list(latents.shape)
        with phase("vae decode") as extra:
            images = runner.latents_to_images(latents)
            extra["image"] = list(images[0].size)
        if args.i2i:
            grid = torch.tensor([[1, args.size // 16, args.size // 16]])
            with phase("i2i call (vae encode + DiT KV cache of the source, denoise, decode)") as extra:
                out = pipe(
                    "A painting",
                    prior_token_ids=prior,
                    image=[source_picture(args.size)],
                    prior_token_image_ids=[prior[0]],
                    source_image_grid_thw=[grid],
                    **call,
                ).images
                extra["image"] = list(out[0].size)


def measure_sdpa(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    shape = (1, args.heads, args.tokens, args.head_dim)
    q, k, v = (torch.randn(shape) for _ in range(3))
    score_mib = args.heads * args.tokens * args.tokens * 4 // MIB
    with phase("sdpa, no mask") as extra:
        F.scaled_dot_product_attention(q, k, v)
        extra["score_matrix_mib"] = score_mib
    mask = torch.ones(1, 1, args.tokens, args.tokens)
    with phase("sdpa, float mask (1 x 1 x N x N)") as extra:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        extra["score_matrix_mib"] = score_mib


def measure_vllm_pack(args: argparse.Namespace) -> None:
    """What vLLM's CPU GEMM dispatch adds to one weight of ``rows`` x ``cols`` float32: a linear layer
    (``remove_weight``: the packed copy replaces the weight) and an embedding / LM head (it keeps it)."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layers = []  # kept alive: each packed copy lives as long as its layer
    for remove in (True, False):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(args.rows, args.cols), requires_grad=False)
        report("weight made", time.perf_counter())
        with phase(f"dispatch_cpu_unquantized_gemm(remove_weight={remove})") as extra:
            dispatch_cpu_unquantized_gemm(layer, remove_weight=remove)
            extra["weight_mib"] = args.rows * args.cols * 4 // MIB
            extra["kept_mib"] = layer.weight.numel() * 4 // MIB
        layers.append(layer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name in ("ar", "dit"):
        p = sub.add_parser(name)
        p.add_argument("model")
        p.add_argument("--deploy", type=Path, default=SEED_DEPLOY)
        p.add_argument("--size", type=int, default=1024)
        p.add_argument("--steps", type=int, default=1)
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--i2i", action="store_true", help="dit: also an image-to-image call")
        p.add_argument("--load-only", action="store_true", help="ar: stop after loading")
    p = sub.add_parser("sdpa")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p = sub.add_parser("vllm-pack")
    p.add_argument("--rows", type=int, default=16512)
    p.add_argument("--cols", type=int, default=4096)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    report("start", time.perf_counter())
    {"ar": measure_ar, "dit": measure_dit, "sdpa": measure_sdpa, "vllm-pack": measure_vllm_pack}[args.what](
        args
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
