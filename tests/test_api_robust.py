"""Bad input and abuse: each request a hostile or careless client sent to main once answered with a 500 or
lost its run. Now: a 400 or 413 naming the field (and the limit), the run recorded, the server serving.
(SQLite and PostgreSQL: text that SQL cannot hold, a lone surrogate or NUL, is stored escaped.)"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from studio.api.app import create_app
from studio.api.state import ServingOptions, ServingState
from studio.startup.limits import InputLimits
from studio.store import RunFilter

pytest_plugins = ["conftest_store"]

LIMITS = InputLimits(max_body_bytes=300_000, max_prompt_chars=1000, max_messages=4, max_n=2, max_steps=6)


def chat(content, **fields):
    return {"messages": [{"role": "user", "content": content}], "seed": 1, **fields}


@pytest.fixture()
def served(glm_engine, recorder):
    state = ServingState(glm_engine, ServingOptions(limits=LIMITS), recorder=recorder)
    return TestClient(create_app(state)), recorder


@pytest.fixture()
def served_chat(chat_engine, recorder):
    state = ServingState(chat_engine, ServingOptions(limits=LIMITS), recorder=recorder)
    return TestClient(create_app(state)), recorder


def post_raw(client, path: str, body: str | bytes):
    return client.post(path, content=body, headers={"content-type": "application/json"})


def assert_refused(response, status: int, param: str | None, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


def recorded_runs(recorder) -> list:
    recorder.flush(30)
    return recorder.store.list_runs(RunFilter(), limit=100)


def still_serving(client) -> None:
    response = client.post(
        "/v1/chat/completions", json=chat("still there?", height=32, width=32, num_inference_steps=1)
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/images/generations"])
@pytest.mark.parametrize("opening, closing", [("[", "]"), ('{"a":', "}")])
def test_deeply_nested_json_is_a_400_and_recorded(served, path, opening, closing):
    client, recorder = served
    for depth in (40_000, 200):  # past the JSON decoder's own stack, and past --max-json-depth only
        body = opening * depth + ("1" if opening != "[" else "") + closing * depth
        assert_refused(post_raw(client, path, body), 400, None, "nests deeper than 32 levels")
    runs = recorded_runs(recorder)
    assert len(runs) == 2 and all(r.status == "failed" and "nests deeper" in (r.error or "") for r in runs)
    still_serving(client)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", chat("x", size="9" * 5000 + "x32")),
        ("/v1/images/generations", {"prompt": "x", "size": "9" * 5000 + "x32"}),
    ],
)
def test_a_size_of_5000_digits_is_a_400(served, path, body):
    client, recorder = served
    assert_refused(client.post(path, json=body), 400, "size", "WIDTHxHEIGHT")
    assert [r.status for r in recorded_runs(recorder)] == ["failed"]
    still_serving(client)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", chat("a red circle \ud800"), "messages[0].content"),
        (
            "/v1/chat/completions",
            chat([{"type": "text", "text": "nul \x00 and \udfff"}]),
            "messages[0].content[0].text",
        ),
        ("/v1/images/generations", {"prompt": "a red circle \ud800"}, "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_and_the_run_is_kept(served, path, body, param):
    client, recorder = served
    # json.dumps escapes the surrogate as \ud800: valid JSON that decodes to text that is not Unicode.
    assert_refused(post_raw(client, path, json.dumps(body)), 400, param, "lone surrogate")
    runs = recorded_runs(recorder)
    assert len(runs) == 1 and runs[0].status == "failed"
    detail = recorder.store.get_run(runs[0].id)
    assert "lone surrogate" in detail.error
    assert "a red circle" in json.dumps(detail.request) or "nul" in json.dumps(detail.request)
    still_serving(client)


def test_a_megabyte_prompt_is_refused_before_the_engine(served):
    client, recorder = served
    huge = "word " * 200_000  # 1 MB
    response = client.post("/v1/chat/completions", json=chat(huge))
    assert_refused(response, 413, None, "limit is 300000")  # over the body limit first
    response = client.post("/v1/chat/completions", json=chat("word " * 400))
    assert_refused(response, 400, "messages[0].content", "2000 characters", "limit is 1000")
    response = client.post("/v1/images/generations", json={"prompt": "word " * 400})
    assert_refused(response, 400, "prompt", "limit is 1000")
    assert [r.status for r in recorded_runs(recorder)] == ["failed"] * 3
    still_serving(client)


@pytest.mark.parametrize(
    "path, body, status, param, fragment",
    [
        ("/v1/chat/completions", chat("x", n=3), 400, "n", "limit is 2"),
        ("/v1/chat/completions", chat("x", num_inference_steps=7), 400, "num_inference_steps", "limit is 6"),
        (
            "/v1/chat/completions",
            chat("x", negative_prompt="n" * 1001),
            400,
            "negative_prompt",
            "limit is 1000",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}] * 5},
            400,
            "messages",
            "limit is 4",
        ),
        ("/v1/images/generations", {"prompt": "x", "n": 3}, 400, "n", "limit is 2"),
        (
            "/v1/images/generations",
            {"prompt": "x", "num_inference_steps": 9},
            400,
            "num_inference_steps",
            "limit is 6",
        ),
    ],
)
def test_limits_name_the_field_and_the_limit(served, path, body, status, param, fragment):
    client, recorder = served
    assert_refused(client.post(path, json=body), status, param, fragment)
    assert [r.status for r in recorded_runs(recorder)] == ["failed"]


def test_an_unexpected_error_is_a_500_and_still_recorded(served, monkeypatch):
    client, recorder = served

    def explode(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("studio.api.serving_chat.chat_to_engine_request", explode)
    response = client.post("/v1/chat/completions", json=chat("x"))
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal_error"
    runs = recorded_runs(recorder)
    assert len(runs) == 1 and runs[0].status == "failed" and "boom" in (runs[0].error or "")
    assert response.headers.get("x-run-id") == runs[0].id
    monkeypatch.undo()
    still_serving(client)


@pytest.mark.parametrize(
    "field, value",
    [
        ("height", 64),
        ("width", 64),
        ("num_inference_steps", 4),
        ("negative_prompt", "blurry"),
        ("guidance_scale", 2.0),
    ],
)
def test_a_chat_model_refuses_image_fields(served_chat, field, value):
    client, recorder = served_chat
    error = assert_refused(client.post("/v1/chat/completions", json=chat("hi", **{field: value})), 400, field)
    assert "has no diffusion stage" in error["message"] and "max_tokens" in error["message"]
    assert [r.status for r in recorded_runs(recorder)] == ["failed"]
    assert client.post("/v1/chat/completions", json=chat("hi", max_tokens=4)).status_code == 200
