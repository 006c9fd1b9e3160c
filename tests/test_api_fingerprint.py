"""system_fingerprint on every construction path (multi-stage, AR-only, diffusion-only), every mode,
non-streaming and streaming with include_usage on and off: exactly one carrier, and which chunk it is.

The last tests are the negative control: they break the wiring the way the seed thread describes (the
mode never applied before the handlers are built) and check that the same assertions then fail.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from studio.api.app import create_app
from studio.api.fingerprint import FingerprintError, FingerprintSettings, system_fingerprint
from studio.api.state import ServingOptions, ServingState

MODES = [("full", None), ("hash", None), ("custom", "omni-fp-custom"), ("none", None)]


@pytest.fixture(params=["glm_engine", "chat_engine", "diffusion_engine"])
def engine(request):
    return request.getfixturevalue(request.param)


def expected_fingerprint(mode: str, value: str | None, engine) -> str | None:
    hash8 = engine.config.hash8
    return {
        "full": f"omni-studio-0.1.0-{hash8}",
        "hash": f"omni-studio-0.1.0-{hash8}",
        "custom": value,
        "none": None,
    }[mode]


def chat_payload(engine, stream: bool, include_usage: bool | None = None) -> dict:
    payload = {"messages": [{"role": "user", "content": "hello"}], "seed": 1, "stream": stream}
    if engine.config.family == "chat":
        payload["max_tokens"] = 4
    if include_usage is not None:
        payload["stream_options"] = {"include_usage": include_usage}
    return payload


def sse_chunks(text: str) -> list[dict]:
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def check_non_streaming(body: dict, expected: str | None) -> None:
    if expected is None:
        assert "system_fingerprint" not in body
    else:
        assert body["system_fingerprint"] == expected


def check_stream(chunks: list[dict], expected: str | None, include_usage: bool) -> None:
    carriers = [i for i, c in enumerate(chunks) if "system_fingerprint" in c]
    if expected is None:
        assert carriers == []
        return
    assert len(carriers) == 1, f"{len(carriers)} chunks carry the fingerprint"
    carrier = chunks[carriers[0]]
    assert carrier["system_fingerprint"] == expected
    if include_usage:
        assert carrier["choices"] == [] and "usage" in carrier
        assert carriers[0] == len(chunks) - 1
    else:
        assert carrier["choices"] and all(c["finish_reason"] for c in carrier["choices"])
        assert "usage" not in carrier


def client_for(engine, mode: str, value: str | None) -> TestClient:
    state = ServingState(engine, ServingOptions(fingerprint=FingerprintSettings(mode, value)))
    return TestClient(create_app(state))


@pytest.mark.parametrize("mode, value", MODES)
def test_fingerprint_modes_on_every_path(engine, mode, value):
    expected = expected_fingerprint(mode, value, engine)
    client = client_for(engine, mode, value)
    response = client.post("/v1/chat/completions", json=chat_payload(engine, stream=False))
    assert response.status_code == 200, response.text
    check_non_streaming(response.json(), expected)
    for include_usage in (None, False, True):
        streamed = client.post("/v1/chat/completions", json=chat_payload(engine, True, include_usage))
        assert streamed.status_code == 200, streamed.text
        check_stream(sse_chunks(streamed.text), expected, bool(include_usage))
    if engine.config.family != "chat":
        images = client.post("/v1/images/generations", json={"prompt": "a cat", "seed": 1})
        assert images.status_code == 200, images.text
        check_non_streaming(images.json(), expected)


def test_full_mode_names_tensor_and_pipeline_parallelism(glm_engine):
    from dataclasses import replace

    config = glm_engine.config
    stages = tuple(
        replace(s, engine_args=replace(s.engine_args, tensor_parallel_size=2, pipeline_parallel_size=3))
        for s in config.stages
    )
    parallel = replace(config, stages=stages)
    assert (
        system_fingerprint(FingerprintSettings("full"), parallel)
        == f"omni-studio-0.1.0-tp2-pp3-{parallel.hash8}"
    )
    assert system_fingerprint(FingerprintSettings("hash"), parallel) == f"omni-studio-0.1.0-{parallel.hash8}"


@pytest.mark.parametrize(
    "mode, value, fragment",
    [
        ("custom", None, "needs --fingerprint-value"),
        ("custom", "", "needs --fingerprint-value"),
        ("full", "x", "only used with --fingerprint-mode custom"),
        ("none", "x", "only used with --fingerprint-mode custom"),
        ("weird", None, "must be one of full, hash, custom, none"),
    ],
)
def test_bad_mode_value_combinations_are_refused(mode, value, fragment):
    with pytest.raises(FingerprintError, match=fragment):
        FingerprintSettings(mode, value)


def test_serve_refuses_custom_without_a_value_at_start(tmp_path, capsys):
    from studio.cli import main

    assert main(["serve", "--fingerprint-mode", "custom", "--data-dir", str(tmp_path)]) == 2
    assert "--fingerprint-mode custom needs --fingerprint-value" in capsys.readouterr().err
    assert main(["serve", "--fingerprint-value", "abc", "--data-dir", str(tmp_path)]) == 2
    assert "only used with --fingerprint-mode custom" in capsys.readouterr().err


def test_rebuild_applies_a_new_mode_to_the_next_response(glm_engine):
    state = ServingState(glm_engine, ServingOptions())
    client = TestClient(create_app(state))
    first = client.post("/v1/images/generations", json={"prompt": "a cat", "seed": 1}).json()
    assert first["system_fingerprint"] == expected_fingerprint("full", None, glm_engine)
    assert state.set_fingerprint("custom", "after-rebuild") == "after-rebuild"
    second = client.post("/v1/chat/completions", json=chat_payload(glm_engine, stream=False)).json()
    assert second["system_fingerprint"] == "after-rebuild"
    state.set_fingerprint("none")
    assert (
        "system_fingerprint"
        not in client.post("/v1/chat/completions", json=chat_payload(glm_engine, stream=False)).json()
    )
    with pytest.raises(FingerprintError):
        state.set_fingerprint("custom", None)
    assert state.handlers.system_fingerprint is None  # a refused change leaves the serving state as it was


# -- negative control ---------------------------------------------------------------------------------


def _unwired(monkeypatch):
    """Reproduce the seed bug: the configured mode never reaches the handlers (they keep the default)."""
    import studio.api.state as app_module

    monkeypatch.setattr(
        app_module,
        "system_fingerprint",
        lambda settings, config: system_fingerprint(FingerprintSettings(), config),
    )


@pytest.mark.parametrize("mode, value", [("none", None), ("custom", "omni-fp-custom")])
def test_negative_control_unwired_mode_is_caught(engine, mode, value, monkeypatch):
    _unwired(monkeypatch)
    expected = expected_fingerprint(mode, value, engine)
    client = client_for(engine, mode, value)
    body = client.post("/v1/chat/completions", json=chat_payload(engine, stream=False)).json()
    with pytest.raises(AssertionError):
        check_non_streaming(body, expected)
    streamed = client.post("/v1/chat/completions", json=chat_payload(engine, True, True))
    with pytest.raises(AssertionError):
        check_stream(sse_chunks(streamed.text), expected, True)


def test_negative_control_two_carriers_are_caught(glm_engine):
    chunks = [
        {"choices": [{"finish_reason": "stop"}], "system_fingerprint": "x"},
        {"choices": [], "usage": {}, "system_fingerprint": "x"},
    ]
    with pytest.raises(AssertionError, match="2 chunks carry"):
        check_stream(chunks, "x", True)
    with pytest.raises(AssertionError):
        check_stream([chunks[0], {"choices": [], "usage": {}}], "x", True)  # carried by the wrong chunk
