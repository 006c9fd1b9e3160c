"""The studio: the Gradio UI and the whole ``/v1`` API from one process and one port.

The API routes are added to the app that ``launch()`` runs (ahead of Gradio's catch-all routes), so a
``--share`` link carries both; ``mount_gradio_app`` cannot make share links.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gradio as gr

from studio.api.app import ServingState, create_api_router
from studio.controller import Studio, generate_secret
from studio.ui.chat import build_chat_tab
from studio.ui.history import build_history_tab
from studio.ui.pipeline import build_pipeline_tab
from studio.ui.serving import build_serving_tab
from studio.ui.system import build_system_tab

CSS = """
.omni-progress { display: flex; flex-direction: column; gap: 6px; font-size: 0.9em; }
.omni-stage { display: grid; grid-template-columns: 9em 1fr 14em; align-items: center; gap: 8px; }
.omni-stage progress { width: 100%; height: 12px; }
.omni-stage.failed .omni-stage-count, .omni-stage.cancelled .omni-stage-count { color: #c0392b; }
.omni-stage.succeeded .omni-stage-count { color: #1e8449; }
.omni-errors ul { margin: 4px 0; color: #c0392b; }
.omni-invalid { color: #c0392b; }
.omni-ok pre { white-space: pre-wrap; font-size: 0.85em; }
.omni-chart { display: flex; flex-direction: column; gap: 6px; padding: 8px 0; }
.omni-chart-title { font-weight: 600; }
.omni-chart-row { display: grid; grid-template-columns: 11em 1fr 17em; align-items: center; gap: 8px; }
.omni-chart-track { display: flex; height: 14px; background: #eef; border-radius: 3px; overflow: hidden; }
.omni-chart-queue { background: #ccc; }
.omni-chart-bar { background: #6366f1; }
.omni-chart-bar.failed, .omni-chart-bar.cancelled { background: #c0392b; }
.omni-chart-value { font-size: 0.85em; }
"""


def header(studio: Studio) -> str:
    return f"## Omni Studio · {studio.model.name} ({studio.config.family}) · config `{studio.config.hash8}`"


def build_ui(studio: Studio) -> gr.Blocks:
    with gr.Blocks(title="Omni Studio", analytics_enabled=False) as demo:  # no calls home
        title = gr.Markdown(header(studio), elem_id="omni-header")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat"):
                chat = build_chat_tab(studio)
            with gr.Tab("Pipeline", id="pipeline") as pipeline_tab:
                pipeline = build_pipeline_tab(studio)
            with gr.Tab("Serving", id="serving") as serving_tab:
                serving = build_serving_tab(studio)
            with gr.Tab("History", id="history") as history_tab:
                history = build_history_tab(studio)
            with gr.Tab("System", id="system") as system_tab:
                system = build_system_tab(studio)
        pipeline["apply_event"].then(
            chat["sync_defaults"], None, chat["defaults_outputs"], api_visibility="private"
        )
        for event in (pipeline["apply_event"], chat["switch_event"]):  # the header names the running config
            event.then(lambda: header(studio), None, [title], api_visibility="private")
        # Each tab shows the current state when opened (another tab, the API or the CLI may have changed it).
        pipeline_tab.select(pipeline["refresh"], None, pipeline["refresh_outputs"], api_visibility="private")
        serving_tab.select(serving["refresh"], None, serving["refresh_outputs"], api_visibility="private")
        system_tab.select(system["refresh"], None, system["refresh_outputs"], api_visibility="private")
        if history:
            history_tab.select(history["refresh"], None, history["refresh_outputs"], api_visibility="private")
    return demo


def attach_api(app, serving: ServingState) -> None:
    """Put the API routes in front of Gradio's own (its catch-all routes would answer first otherwise)."""
    router = create_api_router(serving)
    routes = app.router.routes
    for route in reversed(router.routes):
        routes.insert(0, route)


def launch_studio(args: argparse.Namespace, engine=None) -> int:
    """Serve the studio; ``engine`` may be started already (the CLI overlaps that with importing Gradio)."""
    from studio.runtime import data_dir_from, start_engine
    from studio.server import open_recorder, serving_options

    try:
        options = serving_options(args)
    except Exception as exc:  # FingerprintError: a clear message before anything loads
        from studio.cli import CLIError

        raise CLIError(str(exc)) from exc
    auth = None
    share_user = share_password = None
    generated_key = False
    if args.auth:
        if ":" not in args.auth:
            from studio.cli import CLIError

            raise CLIError("--auth takes USER:PASS")
        share_user, share_password = args.auth.split(":", 1)
        auth = (share_user, share_password)
    if args.share:
        if auth is None:  # a public link without a login would let anyone use the machine
            share_user, share_password = "omni", generate_secret()
            auth = (share_user, share_password)
        if not options.api_key:  # ... and the API is public through the same link
            from dataclasses import replace

            options = replace(options, api_key=generate_secret(18))
            generated_key = True

    data_dir = data_dir_from(args)
    recorder = open_recorder(args)
    engine = engine or start_engine(args)
    serving = ServingState(engine, options, recorder=recorder, source="api")
    deploy_text = Path(args.deploy_config).read_text() if args.deploy_config else None
    studio = Studio(
        engine,
        serving,
        data_dir,
        recorder=recorder,
        store=getattr(recorder, "store", None),
        deploy_text=deploy_text,
        ar_backend=args.ar_backend,
    )
    studio.share.requested = bool(args.share)
    studio.share.api_key_generated = generated_key
    if args.share:
        studio.share.username, studio.share.password = share_user, share_password

    demo = build_ui(studio)
    demo.queue(default_concurrency_limit=4, max_size=64)
    app, local_url, share_url = demo.launch(
        server_name=args.host,
        server_port=args.port,
        share=args.share,
        auth=auth,
        prevent_thread_lock=True,
        allowed_paths=[str(data_dir)],
        quiet=True,
        show_error=True,
        css=CSS,
        theme=gr.themes.Soft(),
    )
    attach_api(app, serving)
    studio.base_url = local_url.rstrip("/") if local_url else f"http://{args.host}:{args.port}"
    studio.share.url = share_url
    if args.share and not share_url:
        studio.share.message = "(could not create a share link: no internet access?)"
    lines = [
        f"Omni Studio on {studio.base_url} — model {serving.served_model_name} ({engine.config.family}), "
        f"config {engine.config.hash8}",
        f"  OpenAI-compatible API: {studio.base_url}/v1"
        + (f" and {share_url.rstrip('/')}/v1" if share_url else ""),
    ]
    if args.share:
        lines.append(f"  share link: {share_url or 'not available ' + studio.share.message}")
        lines.append(f"  UI login: {share_user} / {share_password}")
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
