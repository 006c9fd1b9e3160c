"""AR-only chat: a causal LM with a chat template that streams text (``tiny-chat``, or any local chat LM)."""

from engine.pipelines.chat.ar_transformers import ChatARStage
from engine.pipelines.chat.family import DEFAULT_MAX_TOKENS, ChatFamily

__all__ = ["DEFAULT_MAX_TOKENS", "ChatARStage", "ChatFamily"]
