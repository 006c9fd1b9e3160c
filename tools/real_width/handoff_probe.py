"""``python -m tools.real_width.handoff_probe ARGS``: ``omni-studio ARGS`` with the AR -> DiT hand-off
recorded, one JSON line per hand-off, to the file named by ``OMNI_HANDOFF_LOG``.

The engine reports the AR stage's output tokens (``StageFinished.output_tokens``, the run store's stage
records) but nothing reports what the DiT is given: the prior token count and whether prior image ids
came with it. This wraps the registered ``ar2diffusion`` input processor (engine/processors.py) in the
server process, calls it unchanged and writes what went in and what came out; everything else is the
plain CLI (``studio.cli.main``). bench/real_shapes.py starts servers through it (docs/real-shapes.md).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

LOG_ENV = "OMNI_HANDOFF_LOG"


def _count(value: Any) -> int:
    import torch

    if value is None:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(_count(v) for v in value)
    return int(torch.as_tensor(value).numel())


def install(path: str) -> None:
    """Wrap ``INPUT_PROCESSORS['ar2diffusion']`` so every call appends a record to ``path``."""
    from engine.processors import INPUT_PROCESSORS

    original = INPUT_PROCESSORS["ar2diffusion"]
    lock = threading.Lock()

    def recorded(ar_outputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        inputs = original(ar_outputs, params)
        record = {
            "height": int(params["height"]),
            "width": int(params["width"]),
            "prompt": str(params.get("prompt", ""))[:200],
            "ar_tokens": _count(ar_outputs.get("token_ids")),
            "prior_tokens": _count(inputs.get("prior_token_ids")),
            "prior_token_ids_shape": list(inputs["prior_token_ids"].shape),
            "prior_image_ids_present": inputs.get("prior_token_image_ids") is not None,
            "prior_image_ids": _count(inputs.get("prior_token_image_ids")),
            "source_image_codes": _count(ar_outputs.get("prior_image")),
        }
        with lock, open(path, "a") as log:
            log.write(json.dumps(record) + "\n")
        return inputs

    INPUT_PROCESSORS["ar2diffusion"] = recorded


def main(argv: list[str] | None = None) -> int:
    path = os.environ.get(LOG_ENV)
    if not path:
        print(f"set {LOG_ENV} to the file the hand-off records go to", file=sys.stderr)
        return 2
    install(path)
    from studio.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
