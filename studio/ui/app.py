"""The studio: the Gradio UI and the whole ``/v1`` API from one process and one port.

``studio.startup.launch.launch_ui`` builds the UI here and launches it. The API routes are added to the app that
``launch()`` runs (ahead of Gradio's catch-all routes), so a
``--share`` link carries both; ``mount_gradio_app`` cannot make share links.
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from studio.api.app import create_api_router
from studio.api.auth import guard_gradio_login, limiter_for
from studio.api.state import ServingState
from studio.controller import Studio
from studio.ui.chat import build_chat_tab
from studio.ui.history import build_history_tab
from studio.ui.jobs import build_batch_tab
from studio.ui.pipeline import build_pipeline_tab
from studio.ui.queue import build_queue_tab, tab_timers
from studio.ui.serving import build_serving_tab
from studio.ui.speech import build_speech_tab
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


def who_markdown(studio: Studio, username: str | None) -> str:
    """Who is logged in (docs/team.md): the account and whether it is an admin; empty without a login."""
    if not username:
        return ""
    identity = studio.identity(username)
    if identity.accounts and identity.name is None and not identity.admin:
        return f"Logged in as **{username}**, which is no longer an account: log out and in again."
    shown = identity.name or username
    role = " (admin)" if identity.admin else ""
    return f"Logged in as **{shown}**{role}"


def build_ui(studio: Studio) -> gr.Blocks:
    with gr.Blocks(title="Omni Studio", analytics_enabled=False) as demo:  # no calls home
        with gr.Row(equal_height=True):
            title = gr.Markdown(header(studio), elem_id="omni-header")
            who = gr.Markdown("", elem_id="omni-who")
            # Gradio's own log-out: clears this browser's login cookie, then back to the login page.
            logout = gr.Button(
                "Log out",
                link="/logout?all_session=false",
                visible=False,
                size="sm",
                scale=0,
                min_width=90,
                elem_id="omni-logout",
            )
        with gr.Tabs() as tabs:
            with gr.Tab("Chat", id="chat"):
                chat = build_chat_tab(studio)
            with gr.Tab("Speech", id="speech"):
                speech = build_speech_tab(studio)
            with gr.Tab("Pipeline", id="pipeline") as pipeline_tab:
                pipeline = build_pipeline_tab(studio)
            with gr.Tab("Serving", id="serving") as serving_tab:
                serving = build_serving_tab(studio)
            with gr.Tab("History", id="history") as history_tab:
                history = build_history_tab(studio)
            with gr.Tab("System", id="system") as system_tab:
                system = build_system_tab(studio)
            with gr.Tab("Batch", id="batch") as batch_tab:
                batch = build_batch_tab(studio)
            with gr.Tab("Queue", id="queue") as queue_tab:
                queue = build_queue_tab(studio)
        pipeline["apply_event"].then(
            chat["sync_defaults"], None, chat["defaults_outputs"], api_visibility="private"
        )
        for event in (pipeline["apply_event"], chat["switch_event"]):  # the header names the running config
            event.then(lambda: header(studio), None, [title], api_visibility="private")
            event.then(speech["sync"], None, speech["sync_outputs"], api_visibility="private")
        # Each tab shows the current state when opened (another tab, the API or the CLI may have changed it).
        pipeline_tab.select(pipeline["refresh"], None, pipeline["refresh_outputs"], api_visibility="private")
        serving_tab.select(serving["refresh"], None, serving["refresh_outputs"], api_visibility="private")
        system_tab.select(system["refresh"], None, system["refresh_outputs"], api_visibility="private")
        if history:
            history_tab.select(history["refresh"], None, history["refresh_outputs"], api_visibility="private")
        batch_tab.select(
            batch["refresh"], batch["refresh_inputs"], batch["refresh_outputs"], api_name="batch_open"
        )
        queue_tab.select(queue["refresh"], None, queue["refresh_outputs"], api_name="queue_open")

        def on_load(request: gr.Request):
            """Whose page this is: shown at the top, and remembered for the session's runs (docs/team.md)."""
            username = getattr(request, "username", None)
            identity = studio.identity(username)
            studio.ui_users.remember(request.session_hash, identity.name if identity.accounts else None)
            return who_markdown(studio, username), gr.Button(visible=bool(username))

        demo.load(on_load, None, [who, logout], api_name="whoami", api_visibility="private")
        # The Batch and Queue tabs refresh themselves every second or so, only while they are shown.
        tabs.select(
            tab_timers,
            None,
            [batch["timer"], queue["timer"]],
            api_name="tab_timers",
            api_visibility="private",
        )
    return demo


def api_app_kwargs(serving: ServingState) -> dict[str, Any]:
    """``launch(app_kwargs=...)``: Gradio's app is built with the API routes first (ahead of its catch-all
    routes), so ``/health`` and ``/v1`` answer from the server's first request on."""
    from starlette.middleware import Middleware

    from studio.api.refusals import RefusalThrottle
    from studio.startup.starting import RetryAfterOn503

    return {
        "routes": list(create_api_router(serving).routes),
        "middleware": [Middleware(RetryAfterOn503), Middleware(RefusalThrottle, rate=serving.refusals)],
    }


def attach_api(app, serving: ServingState) -> None:
    """Put the API routes in front of Gradio's own (unless :func:`api_app_kwargs` put them there already),
    and Gradio's ``POST /login`` behind the failed-login limiter the API keys share (README, "--share")."""
    routes = app.router.routes
    if not any(getattr(route, "path", None) == "/health" for route in routes):
        for route in reversed(create_api_router(serving).routes):
            routes.insert(0, route)
    guard_gradio_login(app, limiter_for(serving))
