"""The vLLM names the vLLM stage uses (docs/vllm.md), imported in one place.

vLLM logs every engine start at INFO and reconfigures its loggers when an engine starts, so the level is
set through its own variable before vLLM is imported (a user's setting wins). A broken install (e.g. a
CUDA torchvision beside CPU torch) raises ``ImportError``: to ``engine/stages/backends.py`` it is "not
importable".
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

try:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
except Exception as exc:  # a broken install is "not importable"
    raise ImportError(f"vLLM is installed but does not import: {type(exc).__name__}: {exc}") from exc

__all__ = ["AsyncEngineArgs", "EngineArgs", "RequestOutputKind", "SamplingParams", "TokensPrompt"]
