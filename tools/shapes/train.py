"""Retrain `tiny-glm-shapes` from nothing and print its evaluation through the engine.

    .venv/bin/python -m tools.shapes.train --out DIR [--install]

Stages (each resumes from its checkpoint under ``DIR/ckpt`` and is skipped once ``DIR/stages/<name>.pt``
exists, so an interrupted run continues where it stopped):

1. ``vae``: AutoencoderKL on training-split pictures, latent statistics into its config, decoder fine-tune.
2. ``dit``: GlmImageTransformer2DModel on (target codes -> normalised latents), flow matching.
3. ``ar``: GlmImageForConditionalGeneration on (caption -> preview codes -> target codes).

Then the pipeline is saved in GLM-Image's layout to ``DIR/model`` and scored through ``build_engine`` with
``assets/deploy/tiny-glm-shapes.yaml`` on every combination (held-out ones never seen in training).
``--install`` copies ``DIR/model`` to ``assets/models/tiny-glm-shapes`` (the shipped built-in model).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.tiny.glm_image import build_glyph_encoder, save_glm_image
from tools.shapes import ar as ar_training
from tools.shapes import dit as dit_training
from tools.shapes import vae as vae_training
from tools.shapes.model import (
    build_ar,
    build_processor,
    build_transformer,
    build_vae,
    load_recipe,
)
from tools.shapes.world import held_out_scenes, quantise, render, training_scenes

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "assets" / "models" / "tiny-glm-shapes"


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


@torch.no_grad()
def empty_glyph_embeds(glyph_encoder: torch.nn.Module) -> torch.Tensor:
    """The glyph embedding the pipeline computes for a prompt without quoted text (and for the negative "")."""
    from diffusers import GlmImagePipeline
    from transformers import ByT5Tokenizer

    pipe = GlmImagePipeline(
        tokenizer=ByT5Tokenizer(),
        processor=None,
        text_encoder=glyph_encoder.eval(),
        vision_language_encoder=None,
        vae=None,
        transformer=None,
        scheduler=None,
    )
    return pipe._get_glyph_embeds([""], device=torch.device("cpu"), dtype=torch.float32)


def run_stage(name: str, stages: Path, module: torch.nn.Module, train: Callable[[], None]) -> None:
    """Train ``module`` with ``train()`` unless the stage's final weights already exist (then load them)."""
    done = stages / f"{name}.pt"
    if done.exists():
        state = torch.load(done, weights_only=False)
        module.load_state_dict(state["model"])
        if "config" in state:
            module.register_to_config(**state["config"])
        log(f"[{name}] already trained: loaded {done}")
        return
    started, cpu = time.time(), time.process_time()
    train()
    state = {"model": module.state_dict(), "minutes": (time.time() - started) / 60}
    if name == "vae":
        state["config"] = {
            "latents_mean": module.config.latents_mean,
            "latents_std": module.config.latents_std,
        }
    torch.save(state, done)
    log(f"[{name}] done in {state['minutes']:.1f} min ({(time.process_time() - cpu) / 60:.1f} CPU min)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Retrain tiny-glm-shapes from nothing and evaluate it.")
    parser.add_argument(
        "--out", type=Path, required=True, help="work folder (checkpoints, model/, eval.json)"
    )
    parser.add_argument("--recipe", type=Path, default=None, help="recipe YAML (default: the package's)")
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads (on a CPU shared with other jobs, 1 is often faster)",
    )
    parser.add_argument("--install", action="store_true", help="copy the trained model to assets/models/")
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument(
        "--eval-held-out", type=int, default=None, help="held-out prompts to score (default: all)"
    )
    parser.add_argument(
        "--eval-training", type=int, default=None, help="training prompts to score (default: all)"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    from engine.environment import quiet_libraries

    quiet_libraries()
    recipe = load_recipe(args.recipe) if args.recipe else load_recipe()
    steps = recipe["train"]
    out: Path = args.out
    ckpt, stages = out / "ckpt", out / "stages"
    ckpt.mkdir(parents=True, exist_ok=True)
    stages.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train, held = training_scenes(), held_out_scenes()
    log(f"world: {len(train)} training combinations, {len(held)} held out (never trained on)")
    torch.manual_seed(int(recipe["seed"]))

    processor = build_processor()
    vae = build_vae(recipe)

    def train_vae() -> None:
        vae_training.train_autoencoder(vae, train, steps=steps["vae_steps"], ckpt=ckpt / "vae.pt", log=log)
        vae_training.set_latent_stats(vae, vae_training.encode_scenes(vae, train))
        log(f"[vae] latents mean {vae.config.latents_mean} std {vae.config.latents_std}")
        vae_training.finetune_decoder(
            vae, train, steps=steps["vae_decoder_steps"], ckpt=ckpt / "vae_dec.pt", log=log
        )

    run_stage("vae", stages, vae, train_vae)
    vae.eval()

    glyph_encoder = build_glyph_encoder(recipe)
    glyph = empty_glyph_embeds(glyph_encoder)
    transformer = build_transformer(recipe)

    def train_dit() -> None:
        latents = vae_training.normalise(vae, vae_training.encode_scenes(vae, train))
        targets = torch.stack([torch.from_numpy(quantise(render(s)).target) for s in train])
        dit_training.train_dit(
            transformer,
            latents,
            targets,
            glyph,
            steps=steps["dit_steps"],
            ckpt=ckpt / "dit.pt",
            seed=int(recipe["seed"]),
            log=log,
        )

    run_stage("dit", stages, transformer, train_dit)

    ar_model = build_ar(recipe, processor)

    def train_ar() -> None:
        import random

        probe = random.Random(0).sample(train, 45)
        ar_training.train_ar(
            ar_model,
            processor,
            train,
            {"held-out": held, "training": probe},
            steps=steps["ar_steps"],
            ckpt=ckpt / "ar.pt",
            eval_every=250,
            seed=int(recipe["seed"]),
            log=log,
        )

    run_stage("ar", stages, ar_model, train_ar)

    model_dir = out / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    save_glm_image(
        model_dir,
        processor=processor,
        ar=ar_model,
        glyph_encoder=glyph_encoder,
        transformer=transformer,
        vae=vae,
        dtype=getattr(torch, recipe.get("save_dtype", "float32")),
    )
    size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    stage_minutes = {
        n: torch.load(stages / f"{n}.pt", weights_only=False)["minutes"] for n in ("vae", "dit", "ar")
    }
    train_minutes = sum(stage_minutes.values())  # across resumed runs too
    log(
        f"saved {model_dir} ({size / 1e6:.2f} MB); training took {train_minutes:.1f} min "
        f"({', '.join(f'{n} {m:.1f}' for n, m in stage_minutes.items())})"
    )

    if args.install:
        if SHIPPED_DIR.exists():
            shutil.rmtree(SHIPPED_DIR)
        shutil.copytree(model_dir, SHIPPED_DIR)
        log(f"installed as {SHIPPED_DIR}")

    if not args.skip_eval:
        from tools.shapes.evaluate import evaluate_model, pick_scenes

        scenes = pick_scenes(args.eval_held_out, args.eval_training)
        log(f"[eval] {len(scenes)} prompts through the engine (assets/deploy/tiny-glm-shapes.yaml)")
        evaluation = evaluate_model(
            model_dir,
            scenes=scenes,
            data_dir=out / "eval-data",
            progress=lambda i, n: i % 50 == 0 and log(f"[eval] {i}/{n}"),
        )
        print(evaluation.report(), flush=True)
        (out / "eval.json").write_text(
            json.dumps(
                {**evaluation.as_dict(), "train_minutes": round(train_minutes, 1), "model_bytes": size},
                indent=2,
            )
        )
    log(f"total {(time.time() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
