"""Engine overhead: the two-stage engine's T2I time vs the one-shot diffusers call on the same tiny pipeline.

Prints the median wall time of each and their ratio, interleaved repeats, same PNG bytes checked:
- tiny-glm-image (random weights) at each ``--sizes``: the engine's overhead (target: <= 1.05);
- tiny-glm-shapes (trained, 128x128, its preset's steps and guidance, greedy AR): per image, the engine
  with its lean AR decode vs the one-shot ``GlmImagePipeline`` (target: <= 0.5), with the range.

    .venv/bin/python bench/overhead.py [--repeats 15] [--sizes 64 256] [--steps 4]
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time

import torch


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def one_thread_png(call) -> bytes:
    """The one-shot call's PNG on one intra-op thread: the engine runs small models on one thread, so its
    bytes do not depend on the machine's cores, and on more threads the one-shot sampling can draw other
    tokens from logits that differ in the last bits (docs/batching.md). The timings use the process's
    threads (the fastest one-shot)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return png(call())
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    from diffusers import GlmImagePipeline

    from engine import GenerationParams, GenerationRequest, build_engine
    from engine.environment import quiet_libraries

    quiet_libraries()
    engine = build_engine(
        "tiny-glm-image",
        {"stages": [{"stage_id": 0, "backend": "transformers"}]},
        data_dir=tempfile.mkdtemp(),
    )
    pipe = GlmImagePipeline.from_pretrained(engine.model.path)
    pipe.set_progress_bar_config(disable=True)
    print(
        f"{'size':>6} {'engine ms':>10} {'one-shot ms':>12} {'ratio':>7}  same bytes (one-shot on 1 thread)"
    )
    for size in args.sizes:
        request = GenerationRequest(
            "a red 'cat'", GenerationParams(seed=1, height=size, width=size, num_inference_steps=args.steps)
        )

        def one_shot(size: int = size):
            return pipe(
                "a red 'cat'",
                height=size,
                width=size,
                num_inference_steps=args.steps,
                guidance_scale=1.5,
                generator=torch.Generator().manual_seed(1),
            ).images[0]

        same = png(engine.run(request).images[0]) == one_thread_png(one_shot)
        one_shot()  # warm-up on the process's threads
        engine_times, direct_times = [], []
        for _ in range(args.repeats):  # interleaved so drift hits both equally
            t = time.perf_counter()
            engine.run(request)
            engine_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            one_shot()
            direct_times.append(time.perf_counter() - t)
        e, d = statistics.median(engine_times) * 1000, statistics.median(direct_times) * 1000
        print(f"{size:>6} {e:>10.1f} {d:>12.1f} {e / d:>7.3f}  {same}")
    engine.close()
    shapes_ratio(args.repeats)


def shapes_ratio(repeats: int) -> None:
    """tiny-glm-shapes per image: engine (lean AR decode) vs one-shot GlmImagePipeline, same picture."""
    from diffusers import GlmImagePipeline

    from engine import GenerationParams, GenerationRequest, build_engine

    engine = build_engine("tiny-glm-shapes", None, data_dir=tempfile.mkdtemp())
    pipe = GlmImagePipeline.from_pretrained(engine.model.path)
    pipe.set_progress_bar_config(disable=True)
    dit = engine.config.stage(1).default_sampling_params
    prompt = "a red circle on a blue background, top left"
    # The one-shot pipeline samples (do_sample, temperature 1); so does the engine here, for the same bytes.
    request = GenerationRequest(prompt, GenerationParams(seed=7, height=128, width=128, temperature=1.0))

    def one_shot():
        return pipe(
            prompt,
            height=128,
            width=128,
            num_inference_steps=int(dit["num_inference_steps"]),
            guidance_scale=float(dit["guidance_scale"]),
            generator=torch.Generator().manual_seed(7),
        ).images[0]

    same = png(engine.run(request).images[0]) == one_thread_png(one_shot)
    one_shot()  # warm-up on the process's threads
    engine_times, direct_times = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        engine.run(request)
        engine_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        one_shot()
        direct_times.append(time.perf_counter() - t)
    ratios = sorted(e / d for e, d in zip(engine_times, direct_times, strict=True))
    e, d = statistics.median(engine_times) * 1000, statistics.median(direct_times) * 1000
    print(
        f"\ntiny-glm-shapes 128x128 per image: engine {e:.0f} ms, one-shot {d:.0f} ms, ratio {e / d:.3f} "
        f"(paired ratios {ratios[0]:.3f}-{ratios[-1]:.3f}; target <= 0.5); same bytes: {same}"
    )
    engine.close()


if __name__ == "__main__":
    main()
