"""Render a grid of prompts and the pictures `tiny-glm-shapes` draws for them (docs/shapes-grid.png).

Each picture comes from the real engine (``build_engine("tiny-glm-shapes")``), one request per prompt, with
the prompt written under it; held-out combinations (never seen in training) are marked.

    .venv/bin/python scripts/shapes_grid.py [--out docs/shapes-grid.png] [--columns 4] [--model NAME_OR_DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "a red circle on a blue background, top left",
    "a yellow triangle on a purple background, bottom right",
    "a cyan square on a red background, center",
    "a green circle on a yellow background, top right",
    "a purple triangle on a cyan background, bottom left",
    "a blue square on a green background, top right",
    "a red triangle on a yellow background, center",
    "a yellow circle on a cyan background, bottom left",
    "a green square on a purple background, bottom right",
    "a cyan circle on a blue background, center",
    "a purple square on a yellow background, top left",
    "a blue triangle on a red background, top right",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "shapes-grid.png")
    parser.add_argument("--columns", type=int, default=4)
    parser.add_argument("--model", default="tiny-glm-shapes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    from engine import GenerationParams, GenerationRequest, build_engine
    from engine.environment import quiet_libraries
    from tools.shapes.classify import classify
    from tools.shapes.evaluate import DEPLOY_PATH
    from tools.shapes.world import parse_caption

    quiet_libraries()
    engine = build_engine(
        args.model, str(DEPLOY_PATH), data_dir=Path(tempfile.mkdtemp(prefix="shapes-grid-"))
    )
    tile, caption_h, pad = 128, 44, 8
    rows = (len(PROMPTS) + args.columns - 1) // args.columns
    sheet = Image.new(
        "RGB", (args.columns * (tile + pad) + pad, rows * (tile + caption_h + pad) + pad), "white"
    )
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    try:
        for i, prompt in enumerate(PROMPTS):
            image = engine.run(GenerationRequest(prompt, GenerationParams(seed=args.seed + i))).images[0]
            scene = parse_caption(prompt)
            ok = all(classify(np.asarray(image.convert("RGB"))).correct(scene).values())
            x = pad + (i % args.columns) * (tile + pad)
            y = pad + (i // args.columns) * (tile + caption_h + pad)
            sheet.paste(image.convert("RGB"), (x, y))
            label = prompt.removeprefix("a ") + (" [held-out]" if scene.held_out else "")
            draw.multiline_text(
                (x, y + tile + 2), "\n".join(textwrap.wrap(label, 22)), fill="black", font=font
            )
            if not ok:
                draw.rectangle((x, y, x + tile - 1, y + tile - 1), outline="black", width=2)
            print(f"{'ok   ' if ok else 'WRONG'} {prompt}")
    finally:
        engine.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(args.out, optimize=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
