"""Output modalities: canonical names, parsing, default output keys and DELTA accumulation.

A stage declares what it emits with ``engine_output_type`` (e.g. ``token_ids`` for GLM-Image's AR stage,
``image`` for its diffusion stage). Only the canonical lowercase names are accepted; aliases such as
``latents`` or ``tokens`` are rejected instead of silently mapped, because a silently mapped alias once
routed image token ids through the text path (see shared/seeds/004).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class OutputModality(StrEnum):
    """The kinds of output a stage can produce."""

    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"
    LATENT = "latent"
    TOKEN_IDS = "token_ids"


VALID_MODALITY_NAMES: tuple[str, ...] = tuple(m.value for m in OutputModality)
DEFAULT_MODALITY = OutputModality.TEXT
_SEPARATORS = re.compile(r"[+,]")


class ModalityError(ValueError):
    """A modality string that is not a canonical name or combination of them."""


def _valid_names_hint() -> str:
    return (
        "valid names are "
        + ", ".join(VALID_MODALITY_NAMES)
        + "; combine them with '+' or ',' (e.g. 'text+image')"
    )


def parse_output_modalities(value: str | None) -> tuple[OutputModality, ...]:
    """Parse ``engine_output_type`` into modalities.

    ``None`` (the key was omitted) means ``text``. An explicitly empty string is an error, not the default.
    Components are joined with ``+`` or ``,``; every component must be a canonical name exactly (no case
    variants, no whitespace, no aliases, no empty components, no repeats).
    """
    if value is None:
        return (DEFAULT_MODALITY,)
    if not isinstance(value, str):
        raise ModalityError(
            f"output modality must be a string, got {type(value).__name__}; {_valid_names_hint()}"
        )
    if value == "":
        raise ModalityError(f"output modality is empty; {_valid_names_hint()}")
    if any(ch.isspace() for ch in value):
        raise ModalityError(f"output modality {value!r} contains whitespace; {_valid_names_hint()}")
    parts = _SEPARATORS.split(value)
    modalities: list[OutputModality] = []
    for part in parts:
        if part == "":
            raise ModalityError(f"output modality {value!r} has an empty component; {_valid_names_hint()}")
        if part not in VALID_MODALITY_NAMES:
            raise ModalityError(f"unknown output modality {part!r} in {value!r}; {_valid_names_hint()}")
        modality = OutputModality(part)
        if modality in modalities:
            raise ModalityError(f"output modality {part!r} is repeated in {value!r}; {_valid_names_hint()}")
        modalities.append(modality)
    return tuple(modalities)


def format_output_modalities(modalities: tuple[OutputModality, ...]) -> str:
    """The canonical spelling of a parsed combination (``text+image``)."""
    return "+".join(m.value for m in modalities)


class Accumulation(StrEnum):
    """How successive DELTA payloads of one key combine."""

    CONCAT_DIM0 = "concat_dim0"  # tensors (and lists) are concatenated along dim 0
    CONCAT_TEXT = "concat_text"  # strings are appended
    REPLACE = "replace"  # the newest value wins


@dataclass(frozen=True)
class ModalitySpec:
    """What the engine does with one modality's payload."""

    default_key: str
    accumulation: Accumulation
    retained_across_delta: bool  # kept (and accumulated) after a DELTA step, or drained once delivered


MODALITY_SPECS: Mapping[OutputModality, ModalitySpec] = {
    OutputModality.TEXT: ModalitySpec("text", Accumulation.CONCAT_TEXT, True),
    OutputModality.IMAGE: ModalitySpec("image", Accumulation.REPLACE, False),
    OutputModality.AUDIO: ModalitySpec("audio", Accumulation.CONCAT_DIM0, False),
    OutputModality.LATENT: ModalitySpec("latent", Accumulation.CONCAT_DIM0, True),
    OutputModality.TOKEN_IDS: ModalitySpec("token_ids", Accumulation.CONCAT_DIM0, True),
}

# Keys a model runner emits without saying what they are; they take the declared type's default key.
GENERIC_PRODUCER_KEYS: tuple[str, ...] = ("model_outputs", "hidden")


def default_output_key(modality: OutputModality) -> str:
    return MODALITY_SPECS[modality].default_key


def normalize_output_keys(payload: Mapping[str, Any], declared: OutputModality) -> dict[str, Any]:
    """Rename generic producer keys to ``declared``'s default key; values pass through untouched.

    Explicitly named keys (``prior_image``, ``text``, ...) are kept as they are. When the default key is
    already present, the generic key keeps its own name rather than overwriting an explicit value.
    """
    target = default_output_key(declared)
    normalized: dict[str, Any] = {}
    for key, value in payload.items():
        if key in GENERIC_PRODUCER_KEYS and target not in payload and target not in normalized:
            normalized[target] = value
        else:
            normalized[key] = value
    return normalized


def _concat_dim0(old: Any, new: Any) -> Any:
    import torch  # here, not at import time: validating a config should not load torch

    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        if old.dim() == 0:
            old = old.reshape(1)
        if new.dim() == 0:
            new = new.reshape(1)
        return torch.cat([old, new.to(old.device)], dim=0)
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    raise TypeError(f"cannot concatenate {type(old).__name__} with {type(new).__name__} along dim 0")


class OutputAccumulator:
    """Combines the DELTA payloads a stage emits for one request.

    Keys of retained modalities (text, latent, token_ids) accumulate and stay available after each
    delivery; keys of drained modalities (image, audio) are handed out once and then cleared. Per-key
    strategies given explicitly take precedence over the modality defaults; unknown auxiliary keys
    are replaced by their newest value and retained.
    """

    def __init__(
        self,
        modalities: tuple[OutputModality, ...],
        key_strategies: Mapping[str, Accumulation] | None = None,
    ) -> None:
        self.modalities = modalities
        self._declared = modalities[0]
        self._key_modality = {default_output_key(m): m for m in modalities}
        self._key_strategies = dict(key_strategies or {})
        self._values: dict[str, Any] = {}

    def _strategy(self, key: str) -> Accumulation:
        if key in self._key_strategies:
            return self._key_strategies[key]
        modality = self._key_modality.get(key)
        return MODALITY_SPECS[modality].accumulation if modality else Accumulation.REPLACE

    def _retained(self, key: str) -> bool:
        modality = self._key_modality.get(key)
        return MODALITY_SPECS[modality].retained_across_delta if modality else True

    def add(self, delta: Mapping[str, Any]) -> None:
        """Merge one DELTA payload (generic keys are normalized to the first declared modality)."""
        for key, value in normalize_output_keys(delta, self._declared).items():
            if key not in self._values:
                self._values[key] = value
                continue
            strategy = self._strategy(key)
            if strategy is Accumulation.CONCAT_DIM0:
                self._values[key] = _concat_dim0(self._values[key], value)
            elif strategy is Accumulation.CONCAT_TEXT:
                self._values[key] = str(self._values[key]) + str(value)
            else:
                self._values[key] = value

    def deliver(self) -> dict[str, Any]:
        """Return everything accumulated so far, then drain the non-retained keys."""
        snapshot = dict(self._values)
        for key in [k for k in self._values if not self._retained(k)]:
            del self._values[key]
        return snapshot

    def peek(self) -> dict[str, Any]:
        return dict(self._values)
