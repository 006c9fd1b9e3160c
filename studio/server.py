"""``omni-studio serve``: the API alone, on uvicorn (the studio serves the same routes from Gradio's app)."""

from __future__ import annotations

import argparse
import logging
import sys

from studio.api.app import ServingOptions, ServingState, create_app
from studio.api.fingerprint import FingerprintError, FingerprintSettings
from studio.runtime import data_dir_from, start_engine


def fingerprint_settings(args: argparse.Namespace) -> FingerprintSettings:
    """Checked before anything loads: a bad mode/value combination stops start-up with a clear message."""
    return FingerprintSettings(args.fingerprint_mode, args.fingerprint_value)


def serving_options(args: argparse.Namespace) -> ServingOptions:
    return ServingOptions(
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        fingerprint=fingerprint_settings(args),
        data_dir=data_dir_from(args),
    )


def open_recorder(args: argparse.Namespace):
    """The run store's recorder, or ``None`` when the store is not available in this build."""
    try:
        from studio.store import RunRecorder, open_store
    except ImportError:
        return None
    store = open_store(args.db, data_dir_from(args))
    return RunRecorder(store)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    try:
        options = serving_options(args)
    except FingerprintError as exc:
        from studio.cli import CLIError

        raise CLIError(str(exc)) from exc
    recorder = open_recorder(args)
    engine = start_engine(args)
    state = ServingState(engine, options, recorder=recorder, source="api")
    app = create_app(state)
    fingerprint = state.handlers.system_fingerprint if state.handlers else None
    print(
        f"Omni Studio API on http://{args.host}:{args.port}/v1 — model {state.served_model_name} "
        f"({engine.config.family}), config {engine.config.hash8}, fingerprint {fingerprint or 'none'}",
        file=sys.stderr,
        flush=True,
    )
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.close()
        if recorder is not None:
            recorder.close()
    return 0
