"""Shared fixtures: one model cache for the whole run, engines built once per session."""

from __future__ import annotations

import atexit
import importlib.util
import io
import os
import platform
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Built-in models are built once per test run (or once per machine when scripts/test.sh points this at
# .venv) and shared by in-process engines and the servers tests start as subprocesses.
_cache = os.environ.get("OMNI_STUDIO_TEST_MODEL_CACHE") or tempfile.mkdtemp(prefix="omni-test-models-")
os.environ["OMNI_STUDIO_MODEL_CACHE"] = _cache
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# -- the share guard (docs/testing.md, "No public share link") --------------------------------------------
# `ui --share` makes Gradio open a tunnel: it asks api.gradio.app for a share server (unless
# GRADIO_SHARE_SERVER_ADDRESS names one), downloads its `frpc` client into $HF_HOME/gradio/frpc when missing,
# and runs it against that server. For the whole test run, in this process and every server it starts (they
# inherit the environment), the share server is a 127.0.0.1 port held by a socket that never listens (so a
# connection to it is refused), and $HF_HOME holds a stand-in `frpc` that records its arguments and reports a
# refused login at once: no request leaves the machine even where it has internet. tests/test_ui_share.py
# proves it. Set here, at import, so servers started by fixtures of any scope see it.
class ShareGuard:
    def __init__(self) -> None:
        self.holder = socket.socket()
        self.holder.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        self.address = f"127.0.0.1:{self.holder.getsockname()[1]}"
        self.root = Path(tempfile.mkdtemp(prefix="omni-test-share-guard-"))
        self.calls_path = self.root / "frpc-calls.log"
        self.calls_path.touch()
        self.client = self.root / "hf" / "gradio" / "frpc" / _gradio_frpc_name()
        self.client.parent.mkdir(parents=True)
        self.client.write_text(
            "#!/bin/sh\n"
            "# Gradio's share tunnel client, replaced for the test run (tests/conftest.py, docs/testing.md)\n"
            f"printf '%s\\n' \"$*\" >> '{self.calls_path}'\n"
            "echo 'login to server failed: refused by the test suite share guard (tests/conftest.py)'\n"
            "exit 1\n"
        )
        self.client.chmod(0o755)

    def install(self) -> None:
        hf_home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
        )
        # models already in the Hub cache stay where they are; only Gradio's frpc folder moves
        hub_cache = os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(hf_home, "hub")
        os.environ.setdefault("HF_HUB_CACHE", hub_cache)
        os.environ["HF_HOME"] = str(self.root / "hf")
        os.environ["GRADIO_SHARE_SERVER_ADDRESS"] = self.address

    def calls(self) -> list[list[str]]:
        """The stand-in frpc's invocations so far, each as its argument list."""
        return [line.split() for line in self.calls_path.read_text().splitlines() if line]

    def close(self) -> None:
        self.holder.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _gradio_frpc_name() -> str:
    """The file name gradio/tunneling.py gives its frpc client (BINARY_FILENAME), without importing Gradio."""
    spec = importlib.util.find_spec("gradio")
    assert spec is not None and spec.submodule_search_locations, "gradio is not installed"
    source = (Path(next(iter(spec.submodule_search_locations))) / "tunneling.py").read_text()
    version = re.search(r'^VERSION = "([^"]+)"', source, re.M)
    assert version, "gradio/tunneling.py no longer names its frpc VERSION: update the share guard"
    machine = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return f"frpc_{platform.system().lower()}_{machine.lower()}_v{version.group(1)}"


_share_guard = ShareGuard()
_share_guard.install()
atexit.register(_share_guard.close)

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(__file__).resolve().parent / "data"
SEED_DEPLOY = DATA_DIR / "seed_deploy.yaml"


def _quiet() -> None:
    from engine.environment import quiet_libraries

    quiet_libraries()


_quiet()


def png(image) -> bytes:
    """PNG bytes of a PIL image (what a user would save)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return Path(_cache)


@pytest.fixture(scope="session")
def share_guard() -> ShareGuard:
    """The share guard above: its refusing address and the stand-in frpc's recorded calls."""
    return _share_guard


@pytest.fixture(scope="session")
def session_data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


def tiny_deploy(model: str, **stage_overrides: dict) -> dict:
    """The built-in model's default deploy config with per-stage overrides (``stage0={...}``)."""
    import yaml

    deploy = yaml.safe_load((REPO_ROOT / "assets" / "deploy" / f"{model}.yaml").read_text())
    for stage in deploy["stages"]:
        stage.update(stage_overrides.get(f"stage{stage['stage_id']}", {}))
    return deploy


def _engine(model: str, data_dir: Path, deploy=None):
    from engine import build_engine

    return build_engine(model, deploy, data_dir=data_dir)


@pytest.fixture(scope="session")
def glm_engine(session_data_dir) -> Iterator:
    engine = _engine(
        "tiny-glm-image", session_data_dir, tiny_deploy("tiny-glm-image", stage0={"backend": "transformers"})
    )
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def chat_engine(session_data_dir) -> Iterator:
    engine = _engine(
        "tiny-chat", session_data_dir, tiny_deploy("tiny-chat", stage0={"backend": "transformers"})
    )
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def diffusion_engine(session_data_dir) -> Iterator:
    engine = _engine("tiny-diffusion", session_data_dir)
    yield engine
    engine.close()


# -- browser tests (tests/browser.py) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator:
    """Headless Chromium, one per test module."""
    from tests.browser import chromium

    with chromium() as launched:
        yield launched


@pytest.fixture()
def page(browser, studio) -> Iterator:
    """A fresh page on the module's ``studio`` server (each browser test module defines ``studio``)."""
    from tests.browser import studio_page

    with studio_page(browser, studio.url) as opened:
        yield opened
