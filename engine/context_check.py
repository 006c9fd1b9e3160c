"""Refusing a prompt longer than an entry AR stage's context before it is queued (``OmniEngine.check_context``)."""

from __future__ import annotations

from engine.config import PipelineConfig, ResolvedStage
from engine.request import RequestError, ResolvedRequest
from engine.stages.base import StageRunner


def check_context(config: PipelineConfig, runners: dict[int, StageRunner], resolved: ResolvedRequest) -> None:
    """Raise :class:`RequestError` naming ``prompt`` when the prompt is longer than an entry AR stage's
    context (``max_model_len`` or the model's positions).

    The count covers the prompt and message texts only (a chat template adds a few tokens, which the
    stage still checks); it tokenizes only text with more UTF-8 bytes than the context has positions.
    """
    request = resolved.request
    texts = [request.prompt or ""] + [turn.text for turn in request.messages or ()]
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    for stage in config.entry_stages:
        if stage.kind != "ar":
            continue
        runner = runners[stage.stage_id]
        limit = context_length(runner, stage)
        if not limit or size <= limit:  # a token covers at least one byte
            continue
        count = count_tokens(runner, texts)
        if count is not None and count > limit:
            raise RequestError(
                "prompt",
                f"is {count} tokens; the model's context is {limit} tokens "
                f"(stage {stage.stage_id} max_model_len)",
            )


def context_length(runner: StageRunner, stage: ResolvedStage) -> int | None:
    """The AR stage's context: ``max_model_len`` (config or vLLM's), else the model's positions."""
    limit = stage.engine_args.max_model_len or getattr(runner, "max_model_len", None)
    if limit:
        return int(limit)
    config = getattr(getattr(runner, "model", None), "config", None)
    for candidate in (config, getattr(config, "text_config", None)):
        positions = getattr(candidate, "max_position_embeddings", None)
        if isinstance(positions, int) and positions > 0:
            return positions
    return None


def count_tokens(runner: StageRunner, texts: list[str]) -> int | None:
    """Tokens of ``texts`` under the runner's tokenizer; ``None`` when it has none (the stage checks)."""
    processor = getattr(runner, "processor", None)
    tokenizer = getattr(runner, "tokenizer", None) or getattr(processor, "tokenizer", None)
    if tokenizer is None:
        return None
    try:
        return sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts if t)
    except Exception:  # a tokenizer that refuses the text: the stage reports it
        return None
