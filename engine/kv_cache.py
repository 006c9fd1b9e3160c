"""How many bytes an AR model's KV cache takes per token: what sizes a vLLM stage's cache on a CPU
(engine/stages/ar_vllm.py) and the memory estimate before loading (engine/memory_estimate/)."""

from __future__ import annotations

from typing import Any

import torch


def kv_bytes_per_token(hf_text_config: Any, dtype: torch.dtype) -> int:
    """Bytes of KV cache per token: keys and values of every layer's KV heads (also what sizes a vLLM
    stage's KV cache on a CPU, engine/stages/ar_vllm.py)."""
    heads = int(getattr(hf_text_config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(hf_text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_text_config, "head_dim", None) or hf_text_config.hidden_size // heads)
    layers = int(hf_text_config.num_hidden_layers)
    return 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
