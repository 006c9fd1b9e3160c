"""Shapes-world accuracy of a GLM-Image model through the real engine (default: the built-in `tiny-glm-shapes`).

Every caption runs as an ordinary request (``build_engine(...).run``: AR -> ar2diffusion -> DiT -> VAE);
a pixel classifier reads each picture (background and shape colour by nearest palette entry, position
by the shape's centroid, shape by template overlap). Prints accuracy per attribute and all four right,
on held-out combinations (never trained on) and on training ones, plus the time per image.

    .venv/bin/python bench/shapes_eval.py [--held-out N] [--training N] [--model NAME_OR_DIR] [--json]
        [--steps N] [--guidance G] [--temperature T] [--ar-backend vllm]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-glm-shapes", help="built-in name or checkpoint folder")
    parser.add_argument(
        "--deploy", default=None, help="deploy YAML (default: assets/deploy/tiny-glm-shapes.yaml)"
    )
    parser.add_argument(
        "--held-out", type=int, default=None, help="held-out prompts to run (default: all 90)"
    )
    parser.add_argument(
        "--training", type=int, default=None, help="training prompts to run (default: all 360)"
    )
    parser.add_argument("--seed", type=int, default=0, help="request i uses seed + i; also picks the samples")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the deploy's)")
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the deploy's)")
    parser.add_argument(
        "--temperature", type=float, default=None, help="AR temperature (default: the deploy's)"
    )
    parser.add_argument(
        "--ar-backend",
        choices=("auto", "vllm", "transformers"),
        default=None,
        help="override the deploy's AR backend (e.g. vllm for the parity check)",
    )
    parser.add_argument("--failures", action="store_true", help="list the prompts that came out wrong")
    parser.add_argument("--json", action="store_true", help="print the scores as JSON too")
    args = parser.parse_args()

    import torch

    from engine.environment import quiet_libraries
    from tools.shapes.evaluate import DEPLOY_PATH, evaluate_model, pick_scenes

    quiet_libraries()
    if args.threads:
        torch.set_num_threads(args.threads)
    scenes = pick_scenes(args.held_out, args.training, seed=args.seed)
    overrides = {
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance,
        "temperature": args.temperature,
    }
    params = {k: v for k, v in overrides.items() if v is not None}
    from tqdm import tqdm

    with tqdm(total=len(scenes), desc="prompts", unit="img", file=sys.stderr) as bar:
        evaluation = evaluate_model(
            args.model,
            args.deploy or DEPLOY_PATH,
            scenes,
            seed=args.seed,
            params=params,
            ar_backend=args.ar_backend,
            progress=lambda done, total: bar.update(1),
        )
    print(f"model {args.model}: {len(scenes)} prompts through the engine" + (f", {params}" if params else ""))
    print(evaluation.report())
    if args.failures:
        for caption, reading in evaluation.failures:
            print(
                f"  wrong: {caption!r} -> {reading.colour} {reading.shape} on {reading.background}, "
                f"{reading.position} (iou {reading.iou:.2f})"
            )
    if args.json:
        print(json.dumps(evaluation.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
