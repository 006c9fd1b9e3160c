"""Third-party clients against a live `omni-studio serve` on 127.0.0.1: openai, langchain-openai and litellm
(versions pinned in pyproject's `test` extra). Chat text and image replies in both formats (README.md,
"The API": list content by default; `image_reply: "images"` per request or `--image-reply images` per
server), streaming, usage, errors, keys and signed output URLs."""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import os
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no fetch at import

import httpx
import openai
import pytest
from PIL import Image

from tests.servers import running_server

KEY = "clients-key-1"
MODEL = "tiny-glm-image"
GEN = {"height": 64, "width": 64, "num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Default image replies (list content), an API key."""
    with running_server(["serve", "--api-key", KEY], tmp_path_factory.mktemp("keyed")) as server:
        yield server


@pytest.fixture(scope="module")
def images_server(tmp_path_factory):
    """`--image-reply images`: every client reads `message.content` as a string."""
    with running_server(["serve", "--image-reply", "images"], tmp_path_factory.mktemp("images")) as server:
        yield server


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    args = ["serve", "tiny-chat", "--ar-backend", "transformers", "--served-model-name", "chatty"]
    with running_server(args, tmp_path_factory.mktemp("chat")) as server:
        yield server


@pytest.fixture(scope="module")
def client(keyed) -> openai.OpenAI:
    return openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def png_of(url: str) -> Image.Image:
    assert url.startswith("data:image/png;base64,"), url[:40]
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1], validate=True)))


def ask(text: str = "a red circle") -> list[dict]:
    return [{"role": "user", "content": text}]


# -- openai -----------------------------------------------------------------------------------------


def test_openai_image_reply_default_is_list_content(client):
    response = client.chat.completions.create(model=MODEL, messages=ask(), extra_body=GEN)
    content = response.choices[0].message.content
    assert isinstance(content, list) and content[0]["type"] == "image_url"
    assert png_of(content[0]["image_url"]["url"]).size == (64, 64)
    assert response.usage.completion_tokens > 0


def test_openai_image_reply_images_per_request(client):
    response = client.chat.completions.create(
        model=MODEL, messages=ask(), extra_body={**GEN, "image_reply": "images"}
    )
    message = response.choices[0].message
    assert message.content == ""
    images = message.model_extra["images"]
    assert [part["type"] for part in images] == ["image_url"]
    assert png_of(images[0]["image_url"]["url"]).size == (64, 64)


@pytest.mark.parametrize("image_reply", ["content", "images"])
def test_openai_stream_with_usage_and_a_follow_up_turn(client, image_reply):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask(),
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**GEN, "image_reply": image_reply},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if isinstance(choice.delta.content, list):
                parts += choice.delta.content
            parts += (choice.delta.model_extra or {}).get("images") or []
    assert len(parts) == 1 and png_of(parts[0]["image_url"]["url"]).size == (64, 64)
    assert usage is not None and usage.total_tokens > 0
    # The reply sent back as the client got it, in either format, is a valid earlier turn.
    reply = (
        {"role": "assistant", "content": parts}
        if image_reply == "content"
        else {
            "role": "assistant",
            "content": "",
            "images": parts,
        }
    )
    follow_up = client.chat.completions.create(
        model=MODEL, messages=[*ask(), reply, *ask("now blue")], extra_body=GEN
    )
    assert follow_up.choices[0].message.content[0]["type"] == "image_url"


def test_openai_a_bad_follow_up_names_the_clients_field(client):
    reply = {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": 5}}]}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[*ask(), reply, *ask("again")], extra_body=GEN)
    assert caught.value.body["param"] == "messages[1].content[0].image_url.url"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ask(), extra_body={"image_reply": "pictures"})
    assert caught.value.body["param"] == "image_reply"


def test_openai_errors_keys_and_models(client, keyed):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    wrong = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.NotFoundError) as caught:
        client.get("/nothing/here", cast_to=object)
    assert caught.value.body["code"] == "not_found"


def test_openai_text_chat(chat_server):
    chat = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = chat.chat.completions.create(
        model="chatty",
        messages=ask("hello"),
        max_tokens=4,
        temperature=0,
        extra_body={"image_reply": "images"},
    )
    assert isinstance(response.choices[0].message.content, str)
    assert response.usage.completion_tokens > 0


# -- signed output URLs ------------------------------------------------------------------------------


def test_signed_output_urls(client, keyed):
    result = client.images.generate(model=MODEL, prompt="a cat", size="64x64", response_format="url")
    url = httpx.URL(result.data[0].url)
    assert url.path.endswith(".png") and {"exp", "sig"} <= set(url.params)
    assert 3590 <= int(url.params["exp"]) - time.time() <= 3600  # default lifetime: 1 h
    plain = httpx.get(url)  # no key: the signature is enough
    assert plain.status_code == 200 and Image.open(io.BytesIO(plain.content)).size == (64, 64)
    unsigned = url.copy_with(query=None)
    refused = httpx.get(unsigned)
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert httpx.get(unsigned, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(unsigned, headers={"Authorization": "Bearer wrong"}).status_code == 401
    tampered = url.copy_set_param("sig", "0" * 64)
    assert httpx.get(tampered).status_code == 403
    later = url.copy_set_param("exp", str(int(url.params["exp"]) + 10))
    assert httpx.get(later).status_code == 403
    # Expired: signed with the data dir's secret, as the server would, an hour ago.
    secret = (keyed.data_dir / "url-signing.key").read_bytes()
    name, past = url.path.rsplit("/", 1)[1], int(time.time()) - 10
    signature = hmac.new(secret, f"{name}\n{past}".encode(), hashlib.sha256).hexdigest()
    expired = httpx.get(url.copy_with(params={"exp": str(past), "sig": signature}))
    assert expired.status_code == 403 and "expired" in expired.json()["error"]["message"]


# -- langchain-openai ------------------------------------------------------------------------------


def test_langchain_image_reply_default_content(keyed):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=keyed.url + "/v1", api_key=KEY, model=MODEL, max_retries=0, extra_body=GEN)
    message = llm.invoke("a red circle")
    images = [part for part in message.content if isinstance(part, dict) and part["type"] == "image_url"]
    assert png_of(images[0]["image_url"]["url"]).size == (64, 64)
    assert message.usage_metadata["output_tokens"] > 0
    streamed = None
    for chunk in llm.stream("a red circle"):
        streamed = chunk if streamed is None else streamed + chunk
    parts = [p for p in streamed.content if isinstance(p, dict) and p.get("type") == "image_url"]
    assert png_of(parts[0]["image_url"]["url"]).size == (64, 64)


def test_langchain_text_and_errors(chat_server, keyed, images_server):
    import langchain_openai

    text = langchain_openai.ChatOpenAI(
        base_url=chat_server.url + "/v1", api_key="unused", model="chatty", max_tokens=4, temperature=0
    ).invoke("hello")
    assert isinstance(text.content, str) and text.usage_metadata["total_tokens"] > 0
    wrong = langchain_openai.ChatOpenAI(
        base_url=keyed.url + "/v1", api_key="wrong", model=MODEL, max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        wrong.invoke("hi")
    # With --image-reply images the content is a string; langchain-openai 1.8 keeps only the text.
    plain = langchain_openai.ChatOpenAI(
        base_url=images_server.url + "/v1", api_key="unused", model=MODEL, extra_body=GEN
    ).invoke("a red circle")
    assert plain.content == ""


# -- litellm ----------------------------------------------------------------------------------------


def test_litellm_image_reply_images(images_server, keyed):
    import litellm

    response = litellm.completion(
        model=f"openai/{MODEL}", api_base=images_server.url + "/v1", api_key="unused", messages=ask(), **GEN
    )
    message = response.choices[0].message
    assert message.content == ""
    assert png_of(message.images[0]["image_url"]["url"]).size == (64, 64)
    assert response.usage.completion_tokens > 0
    # Per request on a default server:
    per_request = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=keyed.url + "/v1",
        api_key=KEY,
        messages=ask(),
        extra_body={**GEN, "image_reply": "images"},
    )
    assert png_of(per_request.choices[0].message.images[0]["image_url"]["url"]).size == (64, 64)


def test_litellm_stream_carries_the_image(images_server):
    import litellm

    chunks = list(
        litellm.completion(
            model=f"openai/{MODEL}",
            api_base=images_server.url + "/v1",
            api_key="unused",
            messages=ask(),
            stream=True,
            stream_options={"include_usage": True},
            **GEN,
        )
    )
    images = [
        image
        for chunk in chunks
        for choice in chunk.choices
        for image in (getattr(choice.delta, "images", None) or [])
    ]
    assert len(images) == 1 and png_of(images[0]["image_url"]["url"]).size == (64, 64)
    rebuilt = litellm.stream_chunk_builder(chunks)
    assert rebuilt.usage.total_tokens > 0


def test_litellm_text_errors_and_image_generation(chat_server, keyed):
    import litellm

    text = litellm.completion(
        model="openai/chatty",
        api_base=chat_server.url + "/v1",
        api_key="unused",
        messages=ask("hi"),
        max_tokens=4,
    )
    assert isinstance(text.choices[0].message.content, str)
    with pytest.raises(litellm.AuthenticationError):
        litellm.completion(
            model=f"openai/{MODEL}", api_base=keyed.url + "/v1", api_key="wrong", messages=ask()
        )
    with pytest.raises(litellm.BadRequestError):
        litellm.completion(
            model=f"openai/{MODEL}",
            api_base=keyed.url + "/v1",
            api_key=KEY,
            messages=ask(),
            extra_body={"bogus": 1},
        )
    generated = litellm.image_generation(
        model=f"openai/{MODEL}", api_base=keyed.url + "/v1", api_key=KEY, prompt="a cat", size="64x64"
    )
    assert Image.open(io.BytesIO(base64.b64decode(generated.data[0].b64_json))).size == (64, 64)
