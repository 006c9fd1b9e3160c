"""GPU check of the engine's CUDA paths without vLLM: the speech family and GLM-Image on one GPU.

Runs where `bench/gpu_check.sh` cannot (a machine with a CUDA torch but no network, so no vLLM and no
`scripts/setup.sh`): carry the pure-Python wheels the engine needs beyond such an image (transformers
5.19, diffusers, pydantic) and put them on PYTHONPATH (see the comment at the end). Prints, per check:

1. tiny-qwen-omni, every stage on GPU 0, the whole-utterance render: the split engine's text and waveform
   vs transformers' one-shot ``generate(..., return_audio)`` on the same GPU, same seed (sample for sample,
   or the largest difference), and the peak CUDA memory beside the engine's memory estimate;
2. tiny-glm-image on GPU 0 vs this machine's CPU: the decoded RGB sha256 of each (fixed seed), and whether
   alone == among 8 concurrent requests on the GPU.

    PYTHONPATH=/tmp/gpu_pylib:. python3 bench/gpu_speech_check.py
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import GenerationParams, GenerationRequest  # noqa: E402
from engine.engine import build_engine  # noqa: E402
from engine.modality import OutputModality  # noqa: E402
from engine.paths import DEPLOY_PRESETS_DIR  # noqa: E402
from engine.pipelines.qwen_omni import chat_messages  # noqa: E402
from engine.request import ChatTurn  # noqa: E402
from engine.tiny import ensure_builtin_model  # noqa: E402
from tests.qwen_omni_reference import generate_one_shot  # noqa: E402

# "cuda" (GPU 0); CHECK_DEVICE=cpu runs the same script on a CPU (a dry run of the script itself).
DEVICE = os.environ.get("CHECK_DEVICE", "cuda")


def tiny_deploy(model: str, **stage_overrides: dict) -> dict:
    """The built-in model's preset with per-stage overrides (``stage2={...}``)."""
    import yaml

    deploy = yaml.safe_load((DEPLOY_PRESETS_DIR / f"{model}.yaml").read_text())
    for stage in deploy["stages"]:
        stage.update(stage_overrides.get(f"stage{stage['stage_id']}", {}))
    return deploy


def on_gpu(model: str, **extra: dict) -> dict:
    deploy = tiny_deploy(model, **extra)
    for stage in deploy["stages"]:
        stage["devices"] = "0" if DEVICE == "cuda" else "cpu"
        stage.pop("own_process", None)
    return deploy


def rgb_sha(image) -> str:
    return hashlib.sha256(image.convert("RGB").tobytes()).hexdigest()


def speech_check(data_dir: Path) -> None:
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    deploy = on_gpu("tiny-qwen-omni", stage2={"chunk_size": None})
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine = build_engine("tiny-qwen-omni", deploy, data_dir=data_dir, ar_backend="transformers")
    try:
        path = engine.model.path
        for seed, voice, temperature in ((7, "Chelsie", 0.8), (11, "Ethan", 0.8)):
            started = time.perf_counter()
            request = GenerationRequest(
                "say hello",
                GenerationParams(seed=seed, voice=voice),
                modalities=(OutputModality.TEXT, OutputModality.AUDIO),
            )
            output = engine.run(request).outputs[0]
            took = time.perf_counter() - started
            model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval().to(DEVICE)
            tokenizer = AutoTokenizer.from_pretrained(path)
            inputs = tokenizer.apply_chat_template(
                chat_messages([ChatTurn("user", "say hello")], speak=True),
                add_generation_prompt=True,
                return_dict=True,
                return_tensors="pt",
            ).to(DEVICE)
            sequences, wave = generate_one_shot(
                model, inputs, seed=seed, voice=voice, temperature=temperature
            )
            reply = tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            wave = wave.float().cpu().numpy()
            same_len = output.audio is not None and output.audio.shape == wave.shape
            diff = float(np.abs(output.audio - wave).max()) if same_len else float("nan")
            print(
                f"[speech] seed {seed} {voice}: engine {took:.2f} s, text equal {output.text == reply}, "
                f"samples {0 if output.audio is None else output.audio.size} vs {wave.size}, "
                f"identical {same_len and diff == 0.0}, max abs diff {diff:.3g}"
            )
        if DEVICE == "cuda":
            print(f"[speech] peak CUDA memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    finally:
        engine.close()


def concurrent_shas(engine, prompts: list[str], params: GenerationParams) -> list[str]:
    shas = [""] * len(prompts)

    def one(i: int) -> None:
        shas[i] = rgb_sha(engine.run(GenerationRequest(prompts[i], params)).images[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return shas


def glm_check(data_dir: Path) -> None:
    params = GenerationParams(seed=7, height=64, width=64, num_inference_steps=4)
    request = GenerationRequest("a lighthouse", params)
    shas = {}
    for where, deploy in (("cpu", tiny_deploy("tiny-glm-image")), ("cuda", on_gpu("tiny-glm-image"))):
        engine = build_engine("tiny-glm-image", deploy, data_dir=data_dir, ar_backend="transformers")
        try:
            shas[where] = rgb_sha(engine.run(request).images[0])
            if where == "cuda":
                prompts = [f"a lighthouse {i}" for i in range(8)]
                alone = [rgb_sha(engine.run(GenerationRequest(p, params)).images[0]) for p in prompts]
                together = concurrent_shas(engine, prompts, params)
                print(f"[glm] cuda: alone == 8 concurrent: {alone == together}")
        finally:
            engine.close()
    print(
        f"[glm] RGB sha256 cpu {shas['cpu'][:16]} cuda {shas['cuda'][:16]} equal {shas['cpu'] == shas['cuda']}"
    )


def main() -> None:
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "no GPU (dry run)"
    print(f"[gpu] torch {torch.__version__}, cuda {torch.version.cuda}, {name}")
    data_dir = Path(tempfile.mkdtemp())
    os.environ.setdefault("OMNI_STUDIO_MODEL_CACHE", str(data_dir / "models"))
    for name in ("tiny-qwen-omni", "tiny-glm-image"):
        started = time.perf_counter()
        ensure_builtin_model(name, data_dir / "models")
        print(f"[gpu] built {name} in {time.perf_counter() - started:.1f} s")
    for check in (speech_check, glm_check):
        try:
            check(data_dir)
        except Exception as exc:  # one check failing must not hide the other's result
            print(f"[{check.__name__}] FAILED: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()

# Carrying the wheels (on the machine with the network, into an ignored folder that travels):
#   pip download --no-deps -d .gpu_wheels "transformers==5.19.*" "diffusers==0.42.1"
#   pip download --python-version 3.12 --only-binary=:all: -d .gpu_wheels "pydantic==2.14.4"
# then on the GPU machine: pip install --no-deps --target /tmp/gpu_pylib .gpu_wheels/*.whl
