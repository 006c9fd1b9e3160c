"""Every bad input gets an OpenAI error body naming the field; the server keeps serving after each one."""

from __future__ import annotations

import base64
import io
import re
import threading

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from studio.api.app import create_app
from studio.api.state import ServingOptions, ServingState
from studio.startup.limits import InputLimits


@pytest.fixture()
def state(glm_engine):
    return ServingState(
        glm_engine,
        ServingOptions(
            limits=InputLimits(max_body_bytes=200_000, max_image_bytes=100_000, max_image_pixels=512 * 512)
        ),
    )


@pytest.fixture()
def client(state):
    return TestClient(create_app(state))


def chat(content, **fields):
    return {"messages": [{"role": "user", "content": content}], "seed": 1, **fields}


def png_url(size=(64, 64), fmt="PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def assert_error(response, status: int, param: str | None = None, fragment: str = ""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    assert fragment in error["message"]
    return error


def still_serving(client):
    response = client.post("/v1/chat/completions", json=chat("still there?"))
    assert response.status_code == 200


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        (chat("x", temperature="hot"), "temperature", "valid number"),
        (chat("x", n=0), "n", "greater than or equal to 1"),
        (chat("x", size="big"), "size", "WIDTHxHEIGHT"),
        (chat("x", logprobs=True), "logprobs", "Unsupported field 'logprobs'"),
        (chat("x", extra_body={"steps": 3}), "extra_body.steps", "Unsupported field"),
        (
            chat("x", modalities=["images"]),
            "modalities",
            "valid names are text, image, audio, latent, token_ids",
        ),
        (chat("x", height=64, extra_body={"height": 96}), None, "both at the top level and under extra_body"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "Input should be"),
        (chat("x", height=70), "height", "multiple of 32"),
        (chat("x", num_inference_steps=0), "num_inference_steps", "greater than or equal to 1"),
        (chat("x", modalities=["text"]), "modalities", "produces image; cannot produce text"),
        (chat("x", size="64x64", width=96), "size", "disagrees with width"),
    ],
)
def test_bad_fields_are_400_naming_the_field(client, body, param, fragment):
    assert_error(client.post("/v1/chat/completions", json=body), 400, param, fragment)
    still_serving(client)


def test_bad_messages_and_images(client):
    assert_error(
        client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        ),
        400,
        "messages",
        "last message must come from the user",
    )
    remote = chat(
        [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]
    )
    assert_error(client.post("/v1/chat/completions", json=remote), 400, None, "only data: URLs")
    garbage = chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}])
    assert_error(client.post("/v1/chat/completions", json=garbage), 400, None, "invalid base64")
    not_image = chat(
        [
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"hello").decode()},
            }
        ]
    )
    assert_error(client.post("/v1/chat/completions", json=not_image), 422, None, "not a decodable image")
    two = chat([{"type": "image_url", "image_url": {"url": png_url()}}] * 2)
    assert_error(client.post("/v1/chat/completions", json=two), 400, "messages", "at most one image")
    assert_error(
        client.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}),
        400,
        None,
        "not valid JSON",
    )
    still_serving(client)


def test_too_large_is_413(client):
    big_body = chat("x" * 300_000)
    assert_error(client.post("/v1/chat/completions", json=big_body), 413, None, "limit is 200000")
    huge_pixels = chat(
        [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": png_url((1024, 1024))}}]
    )
    assert_error(client.post("/v1/chat/completions", json=huge_pixels), 413, None, "pixels")
    still_serving(client)


def test_unknown_model_and_file_are_404(client):
    assert_error(
        client.post("/v1/chat/completions", json={**chat("x"), "model": "nope"}),
        404,
        "model",
        "does not exist",
    )
    assert_error(client.get("/v1/outputs/" + "0" * 64 + ".png"), 404, "name", "No output file")
    assert client.get("/v1/nothing-here").status_code == 404
    still_serving(client)


def test_api_key_protects_v1_only(glm_engine):
    state = ServingState(glm_engine, ServingOptions(api_key="k1"))
    client = TestClient(create_app(state))
    assert_error(client.get("/v1/models"), 401, None, "Missing API key")
    assert_error(
        client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, None, "Incorrect API key"
    )
    assert client.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert client.get("/health").status_code == 200
    state.set_api_key(None)
    assert client.get("/v1/models").status_code == 200


def test_queue_full_is_429(client, glm_engine, monkeypatch):
    monkeypatch.setattr(glm_engine, "max_pending", 0)
    assert_error(client.post("/v1/chat/completions", json=chat("x")), 429, None, "busy")
    monkeypatch.setattr(glm_engine, "max_pending", 64)
    still_serving(client)


def test_engine_failure_is_500_and_the_server_recovers(client, glm_engine, monkeypatch):
    runner = glm_engine.runners[1]

    def broken(jobs):
        raise RuntimeError("DiT weights on fire")

    original = runner.run
    monkeypatch.setattr(runner, "run", broken)
    error = assert_error(
        client.post("/v1/chat/completions", json=chat("x")), 500, None, "DiT weights on fire"
    )
    assert error["type"] == "server_error"
    streamed = client.post("/v1/chat/completions", json=chat("x", stream=True))
    assert (
        streamed.status_code == 200
        and "DiT weights on fire" in streamed.text
        and streamed.text.endswith("data: [DONE]\n\n")
    )
    monkeypatch.setattr(runner, "run", original)
    still_serving(client)


def test_no_engine_is_503(state):
    state.set_engine(None)
    client = TestClient(create_app(state))
    assert client.get("/health").status_code == 503
    assert_error(client.post("/v1/chat/completions", json=chat("x")), 503, None, "not ready")


def test_metrics_report_requests_stages_and_queue(client):
    still_serving(client)
    text = client.get("/metrics").text
    assert 'omni_studio_requests_total{endpoint="chat_completions",status="200"}' in text
    assert 'omni_studio_stage_seconds_count{kind="diffusion",stage="1"}' in text
    assert 'omni_studio_queue_depth{stage="0"}' in text
    assert "omni_studio_request_latency_seconds_bucket" in text
    # How stage 0 batches on this machine (docs/batching.md): chosen by its checks at the first step.
    assert re.search(
        r'omni_studio_decode_path\{path="batched, tiles of (4|8|16) rows[^"]*",stage="0"\} 1\.0', text
    )


def test_concurrent_requests_through_http(client):
    results: list[int] = []

    def one(seed):
        results.append(client.post("/v1/chat/completions", json=chat("x", seed=seed)).status_code)

    threads = [threading.Thread(target=one, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 6
