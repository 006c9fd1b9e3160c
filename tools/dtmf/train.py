"""Retrain `tiny-qwen-omni-dtmf` from nothing.

    .venv/bin/python -m tools.dtmf.train --out DIR [--threads 1] [--install]

Stages (each resumes from ``DIR/ckpt/<name>.pt`` and is skipped once ``DIR/stages/<name>.pt`` exists, so
an interrupted run continues where it stopped):

1. ``thinker``: ``dial 4 1 7`` -> ``4 1 7`` (tools/dtmf/thinker.py).
2. ``vocoder``: BigVGAN, log-mel -> DTMF waveform (tools/dtmf/vocoder.py).
3. ``dit``: the token2wav DiT, codes -> frames by flow matching (tools/dtmf/dit.py).
4. ``dit_sampler``: the DiT fine-tuned through the deploy preset's sampler (10 Runge-Kutta steps).
5. ``talker``: thinker rows -> codec ids, on the trained thinker's rows (tools/dtmf/talker.py).

Then the whole model is saved in Qwen2.5-Omni's checkpoint layout to ``DIR/model`` (config.json,
model.safetensors, tokenizer, preprocessor_config.json, spk_dict.pt). ``--install`` copies it to
``assets/models/tiny-qwen-omni-dtmf`` (the shipped built-in model). Score it with
``bench/dtmf_eval.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import WhisperFeatureExtractor

from engine.tiny.qwen_omni import speakers
from tools.dtmf.dit import finetune_dit, train_dit
from tools.dtmf.model import build_model, dtmf_tokenizer, load_recipe
from tools.dtmf.talker import train_talker
from tools.dtmf.thinker import train_thinker
from tools.dtmf.vocoder import train_vocoder

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "assets" / "models" / "tiny-qwen-omni-dtmf"


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def run_stage(name: str, stages: Path, module: torch.nn.Module, train: Callable[[], None]) -> float:
    """Train ``module`` unless its final weights exist (then load them); the minutes it took."""
    done = stages / f"{name}.pt"
    if done.exists():
        state = torch.load(done, weights_only=False)
        module.load_state_dict(state["model"])
        log(f"[{name}] already trained: loaded {done}")
        return float(state["minutes"])
    started = time.time()
    train()
    minutes = (time.time() - started) / 60
    torch.save({"model": module.state_dict(), "minutes": minutes}, done)
    log(f"[{name}] done in {minutes:.1f} min")
    return minutes


def save_model(model: Any, tokenizer: Any, recipe: dict[str, Any], out: Path) -> None:
    """The real checkpoint's layout, as engine/tiny/qwen_omni.py saves the random tiny model."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=int(recipe["audio_encoder"]["num_mel_bins"])).save_pretrained(out)
    torch.save(speakers(recipe, dict(tokenizer.get_vocab())), out / "spk_dict.pt")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--install", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipe = load_recipe()
    steps = recipe["train"]
    ckpt, stages = args.out / "ckpt", args.out / "stages"
    ckpt.mkdir(parents=True, exist_ok=True)
    stages.mkdir(parents=True, exist_ok=True)
    tokenizer = dtmf_tokenizer(recipe)
    model = build_model(recipe, tokenizer)
    voices = speakers(recipe, dict(tokenizer.get_vocab()))
    token2wav = model.token2wav
    minutes = {
        "thinker": run_stage(
            "thinker",
            stages,
            model.thinker,
            lambda: train_thinker(
                model.thinker, tokenizer, steps=steps["thinker_steps"], ckpt=ckpt / "thinker.pt", log=log
            ),
        ),
        "vocoder": run_stage(
            "vocoder",
            stages,
            token2wav.code2wav_bigvgan_model,
            lambda: train_vocoder(
                token2wav.code2wav_bigvgan_model,
                steps=steps["vocoder_steps"],
                ckpt=ckpt / "vocoder.pt",
                log=log,
            ),
        ),
        "dit": run_stage(
            "dit",
            stages,
            token2wav.code2wav_dit_model,
            lambda: train_dit(
                token2wav.code2wav_dit_model,
                [(v["cond"], v["ref_mel"]) for v in voices.values()],
                steps=steps["dit_steps"],
                ckpt=ckpt / "dit.pt",
                log=log,
            ),
        ),
    }
    minutes["dit_sampler"] = run_stage(
        "dit_sampler",
        stages,
        token2wav.code2wav_dit_model,
        lambda: finetune_dit(
            token2wav.code2wav_dit_model,
            [(v["cond"], v["ref_mel"]) for v in voices.values()],
            steps=steps["dit_sampler_steps"],
            ckpt=ckpt / "dit_sampler.pt",
            log=log,
        ),
    )
    model.thinker.eval()
    minutes["talker"] = run_stage(
        "talker",
        stages,
        model.talker,
        lambda: train_talker(
            model.talker,
            model.thinker,
            tokenizer,
            [int(v["bos_token"]) for v in voices.values()],
            steps=steps["talker_steps"],
            ckpt=ckpt / "talker.pt",
            log=log,
        ),
    )
    model.eval()
    save_model(model, tokenizer, recipe, args.out / "model")
    (args.out / "minutes.json").write_text(json.dumps(minutes, indent=2))
    log(
        f"saved {args.out / 'model'}; training minutes {json.dumps(minutes)} (total {sum(minutes.values()):.1f})"
    )
    if args.install:
        if SHIPPED_DIR.exists():
            shutil.rmtree(SHIPPED_DIR)
        shutil.copytree(args.out / "model", SHIPPED_DIR)
        log(f"installed {SHIPPED_DIR}")


if __name__ == "__main__":
    main()
