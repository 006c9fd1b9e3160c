"""Fairness: other clients' latency while one client sends 1 MB prompts and walks away.

Against a real `omni-studio serve` (default: tiny-glm-shapes with its shipped deploy config, 128x128),
``--clients`` well-behaved clients send chat requests one after another; phases alternate over rounds:

- quiet: only them;
- abusive: meanwhile one more client (a process of its own) keeps sending a 1 MB chat prompt (250,000 words) on a raw socket
  and closes it without reading the answer (the studio refuses it: `--max-prompt-chars`, a 400 naming
  `messages`; then, past a sustained rate of refusals, 429s: studio/api/refusals.py).

Prints the well-behaved clients' p50/p95 per phase, the ratio abusive/quiet per round and its median, and
how many 1 MB requests were sent. Target: other clients' latency within 2x of normal.

``--scenario greedy``: one client keeps 16 requests in flight while another sends one request at a time;
phases alternate over rounds (the small client alone, then beside the greedy one). Prints the small
client's p50 beside the greedy client vs alone (target <= 1.5x: waiting requests are served round-robin
across clients) and whether every greedy request succeeded (no 429: the queue is not full).

    .venv/bin/python bench/fairness.py [--scenario flood|greedy] [--rounds 3] [--clients 4] [--per-client 3]
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import running_server  # noqa: E402

PROMPT = "a red circle on a blue background, top left"


def huge_body() -> bytes:
    """A 1 MB chat request: one message of 250,000 words."""
    return json.dumps({"messages": [{"role": "user", "content": "cat " * 250_000}]}).encode()


def send_and_walk_away(host: str, port: int, data: bytes) -> None:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(head)
            sock.sendall(data)
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # the server answered 429 without reading the body and closed: the next one
        pass


def well_behaved(url: str, client: int, per_client: int) -> list[float]:
    times = []
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer client-{client}"}) as http:
        for i in range(per_client):
            body = {"messages": [{"role": "user", "content": PROMPT}], "seed": client * 100 + i}
            started = time.perf_counter()
            response = http.post(url + "/v1/chat/completions", json=body)
            response.raise_for_status()
            times.append(time.perf_counter() - started)
    return times


def abuse(url: str) -> None:
    """The abusive client (``--abuse URL``, a process of its own, as another machine's client would be:
    it shares no interpreter lock with the well-behaved clients): sends 1 MB prompts back to back until
    terminated, then prints how many it sent."""
    data = huge_body()
    parsed = httpx.URL(url)
    sent = 0

    def report(*_: object) -> None:
        print(sent, flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, report)
    while True:
        send_and_walk_away(parsed.host, parsed.port or 80, data)
        sent += 1


def sink() -> None:
    """``--sink``: the cheapest possible server (accept, close; a process of its own) on a free port,
    printed first. The control phase floods it instead of the studio: the same abuser load on the
    machine, none of it on the studio, so the control's ratio is what the abuser costs the machine's
    shared CPU by itself, whatever any server does."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(f"http://127.0.0.1:{server.getsockname()[1]}", flush=True)
        while True:
            conn, _ = server.accept()
            conn.close()


def phase(url: str, clients: int, per_client: int, target: str | None) -> tuple[list[float], int]:
    """The well-behaved clients' latencies, with an abuser flooding ``target`` meanwhile (None: none)."""
    abuser = (
        subprocess.Popen([sys.executable, __file__, "--abuse", target], stdout=subprocess.PIPE, text=True)
        if target
        else None
    )
    if abuser:
        time.sleep(0.5)
    try:
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(lambda c: well_behaved(url, c, per_client), range(clients)))
    finally:
        sent = 0
        if abuser:
            abuser.terminate()
            out, _ = abuser.communicate(timeout=30)
            sent = int(out.strip() or 0)
    return [t for times in results for t in times], sent


def greedy_phase(url: str, per_client: int, greedy: bool) -> tuple[list[float], list[int]]:
    """The small client's latencies (``per_client`` requests, one at a time), with or without a greedy
    client keeping 16 in flight meanwhile; the greedy client's statuses."""
    stop = threading.Event()
    statuses: list[int] = []

    def keep_one_in_flight(slot: int) -> None:
        with httpx.Client(timeout=300, headers={"Authorization": "Bearer greedy"}) as http:
            i = 0
            while not stop.is_set():
                body = {"messages": [{"role": "user", "content": PROMPT}], "seed": 10_000 + slot * 1000 + i}
                statuses.append(http.post(url + "/v1/chat/completions", json=body).status_code)
                i += 1

    pool = ThreadPoolExecutor(16) if greedy else None
    if pool is not None:
        for slot in range(16):
            pool.submit(keep_one_in_flight, slot)
        time.sleep(2.0)  # the 16 are queued and running
    try:
        times = well_behaved(url, 99, per_client)
    finally:
        stop.set()
        if pool is not None:
            pool.shutdown(wait=True)
    return times, statuses


def greedy_scenario(url: str, rounds: int, per_client: int) -> None:
    ratios, alone_all, beside_all, statuses = [], [], [], []
    for round_ in range(rounds):
        p50 = {}
        for greedy in (False, True) if round_ % 2 == 0 else (True, False):
            times, seen = greedy_phase(url, per_client, greedy)
            statuses += seen
            (beside_all if greedy else alone_all).extend(times)
            p50[greedy] = statistics.median(times)
            label = f"beside 16 in flight ({len(seen)} greedy requests)" if greedy else "alone"
            print(f"round {round_ + 1} {label:42}: p50 {p50[greedy]:.2f} s, p95 {pct(times, 0.95):.2f} s")
        ratios.append(p50[True] / p50[False])
    failed = sum(status != 200 for status in statuses)
    print(
        f"\nsmall client p50 alone {statistics.median(alone_all):.2f} s, beside a client with 16 in flight "
        f"{statistics.median(beside_all):.2f} s; ratio per round {min(ratios):.2f}-{max(ratios):.2f}, "
        f"median {statistics.median(ratios):.2f} (target <= 1.5); greedy requests: {len(statuses)}, "
        f"{'all 200' if not failed else f'{failed} not 200'}"
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--per-client", type=int, default=3)
    parser.add_argument("--model", default="tiny-glm-shapes")
    parser.add_argument("--scenario", choices=("flood", "greedy"), default="flood")
    parser.add_argument("--abuse", metavar="URL", help=argparse.SUPPRESS)  # the abuser's own process
    parser.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)  # the control's server
    args = parser.parse_args()
    if args.abuse:
        abuse(args.abuse)
        return
    if args.sink:
        sink()
        return
    with running_server(["serve", "--model", args.model], Path(tempfile.mkdtemp())) as server:
        well_behaved(server.url, 0, 1)  # warm-up
        if args.scenario == "greedy":
            greedy_scenario(server.url, args.rounds, args.per_client)
            return
        sink_process = subprocess.Popen(
            [sys.executable, __file__, "--sink"], stdout=subprocess.PIPE, text=True
        )
        assert sink_process.stdout is not None
        sink_url = sink_process.stdout.readline().strip()
        try:
            flood_scenario(server.url, sink_url, args.rounds, args.clients, args.per_client)
        finally:
            sink_process.kill()


def flood_scenario(url: str, sink_url: str, rounds: int, clients: int, per_client: int) -> None:
    """Per round, in rotating order: quiet, abusive (the studio flooded) and control (the sink flooded:
    the same load on the machine, none on the studio)."""
    labels = {"quiet": None, "abusive": url, "control": sink_url}
    times_all: dict[str, list[float]] = {label: [] for label in labels}
    ratios: dict[str, list[float]] = {"abusive": [], "control": []}
    huge = 0
    for round_ in range(rounds):
        order = list(labels)[round_ % 3 :] + list(labels)[: round_ % 3]
        p50 = {}
        for label in order:
            times, sent = phase(url, clients, per_client, labels[label])
            huge += sent if label == "abusive" else 0
            times_all[label].extend(times)
            p50[label] = statistics.median(times)
            text = f"{label} ({sent} x 1 MB sent)" if labels[label] else label
            print(f"round {round_ + 1} {text:32}: p50 {p50[label]:.2f} s, p95 {pct(times, 0.95):.2f} s")
        for label in ratios:
            ratios[label].append(p50[label] / p50["quiet"])

    def summary(label: str) -> str:
        values = ratios[label]
        return f"{min(values):.2f}-{max(values):.2f}, median {statistics.median(values):.2f}"

    print(
        f"\n{clients} clients, p50 quiet {statistics.median(times_all['quiet']):.2f} s, with 1 MB prompts "
        f"{statistics.median(times_all['abusive']):.2f} s; ratio per round {summary('abusive')} (target <= 2.0); "
        f"{huge} x 1 MB prompts sent\ncontrol (the same flood sent to a sink, not the studio: what the abuser's "
        f"own CPU costs this machine): ratio {summary('control')}"
    )


if __name__ == "__main__":
    main()
