"""The components of `tiny-qwen-omni-dtmf`: the tokenizer and the Qwen2.5-Omni model at the recipe's sizes.

The configuration is engine/tiny/qwen_omni.py's (``omni_config``), the chat template and special tokens
too. The tokenizer is byte-fallback BPE with two additions:

- **Pacing fillers.** Its normaliser follows every key character (``0``-``9``, ``*``, ``#``) with six
  filler characters (private-use U+E001-U+E006, one token each) that its decoder drops. A key and its
  fillers, with the space before the next key, are 8 tokens: the talker reads one thinker row per codec
  id, and 8 codec ids (160 ms) speak a key, so the reply's rows arrive at the pace of its sound.
  ``"4 1 7"`` encodes to ``4 f1..f6 ␣ 1 f1..f6 ␣ 7 f1..f6`` and decodes back to ``"4 1 7"``.
- **The speech system prompt as one token** (engine/pipelines/qwen_omni/thinker.py inserts it whenever a
  reply is spoken), which keeps the thinker's and talker's prompts short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from engine.pipelines.qwen_omni.thinker import SPEECH_SYSTEM_PROMPT
from engine.tiny.qwen_omni import CHAT_TEMPLATE, IM_END, PAD, SPECIAL, voice_token
from tools.dtmf.world import KEYS

RECIPE_PATH = Path(__file__).with_name("recipe.yaml")
FILLERS = [chr(0xE001 + i) for i in range(6)]


def load_recipe(path: Path = RECIPE_PATH) -> dict[str, Any]:
    return dict(yaml.safe_load(Path(path).read_text()))


def dtmf_tokenizer(recipe: dict[str, Any]) -> PreTrainedTokenizerFast:
    special = SPECIAL + [voice_token(v) for v in recipe["voices"]]
    vocab = {token: i for i, token in enumerate(special)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for filler in FILLERS:
        vocab[filler] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    paced = "".join(FILLERS)
    backend.normalizer = normalizers.Sequence([normalizers.Replace(k, k + paced) for k in KEYS])
    backend.decoder = decoders.Sequence(
        [*(decoders.Replace(f, "") for f in FILLERS), decoders.ByteFallback(), decoders.Fuse()]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(SPEECH_SYSTEM_PROMPT, special=False, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=int(recipe["thinker"]["max_position_embeddings"]),
    )


def build_model(recipe: dict[str, Any], tokenizer: PreTrainedTokenizerFast) -> Any:
    """A freshly initialised ``Qwen2_5OmniForConditionalGeneration`` of the recipe (seeded)."""
    import torch
    from transformers import GenerationConfig, Qwen2_5OmniForConditionalGeneration

    from engine.tiny.qwen_omni import omni_config

    ids = dict(tokenizer.get_vocab())
    config = omni_config(recipe, ids, vocab_size=len(tokenizer))
    torch.manual_seed(int(recipe["seed"]))
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=ids[IM_END], pad_token_id=ids[PAD])
    return model
