"""The API as a new user meets it: the official `openai` SDK and the seed GLM-Image client against a live
`omni-studio serve` on 127.0.0.1."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from tests.servers import running_server

API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def glm_server(tmp_path_factory):
    with running_server(["serve", "--api-key", API_KEY], tmp_path_factory.mktemp("glm")) as server:
        yield server


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    args = ["serve", "tiny-chat", "--ar-backend", "transformers", "--served-model-name", "chatty"]
    with running_server(args, tmp_path_factory.mktemp("chat")) as s:
        yield s


@pytest.fixture(scope="module")
def client(glm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=glm_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def decode_data_url(url: str) -> bytes:
    assert url.startswith("data:image/png;base64,")
    return base64.b64decode(url.split(",", 1)[1], validate=True)


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-glm-image"]


def test_chat_completion_with_extra_body_returns_one_png(client):
    response = client.chat.completions.create(
        model="tiny-glm-image",
        messages=[{"role": "user", "content": "a red 'cat'"}],
        seed=42,
        extra_body={"height": 96, "width": 64, "num_inference_steps": 4, "guidance_scale": 1.5},
    )
    content = response.choices[0].message.content
    assert isinstance(content, list)
    images = [part for part in content if part["type"] == "image_url"]
    assert len(images) == 1
    image = Image.open(io.BytesIO(decode_data_url(images[0]["image_url"]["url"])))
    assert image.size == (64, 96)
    assert response.system_fingerprint.startswith("omni-studio-0.1.0-")
    assert response.usage.completion_tokens > 0


def test_chat_completion_stream_ends_with_the_image(client):
    stream = client.chat.completions.create(
        model="tiny-glm-image",
        messages=[{"role": "user", "content": "a cat"}],
        stream=True,
        seed=3,
        extra_body={"height": 64, "width": 64},
    )
    chunks = list(stream)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
    progress = [
        c.model_extra.get("progress") for c in chunks if c.model_extra and c.model_extra.get("progress")
    ]
    assert {p["stage"] for p in progress} == {0, 1}
    assert progress[-1]["step"] == progress[-1]["total"] == 4
    image_parts = [
        part
        for c in chunks
        if c.choices and isinstance(c.choices[0].delta.content, list)
        for part in c.choices[0].delta.content
    ]
    assert len(image_parts) == 1
    assert Image.open(io.BytesIO(decode_data_url(image_parts[0]["image_url"]["url"]))).size == (64, 64)


def test_images_generate_b64_json(client):
    result = client.images.generate(
        model="tiny-glm-image",
        prompt="a blue square",
        size="64x64",
        n=2,
        response_format="b64_json",
        extra_body={"seed": 5},
    )
    assert len(result.data) == 2
    first, second = (base64.b64decode(d.b64_json) for d in result.data)
    assert Image.open(io.BytesIO(first)).size == (64, 64)
    assert first != second  # seeds 5 and 6


def test_images_generate_url_serves_the_file(client, glm_server):
    result = client.images.generate(
        model="tiny-glm-image", prompt="a cat", size="64x64", response_format="url", extra_body={"seed": 9}
    )
    url = result.data[0].url
    assert url.startswith(glm_server.url + "/v1/outputs/") and httpx.URL(url).path.endswith(".png")
    assert httpx.get(url).status_code == 200  # signed: no key needed (tests/test_api_clients.py)
    fetched = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"})
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(fetched.content)).size == (64, 64)


def test_images_edit_with_an_uploaded_file(client):
    source = io.BytesIO()
    Image.new("RGB", (64, 64), (30, 200, 90)).save(source, format="PNG")
    source.seek(0)
    result = client.images.edit(
        model="tiny-glm-image",
        image=("source.png", source, "image/png"),
        prompt="make it red",
        response_format="b64_json",
    )
    assert Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).size == (64, 64)


def test_typed_errors(client, glm_server):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    assert "does not exist" in missing.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="tiny-glm-image", messages=[{"role": "user", "content": "hi"}], extra_body={"height": 50}
        )
    assert bad.value.body["param"] == "height" and "multiple of 32" in bad.value.message
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.chat.completions.create(
            model="tiny-glm-image", messages=[{"role": "user", "content": "hi"}], presence_penalty=0.5
        )
    assert unsupported.value.body["param"] == "presence_penalty"
    assert "Unsupported field 'presence_penalty'" in unsupported.value.message
    wrong_key = openai.OpenAI(base_url=glm_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    # ... and the server is still serving
    assert client.models.list().data


def seed_client_payload(content) -> dict:
    """The JSON shape of the GLM-Image regression client (shared/seeds/004): a literal extra_body key."""
    return {
        "model": "tiny-glm-image",
        "stream": False,
        "seed": 42,
        "messages": [{"role": "user", "content": content}],
        "extra_body": {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 1.5},
    }


def test_seed_glm_image_client_t2i_then_i2i(glm_server):
    session = httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120, trust_env=False)
    session.get(glm_server.url + "/health").raise_for_status()
    source = io.BytesIO()
    Image.linear_gradient("L").resize((64, 64)).convert("RGB").save(source, format="PNG")
    image_url = "data:image/png;base64," + base64.b64encode(source.getvalue()).decode()
    cases = {
        "t2i": "A Vincent van Gogh style impressionist painting.",
        "i2i": [
            {
                "type": "text",
                "text": "Transform this modern, geometric image into a Vincent van Gogh style painting.",
            },
            {"type": "image_url", "image_url": {"url": image_url}},
        ],
    }
    for case, content in cases.items():
        pngs = []
        for _ in range(2):
            response = session.post(
                glm_server.url + "/v1/chat/completions", json=seed_client_payload(content)
            )
            assert response.status_code == 200, response.text[:3000]
            parts = response.json()["choices"][0]["message"]["content"]
            assert isinstance(parts, list)
            images = [item for item in parts if item.get("type") == "image_url"]
            assert len(images) == 1, case
            png = decode_data_url(images[0]["image_url"]["url"])
            image = Image.open(io.BytesIO(png))
            image.load()
            assert image.size == (64, 64)
            pngs.append(png)
        assert pngs[0] == pngs[1], f"{case}: same request, different bytes"


def test_chat_model_streams_text_token_by_token(chat_server):
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["chatty"]  # --served-model-name
    stream = client.chat.completions.create(
        model="chatty",
        messages=[{"role": "user", "content": "tell me about the river"}],
        stream=True,
        max_tokens=16,
        seed=1,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 5
    usage = [c for c in chunks if c.usage]
    assert usage and usage[-1].usage.completion_tokens <= 16
    full = client.chat.completions.create(
        model="chatty",
        messages=[{"role": "user", "content": "tell me about the river"}],
        max_tokens=16,
        seed=1,
    )
    assert full.choices[0].message.content == "".join(pieces)  # same seed, same words, streamed or not
