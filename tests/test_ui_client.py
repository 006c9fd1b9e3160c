"""The studio's named Gradio endpoints through `gradio_client` (what a script driving the studio uses)."""

from __future__ import annotations

import uuid

import httpx
import pytest
from gradio_client import Client

from tests.servers import running_server

pytestmark = pytest.mark.browser  # needs a running studio, like the browser tests


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    with running_server(
        ["ui", "--ar-backend", "transformers"], tmp_path_factory.mktemp("studio-client")
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(studio) -> Client:
    return Client(studio.url + "/", verbose=False)


def test_named_endpoints_are_listed_and_internal_ones_hidden(client):
    endpoints = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    for name in (
        "/chat",
        "/stop",
        "/send_to_source",
        "/switch_model",
        "/validate_config",
        "/apply_config",
        "/load_preset",
        "/form_to_yaml",
        "/set_fingerprint",
        "/set_api_key",
        "/history_search",
        "/run_detail",
        "/rerun",
        "/replay",
        "/compare",
        "/delete_run",
        "/export_history",
        "/import_history",
        "/system_info",
    ):
        assert name in endpoints, name
    assert not any(name.startswith(("/lambda", "/refresh", "/on_select")) for name in endpoints)


def test_chat_endpoint_returns_the_image_in_the_conversation(client):
    prompt = f"client chat {uuid.uuid4().hex[:6]}"
    result = client.predict(
        {"text": prompt, "files": []}, [], 7, 64, 64, 4, 1.5, "", 32, 0.8, [], 0, api_name="/chat"
    )
    history, status = result[0], result[-1]
    assert history[0]["role"] == "user" and history[-1]["role"] == "assistant"
    assert any(part.get("type") == "file" for part in history[-1]["content"])
    assert "Done in" in status and "seed 7" in status


def test_validate_endpoint_reports_bad_modalities(client):
    bad = "stages:\n- stage_id: 1\n  engine_output_type: latents\n"
    result = client.predict(bad, api_name="/validate_config")
    assert "Invalid" in result[0]
    stage_errors = [part for part in result if isinstance(part, str) and "omni-errors" in part]
    assert len(stage_errors) == 1  # shown beside stage 1's form only
    assert (
        "engine_output_type" in stage_errors[0]
        and "unknown output modality &#x27;latents&#x27;" in stage_errors[0]
    )
    good = "stages:\n- stage_id: 1\n  default_sampling_params:\n    num_inference_steps: 4\n"
    assert "Valid" in client.predict(good, api_name="/validate_config")[0]


def test_set_fingerprint_endpoint_changes_what_the_api_serves(client, studio):
    html = client.predict("custom", "client-fp", api_name="/set_fingerprint")
    assert "client-fp" in html
    body = httpx.post(
        studio.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "x"}], "seed": 1},
    ).json()
    assert body["system_fingerprint"] == "client-fp"
    assert "full" in client.predict("full", "", api_name="/set_fingerprint")


def test_history_search_detail_and_compare(client, studio):
    tag = uuid.uuid4().hex[:6]
    ids = []
    for seed in (1, 2):
        response = httpx.post(
            studio.url + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": f"client history {tag}"}], "seed": seed},
        )
        ids.append(response.headers["x-run-id"])
    table, _gallery, count, *_ = client.predict(
        f"client history {tag}", "any", "any", "", "", "", "", api_name="/history_search"
    )
    assert "2 run(s) match" in count
    assert {row[0] for row in table["data"]} == {i[:12] for i in ids}
    detail = client.predict(ids[0], api_name="/run_detail")
    assert f"client history {tag}" in detail[0] and "succeeded" in detail[0]
    diff, _a, _b = client.predict(ids[0], ids[1], api_name="/compare")
    keys = {row[1] for row in diff["data"]}
    assert "seed" in keys


def test_system_info_endpoint(client):
    info = client.predict(api_name="/system_info")
    assert info["running"]["model"] == "tiny-glm-image"
    assert "torch" in info["versions"] and info["devices"]["cpu_cores"] >= 1
    # What a picture's bytes depend on (docs/recipes.md) and how stage 0 batches (docs/batching.md).
    kernels = info["devices"]["kernels"]
    assert kernels["vector_class"] in ("avx512", "avx2", "x86-64", "aarch64") and kernels["aten_capability"]
    assert info["running"]["stages"][0]["decode"].startswith(
        ("batched", "continuous batching", "one request")
    )


def test_export_then_import_through_the_history_endpoints(client, studio):
    tag = uuid.uuid4().hex[:6]
    httpx.post(
        studio.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": f"bundle {tag}"}], "seed": 3},
    )
    bundle = client.predict(f"bundle {tag}", "any", "any", "", "", "", "", api_name="/export_history")
    assert str(bundle).endswith(".zip")
    from gradio_client import handle_file

    status, _table, _gallery, count, *_ = client.predict(
        handle_file(bundle), f"bundle {tag}", "any", "any", "", "", "", "", api_name="/import_history"
    )
    assert "Imported 0 run(s); 1 already present" in status  # the run is there already: no duplicate
    assert "1 run(s) match" in count


def test_the_trained_shapes_model_from_the_picker_draws_the_prompt(client):
    """Pick `tiny-glm-shapes` (as the Chat tab's model picker does), then chat: the picture follows the prompt.
    Switches back to the default model afterwards (the studio is shared by this module's tests)."""
    import numpy as np
    from PIL import Image

    from tools.shapes.classify import classify
    from tools.shapes.world import parse_caption

    assert "Now serving **tiny-glm-shapes**" in client.predict("tiny-glm-shapes", api_name="/switch_model")
    try:
        running = client.predict(api_name="/system_info")["running"]
        assert running["model"] == "tiny-glm-shapes"
        # Its preset runs the DiT in a process of its own (docs/batching.md): the System tab shows which.
        dit = running["stages"][1]
        assert "own_process" not in running["stages"][0] and dit["own_process"][0]["pid"] > 0
        assert dit["runs_in"] == f"own process (pid {dit['own_process'][0]['pid']})"
        prompt = "a yellow square on a green background, bottom right"
        history = client.predict(
            {"text": prompt, "files": []}, [], 5, 128, 128, 8, 1.0, "", 32, 0.0, [], 0, api_name="/chat"
        )[0]
        image_part = next(p for p in history[-1]["content"] if p.get("type") == "file")
        reading = classify(
            np.asarray(Image.open(image_part["file"]).convert("RGB"))
        )  # downloaded by the client
        assert all(reading.correct(parse_caption(prompt)).values()), reading
    finally:
        assert "Now serving **tiny-glm-image**" in client.predict("tiny-glm-image", api_name="/switch_model")
