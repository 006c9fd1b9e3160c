"""Build ``tiny-qwen-omni``: Qwen2.5-Omni (thinker -> talker -> token2wav) of the real classes at toy size.

The folder is the real checkpoint's layout: ``config.json`` + safetensors weights of
``Qwen2_5OmniForConditionalGeneration``, ``generation_config.json``, the tokenizer (built with the
``tokenizers`` library) with a Qwen-style chat template, the Whisper feature extractor's
``preprocessor_config.json`` (audio in) and ``spk_dict.pt`` (the voices). Everything is random but made
deterministically from the recipe's seeds on the CPU, so every machine builds the same bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2_5OmniConfig,
    Qwen2_5OmniForConditionalGeneration,
    WhisperFeatureExtractor,
)

from engine.tiny.tokenizers import byte_fallback_tokenizer

# The real checkpoint's special tokens (the thinker's vocabulary), then one text-start token per voice
# (a speaker's ``bos_token`` in spk_dict.pt: the talker's first text token).
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
AUDIO, AUDIO_BOS, AUDIO_EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
IMAGE, VIDEO, VISION_BOS, VISION_EOS = "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>"
TTS_PAD, TTS_BOS, TTS_EOS = "<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>"
SPECIAL = [PAD, IM_START, IM_END, AUDIO, AUDIO_BOS, AUDIO_EOS, IMAGE, VIDEO, VISION_BOS, VISION_EOS]
SPECIAL += [TTS_PAD, TTS_BOS, TTS_EOS]

READABLE = "abcdefghijklmnopqrstuvwxyz ,."

CHAT_TEMPLATE = (
    "{%- for message in messages -%}" + IM_START + "{{ message.role }}\n"
    "{%- if message.content is string -%}{{ message.content }}{%- else -%}"
    "{%- for part in message.content -%}"
    "{%- if part.type == 'audio' or part.type == 'input_audio' -%}" + AUDIO_BOS + AUDIO + AUDIO_EOS + ""
    "{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}" + IM_END + "\n{% endfor -%}"
    "{%- if add_generation_prompt -%}" + IM_START + "assistant\n{%- endif -%}"
)


def voice_token(name: str) -> str:
    return f"<|voice_{name}|>"


def build(recipe: dict[str, Any], out_dir: Path) -> None:
    voices = dict(recipe["voices"])
    backend = byte_fallback_tokenizer(SPECIAL + [voice_token(v) for v in voices], [])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=int(recipe["thinker"]["max_position_embeddings"]),
    )
    ids = dict(backend.get_vocab())  # the tokenizer's ids are the backend's
    config = omni_config(recipe, ids, vocab_size=len(tokenizer))

    torch.manual_seed(int(recipe["seed"]))
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    readable = [ids[f"<0x{ord(c):02X}>"] for c in READABLE] + [ids[IM_END]]
    readable_head(
        model.thinker.lm_head, readable, float(recipe["thinker"]["readable_logit_std"]), int(recipe["seed"])
    )
    audible_vocoder(model.token2wav.code2wav_bigvgan_model, recipe["bigvgan"], int(recipe["seed"]))
    model.generation_config = GenerationConfig(eos_token_id=ids[IM_END], pad_token_id=ids[PAD])
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    WhisperFeatureExtractor(feature_size=int(recipe["audio_encoder"]["num_mel_bins"])).save_pretrained(
        out_dir
    )
    torch.save(speakers(recipe, ids), out_dir / "spk_dict.pt")


def readable_head(head: torch.nn.Linear, readable: list[int], std: float, seed: int) -> None:
    """Make the thinker's random replies lowercase text that ends now and then.

    Only the rows of ``readable`` ids (lowercase letters, space, comma, full stop and <|im_end|>) stay
    random, drawn so their logits spread ``std`` wide; every other row is zero. A random reply of
    bytes would not decode, and a special id (audio, image) would stand for inputs that are not there;
    with logits this spread those ids keep a probability near e^-15 per token. <|im_end|> (the last of
    ``readable``) gets half the spread: replies end now and then, or at the deploy config's max_tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    hidden = head.weight.shape[1]
    with torch.no_grad():
        head.weight.zero_()
        rows = torch.randn(len(readable), hidden, generator=generator) * (std / hidden**0.5)
        head.weight[readable] = rows
        head.weight[readable[-1]] *= 0.5  # <|im_end|>: rarely the first choice, so replies have words


def audible_vocoder(vocoder: torch.nn.Module, spec: dict[str, Any], seed: int) -> None:
    """Re-draw the vocoder's convolutions so a random model makes audible sound.

    The library's initialisation (std 0.02) shrinks the signal at every one of BigVGAN's convolutions:
    its random waveform peaks near 1e-9, silence once encoded as 16-bit PCM. Drawn with std
    1/sqrt(fan_in) the signal keeps its scale through the stack; the last convolution is scaled by
    ``output_gain`` so the waveform sits well inside [-1, 1] (RMS about 0.1 rather than clipped).
    """
    generator = torch.Generator().manual_seed(seed)
    convolutions = [m for m in vocoder.modules() if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d)]
    with torch.no_grad():
        for conv in convolutions:
            weight = conv.weight
            # Conv1d weights are (out, in, k), ConvTranspose1d's (in, out, k): the inputs summed per output.
            fan_in = weight.shape[1 if isinstance(conv, torch.nn.Conv1d) else 0] * weight.shape[2]
            weight.copy_(torch.randn(weight.shape, generator=generator) / fan_in**0.5)
        post = vocoder.get_submodule("conv_post")
        assert isinstance(post, torch.nn.Conv1d)
        post.weight.mul_(float(spec["output_gain"]))


def speakers(recipe: dict[str, Any], ids: dict[str, int]) -> dict[str, dict[str, Any]]:
    """spk_dict.pt's content: per voice a speaker embedding (``cond``), a reference mel and its text bos."""
    dit = recipe["dit"]
    table: dict[str, dict[str, Any]] = {}
    for name, spec in recipe["voices"].items():
        generator = torch.Generator().manual_seed(int(spec["seed"]))
        table[name] = {
            "cond": torch.randn(1, int(dit["enc_emb_dim"]), generator=generator),
            "ref_mel": torch.randn(1, int(spec["ref_frames"]), int(dit["mel_dim"]), generator=generator),
            "bos_token": ids[voice_token(name)],
        }
    return table


def omni_config(recipe: dict[str, Any], ids: dict[str, int], vocab_size: int) -> Qwen2_5OmniConfig:
    """The Qwen2.5-Omni configuration of the recipe (special ids inside the tiny vocabularies)."""
    thinker, talker, dit, vocoder = recipe["thinker"], recipe["talker"], recipe["dit"], recipe["bigvgan"]
    rope = {
        "rope_type": "default",
        "mrope_section": list(thinker["mrope_section"]),
        "rope_theta": float(thinker["rope_theta"]),
    }
    token_ids = {
        "audio_token_index": ids[AUDIO],
        "image_token_index": ids[IMAGE],
        "video_token_index": ids[VIDEO],
        "audio_start_token_id": ids[AUDIO_BOS],
        "audio_end_token_id": ids[AUDIO_EOS],
    }
    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": thinker["hidden_size"],
        "intermediate_size": thinker["intermediate_size"],
        "num_hidden_layers": thinker["num_hidden_layers"],
        "num_attention_heads": thinker["num_attention_heads"],
        "num_key_value_heads": thinker["num_key_value_heads"],
        "max_position_embeddings": thinker["max_position_embeddings"],
        "rope_parameters": rope,
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[PAD],
        "tie_word_embeddings": False,
    }
    audio = recipe["audio_encoder"]
    vision = recipe["vision_encoder"]
    thinker_config = {
        "text_config": text_config,
        "audio_config": {**audio, "output_dim": thinker["hidden_size"]},
        "vision_config": {**vision, "out_hidden_size": thinker["hidden_size"]},
        "vision_start_token_id": ids[VISION_BOS],
        "vision_end_token_id": ids[VISION_EOS],
        "user_token_id": ids[IM_START],
        **token_ids,
    }
    talker_config = {
        "vocab_size": talker["vocab_size"],
        "hidden_size": talker["hidden_size"],
        "intermediate_size": talker["intermediate_size"],
        "num_hidden_layers": talker["num_hidden_layers"],
        "num_attention_heads": talker["num_attention_heads"],
        "num_key_value_heads": talker["num_key_value_heads"],
        "head_dim": talker["head_dim"],
        "max_position_embeddings": talker["max_position_embeddings"],
        "embedding_size": thinker["hidden_size"],
        "rope_parameters": rope,
        "tts_codec_start_token_id": talker["codec_start"],
        "tts_codec_end_token_id": talker["codec_end"],
        "tts_codec_pad_token_id": talker["codec_pad"],
        "tts_codec_mask_token_id": talker["codec_mask"],
        "tts_text_start_token_id": ids[TTS_BOS],
        "tts_text_end_token_id": ids[TTS_EOS],
        "tts_text_pad_token_id": ids[TTS_PAD],
        "vision_start_token_id": ids[VISION_BOS],
        "vision_end_token_id": ids[VISION_EOS],
        **token_ids,
    }
    token2wav_config = {
        "dit_config": {**dit, "num_embeds": talker["vocab_size"]},
        "bigvgan_config": {
            **{k: v for k, v in vocoder.items() if k != "output_gain"},
            "mel_dim": dit["mel_dim"],
        },
    }
    return Qwen2_5OmniConfig(
        thinker_config=thinker_config,
        talker_config=talker_config,
        token2wav_config=token2wav_config,
        enable_audio_output=True,
    )
