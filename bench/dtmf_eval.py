"""DTMF accuracy of `tiny-qwen-omni-dtmf` through the real engine, chat and speech, streamed and whole.

A Goertzel DTMF decoder (tools/dtmf/decode.py) first proves itself on controls: synthetic dials with
white noise at 10 dB SNR decode right; white noise and single tones (a row or a column frequency
alone) decode to nothing. Then N random key sequences (1-10 keys; a fifth of all sequences is held out
of training, tools/dtmf/world.py) run through ``build_engine(...).run`` both ways:

- chat: ``dial K`` asking for text and audio; its text must be ``K`` and its audio must decode to ``K``;
- speech: what ``/v1/audio/speech`` sends for ``input: K`` (the reply teacher-forced to ``K``);

each with code2wav streaming (the deploy's ``chunk_size``) and rendering the whole utterance at once.
Prints exact-sequence and per-key accuracy per split.

    .venv/bin/python bench/dtmf_eval.py [--n 500] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.dtmf.decode import COLUMNS, ROWS, decode, synthetic  # noqa: E402
from tools.dtmf.world import held_out, random_keys  # noqa: E402

MODEL = "tiny-qwen-omni-dtmf"


def controls() -> dict[str, float]:
    """The decoder's own checks: the share of positives decoded right and of negatives decoded empty."""
    rng = np.random.default_rng(1)
    positives = [" ".join(random_keys(rng, held=None)) for _ in range(50)]
    right = sum(decode(synthetic(k, snr_db=10.0, seed=i)) == k for i, k in enumerate(positives))
    t = np.arange(24_000) / 24_000
    negatives = [rng.normal(0, 0.3, 24_000) for _ in range(10)]
    negatives += [0.5 * np.sin(2 * np.pi * f * t) for f in ROWS + COLUMNS]
    empty = sum(decode(x) == "" for x in negatives)
    return {"positives_right": right / len(positives), "negatives_empty": empty / len(negatives)}


def key_accuracy(truth: str, got: str) -> float:
    """Keys of ``truth`` matched in order by ``got`` (longest matching blocks), as a share of ``truth``'s."""
    a, b = truth.split(), got.split()
    matched = sum(m.size for m in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks())
    return matched / len(a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="key sequences (each runs 4 times)")
    parser.add_argument("--seed", type=int, default=0, help="picks the sequences; request i uses seed + i")
    parser.add_argument("--model", default=MODEL, help="built-in name or checkpoint folder")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()

    import torch
    import yaml

    from engine import GenerationParams, GenerationRequest, build_engine
    from engine.modality import OutputModality
    from engine.paths import ASSETS_DIR

    if args.threads:
        torch.set_num_threads(args.threads)
    checks = controls()
    print(
        f"decoder controls: noisy dials right {checks['positives_right']:.0%}, "
        f"noise and single tones empty {checks['negatives_empty']:.0%}"
    )
    deploy = yaml.safe_load((ASSETS_DIR / "deploy" / f"{MODEL}.yaml").read_text())
    whole = json.loads(json.dumps(deploy))
    for stage in whole["stages"]:
        stage.pop("chunk_size", None)
    engines = {"streamed": build_engine(args.model, deploy), "whole": build_engine(args.model, whole)}
    rng = np.random.default_rng(args.seed)
    sequences = [random_keys(rng, held=None) for _ in range(args.n)]
    rows: list[dict[str, object]] = []
    started = time.time()
    try:
        for i, keys in enumerate(sequences):
            text = " ".join(keys)
            requests = {
                "chat": GenerationRequest(
                    f"dial {text}",
                    GenerationParams(seed=args.seed + i),
                    modalities=(OutputModality.TEXT, OutputModality.AUDIO),
                ),
                "speech": GenerationRequest(
                    text,
                    GenerationParams(seed=args.seed + i),
                    modalities=(OutputModality.AUDIO,),
                    speak_text=text,
                ),
            }
            for way, request in requests.items():
                for render, engine in engines.items():
                    output = engine.run(request).outputs[0]
                    heard = decode(np.asarray(output.audio), output.sample_rate)
                    rows.append(
                        {
                            "keys": text,
                            "held_out": held_out(keys),
                            "way": way,
                            "render": render,
                            "text": output.text if way == "chat" else None,
                            "heard": heard,
                        }
                    )
            if (i + 1) % 25 == 0:
                print(
                    f"  {i + 1}/{args.n} sequences, {(time.time() - started) / (i + 1):.2f} s each",
                    flush=True,
                )
    finally:
        for engine in engines.values():
            engine.close()
    table = summarise(rows)
    print_table(table, len(sequences), time.time() - started)
    if args.json:
        args.json.write_text(json.dumps({"controls": checks, "table": table, "rows": rows}, indent=1))
    return 0


def summarise(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    table: list[dict[str, object]] = []
    for split in ("held-out", "training"):
        for way in ("chat", "speech"):
            for render in ("streamed", "whole"):
                picked = [
                    r
                    for r in rows
                    if r["way"] == way and r["render"] == render and r["held_out"] == (split == "held-out")
                ]
                if not picked:
                    continue
                exact = sum(r["heard"] == r["keys"] for r in picked) / len(picked)
                keys = sum(key_accuracy(str(r["keys"]), str(r["heard"])) for r in picked) / len(picked)
                texts = [r for r in picked if r["text"] is not None]
                text = sum(r["text"] == r["keys"] for r in texts) / len(texts) if texts else None
                table.append(
                    {
                        "split": split,
                        "way": way,
                        "render": render,
                        "n": len(picked),
                        "exact": exact,
                        "per_key": keys,
                        "text": text,
                    }
                )
    return table


def print_table(table: list[dict[str, object]], n: int, seconds: float) -> None:
    print(f"\n{n} sequences x 2 ways x 2 renders in {seconds / 60:.1f} min\n")
    print("| split | way | render | n | text right | audio exact | audio per key |")
    print("|---|---|---|---|---|---|---|")
    for row in table:
        text = "-" if row["text"] is None else f"{row['text']:.1%}"
        print(
            f"| {row['split']} | {row['way']} | {row['render']} | {row['n']} | {text} | "
            f"{row['exact']:.1%} | {row['per_key']:.1%} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
