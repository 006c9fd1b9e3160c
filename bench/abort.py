"""How fast an abort frees the engine, wherever the request is (the timing half of tests/test_abort.py).

Against live `omni-studio serve` processes on 127.0.0.1 (tiny-glm-image with one AR slot, tiny-chat with
1000 forced tokens), each repeat times, from the moment the client closes its connection:

- decode-json / decode-sse: a 5120-token decode (non-streaming / streaming) until `/metrics` in-flight is 0;
- denoise: a 400-step denoise until in-flight is 0;
- queued: a request waiting behind a long decode until it has left the engine (in-flight back to 1);
- prefill-json / prefill-sse: a ~1000-token prompt dropped as soon as the engine takes it, until in-flight
  is 0;
- process-cancel: in this process, an engine whose diffusion stage runs in a process of its own
  (``own_process: true``; tests/test_process_stage.py): a 1000-step denoise cancelled after its first
  step, until the run has ended cancelled.

The client goes away once the request is where the scenario wants it (the same states the tests wait on).
Scenarios alternate within each repeat so drifting machine load hits each alike. Prints each time, then
median and range per scenario against the target (every abort frees the engine within 1 s); exits 1 when
an abort took longer.

    .venv/bin/python bench/abort.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.events import DiffusionStep, RunFailed  # noqa: E402
from tests.conftest import _engine, tiny_deploy  # noqa: E402
from tests.servers import LiveServer, running_server  # noqa: E402
from tests.test_abort import (  # noqa: E402
    at_stage,
    drop,
    image,
    long_chat,
    metric,
    read_until_decoding,
    send_raw,
    wait_for,
)
from tests.test_process_stage import submit, t2i  # noqa: E402
from tests.test_process_stage import wait_for as next_event  # noqa: E402

TARGET_S = 1.0
POLL_S = 0.005  # how finely the time to a freed engine is measured


def in_flight(server: LiveServer) -> float:
    return metric(server, "omni_studio_requests_in_flight")


def time_to(predicate: Callable[[], bool], closed_at: float) -> float:
    wait_for(predicate, interval=POLL_S)
    return time.monotonic() - closed_at


def closed(sock) -> float:
    closed_at = time.monotonic()
    drop(sock)
    return closed_at


def decode(server: LiveServer, stream: bool) -> float:
    sock = send_raw(server.url + "/v1/chat/completions", long_chat(stream, "bench decode"))
    if stream:
        read_until_decoding(sock)
    else:
        wait_for(lambda: at_stage(server, 0))
    return time_to(lambda: in_flight(server) == 0, closed(sock))


def denoise(server: LiveServer) -> float:
    sock = send_raw(server.url + "/v1/images/generations", image("bench denoise", steps=400))
    wait_for(lambda: at_stage(server, 1))
    return time_to(lambda: in_flight(server) == 0, closed(sock))


def queued(server: LiveServer) -> float:
    holder = send_raw(server.url + "/v1/chat/completions", long_chat(True, "bench holder"))
    try:
        read_until_decoding(holder)
        waiting = send_raw(server.url + "/v1/images/generations", image("bench queued"))
        wait_for(lambda: "omni_studio_request_queue_position{" in httpx.get(server.url + "/metrics").text)
        return time_to(lambda: in_flight(server) == 1, closed(waiting))
    finally:
        drop(holder)
        wait_for(lambda: in_flight(server) == 0)


def prefill(server: LiveServer, stream: bool) -> float:
    body = {
        "messages": [{"role": "user", "content": " ".join(["cat"] * 1000)}],
        "max_tokens": 1040,
        "stream": stream,
    }
    sock = send_raw(server.url + "/v1/chat/completions", body)
    wait_for(lambda: in_flight(server) >= 1)
    return time_to(lambda: in_flight(server) == 0, closed(sock))


def process_cancel(engine) -> float:
    handle, events = submit(engine, t2i(num_inference_steps=1000))
    assert isinstance(next_event(events, DiffusionStep), DiffusionStep)
    cancelled_at = time.monotonic()
    handle.cancel()
    while not isinstance(end := next_event(events, RunFailed), RunFailed):
        pass
    assert end.cancelled, end
    return time.monotonic() - cancelled_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-abort-") as tmp:
        image_dir, chat_dir = Path(tmp) / "image", Path(tmp) / "chat"
        image_dir.mkdir()
        chat_dir.mkdir()
        (image_dir / "deploy.yaml").write_text(
            yaml.safe_dump(tiny_deploy("tiny-glm-image", stage0={"max_num_seqs": 1}))
        )
        chat_deploy = tiny_deploy("tiny-chat")
        chat_deploy["stages"][0]["default_sampling_params"]["min_tokens"] = 1000
        (chat_dir / "deploy.yaml").write_text(yaml.safe_dump(chat_deploy))
        image_args = ["serve", "--model", "tiny-glm-image", "--deploy-config", str(image_dir / "deploy.yaml")]
        chat_args = ["serve", "--model", "tiny-chat", "--deploy-config", str(chat_dir / "deploy.yaml")]
        process_deploy = tiny_deploy(
            "tiny-glm-image", stage0={"backend": "transformers"}, stage1={"own_process": True}
        )
        engine = _engine("tiny-glm-image", Path(tmp) / "engine", process_deploy)
        with (
            contextlib.closing(engine),
            running_server(image_args, image_dir) as image_server,
            running_server(chat_args, chat_dir) as chat,
        ):
            scenarios: dict[str, Callable[[], float]] = {
                "decode-json": lambda: decode(image_server, False),
                "decode-sse": lambda: decode(image_server, True),
                "denoise": lambda: denoise(image_server),
                "queued": lambda: queued(image_server),
                "prefill-json": lambda: prefill(chat, False),
                "prefill-sse": lambda: prefill(chat, True),
                "process-cancel": lambda: process_cancel(engine),
            }
            times: dict[str, list[float]] = {name: [] for name in scenarios}
            names = list(scenarios)
            for repeat in range(args.repeats):
                order = names[repeat % len(names) :] + names[: repeat % len(names)]
                for name in order:
                    seconds = scenarios[name]()
                    times[name].append(seconds)
                    print(f"repeat {repeat + 1} {name:14s} {seconds:.3f} s", flush=True)

    print(f"\nabort -> engine free (target <= {TARGET_S:.1f} s)")
    over = False
    for name, values in times.items():
        worst = max(values)
        over = over or worst > TARGET_S
        verdict = "ok" if worst <= TARGET_S else "OVER"
        print(
            f"{name:14s} median {statistics.median(values):.3f} s "
            f"(range {min(values):.3f}-{worst:.3f}) {verdict}"
        )
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
