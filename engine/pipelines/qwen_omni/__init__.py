"""Qwen2.5-Omni (the ``qwen-omni`` family): thinker (AR: text) -> talker (AR: codec ids) -> code2wav (audio).

Stage 0 runs the thinker on the chat messages and streams the reply's text; when the request asks for
audio it also emits its hidden states as ``latent``. ``thinker2talker`` (engine/processors.py) turns
them into the talker's prompt; stage 1's talker generates codec ids; ``talker2code2wav`` cuts them at the
talker's stop id and stage 2 renders them to 24 kHz mono samples in the request's voice. The stages
carry transformers' one-shot ``generate``'s RNG stream from one to the next, so the split pipeline
makes its samples (docs/speech.md).
"""

from engine.pipelines.qwen_omni.code2wav import Code2WavStage
from engine.pipelines.qwen_omni.family import QwenOmniFamily
from engine.pipelines.qwen_omni.talker import TalkerStage
from engine.pipelines.qwen_omni.thinker import SPEECH_SYSTEM_PROMPT, ThinkerStage, chat_messages

__all__ = [
    "SPEECH_SYSTEM_PROMPT",
    "Code2WavStage",
    "QwenOmniFamily",
    "TalkerStage",
    "ThinkerStage",
    "chat_messages",
]
