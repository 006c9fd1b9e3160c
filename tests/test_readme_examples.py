"""Every shell and Python example in README.md runs, against a studio this test starts, or is marked
``<!-- not run: REASON -->`` on the line before its fence.

Blocks are found by their fence language (``bash``/``sh``/``shell``/``console``, ``python``/``py``).
``127.0.0.1:7860`` / ``localhost:7860`` become the test server's address; the server serves the model the
block names (``model="X"``, ``"model": "X"``, ``--model X``; default ``tiny-glm-shapes``) with the API key
it uses (``api_key="K"``, ``Bearer K``; ``$OMNI_STUDIO_API_KEY`` gets a key set in the environment).
Shell blocks run under ``bash -eo pipefail`` with ``.venv/bin`` first on PATH, in a scratch folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import soundfile as sf

from tests.servers import LiveServer, start_server
from tools.dtmf.decode import decode

README = Path(__file__).resolve().parent.parent / "README.md"
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py"}
FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
DEFAULT_ADDRESS = re.compile(r"(?:127\.0\.0\.1|localhost):7860")
ENV_KEY = "readme-env-key"


@dataclass(frozen=True)
class Example:
    line: int
    language: str
    code: str
    not_run: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        first = next((ln for ln in self.code.splitlines() if ln.strip()), "")
        return f"L{self.line}-{self.language}-{re.sub(r'[^A-Za-z0-9]+', '_', first)[:40]}"

    @property
    def needs_server(self) -> bool:
        return bool(DEFAULT_ADDRESS.search(self.code))

    def model(self) -> str:
        for pattern in (r'model="([\w.-]+)"', r'"model":\s*"([\w.-]+)"', r"--model\s+([\w.-]+)"):
            if match := re.search(pattern, self.code):
                return match.group(1)
        return "tiny-glm-shapes"

    def api_key(self) -> str | None:
        if "OMNI_STUDIO_API_KEY" in self.code:
            return ENV_KEY
        for pattern in (r'api_key="([^"$]+)"', r"Bearer ([^\s\"'$]+)"):
            match = re.search(pattern, self.code)
            if match and match.group(1) not in ("unused", "<key>", "KEY"):
                return match.group(1)
        return None


def readme_examples(text: str | None = None) -> list[Example]:
    text = README.read_text() if text is None else text
    examples = []
    for match in FENCE.finditer(text):
        language = match.group(1).lower()
        if language not in SHELL | PYTHON:
            continue
        before = text[: match.start()].rstrip().splitlines()
        marker = NOT_RUN.search(before[-1]) if before else None
        line = text.count("\n", 0, match.start()) + 1
        examples.append(Example(line, language, match.group(2), marker.group(1) if marker else None))
    return examples


EXAMPLES = readme_examples()


def test_the_extractor_finds_blocks_and_markers():
    sample = (
        "x\n\n```bash\necho hi\n```\n\n<!-- not run: needs a GPU -->\n```python\nimport torch\n```\n"
        "```yaml\na: 1\n```\n"
    )
    found = readme_examples(sample)
    assert [(e.language, e.not_run) for e in found] == [("bash", None), ("python", "needs a GPU")]
    assert sum(e.not_run is None for e in EXAMPLES) >= 2  # the README's own examples are found


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.not_run is not None], ids=lambda e: e.id)
def test_blocks_not_run_say_why(example):
    assert len(example.not_run or "") >= 10, f"README line {example.line}: give the reason it is not run"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    running: dict[tuple[str, str | None], LiveServer] = {}

    def get(model: str, key: str | None) -> LiveServer:
        if (model, key) not in running:
            args = ["ui", "--model", model, *(["--api-key", key] if key else [])]
            running[model, key] = start_server(args, tmp_path_factory.mktemp(f"readme-{model}"))
        return running[model, key]

    yield get
    for server in running.values():
        server.stop()


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.not_run is None], ids=lambda e: e.id)
def test_readme_example_runs(example, servers, tmp_path):
    code = example.code
    env = {
        **os.environ,
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
        "OMNI_STUDIO_DATA_DIR": str(tmp_path / "data"),
        "OMNI_STUDIO_API_KEY": ENV_KEY,
    }
    if example.needs_server:
        server = servers(example.model(), example.api_key())
        code = DEFAULT_ADDRESS.sub(f"127.0.0.1:{server.port}", code)
        env["OMNI_STUDIO_DATA_DIR"] = str(server.data_dir)
    if example.language in PYTHON:
        (tmp_path / "example.py").write_text(code)
        command = [sys.executable, "example.py"]
    else:
        command = ["bash", "-eo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"README.md line {example.line} ({example.language}) failed with {done.returncode}:\n"
        f"{code}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )
    if "dial 4 1 7" in code:  # the speech demo: what its comment promises, the reply and the tones
        assert "4 1 7" in done.stdout.splitlines()  # the text reply, a line of its own
        samples, rate = sf.read(tmp_path / "keys.wav", dtype="float32")
        assert decode(samples, rate) == "4 1 7"
