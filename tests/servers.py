"""Starting real `omni-studio` processes for tests: 127.0.0.1 only, a free port, stopped by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, process: subprocess.Popen, port: int, log_path: Path, data_dir: Path) -> None:
        self.process = process
        self.port = port
        self.log_path = log_path
        self.data_dir = data_dir

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


REPO_ROOT = Path(__file__).resolve().parent.parent


def start_server(
    args: list[str],
    data_dir: Path,
    ready_path: str = "/health",
    timeout: float = 120,
    module: str = "studio.cli",
    env: dict[str, str] | None = None,
) -> LiveServer:
    """Run ``omni-studio ARGS --host 127.0.0.1 --port P --data-dir D`` (``python -m MODULE``: the CLI, or
    a wrapper of it such as tools/real_width/handoff_probe.py; ``env``: added to this process's) and wait
    until it answers."""
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / f"server-{port}.log"
    command = [
        sys.executable,
        "-m",
        module,
        *args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=REPO_ROOT
        )
    server = LiveServer(process, port, log_path, data_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + ready_path, timeout=2).status_code == 200:
                return server
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become ready in {timeout}s:\n{server.log()}")


@contextlib.contextmanager
def running_server(args: list[str], data_dir: Path, **kwargs) -> Iterator[LiveServer]:
    server = start_server(args, data_dir, **kwargs)
    try:
        yield server
    finally:
        server.stop()


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def s3_server(bucket: str) -> Iterator[str]:
    """moto's S3-compatible server on 127.0.0.1 (its own process, stopped by PID) with ``bucket`` made,
    and the AWS variables that reach it set here; yields the endpoint URL.

    Its own process, not moto's in-process server: that imports Flask into the test process, and vLLM's
    start-up scans every module's globals, where Flask's context proxies raise outside a request.
    """
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    environment = mock.patch.dict(os.environ, S3_ENV)
    environment.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "moto's server exited"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(endpoint, timeout=2).status_code < 500:
                    break
            assert time.monotonic() < deadline, "moto's server did not start"
            time.sleep(0.1)
        httpx.put(f"{endpoint}/{bucket}", timeout=10).raise_for_status()
        yield endpoint
    finally:
        environment.stop()
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
