"""Starting the studio from its settings: the run recorder, the engine, the API and the UI.

``omni-studio serve`` -> :func:`serve_api` (the API alone, on uvicorn); ``omni-studio ui`` ->
:func:`launch_ui` (Gradio and the whole ``/v1`` API on one port). Both take a :class:`StudioSettings`
and nothing else; start-up failures become :class:`StartupError` with a message that says what to change.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from studio.errors import StartupError
from studio.settings import StudioSettings

if TYPE_CHECKING:
    from engine import OmniEngine
    from studio.api.app import ServingOptions
    from studio.store.recorder import RunRecorder


def tune_interpreter() -> None:
    """Shorter GIL time slices (5 ms -> 1 ms) for our thread-heavy processes.

    Every request crosses threads several times (event loop -> stage workers -> event loop, per event);
    with the default 5 ms slice each hand-off can wait for a busy thread's whole slice, which cost the
    API ~40-80 ms per tiny request here. Torch releases the GIL inside its kernels either way.
    """
    sys.setswitchinterval(0.001)


def start_engine(settings: StudioSettings, max_pending: int = 64) -> OmniEngine:
    """Validate the deploy config against the model, build the model if built in, load every stage."""
    from engine.config import DeployConfigError
    from engine.engine import EngineBuildError, build_engine
    from engine.models import ModelNotFound
    from engine.pipelines import UnknownModelFamily

    try:
        return build_engine(
            settings.model,
            settings.deploy_config,
            data_dir=settings.data_dir,
            ar_backend=settings.ar_backend,
            max_pending=max_pending,
        )
    except DeployConfigError as exc:
        raise StartupError(exc.render()) from exc
    except (ModelNotFound, UnknownModelFamily, EngineBuildError) as exc:
        raise StartupError(str(exc)) from exc


def open_recorder(settings: StudioSettings) -> RunRecorder:
    """The run store (opened and migrated) behind its writer thread."""
    from studio.store import StoreError, open_store
    from studio.store.recorder import RunRecorder

    try:
        return RunRecorder(open_store(settings.db_url, settings.data_dir))
    except StoreError as exc:
        raise StartupError(str(exc)) from exc


def close_recorder(recorder: RunRecorder) -> None:
    """Write everything queued, then close the store (before the process exits)."""
    recorder.close()
    recorder.store.close()


def serving_options(settings: StudioSettings) -> ServingOptions:
    from studio.api.app import ServingOptions
    from studio.api.fingerprint import FingerprintSettings

    return ServingOptions(
        served_model_name=settings.served_model_name,
        api_key=settings.api_key,
        fingerprint=settings.fingerprint or FingerprintSettings(),
        data_dir=settings.data_dir,
        limits=settings.limits,
    )


def serve_api(settings: StudioSettings) -> int:
    """``omni-studio serve``: the OpenAI-compatible API alone, on uvicorn."""
    import uvicorn

    from studio.api.app import ServingState, create_app

    options = serving_options(settings)
    recorder = open_recorder(settings)
    engine = start_engine(settings)
    state = ServingState(engine, options, recorder=recorder, source="api")
    app = create_app(state)
    fingerprint = state.handlers.system_fingerprint if state.handlers else None
    print(
        f"Omni Studio API on http://{settings.host}:{settings.port}/v1 — model {state.served_model_name} "
        f"({engine.config.family}), config {engine.config.hash8}, fingerprint {fingerprint or 'none'}",
        file=sys.stderr,
        flush=True,
    )
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    try:
        uvicorn.run(
            app, host=settings.host, port=settings.port, log_level="warning", timeout_graceful_shutdown=5
        )
    finally:
        engine.close()
        recorder.close()
    return 0


def launch_ui(settings: StudioSettings) -> int:
    """``omni-studio ui``: the Gradio studio and the whole ``/v1`` API on one port."""
    from studio.controller import generate_secret

    # Settle the share login and API key before anything loads: a public link without a login would let
    # anyone use the machine, and the API is public through the same link.
    options = serving_options(settings)
    auth = settings.auth
    generated_key = False
    if settings.share:
        if auth is None:
            auth = ("omni", generate_secret())
        if not options.api_key:
            options = replace(options, api_key=generate_secret(18))
            generated_key = True

    # Gradio's import (seconds) overlaps torch/transformers/diffusers and the engine start on the main
    # thread: a large part of both is file I/O, which releases the GIL. It cuts the studio's cold start.
    preload = threading.Thread(
        target=lambda: __import__("studio.ui.app"), daemon=True, name="omni-preload-ui"
    )
    preload.start()
    engine = start_engine(settings)
    preload.join()

    import gradio as gr

    from studio.api.app import ServingState
    from studio.controller import Studio
    from studio.ui.app import CSS, attach_api, build_ui

    recorder = open_recorder(settings)
    serving = ServingState(engine, options, recorder=recorder, source="api")
    studio = Studio(
        engine,
        serving,
        settings.data_dir,
        recorder=recorder,
        store=recorder.store,
        deploy_text=settings.deploy_text(),
        ar_backend=settings.ar_backend,
    )
    studio.share.requested = settings.share
    studio.share.api_key_generated = generated_key
    if settings.share and auth is not None:
        studio.share.username, studio.share.password = auth

    # What the UI may serve through /gradio_api/file=: only the run store's output files (the images it
    # shows; Gradio copies them into its cache, and this lets it read them wherever the data dir is),
    # never the rest of the data dir (built models, logs) nor the database, which is also blocked by name
    # in case it lives among the outputs. Not the data dir itself: anyone with the UI (or, with --share,
    # its login) could download runs.db and every file there.
    store = recorder.store
    outputs_dir = str(store.files.root.resolve())
    blocked = []
    if store.engine.dialect.name == "sqlite" and store.engine.url.database not in (None, "", ":memory:"):
        database = str(Path(store.engine.url.database).resolve())
        blocked = [database + suffix for suffix in ("", "-wal", "-shm", "-journal")]

    demo = build_ui(studio)
    demo.queue(default_concurrency_limit=4, max_size=64)
    app, local_url, share_url = demo.launch(
        server_name=settings.host,
        server_port=settings.port,
        share=settings.share,
        auth=auth,
        prevent_thread_lock=True,
        allowed_paths=[outputs_dir],
        blocked_paths=blocked,
        quiet=True,
        show_error=True,
        css=CSS,
        theme=gr.themes.Soft(),
    )
    attach_api(app, serving)
    studio.base_url = local_url.rstrip("/") if local_url else f"http://{settings.host}:{settings.port}"
    studio.share.url = share_url
    if settings.share and not share_url:
        studio.share.message = "(could not create a share link: no internet access?)"
    lines = [
        f"Omni Studio on {studio.base_url} — model {serving.served_model_name} ({engine.config.family}), "
        f"config {engine.config.hash8}",
        f"  OpenAI-compatible API: {studio.base_url}/v1"
        + (f" and {share_url.rstrip('/')}/v1" if share_url else ""),
    ]
    if settings.share and auth is not None:
        lines.append(f"  share link: {share_url or 'not available ' + studio.share.message}")
        lines.append(f"  UI login: {auth[0]} / {auth[1]}")
    if generated_key:
        lines.append(f"  API key (required on /v1 when shared): {options.api_key}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    try:
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        demo.close()
        studio.close()
    return 0
