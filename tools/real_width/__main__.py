"""``python -m tools.real_width OUT_DIR``: build the real-width GLM-Image into OUT_DIR (docs/real-shapes.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tools.real_width.builder import DEFAULT_LAYERS, DEFAULT_SEED, build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.real_width",
        description="Build GLM-Image at the released widths (each stack cut to --layers), random weights, "
        "in the checkpoint layout `omni-studio serve --model OUT_DIR` loads.",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="folder to create (must not exist)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weights seed (default %(default)s)")
    parser.add_argument(
        "--layers", type=int, default=DEFAULT_LAYERS, help="layers per stack (default %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.out_dir.exists():
        parser.error(f"{args.out_dir} exists; give a new folder")
    started = time.perf_counter()
    summary = build(args.out_dir, seed=args.seed, layers=args.layers)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary, indent=2))
    print(f"built {args.out_dir}: omni-studio serve --model {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
