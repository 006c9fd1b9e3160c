"""``omni-studio validate``: check a deploy config against a model (and this machine) without loading it."""

from __future__ import annotations

import argparse
import sys

from engine.config import DeployConfigError
from studio.errors import UserError
from studio.startup.settings import StudioSettings


def cmd_validate(args: argparse.Namespace, settings: StudioSettings) -> int:
    from engine.building import build_pipeline_config, device_problems
    from engine.models import ModelNotFound, describe_model
    from engine.pipelines import UnknownModelFamily

    try:
        source = describe_model(settings.model)
    except (ModelNotFound, UnknownModelFamily) as exc:
        raise UserError(str(exc)) from exc
    try:
        config = build_pipeline_config(source, args.file, settings.ar_backend, settings.devices)
        if args.check_devices:
            problems = device_problems(config)
            # Each stage's memory from the checkpoint's files, never loaded (docs/memory.md); a built-in
            # model is built into the model cache first (cheap: tiny models).
            from engine.memory_estimate import CheckpointError, estimate_memory
            from engine.models import materialize
            from engine.paths import model_cache_dir

            try:
                path = materialize(source, model_cache_dir(settings.data_dir)).path
                assert path is not None
                estimate = estimate_memory(config, path)
            except CheckpointError as exc:
                raise UserError(f"cannot estimate memory: {exc}") from exc
            print(estimate.report())
            problems += estimate.problems()
            if problems:
                raise DeployConfigError(problems, source=args.file)
    except DeployConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    print(f"{args.file}: valid")
    print(config.summary())
    return 0
