"""Speech: TTFP, latency, audio seconds and RTF through HTTP vs transformers' one-shot generate.

A real `omni-studio serve --model tiny-qwen-omni` (its preset: streaming code2wav) is asked, at concurrency
1, for streamed speech (`POST /v1/audio/speech`, `stream_format: "audio"`, pcm) and streamed chat audio
(`modalities: ["text", "audio"]`, `delta.audio` pcm16); beside each request, in this process,
`Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)` runs on the same folder, prompt,
voice, seed and sampling (speech: the thinker teacher-forced with `input`, as the server does). Rounds
alternate the order of the four; ratios engine / one-shot are paired per round and seed. Then
concurrency 1, 4, 8 and 16 of streamed speech (levels alternating over rounds; each client its own API
key): audio seconds made per wall second (also against the one-shot's, one request at a time), TTFP
p50/p95, RTF, the share of streams whose worst underrun is at most 100 ms, and whether every stream's
bytes equal the same request's alone. Before the rounds, two requests at once warm code2wav's second
process (where it runs: docs/speech.md, "The second process"). docs/speech.md, "Benchmark"
and "Many listeners".

    .venv/bin/python bench/speech.py [--rounds 3] [--seeds 3] [--levels 1 4 8 16] [--per-client 1]

TTFP: request sent to the first audio bytes received (one-shot: the whole call, it returns at the end).
RTF: the request's time / the audio's seconds. Audio lengths are checked against the one-shot's (the
same codes make the same length; the streamed samples differ from the whole render by float rounding).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels import kernel_report  # noqa: E402
from tests.servers import running_server  # noqa: E402

MODEL = "tiny-qwen-omni"
VOICE = "Chelsie"
SPEECH_INPUT = "hello there, how are you today"
CHAT_PROMPT = "say hello"
RATE = 24_000  # code2wav's rate (pcm: int16 mono)
VOCODER_START_S = 8.0  # code2wav's second process's start-up (a few seconds), after the warm-up's two streams


def machine() -> str:
    report = kernel_report()
    return f"{report['cpu']}; {report['cpu_flags']}; ATen {report['aten_capability']}; MKL {report['mkl']}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- through HTTP -------------------------------------------------------------------------------------


def http_speech(client: httpx.Client, seed: int, token: str = "speech-bench") -> dict[str, Any]:
    """A streamed `/v1/audio/speech` (pcm): TTFP, latency, audio seconds."""
    body = {
        "model": MODEL,
        "input": SPEECH_INPUT,
        "voice": VOICE,
        "seed": seed,
        "response_format": "pcm",
        "stream_format": "audio",
    }
    started = time.perf_counter()
    first, size = 0.0, 0
    pieces: list[tuple[float, int]] = []  # (arrival, bytes)
    digest = hashlib.sha256()
    with client.stream(
        "POST", "/v1/audio/speech", json=body, headers={"authorization": f"Bearer {token}"}
    ) as response:
        response.raise_for_status()
        for piece in response.iter_bytes():
            if not piece:
                continue
            now = time.perf_counter() - started
            first = first or now
            pieces.append((now, len(piece)))
            digest.update(piece)
            size += len(piece)
    return {
        "ttfp": first,
        "latency": time.perf_counter() - started,
        "audio": size / 2 / RATE,
        "underrun": worst_underrun(pieces),
        "sha256": digest.hexdigest(),
    }


def worst_underrun(pieces: list[tuple[float, int]]) -> float:
    """The longest silence a listener hears mid-stream (seconds): playback starts with the first piece;
    a piece that arrives after everything before it has played leaves a gap, and playback resumes with it
    (so a late piece delays everything after it, as a player's would)."""
    worst, playing_until = 0.0, None
    for arrival, size in pieces:
        seconds = size / 2 / RATE
        if playing_until is None or arrival > playing_until:
            if playing_until is not None:
                worst = max(worst, arrival - playing_until)
            playing_until = arrival + seconds
        else:
            playing_until += seconds
    return worst


def http_chat(client: httpx.Client, seed: int) -> dict[str, Any]:
    """A streamed chat completion with audio (pcm16 `delta.audio`): TTFP, latency, audio seconds, text."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": CHAT_PROMPT}],
        "modalities": ["text", "audio"],
        "audio": {"voice": VOICE, "format": "pcm16"},
        "stream": True,
        "seed": seed,
    }
    started = time.perf_counter()
    first, size, text = 0.0, 0, []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                audio = choice.get("delta", {}).get("audio") or {}
                if audio.get("data"):
                    if not first:
                        first = time.perf_counter() - started
                    size += len(base64.b64decode(audio["data"]))
                if audio.get("transcript"):
                    text.append(audio["transcript"])
    return {
        "ttfp": first,
        "latency": time.perf_counter() - started,
        "audio": size / 2 / RATE,
        "text": "".join(text),
    }


# -- one-shot transformers ----------------------------------------------------------------------------


class OneShot:
    """transformers' own model on the served folder, with the preset's sampling (as tests/test_qwen_omni.py)."""

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        import torch
        from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

        from engine.paths import DEPLOY_PRESETS_DIR

        self.torch = torch
        # One intra-op thread, as the engine's stages run a small model (docs/batching.md): the same
        # kernels; and on a busy machine spinning OpenMP threads cost the one-shot call tens of seconds.
        torch.set_num_threads(1)
        self.device = device
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval().to(device)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        stages = {
            s["stage_id"]: s
            for s in yaml.safe_load((DEPLOY_PRESETS_DIR / f"{MODEL}.yaml").read_text())["stages"]
        }
        self.thinker = stages[0]["default_sampling_params"]
        self.talker = stages[1]["default_sampling_params"]
        self.steps = int(stages[2]["default_sampling_params"]["num_inference_steps"])

    def run(self, seed: int, speech: bool) -> dict[str, Any]:
        from transformers import LogitsProcessorList

        from engine.pipelines.qwen_omni.thinker import END_OF_REPLY, ForcedReply, chat_messages
        from engine.request import ChatTurn

        prompt = SPEECH_INPUT if speech else CHAT_PROMPT
        inputs = self.tokenizer.apply_chat_template(
            chat_messages([ChatTurn("user", prompt)], speak=True),
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
        ).to(self.device)
        thinker: dict[str, Any] = {
            "thinker_do_sample": True,
            "thinker_temperature": float(self.thinker["temperature"]),
            "thinker_top_k": int(self.thinker["top_k"]),
            "thinker_max_new_tokens": int(self.thinker["max_tokens"]),
        }
        if speech:  # the server's speak_text: the reply teacher-forced with `input` and the end of the turn
            ids = self.tokenizer(SPEECH_INPUT, add_special_tokens=False, split_special_tokens=True)[
                "input_ids"
            ]
            forced = self.torch.tensor(
                [*ids, self.tokenizer.convert_tokens_to_ids(END_OF_REPLY)], device=self.device
            )
            prompt_length = int(inputs["input_ids"].shape[1])
            thinker["thinker_logits_processor"] = LogitsProcessorList([ForcedReply(forced, prompt_length)])
            thinker["thinker_max_new_tokens"] = int(forced.numel())
        talker = self.model.config.talker_config
        started = time.perf_counter()
        with self.torch.inference_mode():
            self.torch.manual_seed(seed)
            sequences, wave = self.model.generate(
                **inputs,
                speaker=VOICE,
                return_audio=True,
                talker_max_new_tokens=int(self.talker["max_tokens"]),
                talker_temperature=float(self.talker["temperature"]),
                talker_top_k=int(self.talker["top_k"]),
                talker_top_p=float(self.talker["top_p"]),
                talker_repetition_penalty=float(self.talker["repetition_penalty"]),
                talker_eos_token_id=[talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id],
                token2wav_num_steps=self.steps,
                **thinker,
            )
        seconds = time.perf_counter() - started
        text = self.tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        return {"ttfp": seconds, "latency": seconds, "audio": int(wave.numel()) / RATE, "text": text}


# -- the report ---------------------------------------------------------------------------------------


def row(name: str, runs: list[dict[str, Any]]) -> str:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    rtf = statistics.median(r["latency"] / r["audio"] for r in runs if r["audio"])
    return f"{name:<28} {med('ttfp'):>8.2f} {med('latency'):>9.2f} {med('audio'):>8.2f} {rtf:>6.2f}"


def paired(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], key: str) -> str:
    ratios = sorted(a[key] / b[key] for a, b in zip(ours, theirs, strict=True))
    return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the order alternates within each")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N per round at concurrency 1")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--per-client", type=int, default=1, help="speech requests per client per level")
    parser.add_argument("--serve-args", nargs="*", default=[], help="extra `omni-studio serve` flags")
    parser.add_argument(
        "--devices",
        help="`omni-studio serve --devices` (e.g. 0: every stage on GPU 0; the one-shot there too)",
    )
    args = parser.parse_args()

    from engine.environment import quiet_libraries
    from engine.paths import model_cache_dir
    from engine.tiny import ensure_builtin_model

    quiet_libraries()
    data_dir = Path(tempfile.mkdtemp(prefix="omni-speech-bench-"))
    cache = model_cache_dir(data_dir)
    os.environ["OMNI_STUDIO_MODEL_CACHE"] = str(cache)  # the server builds into (and reads) the same folder
    folder = ensure_builtin_model(MODEL, cache)
    one_shot = OneShot(
        folder, f"cuda:{args.devices.split(',')[0]}" if args.devices and args.devices[0].isdigit() else "cpu"
    )
    if args.devices:
        args.serve_args = [*args.serve_args, "--devices", args.devices]
    kinds = ("speech", "chat")
    engine_runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    direct_runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    same_length = same_text = total = 0
    levels: dict[int, dict[str, list[Any]]] = {
        n: {"rate": [], "ttfp": [], "rtf": [], "underrun": [], "same": []} for n in args.levels
    }
    seeds = range(100, 100 + max(args.levels) * args.per_client)
    with running_server(["serve", "--model", MODEL, *args.serve_args], data_dir) as server:
        client = httpx.Client(base_url=server.url, timeout=600)
        http_speech(client, 0), http_chat(client, 0), one_shot.run(0, True)  # warm-up
        # Two streams at once start code2wav's second process where the machine has a second core
        # (docs/speech.md, "The second process"): every round then sees the server as it
        # serves once it has had two listeners, not its first seconds.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda _: http_speech(client, 0), range(2)))
        time.sleep(VOCODER_START_S)
        for round_index in range(args.rounds):
            for seed in range(1, args.seeds + 1):
                steps = [
                    ("engine", "speech"),
                    ("engine", "chat"),
                    ("one-shot", "speech"),
                    ("one-shot", "chat"),
                ]
                results: dict[tuple[str, str], dict[str, Any]] = {}
                for side, kind in steps if (round_index + seed) % 2 == 0 else list(reversed(steps)):
                    if side == "engine":
                        results[side, kind] = (
                            http_speech(client, seed) if kind == "speech" else http_chat(client, seed)
                        )
                    else:
                        results[side, kind] = one_shot.run(seed, kind == "speech")
                for kind in kinds:
                    ours, theirs = results["engine", kind], results["one-shot", kind]
                    engine_runs[kind].append(ours)
                    direct_runs[kind].append(theirs)
                    total += 1
                    same_length += abs(ours["audio"] - theirs["audio"]) < 0.5 / RATE
                    same_text += kind == "speech" or ours["text"] == theirs["text"]
            print(f"  round {round_index + 1}: concurrency 1 done", flush=True)
        alone = {seed: http_speech(client, seed)["sha256"] for seed in seeds}  # each stream's alone bytes
        for round_index in range(args.rounds):
            order = args.levels if round_index % 2 == 0 else list(reversed(args.levels))
            for level in order:
                count = level * args.per_client

                def one(i: int, level: int = level) -> dict[str, Any]:
                    return http_speech(client, seeds[i], token=f"speech-bench-{i % level}")

                started = time.perf_counter()
                with ThreadPoolExecutor(level) as pool:
                    results_at = list(pool.map(one, range(count)))
                wall = time.perf_counter() - started
                levels[level]["rate"].append(sum(r["audio"] for r in results_at) / wall)
                levels[level]["ttfp"].extend(r["ttfp"] for r in results_at)
                levels[level]["rtf"].extend(r["latency"] / r["audio"] for r in results_at if r["audio"])
                levels[level]["underrun"].extend(r["underrun"] for r in results_at)
                levels[level]["same"].extend(r["sha256"] == alone[seeds[i]] for i, r in enumerate(results_at))
                print(
                    f"  round {round_index + 1} concurrency {level}: {count} requests in {wall:.1f} s",
                    flush=True,
                )

    print(f"\n{MODEL}, {args.rounds} rounds x {args.seeds} seeds, voice {VOICE}, one-shot on 1 thread")
    print(f"machine: {machine()}")
    print(f"speech input {SPEECH_INPUT!r}; chat prompt {CHAT_PROMPT!r}")
    print(f"\n{'concurrency 1 (medians)':<28} {'TTFP s':>8} {'latency s':>9} {'audio s':>8} {'RTF':>6}")
    for kind in kinds:
        print(row("engine /v1/audio/speech" if kind == "speech" else "engine chat audio", engine_runs[kind]))
        print(row(f"one-shot generate ({kind})", direct_runs[kind]))
    print(f"\n{'engine / one-shot, paired':<28} {'TTFP (range)':>18} {'latency (range)':>18}")
    for kind in kinds:
        print(
            f"{kind:<28} {paired(engine_runs[kind], direct_runs[kind], 'ttfp'):>18} "
            f"{paired(engine_runs[kind], direct_runs[kind], 'latency'):>18}"
        )
    print(f"same audio length as the one-shot: {same_length}/{total}; same chat text: {same_text}/{total}")
    one_shot_rate = sum(r["audio"] for r in direct_runs["speech"]) / sum(
        r["latency"] for r in direct_runs["speech"]
    )
    base = statistics.median(levels[args.levels[0]]["rate"])
    base_ttfp = statistics.median(levels[args.levels[0]]["ttfp"])
    print(f"\none-shot generate, one request at a time: {one_shot_rate:.2f} audio s / wall s")
    print(
        f"{'clients':>8} {'audio s/wall s (range)':>24} {'x vs ' + str(args.levels[0]):>8} {'x one-shot':>10} "
        f"{'TTFP p50':>9} {'p95':>6} {'x vs ' + str(args.levels[0]):>8} {'RTF p50':>8} "
        f"{'underrun<=100ms':>15} {'= alone':>8}"
    )
    for level in args.levels:
        at = levels[level]
        rate = statistics.median(at["rate"])
        ttfp = statistics.median(at["ttfp"])
        spread = f"{rate:.2f} ({min(at['rate']):.2f}-{max(at['rate']):.2f})"
        smooth = sum(u <= 0.1 for u in at["underrun"]) / len(at["underrun"])
        print(
            f"{level:>8} {spread:>24} {rate / base:>8.2f} {rate / one_shot_rate:>10.2f} {ttfp:>9.2f} "
            f"{percentile(at['ttfp'], 0.95):>6.2f} {ttfp / base_ttfp:>8.2f} {statistics.median(at['rtf']):>8.2f} "
            f"{smooth:>14.0%} {sum(at['same']):>4}/{len(at['same'])}"
        )
    print("worst underrun per stream: the longest mid-stream silence a listener hears (docs/speech.md)")


if __name__ == "__main__":
    main()
