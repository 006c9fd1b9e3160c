"""Engine overhead: the two-stage engine's T2I time vs the one-shot diffusers call on the same tiny pipeline.

Prints the median wall time of each and their ratio (target: <= 1.05). Both produce the same PNG bytes
(checked), so the comparison is like for like.

    .venv/bin/python bench/overhead.py [--repeats 15] [--size 64] [--steps 4]
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
    print(f"{'size':>6} {'engine ms':>10} {'one-shot ms':>12} {'ratio':>7}  same bytes")
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

        same = png(engine.run(request).images[0]) == png(one_shot())  # also warms both up
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


if __name__ == "__main__":
    main()
