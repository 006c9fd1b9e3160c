"""``system_fingerprint``: which build and pipeline configuration served a response.

Modes (``--fingerprint-mode``): ``full`` -> ``omni-studio-<version>[-tpN][-ppN]-<hash8>``; ``hash`` ->
``omni-studio-<version>-<hash8>``; ``custom`` -> the literal ``--fingerprint-value``; ``none`` -> no
fingerprint. ``hash8`` is the first 8 hex digits of the resolved pipeline config's hash. The value is
computed once, before any serving handler is built, and handlers cache it (see ``ServingState``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import PipelineConfig
from studio import __version__

FINGERPRINT_MODES = ("full", "hash", "custom", "none")


class FingerprintError(ValueError):
    """An invalid mode/value combination (refused at start-up, or when the UI applies it)."""


@dataclass(frozen=True)
class FingerprintSettings:
    mode: str = "full"
    value: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in FINGERPRINT_MODES:
            raise FingerprintError(
                f"--fingerprint-mode must be one of {', '.join(FINGERPRINT_MODES)}, got {self.mode!r}"
            )
        if self.mode == "custom" and not self.value:
            raise FingerprintError(
                "--fingerprint-mode custom needs --fingerprint-value VALUE (a non-empty string)"
            )
        if self.mode != "custom" and self.value is not None:
            raise FingerprintError(
                f"--fingerprint-value is only used with --fingerprint-mode custom (the mode is {self.mode!r}); "
                "drop the value or use custom"
            )


def system_fingerprint(settings: FingerprintSettings, config: PipelineConfig) -> str | None:
    """The fingerprint string for ``config`` under ``settings`` (``None`` in mode ``none``)."""
    if settings.mode == "none":
        return None
    if settings.mode == "custom":
        return settings.value
    if settings.mode == "hash":
        return f"omni-studio-{__version__}-{config.hash8}"
    parallel = ""
    if config.tensor_parallel_size > 1:
        parallel += f"-tp{config.tensor_parallel_size}"
    if config.pipeline_parallel_size > 1:
        parallel += f"-pp{config.pipeline_parallel_size}"
    return f"omni-studio-{__version__}{parallel}-{config.hash8}"
