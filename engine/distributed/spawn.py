"""Starting stage processes (docs/batching.md, "A stage in its own process"): light on purpose.

A stage process spends seconds importing torch and the model libraries before it can load anything. The
studio knows from the deploy file, before it imports those itself, how many stages will want one, and
starts them at once (:func:`prestart`): the child's imports then overlap the parent's on another core
instead of following them. :class:`engine.distributed.process_stage.ProcessStageRunner` takes a started
child (:func:`take`) or starts one. This module imports nothing heavy.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection


@dataclass
class Child:
    """A stage process and its end of the pipe."""

    process: subprocess.Popen[bytes]
    conn: Connection


_started: list[Child] = []
_lock = threading.Lock()


def start() -> Child:
    """A fresh interpreter on ``engine.distributed.process_stage.child_main`` (never multiprocessing's spawn,
    which re-runs the caller's main script; never a fork), with a socket pair as its pipe."""
    parent, child = socket.socketpair()
    # The collector off from the first line: torch's import comes with the module (engine/environment.py).
    code = (
        "import gc; gc.disable(); "
        f"from engine.distributed.process_stage import child_main; child_main({child.fileno()})"
    )
    # The child imports what this process imports (the project, its packages) from the same paths.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
    process = subprocess.Popen(
        [sys.executable, "-c", code], pass_fds=[child.fileno()], env=env, close_fds=True
    )
    child.close()
    return Child(process, Connection(parent.detach()))


def prestart(count: int) -> None:
    """Start ``count`` stage processes now, to be taken by the engine's stages (see the module doc)."""
    with _lock:
        _started.extend(start() for _ in range(max(0, count) - len(_started)))


def take() -> Child:
    """A started, still running stage process, else a new one."""
    with _lock:
        while _started:
            child = _started.pop(0)
            if child.process.poll() is None:
                return child
    return start()


def discard_started() -> None:
    """Stop started processes nobody took (the engine failed to build, or wanted fewer)."""
    with _lock:
        left, _started[:] = list(_started), []
    for child in left:
        child.conn.close()  # the child sees EOF and exits
        try:
            child.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.process.kill()


def stage_processes_wanted(deploy_text: str) -> int:
    """How many stages of a deploy file ask for ``own_process: true`` (0 for anything unreadable)."""
    import yaml

    try:
        data = yaml.safe_load(deploy_text)
    except yaml.YAMLError:
        return 0
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, list):
        return 0
    return sum(1 for stage in stages if isinstance(stage, dict) and stage.get("own_process") is True)
