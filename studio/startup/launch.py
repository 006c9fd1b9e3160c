"""Starting the studio from its settings: the run recorder, the engine, the API and the UI.

``omni-studio serve`` -> :func:`serve_api` (the API alone, on uvicorn); ``omni-studio ui`` ->
:func:`launch_ui` (Gradio and the whole ``/v1`` API on one port). Both take a :class:`StudioSettings`
and nothing else; start-up failures become :class:`StartupError` with a message that says what to change.

Both listen first and load second. The port answers within a second of the process start, before torch,
transformers, diffusers or Gradio are imported: :class:`StartingApp` answers ``/health`` with 503
``starting``, ``/v1/*`` with 503 ``engine_not_ready`` (an OpenAI error body) and ``Retry-After``, and ``/``
(``ui``) with a "loading model" page that reloads itself once the studio answers. Then the engine loads:
``serve`` puts the real API behind the same server (no gap); ``ui`` hands the port to Gradio's
``launch()`` (share links need it) once the engine and the UI are built, a gap of a fraction of a second
that the loading page and ``/health`` pollers ride over. A failed load stops the server and exits 1 with
the start-up error, as before.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.environment import StartupCollection
from studio.errors import StartupError, Terminated
from studio.startup.settings import StudioSettings
from studio.startup.starting import ASGIApp, StartingApp

if TYPE_CHECKING:
    import uvicorn

    from engine import OmniEngine
    from studio.api.state import ServingOptions
    from studio.jobs.service import JobService
    from studio.store.recorder import RunRecorder

log = logging.getLogger("omni_studio")

# Test-only: a file's path. The engine load waits until that file exists, so a test watches the loading
# state for as long as its checks take, whatever the machine's speed, and then lets it go on.
LOAD_HOLD_ENV = "OMNI_STUDIO_TEST_LOAD_HOLD"
# Test-only: the same for `ui`'s page, after the engine is loaded and the API serves, before it is built.
UI_HOLD_ENV = "OMNI_STUDIO_TEST_UI_HOLD"
HOLD_LIMIT_S = 600.0  # a hold nobody lets go ends by itself


def hold_for_test(env: str) -> None:
    """Wait while the test that started this process holds it (``LOAD_HOLD_ENV``, ``UI_HOLD_ENV``)."""
    path = os.environ.get(env)
    if not path:
        return
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def tune_interpreter() -> None:
    """Shorter GIL time slices (5 ms -> 1 ms) for our thread-heavy processes.

    Every request crosses threads several times (event loop -> stage workers -> event loop, per event);
    with the default 5 ms slice each hand-off can wait for a busy thread's whole slice, which cost the
    API ~40-80 ms per tiny request here. Torch releases the GIL inside its kernels either way.
    """
    sys.setswitchinterval(0.001)


SIGTERM_RECEIVED = threading.Event()  # also when something on the way out (Gradio) caught Terminated


def stop_gracefully_on_sigterm() -> None:
    """SIGTERM raises ``Terminated`` in the main thread (studio/errors.py) instead of killing the process.

    Left at the default, SIGTERM ended ``serve`` before any cleanup: uvicorn stops its server on the
    signal, then raises it again once done, and the default action killed the process before the
    recorder had written the runs still queued (they came back "interrupted" at the next start).
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def terminated(signum: int, frame: object) -> None:
        SIGTERM_RECEIVED.set()
        raise Terminated()

    signal.signal(signal.SIGTERM, terminated)


def prestart_stage_processes(settings: StudioSettings) -> None:
    """Start the stage processes the deploy file asks for (``own_process: true``) before this process
    imports the model libraries, so that theirs overlap ours (engine/distributed/spawn.py)."""
    if settings.ray_address:
        return
    from engine.distributed import spawn
    from engine.paths import DEPLOY_PRESETS_DIR

    model = settings.model or _default_model()
    path = Path(settings.deploy_config) if settings.deploy_config else DEPLOY_PRESETS_DIR / f"{model}.yaml"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):  # a local model folder, or a bad path: the build reports it
        return
    spawn.prestart(spawn.stage_processes_wanted(text))


def start_engine(settings: StudioSettings, max_pending: int = 64) -> OmniEngine:
    """Validate the deploy config against the model, build the model if built in, load every stage."""
    hold_for_test(LOAD_HOLD_ENV)
    from engine.config import DeployConfigError
    from engine.distributed import spawn
    from engine.engine import EngineBuildError, build_engine
    from engine.environment import quiet_libraries
    from engine.models import ModelNotFound
    from engine.pipelines import UnknownModelFamily

    quiet_libraries()  # again, now that the model libraries are imported (their progress bars off)
    try:
        return build_engine(
            settings.model,
            settings.deploy_config,
            data_dir=settings.data_dir,
            ar_backend=settings.ar_backend,
            devices=settings.devices,
            max_pending=max_pending,
            ray_address=settings.ray_address,
        )
    except DeployConfigError as exc:
        raise StartupError(exc.render()) from exc
    except (ModelNotFound, UnknownModelFamily, EngineBuildError) as exc:
        raise StartupError(str(exc)) from exc
    finally:
        spawn.discard_started()  # started early and not taken (a build that failed, or wanted fewer)


def open_recorder(settings: StudioSettings) -> RunRecorder:
    """The run store (opened and migrated) behind its writer thread."""
    from studio.store import StoreError, open_store
    from studio.store.object_files import open_output_files
    from studio.store.recorder import RunRecorder

    try:
        files = open_output_files(settings.data_dir, settings.outputs, settings.outputs_options)
        return RunRecorder(open_store(settings.db_url, settings.data_dir, files))
    except StoreError as exc:
        raise StartupError(str(exc)) from exc


def open_accounts(recorder: RunRecorder) -> Any:
    """The team accounts of the run store (``studio.accounts.service.Accounts``; docs/team.md)."""
    from studio.accounts.service import Accounts

    return Accounts(recorder.store)


def close_recorder(recorder: RunRecorder) -> None:
    """Write everything queued, then close the store (before the process exits)."""
    recorder.close()
    recorder.store.close()


def start_jobs(serving: Any, recorder: RunRecorder, settings: StudioSettings) -> JobService:
    """The batch-job queue of this studio, its runner started (studio/jobs/runner.py)."""
    from studio.jobs.service import JobService

    return JobService.for_serving(serving, recorder, settings).start()


def serving_options(settings: StudioSettings) -> ServingOptions:
    from studio.api.fingerprint import FingerprintSettings
    from studio.api.state import ServingOptions

    return ServingOptions(
        served_model_name=settings.served_model_name,
        api_key=settings.api_key,
        fingerprint=settings.fingerprint or FingerprintSettings(),
        data_dir=settings.data_dir,
        limits=settings.limits,
        image_reply="images" if settings.image_reply == "images" else "content",
        output_url_ttl=settings.output_url_ttl,
    )


def import_api() -> types.ModuleType:
    """``studio.api.app``: the serving modules, and through them the engine and torch (seconds)."""
    return importlib.import_module("studio.api.app")


def listen(settings: StudioSettings) -> socket.socket:
    """Bind the port now (a clear start-up error when it is taken), before anything slow loads."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        raise StartupError(
            f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}"
        ) from exc
    return sock


def uvicorn_server(app: ASGIApp) -> uvicorn.Server:
    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5, access_log=False
    )
    return uvicorn.Server(config)


# How long requests in flight on the loading server (the API serves there before the UI is up) may take
# to finish once the port has moved to Gradio: a generation's whole length, not a second.
HANDOVER_GRACE_S = 600


class BackgroundServer:
    """A uvicorn server on an already bound socket, in a thread (the UI's loading phase)."""

    def __init__(self, app: ASGIApp, sock: socket.socket) -> None:
        self.sock = sock
        self.server = uvicorn_server(app)
        self.server.config.timeout_graceful_shutdown = HANDOVER_GRACE_S
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True, name="omni-starting"
        )
        self.thread.start()

    def stop(self) -> None:
        """Stop accepting and free the port; returns once the listening socket is closed.

        Idle keep-alive connections close at once; a request in flight (a generation sent to the API
        while the UI loaded) finishes on this server's thread, and its connection closes after it.
        """
        self.server.should_exit = True
        deadline = time.monotonic() + 10
        while self.thread.is_alive() and self.sock.fileno() != -1 and time.monotonic() < deadline:
            time.sleep(0.01)


def serve_api(settings: StudioSettings) -> int:
    """``omni-studio serve``: the OpenAI-compatible API alone, on uvicorn (listening while it loads)."""
    model = settings.model or _default_model()
    prestart_stage_processes(settings)
    sock = listen(settings)
    front = StartingApp(model, page=False, api_key=settings.api_key)
    server = uvicorn_server(front)
    print(
        f"Omni Studio API on http://{settings.host}:{settings.port}/v1 — loading model {model} …",
        file=sys.stderr,
        flush=True,
    )
    loaded: dict[str, Any] = {}
    failure: list[BaseException] = []

    def load() -> None:
        try:
            with StartupCollection(freeze=True):  # engine/environment.py
                _load()
        except BaseException as exc:  # the server stops and the main thread reports it
            failure.append(exc)
            server.should_exit = True

    def _load() -> None:
        api = import_api()
        options = serving_options(settings)
        recorder = loaded["recorder"] = open_recorder(settings)
        state = api.ServingState(None, options, recorder=recorder, source="api")
        state.accounts = open_accounts(recorder)  # users' own keys (docs/team.md)
        front.target = api.create_app(state)  # 503 engine_not_ready (recorded as runs) until set_engine
        front.record_refused(recorder, state.served_model_name)
        engine = loaded["engine"] = start_engine(settings)
        state.set_engine(engine)
        loaded["jobs"] = state.jobs = start_jobs(state, recorder, settings)  # resumes unfinished jobs
        front.record_refused(recorder, state.served_model_name)  # any that raced the hand-over
        fingerprint = state.handlers.system_fingerprint if state.handlers else None
        print(
            f"Omni Studio API ready on http://{settings.host}:{settings.port}/v1 — model "
            f"{state.served_model_name} ({engine.config.family}), config {engine.config.hash8}, "
            f"fingerprint {fingerprint or 'none'}",
            file=sys.stderr,
            flush=True,
        )

    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    loader = threading.Thread(target=load, daemon=True, name="omni-load-engine")
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:  # interrupted while loading: the daemon loader thread ends with the process
        if "jobs" in loaded:  # first: cells in the engine go back to the job queue
            loaded["jobs"].close()
        if "engine" in loaded:
            loaded["engine"].close()
        if "recorder" in loaded:
            loaded["recorder"].close()
    if failure:
        raise failure[0]
    return 0


def _default_model() -> str:
    from engine.tiny import DEFAULT_MODEL

    return DEFAULT_MODEL


def launch_ui(settings: StudioSettings) -> int:
    """``omni-studio ui``: the Gradio studio and the whole ``/v1`` API on one port.

    A loading page holds the port while the engine, Gradio and the UI load; then ``launch()`` takes it.
    """
    with StartupCollection(freeze=True) as startup:  # until the studio is up (engine/environment.py)
        model = settings.model or _default_model()
        prestart_stage_processes(settings)
        sock = listen(settings)
        # With --share and no --api-key the key is generated later: nobody can send it while loading.
        front = StartingApp(
            model, page=True, api_key=settings.api_key, record=not settings.share or bool(settings.api_key)
        )
        starting = BackgroundServer(front, sock)
        print(
            f"Omni Studio on http://{settings.host}:{settings.port} — loading model {model} …",
            file=sys.stderr,
            flush=True,
        )
        try:
            return _serve_ui(settings, starting.stop, front, startup)
        finally:
            starting.stop()  # a no-op once launch() has the port; frees it when loading failed


def has_accounts(settings: StudioSettings) -> bool:
    """Whether the run store has accounts (then the UI logs in each user: docs/team.md). One look before the
    engine loads: the share login and key are settled from it."""
    from studio.store.accounts import accounts_exist

    try:
        return accounts_exist(settings.db_url, settings.data_dir)
    except ValueError as exc:  # not a database URL: the store's opening reports it
        raise StartupError(f"cannot use run database {settings.db_url!r}: {exc}") from exc


def ui_login(accounts: Any, operator: tuple[str, str] | None) -> Callable[[str, str], Any]:
    """Gradio's login check in a studio with accounts: a user's own name and password (argon2id), or the
    ``--auth`` login (the operator's, an admin). Failures are throttled by the login guard
    (``studio/api/auth.py``) like wrong API keys. The check runs on a worker thread: argon2 takes a
    tenth of a second of CPU by design, which the server's event loop must not wait out."""
    from studio.api.auth import secrets_equal

    async def check(username: str, password: str) -> bool:
        if operator is not None and username == operator[0]:
            return secrets_equal(password, operator[1])
        return await asyncio.to_thread(lambda: accounts.login(username, password) is not None)

    return check


def _serve_ui(
    settings: StudioSettings,
    release_port: Callable[[], None],
    front: StartingApp,
    startup: StartupCollection,
) -> int:
    # Settle the share login and API key before anything loads: a public link without a login would let
    # anyone use the machine, and the API is public through the same link. A studio with accounts needs
    # neither: each user logs in with their own name and calls the API with their own key (docs/team.md).
    team = has_accounts(settings)
    auth = settings.auth
    generated_key: str | None = None
    if settings.share and not team:
        if auth is None:
            auth = ("omni", secrets.token_urlsafe(12))
        if not settings.api_key:
            generated_key = secrets.token_urlsafe(18)

    # One thing at a time: the engine (torch, transformers, diffusers, the model), then Gradio. Importing
    # Gradio on a second thread meanwhile made the whole start 1-2 s *slower* and the engine 4-5 s later:
    # imports are CPU-bound under the GIL, and every GIL release of one thread (file I/O, torch ops) waits
    # out the other's time slice (docs/batching.md, "Start-up").
    import_api()
    options = serving_options(settings)
    if generated_key:
        options = replace(options, api_key=generated_key)
    engine = start_engine(settings)

    from studio.api.app import create_app
    from studio.api.state import ServingState

    recorder = open_recorder(settings)
    serving = ServingState(engine, options, recorder=recorder, source="api")
    serving.accounts = accounts = open_accounts(recorder)
    # Shared with accounts, no key was generated: removing the last account must not open the public API.
    serving.accounts_required = settings.share and team
    serving.jobs = start_jobs(serving, recorder, settings)  # resumes unfinished jobs (docs/jobs.md)
    # The API serves from now on, while Gradio still imports and builds the page (seconds); /health stays
    # "starting" until the whole studio is up (README, first section).
    front.api = create_app(serving)
    front.record_refused(recorder, serving.served_model_name)
    hold_for_test(UI_HOLD_ENV)
    import gradio as gr

    from studio.controller import Studio
    from studio.ui.app import CSS, api_app_kwargs, attach_api, build_ui

    studio = Studio(
        engine,
        serving,
        settings.data_dir,
        recorder=recorder,
        store=recorder.store,
        deploy_text=settings.deploy_text(),
        ar_backend=settings.ar_backend,
        devices=settings.devices,
    )
    studio.share.requested = settings.share
    studio.admin_user = auth[0] if auth is not None else None  # the Queue tab's admin (docs/jobs.md)
    studio.share.api_key_generated = generated_key is not None
    studio.share.accounts = team
    if settings.share and auth is not None and not team:  # with accounts, nobody's password is shown
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
    served_name = serving.served_model_name
    # /health says "starting" (and /v1 503s) until launch() has returned: the share link is settled, the
    # login guarded and the addresses printed before anyone is told the studio is ready.
    serving.set_engine(None)
    release_port()  # the loading page steps aside; launch() binds the same port
    front.record_refused(recorder, serving.served_model_name)
    app, local_url, share_url = demo.launch(
        server_name=settings.host,
        server_port=settings.port,
        share=settings.share,
        auth=ui_login(accounts, auth) if team else auth,
        prevent_thread_lock=True,
        allowed_paths=[outputs_dir],
        blocked_paths=blocked,
        quiet=True,
        show_error=True,
        css=CSS,
        theme=gr.themes.Soft(),
        app_kwargs=api_app_kwargs(serving),
    )
    attach_api(app, serving)  # the login guard (Gradio adds POST /login in launch())
    startup.done()
    studio.base_url = local_url.rstrip("/") if local_url else f"http://{settings.host}:{settings.port}"
    studio.share.url = share_url
    if settings.share and not share_url:
        studio.share.message = "(could not create a share link: no internet access?)"
    lines = [
        f"Omni Studio ready on {studio.base_url} — model {served_name} "
        f"({engine.config.family}), config {engine.config.hash8}",
        f"  OpenAI-compatible API: {studio.base_url}/v1"
        + (f" and {share_url.rstrip('/')}/v1" if share_url else ""),
    ]
    if settings.share and team:
        lines.append(f"  share link: {share_url or 'not available ' + studio.share.message}")
        lines.append(
            "  logins: the studio's accounts (omni-studio users ls); no login generated. API: each user's "
            "own key (omni-studio keys create --user NAME)"
        )
    elif settings.share and auth is not None:
        lines.append(f"  share link: {share_url or 'not available ' + studio.share.message}")
        lines.append(f"  UI login: {auth[0]} / {auth[1]}")
    elif team:
        lines.append("  logins: the studio's accounts (omni-studio users ls)")
    if generated_key:
        lines.append(f"  API key (required on /v1 when shared): {options.api_key}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    serving.set_engine(engine)
    try:
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        if serving.jobs is not None:  # first: cells in the engine go back to the job queue
            serving.jobs.close()
        demo.close()
        studio.close()
    if SIGTERM_RECEIVED.is_set():  # Gradio's block_thread() takes it as Ctrl+C and returns
        raise Terminated()
    return 0
