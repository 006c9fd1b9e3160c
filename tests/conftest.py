"""Shared fixtures: one model cache for the whole run, engines built once per session."""

from __future__ import annotations

import io
import os
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


# The share guard (tests/share_guard.py): installed once per process, whichever name this file is
# imported under (pytest imports it as `conftest`, test modules as `tests.conftest`).
from tests.share_guard import GUARD as _share_guard  # noqa: E402
from tests.share_guard import ShareGuard  # noqa: E402

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
