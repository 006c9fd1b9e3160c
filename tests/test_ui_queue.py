"""The Chat tab tells a waiting user how many requests are ahead of theirs (a live studio, gradio_client)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import yaml

from tests.conftest import tiny_deploy
from tests.servers import running_server

pytestmark = pytest.mark.browser  # a live studio, like tests/test_ui_client.py


def test_a_queued_chat_shows_how_many_are_ahead(tmp_path):
    from gradio_client import Client

    # One AR slot, so a long API request holds the stage while the UI's request waits behind it.
    deploy = tiny_deploy("tiny-glm-image", stage0={"max_num_seqs": 1, "backend": "transformers"})
    deploy_path = tmp_path / "deploy.yaml"
    deploy_path.write_text(yaml.safe_dump(deploy))
    with running_server(["ui", "--deploy-config", str(deploy_path)], tmp_path / "data") as server:
        long_body = {
            "messages": [{"role": "user", "content": "a long one"}],
            "height": 1024,
            "width": 1024,
            "num_inference_steps": 1,
        }
        blocker = threading.Thread(
            target=lambda: httpx.post(server.url + "/v1/chat/completions", json=long_body, timeout=300),
            daemon=True,
        )
        blocker.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until the long request holds the AR stage
            metrics = httpx.get(server.url + "/metrics", timeout=5).text
            if "omni_studio_requests_in_flight 1.0" in metrics:
                break
            time.sleep(0.1)
        client = Client(server.url + "/", verbose=False)
        message = {"text": "a red circle", "files": []}
        job = client.submit(message, [], 1, 64, 64, 2, 1.5, "", 32, 1.0, [], 0, api_name="/chat")
        job.result(timeout=300)
        statuses = [outputs[-1] for outputs in job.outputs() if isinstance(outputs[-1], str)]
        assert any("1 ahead of you" in status for status in statuses), statuses
        assert any(status.startswith("Done") for status in statuses), statuses
        blocker.join(timeout=300)


def test_one_ui_session_is_held_to_the_per_client_limit(tmp_path):
    """The Chat tab's requests count against --max-in-flight-per-client per UI session (it once passed
    no session, so the UI had no limit): a session's second concurrent chat is refused, another's runs."""
    from gradio_client import Client

    deploy = tiny_deploy("tiny-glm-image", stage0={"max_num_seqs": 1, "backend": "transformers"})
    deploy_path = tmp_path / "deploy.yaml"
    deploy_path.write_text(yaml.safe_dump(deploy))
    args = ["ui", "--deploy-config", str(deploy_path), "--max-in-flight-per-client", "1"]
    with running_server(args, tmp_path / "data") as server:
        client = Client(server.url + "/", verbose=False)
        long_message = {"text": "a long one", "files": []}
        first = client.submit(long_message, [], 1, 1024, 1024, 1, 1.5, "", 32, 1.0, [], 0, api_name="/chat")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the first chat holds this session's one slot
            if "omni_studio_requests_in_flight 1.0" in httpx.get(server.url + "/metrics", timeout=5).text:
                break
            time.sleep(0.1)
        second = client.submit(
            {"text": "me too", "files": []}, [], 2, 64, 64, 2, 1.5, "", 32, 1.0, [], 0, api_name="/chat"
        )
        status = second.result(timeout=300)[-1]
        assert "Busy" in status, status
        other = Client(server.url + "/", verbose=False)  # another session is not held back
        done = other.predict(
            {"text": "hello", "files": []}, [], 3, 64, 64, 2, 1.5, "", 32, 1.0, [], 0, api_name="/chat"
        )
        assert "Done" in done[-1], done[-1]
        first.result(timeout=300)
