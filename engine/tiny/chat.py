"""Build ``tiny-chat``: a Llama-architecture chat LM at toy size with a word-level tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from engine.tiny.tokenizers import word_level_tokenizer

SPECIAL = ["<unk>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|{{ message.role }}|> {{ message.content }} <|end|> {% endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build(recipe: dict[str, Any], out_dir: Path) -> None:
    words = str(recipe["words"]).split()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level_tokenizer(words, SPECIAL, unk="<unk>"),
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|end|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=int(recipe["model"]["max_position_embeddings"]),
    )
    cfg = recipe["model"]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(int(recipe["seed"]))
    model = LlamaForCausalLM(config).eval()
    gen = recipe["generation"]
    model.generation_config = GenerationConfig(
        do_sample=True,
        temperature=gen["temperature"],
        top_k=gen["top_k"],
        max_new_tokens=gen["max_new_tokens"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
