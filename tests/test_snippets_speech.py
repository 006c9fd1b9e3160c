"""The Serving tab's snippets for a model that speaks: on `tiny-qwen-omni-dtmf` they ask for the reply as
text and audio, print the text and write the audio to reply.wav, and run as shown they dial the model
card's example (decoded from the WAV by tools/dtmf/decode.py's Goertzel decoder). The same server speaks
given keys through `/v1/audio/speech`, as a WAV file and as a raw pcm stream."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from gradio_client import Client

from tests.servers import running_server
from tests.test_snippets import KEY, snippet_env
from tools.dtmf.decode import decode

PROMPT = "dial 5 5 5 0 1 2 3"  # the model card's example_prompt
KEYS = "5 5 5 0 1 2 3"


@pytest.fixture(scope="module")
def snippets(tmp_path_factory) -> tuple[str, str, str]:
    """The curl and Python snippets, and the server's URL."""
    data = tmp_path_factory.mktemp("speech-snippets")
    with running_server(["ui", "--model", "tiny-qwen-omni-dtmf", "--api-key", KEY], data) as server:
        result = Client(server.url + "/", verbose=False).predict(KEY, api_name="/set_api_key")
        yield result[1], result[2], server.url


def _dialled(folder: Path, output: bytes) -> None:
    assert output.decode().strip().splitlines()[-1] == KEYS  # the printed text reply
    samples, rate = sf.read(folder / "reply.wav", dtype="float32")
    assert rate == 24_000
    assert decode(samples, rate) == KEYS


def test_speech_snippets_ask_for_text_and_audio_in_a_voice_of_the_model(snippets):
    curl, python, _ = snippets
    for text in (curl, python):
        assert "tiny-qwen-omni-dtmf" in text and PROMPT in text
        assert '"modalities": ["text", "audio"]' in text or 'modalities=["text", "audio"]' in text
        assert "reply.wav" in text and "Chelsie" in text
        assert KEY not in text


def test_curl_speech_snippet_runs_and_dials(snippets, tmp_path):
    curl, _, _ = snippets
    done = subprocess.run(
        ["bash", "-c", "set -eo pipefail\n" + curl],
        cwd=tmp_path,
        env=snippet_env(),
        capture_output=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr.decode()
    _dialled(tmp_path, done.stdout)


def test_python_speech_snippet_runs_and_dials(snippets, tmp_path):
    _, python, _ = snippets
    (tmp_path / "snippet.py").write_text(python)
    done = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, env=snippet_env(), capture_output=True, timeout=180
    )
    assert done.returncode == 0, done.stderr.decode()
    _dialled(tmp_path, done.stdout)


@pytest.mark.parametrize("keys", ["4 1 7", "9 # 0 *"])
def test_the_speech_endpoint_dials_the_input_as_a_file_and_as_a_stream(snippets, keys):
    """`/v1/audio/speech` with the keys as `input` (the thinker teacher-forced with them): the WAV and the
    streamed pcm (int16, 24 kHz) decode to those keys, and the stream is the file's samples."""
    *_, url = snippets
    body = {"model": "tiny-qwen-omni-dtmf", "input": keys, "voice": "Chelsie", "seed": 3}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        whole = client.post("/v1/audio/speech", json={**body, "response_format": "wav"})
        assert whole.status_code == 200, whole.text
        samples, rate = sf.read(io.BytesIO(whole.content), dtype="int16")
        assert rate == 24_000 and decode(samples.astype(np.float32) / 32768, rate) == keys
        streamed = b""
        with client.stream(
            "POST", "/v1/audio/speech", json={**body, "response_format": "pcm", "stream_format": "audio"}
        ) as response:
            assert response.status_code == 200
            for piece in response.iter_bytes():
                streamed += piece
    pcm = np.frombuffer(streamed, dtype="<i2")
    assert decode(pcm.astype(np.float32) / 32768, 24_000) == keys
    assert pcm.size == samples.size
