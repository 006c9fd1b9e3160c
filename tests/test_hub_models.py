"""``--model ORG/NAME[@REVISION]``: models by Hugging Face Hub id, through the Hugging Face cache (README.md,
"Serving your own model"; engine/hub.py).

All offline: the cache is laid out by hand the way huggingface_hub writes it (``models--ORG--NAME/refs``,
``snapshots/<commit>`` of symlinks into ``blobs/``), and downloads come from a stand-in for the Hub's file
routes on 127.0.0.1 (``HF_ENDPOINT``), in a subprocess so that huggingface_hub reads it at import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from huggingface_hub import constants
from PIL import Image

from engine.building import build_pipeline_config
from engine.models import ModelNotFound, describe_model, materialize
from engine.tiny import COMPLETE_MARKER, ensure_builtin_model
from tests.conftest import REPO_ROOT
from tests.servers import free_port

REPO = "org/name"
MAIN = hashlib.sha1(b"main commit").hexdigest()
V2 = hashlib.sha1(b"v2 commit").hexdigest()
DEPLOY = str(REPO_ROOT / "assets" / "deploy" / "tiny-glm-image.yaml")


@pytest.fixture(scope="module")
def files(model_cache) -> dict[str, bytes]:
    """tiny-glm-image's files, as a hub repo holds them (path in the repo -> bytes)."""
    folder = ensure_builtin_model("tiny-glm-image", model_cache)
    return {
        file.relative_to(folder).as_posix(): file.read_bytes()
        for file in sorted(folder.rglob("*"))
        if file.is_file() and file.name != COMPLETE_MARKER
    }


def lay_out(
    cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()
) -> Path:
    """Put ``files`` in the Hub cache ``cache`` as huggingface_hub does; returns the snapshot folder."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache, read offline (huggingface_hub reads both settings at import: patched here)."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot_and_names_the_commit(hub_cache, files, model_cache):
    main = lay_out(hub_cache, REPO, MAIN, files, refs=("main",))
    v2 = lay_out(hub_cache, REPO, V2, {**files, "README.md": b"the second revision\n"}, refs=("v2",))

    source = describe_model(REPO)
    assert source.name == REPO and not source.builtin
    assert source.path == main.resolve() and source.family.name == "glm-image"
    assert source.identity == f"hub:{REPO}@{MAIN}"
    assert materialize(source, model_cache) == source  # already on disk: nothing to build
    for spelled in (f"{REPO}@main", f"{REPO}@{MAIN}"):
        assert describe_model(spelled) == source

    second = describe_model(f"{REPO}@v2")
    assert (second.name, second.path, second.identity) == (REPO, v2.resolve(), f"hub:{REPO}@{V2}")
    assert describe_model(f"{REPO}@{V2}") == second

    # the config hash names the resolved commit: another revision, another hash
    first_config, second_config = build_pipeline_config(source), build_pipeline_config(second)
    assert first_config.model_name == REPO and first_config.model_identity == source.identity
    assert first_config.config_hash() != second_config.config_hash()

    # a snapshot handed on by path (a stage's own process, a model switch) keeps its name and identity
    assert describe_model(str(main)) == source


def test_a_missing_hub_model_fails_naming_the_cache_it_read(hub_cache, files):
    lay_out(hub_cache, REPO, MAIN, files, refs=("main",))
    for missing in ("org/missing", f"{REPO}@no-such-branch", f"{REPO}@{V2}"):
        with pytest.raises(ModelNotFound) as caught:
            describe_model(missing)
        message = str(caught.value)
        assert "neither a built-in model" in message and str(hub_cache) in message, message
        assert "HF_HUB_OFFLINE is set, so nothing was downloaded" in message, message


def test_an_interrupted_download_is_not_served(hub_cache, files):
    """huggingface_hub caches each commit's file list (trees/<commit>.json): a snapshot that misses a listed
    file is incomplete, and offline that is an error, not a model that fails to load later."""
    lay_out(hub_cache, REPO, MAIN, files, refs=("main",))
    listing = {name: {"size": len(data), "blob_id": "0" * 40} for name, data in files.items()}
    listing["transformer/diffusion_pytorch_model.safetensors.part2"] = {"size": 1, "blob_id": "1" * 40}
    trees = hub_cache / "models--org--name" / "trees"
    trees.mkdir()
    (trees / f"{MAIN}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    with pytest.raises(ModelNotFound, match=r"holds only part of org/name@main .*HF_HUB_OFFLINE is set"):
        describe_model(REPO)


def test_built_in_names_then_local_folders_win_over_hub_ids(hub_cache, files, tmp_path, monkeypatch):
    lay_out(hub_cache, REPO, MAIN, files, refs=("main",))
    folder = tmp_path / "work" / "org" / "name"
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    monkeypatch.chdir(tmp_path / "work")
    local = describe_model(REPO)  # ./org/name exists: the folder, not the hub model
    assert local.path == folder.resolve() and local.identity.startswith("local:name:")
    assert describe_model("tiny-chat").builtin
    with pytest.raises(ModelNotFound, match="nor a Hugging Face model id"):
        describe_model(str(tmp_path / "no" / "such" / "folder"))


# -- the CLI -----------------------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str | None]) -> subprocess.CompletedProcess:
    """``omni-studio ARGS`` in a subprocess with ``env`` over this one's (None: unset)."""
    full = {k: v for k, v in os.environ.items() if k not in env and k != "HF_TOKEN"}
    full.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run(
        [sys.executable, "-m", "studio.cli", *args], capture_output=True, text=True, timeout=300, env=full
    )


def test_run_draws_with_a_hub_model_and_records_its_commit(tmp_path, files):
    cache = tmp_path / "hub"
    lay_out(cache, REPO, MAIN, files, refs=("main",))
    env: dict[str, str | None] = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    data, out = str(tmp_path / "data"), tmp_path / "lighthouse.png"
    run = cli(
        "run", "a lighthouse", "--model", REPO, "--out", str(out), "--seed", "3",
        "--height", "64", "--width", "64", "--steps", "2", "--data-dir", data, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"{out} (64x64)"
    with Image.open(out) as image:
        assert image.size == (64, 64) and image.convert("RGB").getextrema() != ((0, 0),) * 3
    run_id = re.search(r"recorded as run (\w+)", run.stderr)
    assert run_id, run.stderr
    shown = cli("history", "show", run_id.group(1), "--json", "--data-dir", data, env=env)
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["model"] == REPO
    assert record["config"]["model"] == {"name": REPO, "identity": f"hub:{REPO}@{MAIN}"}

    missing = cli("validate", DEPLOY, "--model", "org/missing", env=env)
    assert missing.returncode == 2, missing.stderr  # a user error, reported before anything loads
    assert f"the Hugging Face cache {cache} has no snapshot of org/missing@main" in missing.stderr
    assert "HF_HUB_OFFLINE is set" in missing.stderr


# -- downloading -------------------------------------------------------------------------------------


class StandInHub:
    """The Hub's routes that huggingface_hub 2.4.0's ``snapshot_download`` calls, for one model repo at one
    commit: ``GET /api/models/{repo}/revision/{rev}`` (repo_info: the commit), ``GET
    /api/models/{repo}/tree/{commit}`` (the file list) and ``HEAD``/``GET /{repo}/resolve/{commit}/{file}``
    (``X-Repo-Commit``, ``ETag``, ``Content-Length``; no Xet headers, so files come over plain HTTP).
    Anything else answers 404 with the Hub's ``X-Error-Code``."""

    def __init__(self, repo_id: str, commit: str, files: dict[str, bytes]) -> None:
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.answer(self, body=True)

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.repo_id, self.commit, self.files = repo_id, commit, files
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(request.path).path)
        self.requests.append(f"{request.command} {path}")
        api, files = f"/api/models/{self.repo_id}/", f"/{self.repo_id}/resolve/"
        if path.startswith(api):
            kind, _, revision = path[len(api) :].partition("/")
            if revision not in ("main", self.commit):
                return self.error(request, "RevisionNotFound")
            if kind == "revision":
                return self.send(request, json.dumps({"id": self.repo_id, "sha": self.commit}).encode(), body)
            if kind == "tree":
                listing = [
                    {"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
                    for name, data in self.files.items()
                ]
                return self.send(request, json.dumps(listing).encode(), body)
        elif path.startswith(files):
            revision, _, name = path[len(files) :].partition("/")
            if revision not in ("main", self.commit):
                return self.error(request, "RevisionNotFound")
            if name not in self.files:
                return self.error(request, "EntryNotFound")
            data = self.files[name]
            return self.send(request, data, body, etag=hashlib.sha256(data).hexdigest())
        self.error(request, "RepoNotFound")

    def send(self, request: BaseHTTPRequestHandler, data: bytes, body: bool, etag: str | None = None) -> None:
        request.send_response(200)
        request.send_header("Content-Length", str(len(data)))
        request.send_header("X-Repo-Commit", self.commit)
        if etag is not None:
            request.send_header("ETag", f'"{etag}"')
        request.end_headers()
        if body:
            request.wfile.write(data)

    def error(self, request: BaseHTTPRequestHandler, code: str) -> None:
        request.send_response(404)
        request.send_header("X-Error-Code", code)
        request.send_header("Content-Length", "0")
        request.end_headers()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture()
def stand_in_hub(files) -> Iterator[StandInHub]:
    hub = StandInHub(REPO, MAIN, files)
    yield hub
    hub.close()


def test_a_model_not_in_the_cache_downloads_into_it(tmp_path, files, stand_in_hub, monkeypatch):
    cache = tmp_path / "hub"
    env: dict[str, str | None] = {
        "HF_HUB_CACHE": str(cache),
        "HF_ENDPOINT": stand_in_hub.url,
        "HF_HUB_OFFLINE": "0",
    }
    first = cli("validate", DEPLOY, "--model", REPO, env=env)
    assert first.returncode == 0, first.stderr
    assert f"model {REPO} (glm-image)" in first.stdout
    assert f"Fetching {len(files)} files" in first.stderr  # the download's progress bar
    assert f"GET /api/models/{REPO}/revision/main" in stand_in_hub.requests
    storage = cache / "models--org--name"
    assert (storage / "refs" / "main").read_text() == MAIN
    snapshot = storage / "snapshots" / MAIN
    assert {name: (snapshot / name).read_bytes() for name in files} == files

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert describe_model(REPO).identity == f"hub:{REPO}@{MAIN}"  # the stand-in's commit

    asked = len(stand_in_hub.requests)
    again = cli("validate", DEPLOY, "--model", REPO, env=env)
    assert again.returncode == 0, again.stderr
    assert stand_in_hub.requests[asked:] == []  # in the cache: used as it is, no network

    unknown = cli("validate", DEPLOY, "--model", "org/missing", env=env)
    assert unknown.returncode == 2
    assert f"the Hugging Face cache {cache} has no snapshot of org/missing@main" in unknown.stderr
    assert f"{stand_in_hub.url} has no model org/missing" in unknown.stderr


def test_a_user_who_never_set_hf_hub_offline_gets_the_download(tmp_path, stand_in_hub):
    cache = tmp_path / "hub"
    env = {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": stand_in_hub.url, "HF_HUB_OFFLINE": None}
    result = cli("validate", DEPLOY, "--model", REPO, env=env)
    assert result.returncode == 0, result.stderr
    assert (cache / "models--org--name" / "snapshots" / MAIN).is_dir()


def test_an_unreachable_hub_fails_at_start_naming_the_cache(tmp_path):
    cache = tmp_path / "hub"
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connections are refused
    env = {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": closed, "HF_HUB_OFFLINE": "0"}
    result = cli("validate", DEPLOY, "--model", REPO, env=env)
    assert result.returncode == 2
    assert f"the Hugging Face cache {cache} has no snapshot of {REPO}@main" in result.stderr
    assert f"{closed} could not be reached to download it (ConnectError" in result.stderr
