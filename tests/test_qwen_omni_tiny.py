"""The built-in tiny-qwen-omni: the real Qwen2.5-Omni layout, loaded and run by transformers' own classes."""

from __future__ import annotations

import json

import torch
from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor

from engine.tiny import ensure_builtin_model


def test_the_folder_has_the_real_checkpoint_layout(model_cache):
    path = ensure_builtin_model("tiny-qwen-omni", model_cache)
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "spk_dict.pt",
    ):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5OmniForConditionalGeneration"]
    assert config["enable_audio_output"] is True
    speakers = torch.load(path / "spk_dict.pt", weights_only=True)
    assert sorted(speakers) == ["Chelsie", "Ethan"]
    assert not torch.equal(speakers["Chelsie"]["cond"], speakers["Ethan"]["cond"])
    features = WhisperFeatureExtractor.from_pretrained(path)
    assert features.feature_size == config["thinker_config"]["audio_config"]["num_mel_bins"]
    parameters = sum(
        p.numel() for p in Qwen2_5OmniForConditionalGeneration.from_pretrained(path).parameters()
    )
    assert parameters < 1_000_000


def test_transformers_one_shot_speaks_audibly_in_both_voices(model_cache):
    """The library's own generate on the folder: readable text, then a waveform that is not silence
    (the vocoder's weights are drawn to keep the signal's scale) and differs between the voices."""
    path = ensure_builtin_model("tiny-qwen-omni", model_cache)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "say hello"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    end, pad = (
        model.config.talker_config.tts_codec_end_token_id,
        model.config.talker_config.tts_codec_pad_token_id,
    )
    waves = {}
    for voice in ("Chelsie", "Ethan"):
        torch.manual_seed(0)
        sequences, wave = model.generate(
            **inputs,
            speaker=voice,
            thinker_max_new_tokens=12,
            talker_max_new_tokens=40,
            talker_eos_token_id=[pad, end],
        )
        reply = tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        assert reply and all(c in "abcdefghijklmnopqrstuvwxyz ,." for c in reply), reply
        assert wave.dtype == torch.float32 and wave.ndim == 1
        assert wave.numel() % 480 == 0 and 0 < wave.numel() <= 40 * 480  # 480 samples per codec id
        assert 0.01 < float(wave.pow(2).mean().sqrt()) < 0.9  # audible, not clipped throughout
        waves[voice] = wave
    assert waves["Chelsie"].shape != waves["Ethan"].shape or not torch.equal(waves["Chelsie"], waves["Ethan"])
