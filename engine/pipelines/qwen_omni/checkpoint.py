"""Reading a Qwen2.5-Omni folder: its configuration, one part's weights, its voices (``spk_dict.pt``).

The checkpoint holds the whole model (``thinker.*``, ``talker.*``, ``token2wav.*`` weights, one file or
shards listed in ``model.safetensors.index.json``); each stage loads only its part.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

SPEAKERS_FILE = "spk_dict.pt"
DEFAULT_VOICE = "Chelsie"  # the released model's default speaker (transformers' generate default too)
SAMPLE_RATE = 24_000  # BigVGAN: 240 samples per mel frame, 100 frames a second


def is_omni_folder(path: Path) -> bool:
    """Whether ``path`` holds a Qwen2.5-Omni checkpoint (its ``config.json`` says so)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    architectures = config.get("architectures") or []
    return (
        config.get("model_type") == "qwen2_5_omni" or "Qwen2_5OmniForConditionalGeneration" in architectures
    )


def omni_config(path: Path) -> Any:
    """The checkpoint's ``Qwen2_5OmniConfig`` (typed Any: its parts are typed as plain dicts too)."""
    from transformers import Qwen2_5OmniConfig

    return Qwen2_5OmniConfig.from_pretrained(path)


def part_state_dict(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The weights under ``prefix`` (``token2wav.``), the prefix taken off, from every safetensors file."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118  (safe_open has keys(), not iteration)
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = handle.get_tensor(key)
    if not state:
        raise ValueError(f"{path} has no weights under {prefix!r}")
    return state


def load_token2wav(path: Path) -> Any:
    """token2wav (the DiT and BigVGAN) from the checkpoint's ``token2wav`` weights, in float32 as the
    library runs it, on the CPU."""
    from transformers import Qwen2_5OmniToken2WavModel

    model = Qwen2_5OmniToken2WavModel._from_config(omni_config(path).token2wav_config)
    model.load_state_dict(part_state_dict(path, "token2wav."))
    return model.float().eval()


def load_speakers(path: Path) -> dict[str, dict[str, Any]]:
    """``spk_dict.pt``: per voice ``cond`` (speaker embedding), ``ref_mel`` (reference mel) and
    ``bos_token`` (the thinker id the talker's text starts with)."""
    file = Path(path) / SPEAKERS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no {SPEAKERS_FILE} (the voices of a Qwen2.5-Omni checkpoint)")
    return dict(torch.load(file, weights_only=True))


def voices_of(path: Path | None) -> tuple[str, ...]:
    """The voices in ``path``'s ``spk_dict.pt``, the default (Chelsie) first; empty without the file."""
    if path is None or not (Path(path) / SPEAKERS_FILE).is_file():
        return ()
    file = Path(path) / SPEAKERS_FILE
    return _voices(str(file), file.stat().st_mtime_ns)


@lru_cache(maxsize=16)
def _voices(file: str, mtime_ns: int) -> tuple[str, ...]:
    names = sorted(torch.load(file, weights_only=True))
    return tuple(sorted(names, key=lambda name: name != DEFAULT_VOICE))


def default_voice(voices: tuple[str, ...]) -> str:
    return voices[0] if voices else DEFAULT_VOICE


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The process-global RNG state a stage leaves to the next (CPU, and the GPU's when it ran on one)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
