"""The API's speech as a user meets it (docs/speech.md, "The API"): the `openai` SDK against a live
`omni-studio serve --model tiny-qwen-omni` on 127.0.0.1: `/v1/audio/speech` files and streams, chat with
audio out and in, the voices in `/v1/models`, every refusal naming its field, runs recorded."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import numpy as np
import openai
import pytest
import soundfile

from engine.tempo import SLACK
from studio.media.audio import read_audio_recipe
from studio.store import RunFilter, open_store
from tests.servers import running_server
from tests.test_abort import wait_for

MODEL = "tiny-qwen-omni"
RATE = 24000
MAX_AUDIO_SECONDS = 2
MAX_AUDIO_BYTES = 200_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["serve", "--model", MODEL, "--max-audio-seconds", str(MAX_AUDIO_SECONDS)]
    args += ["--max-audio-bytes", str(MAX_AUDIO_BYTES)]
    with running_server(args, tmp_path_factory.mktemp("speech")) as live:
        yield live


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    """A model without an audio stage (text only)."""
    args = ["serve", "tiny-chat", "--ar-backend", "transformers"]
    with running_server(args, tmp_path_factory.mktemp("text")) as live:
        yield live


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return sdk(server)


def decode(data: bytes) -> tuple[np.ndarray, int]:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    return samples, rate


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")


def assert_speech(samples: np.ndarray, rate: int) -> None:
    """24 kHz, some audio, not silence."""
    assert rate == RATE
    assert samples.size > RATE // 10
    assert np.sqrt(np.mean(samples.astype(np.float64) ** 2)) > 100  # int16 RMS; silence is 0


def tone(seconds: float, rate: int = 16000, fmt: str = "WAV", frequency: float = 440.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    soundfile.write(buffer, 0.5 * np.sin(2 * np.pi * frequency * t), rate, format=fmt)
    return buffer.getvalue()


def error_of(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def speech(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/audio/speech", json={"model": MODEL, **body}, timeout=120)


# -- /v1/models -----------------------------------------------------------------------------------


def test_models_list_each_models_modalities_and_voices(client, text_server):
    card = client.models.list().data[0]
    assert card.id == MODEL
    assert card.model_extra["modalities"] == ["text", "audio"]
    assert card.model_extra["voices"] == ["Chelsie", "Ethan"]
    text_card = sdk(text_server).models.list().data[0]
    assert text_card.model_extra["modalities"] == ["text"]
    assert text_card.model_extra["voices"] == []


# -- /v1/audio/speech -------------------------------------------------------------------------------


def test_speech_create_returns_a_wav_that_carries_its_recipe(client, server):
    response = client.audio.speech.with_raw_response.create(
        model=MODEL, input="hello there", voice="Ethan", extra_body={"seed": 5}
    )
    assert response.headers["content-type"] == "audio/wav"
    assert response.headers["x-system-fingerprint"].startswith("omni-studio-0.1.0-")
    data = response.content
    samples, rate = decode(data)
    assert_speech(samples, rate)
    recipe = read_audio_recipe(data)
    assert recipe is not None
    assert recipe["parameters"]["seed"] == 5 and recipe["parameters"]["voice"] == "Ethan"
    assert recipe["parameters"]["speak_text"] == "hello there"  # the thinker is made to say the input
    assert recipe["fingerprint"] == response.headers["x-system-fingerprint"]
    # same request, same seed: the same bytes; another voice: other samples
    again = client.audio.speech.create(
        model=MODEL, input="hello there", voice="Ethan", extra_body={"seed": 5}
    )
    assert again.content == data
    other = client.audio.speech.create(
        model=MODEL, input="hello there", voice="Chelsie", extra_body={"seed": 5}
    )
    assert decode(other.content)[0].tobytes() != samples.tobytes()
    # the run is in history, with this fingerprint
    store = open_store(None, server.data_dir)
    try:
        run = wait_for(lambda: _finished(store, response.headers["x-run-id"]))
        assert run.fingerprint == response.headers["x-system-fingerprint"]
        assert "hello there" in run.prompt
        # the run store keeps the very file the client got (the same recipe, so the same bytes)
        assert [o.sha256 for o in run.audio] == [hashlib.sha256(data).hexdigest()]
    finally:
        store.close()


def test_instructions_go_before_the_text_the_audio_speaks(client):
    plain = client.audio.speech.create(model=MODEL, input="good night", voice="Ethan", extra_body={"seed": 8})
    told = client.audio.speech.create(
        model=MODEL, input="good night", voice="Ethan", instructions="whisper it", extra_body={"seed": 8}
    )
    recipe = read_audio_recipe(told.content)
    assert recipe is not None
    assert recipe["request"]["prompt"] == "whisper it\n\ngood night"
    assert recipe["parameters"]["speak_text"] == "good night"
    assert_speech(*decode(told.content))
    assert read_audio_recipe(plain.content)["request"]["prompt"] == "good night"


def _finished(store, run_id: str):
    try:
        run = store.get_run(run_id)
    except Exception:  # not written yet
        return None
    return run if run.status == "succeeded" else None


def test_every_response_format_decodes_to_the_same_speech(client):
    made = {
        fmt: client.audio.speech.with_raw_response.create(
            model=MODEL, input="one two", voice="Chelsie", response_format=fmt, extra_body={"seed": 9}
        )
        for fmt in ("wav", "flac", "pcm", "mp3", "opus")
    }
    types = {fmt: response.headers["content-type"] for fmt, response in made.items()}
    assert types == {
        "wav": "audio/wav",
        "flac": "audio/flac",
        "pcm": "audio/pcm",
        "mp3": "audio/mpeg",
        "opus": "audio/ogg",
    }
    wav, rate = decode(made["wav"].content)
    assert_speech(wav, rate)
    flac, flac_rate = decode(made["flac"].content)
    assert flac_rate == RATE and np.array_equal(flac, wav)  # lossless: the same int16 samples
    assert np.array_equal(pcm(made["pcm"].content), wav)
    for lossy in ("mp3", "opus"):
        samples, lossy_rate = decode(made[lossy].content)
        assert lossy_rate == RATE
        assert abs(samples.size - wav.size) < RATE // 10, lossy  # the same length, within codec padding
        assert np.sqrt(np.mean(samples.astype(np.float64) ** 2)) > 100, lossy


def test_streamed_audio_is_the_whole_file_in_pieces(client):
    whole = client.audio.speech.create(model=MODEL, input="stream me", voice="Ethan", extra_body={"seed": 2})
    whole_samples, _ = decode(whole.content)
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, input="stream me", voice="Ethan", stream_format="audio", extra_body={"seed": 2}
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        assert response.headers["x-system-fingerprint"].startswith("omni-studio-")
        streamed = b"".join(response.iter_bytes())
    assert streamed[:4] == b"RIFF" and streamed[36:40] == b"data"  # the open-ended streaming header
    samples, rate = decode(streamed)
    assert rate == RATE and np.array_equal(samples, whole_samples)
    with client.audio.speech.with_streaming_response.create(
        model=MODEL,
        input="stream me",
        voice="Ethan",
        response_format="pcm",
        stream_format="audio",
        extra_body={"seed": 2},
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        raw = b"".join(response.iter_bytes())
    assert np.array_equal(pcm(raw), whole_samples)


def test_speed_says_the_same_speech_faster_streamed_or_whole(client):
    """``speed`` 2: the utterance stretched to half its length, pitch kept (engine/tempo.py), the same
    samples whole or streamed, recorded in the file's recipe."""
    spoken, _ = decode(
        client.audio.speech.create(
            model=MODEL, input="a little faster please", voice="Ethan", extra_body={"seed": 6}
        ).content
    )
    fast = client.audio.speech.create(
        model=MODEL, input="a little faster please", voice="Ethan", speed=2.0, extra_body={"seed": 6}
    ).content
    fast_samples, rate = decode(fast)
    assert_speech(fast_samples, rate)
    assert fast_samples.size == round(spoken.size / 2) + SLACK
    assert read_audio_recipe(fast)["parameters"]["speed"] == 2.0
    with client.audio.speech.with_streaming_response.create(
        model=MODEL,
        input="a little faster please",
        voice="Ethan",
        speed=2.0,
        response_format="pcm",
        stream_format="audio",
        extra_body={"seed": 6},
    ) as response:
        streamed = pcm(b"".join(response.iter_bytes()))
    assert np.array_equal(streamed, fast_samples)


def test_sse_sends_pcm16_deltas_then_one_done_with_usage(client):
    whole = client.audio.speech.create(
        model=MODEL, input="events", voice="Chelsie", response_format="pcm", extra_body={"seed": 4}
    )
    with client.audio.speech.with_streaming_response.create(
        model=MODEL,
        input="events",
        voice="Chelsie",
        response_format="pcm",
        stream_format="sse",
        extra_body={"seed": 4},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    kinds = [event["type"] for event in events]
    assert kinds[-1] == "speech.audio.done" and kinds.count("speech.audio.done") == 1
    assert set(kinds[:-1]) == {"speech.audio.delta"}
    joined = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
    assert joined == whole.content
    usage = events[-1]["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


# -- chat with audio --------------------------------------------------------------------------------


def chat_audio(client, stream: bool = False, fmt: str = "wav", seed: int = 11, **fields):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": fields.pop("content", "say hello")}],
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": fmt},
        seed=seed,
        stream=stream,
        **fields,
    )


def test_chat_with_audio_returns_message_audio_and_the_text(client):
    before = int(time.time())
    response = chat_audio(client)
    message = response.choices[0].message
    assert message.content and message.audio is not None
    assert message.audio.transcript == message.content
    assert message.audio.id.startswith("audio_")
    assert message.audio.expires_at >= before
    samples, rate = decode(base64.b64decode(message.audio.data))
    assert_speech(samples, rate)
    assert response.system_fingerprint.startswith("omni-studio-0.1.0-")
    # text alone runs the thinker only: the same words, no audio
    text_only = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "say hello"}], modalities=["text"], seed=11
    )
    assert text_only.choices[0].message.audio is None
    assert text_only.choices[0].message.content


def test_streamed_chat_audio_joins_into_the_non_streamed_audio(client):
    whole = chat_audio(client, fmt="pcm16", seed=21).choices[0].message
    chunks = list(chat_audio(client, stream=True, fmt="pcm16", seed=21))
    audio = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    data = b"".join(base64.b64decode(a.data) for a in audio if a.data)
    transcript = "".join(a.transcript for a in audio if a.transcript)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert data and data == base64.b64decode(whole.audio.data)
    assert transcript == content == whole.content
    assert {a.id for a in audio} == {audio[0].id}
    assert audio[-1].expires_at is not None and audio[-1].data is None  # the last update: the expiry
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].system_fingerprint.startswith("omni-studio-")


def test_input_audio_is_heard(client):
    def ask(parts: list[dict]) -> tuple[str, bytes]:
        reply = (
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}],
                modalities=["text", "audio"],
                audio={"voice": "Chelsie", "format": "pcm16"},
                seed=13,
            )
            .choices[0]
            .message
        )
        return reply.content or "", base64.b64decode(reply.audio.data) if reply.audio else b""

    clip = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(tone(1.0)).decode(), "format": "wav"},
    }
    heard = ask([clip])
    assert heard[1]  # it answered, and spoke
    assert heard != ask([])  # the same request without the clip answers otherwise: the clip was heard
    mp3 = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(tone(1.0, fmt="MP3")).decode(), "format": "mp3"},
    }
    assert ask([mp3])[1]


# -- refusals, each naming its field ----------------------------------------------------------------


def test_unknown_voice_names_the_voices(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model=MODEL, input="hi", voice="alloy")
    error = error_of(caught.value)
    assert error["param"] == "voice" and "Chelsie, Ethan" in error["message"]
    assert caught.value.response.headers.get("x-run-id")  # recorded
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )
    error = error_of(caught.value)
    assert error["param"] == "audio.voice" and "Chelsie, Ethan" in error["message"]


def test_a_model_without_an_audio_stage_names_its_modalities(text_server):
    client = sdk(text_server)
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model="tiny-chat", input="hi", voice="Ethan")
    error = error_of(caught.value)
    assert error["param"] == "model" and "produces text" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "hi"}], modalities=["text", "audio"]
        )
    error = error_of(caught.value)
    assert error["param"] == "modalities" and "produces text" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"audio": {"voice": "Ethan", "format": "wav"}},
        )
    assert error_of(caught.value)["param"] == "audio"


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus"])
def test_streaming_a_compressed_format_is_refused(server, fmt):
    for stream_format in ("audio", "sse"):
        response = speech(server, input="hi", response_format=fmt, stream_format=stream_format)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "response_format" and "wav or pcm" in error["message"]
    response = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "modalities": ["text", "audio"],
            "audio": {"format": fmt},
            "stream": True,
        },
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "audio.format" and "wav or pcm16" in error["message"]


def test_speech_field_refusals(server):
    cases = [
        ({"input": ""}, "input", "at least 1 character"),
        ({"input": "   "}, "input", "blank"),
        ({"input": "a" * 4097}, "input", "--max-speech-chars"),
        ({"input": "hi", "speed": 5}, "speed", "4"),
        ({"input": "hi", "speed": 0.1}, "speed", "0.25"),
        (
            {"input": "hi", "response_format": "aac"},
            "response_format",
            "'wav', 'mp3', 'flac', 'opus' or 'pcm'",
        ),
        ({"input": "hi", "stream_format": "chunks"}, "stream_format", "'sse' or 'audio'"),
        ({"input": "hi", "voice": {"id": "nobody"}}, "voice", "Chelsie, Ethan"),
        ({"input": "hi", "temperature": 0.5}, "temperature", "Unsupported field"),
    ]
    for body, param, words in cases:
        response = speech(server, **body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["param"] == param, (body, error)
        assert words in error["message"], (body, error)
    response = speech(server, input="hi", model="tts-1")
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_chat_audio_field_refusals(server):
    def chat(**body) -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)

    hello = [{"role": "user", "content": "hi"}]
    response = chat(messages=hello, modalities=["text"], audio={"voice": "Ethan"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "audio"
    response = chat(messages=hello, modalities=["text", "audio"], audio={"format": "aac"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "audio.format" and "pcm16" in error["message"]


def input_audio_message(data: str, fmt: str = "wav") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "listen"},
                {"type": "input_audio", "input_audio": {"data": data, "format": fmt}},
            ],
        }
    ]


def test_input_audio_refusals_name_the_part(server):
    def chat(messages: list[dict]) -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}, timeout=60)

    part = "messages[0].content[1].input_audio"
    cases = [
        (input_audio_message("not base64!"), 400, f"{part}.data", "base64"),
        (input_audio_message(base64.b64encode(tone(0.5)).decode(), "mp3"), 400, f"{part}.format", "WAV"),
        (input_audio_message(base64.b64encode(b"RIFF nonsense").decode()), 400, f"{part}.data", "readable"),
        (
            input_audio_message(base64.b64encode(tone(0.5)).decode(), "ogg"),
            400,
            f"{part}.format",
            "'wav' or 'mp3'",
        ),
        (
            input_audio_message(base64.b64encode(tone(MAX_AUDIO_SECONDS + 1)).decode()),
            413,
            f"{part}.data",
            "--max-audio-seconds",
        ),
        (
            input_audio_message(base64.b64encode(tone(1, rate=8000, fmt="WAV") * 20).decode()),
            413,
            f"{part}.data",
            "--max-audio-bytes",
        ),
    ]
    for messages, status, param, words in cases:
        response = chat(messages)
        assert response.status_code == status, (param, response.text)
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], error
    earlier = [
        *input_audio_message(base64.b64encode(tone(0.5)).decode()),
        {"role": "assistant", "content": "ok"},
    ]
    earlier.append({"role": "user", "content": "and now?"})
    response = chat(earlier)
    assert response.status_code == 400 and response.json()["error"]["param"] == part


# -- cancel on disconnect ----------------------------------------------------------------------------


def test_a_client_that_leaves_a_speech_stream_cancels_its_run(server):
    """A long render (1000 ODE points) left by its client mid-run is recorded cancelled, and the engine
    takes the next request."""
    url = urlsplit(server.url)
    body = json.dumps(
        {
            "model": MODEL,
            "input": "walk away",
            "stream_format": "audio",
            "num_inference_steps": 1000,
            "seed": 1,
        }
    ).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    head = (
        f"POST /v1/audio/speech HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    store = open_store(None, server.data_dir)
    try:
        try:
            wait_for(lambda: store.list_runs(RunFilter(search="walk away", status="running")))
        finally:
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        run = wait_for(
            lambda: next(iter(store.list_runs(RunFilter(search="walk away", status="cancelled"))), None)
        )
        assert "disconnected" in store.get_run(run.id).error
    finally:
        store.close()
    assert speech(server, input="next", seed=1).status_code == 200


def test_metrics_time_the_spoken_replies(client, server):
    """/metrics: TTFP and RTF histograms and the underrun counter, labelled by model (the replies this
    module's server has spoken so far, and one more)."""

    def count() -> float:
        text = httpx.get(server.url + "/metrics", timeout=60).text
        name = f'omni_studio_speech_ttfp_seconds_count{{model="{MODEL}"}}'
        rows = [row for row in text.splitlines() if row.startswith(name)]
        return float(rows[0].split()[-1]) if rows else 0.0

    before = count()
    client.audio.speech.create(model=MODEL, input="count me", voice="Chelsie", extra_body={"seed": 3})
    assert count() == before + 1
    text = httpx.get(server.url + "/metrics", timeout=60).text
    assert f'omni_studio_speech_realtime_factor_count{{model="{MODEL}"}}' in text
    assert f'omni_studio_speech_underruns_total{{model="{MODEL}"}}' in text
