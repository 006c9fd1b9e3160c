"""`omni-studio run`: same seed, same PNG bytes, at the requested size; I2I from that PNG; chat text."""

import subprocess
import sys

from PIL import Image

from studio.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "studio.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_run_twice_gives_identical_png_bytes_then_i2i(tmp_path):
    data = str(tmp_path / "data")
    a, b, c = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"
    first = run_cli(
        "run",
        "a red 'cat'",
        "--out",
        str(a),
        "--seed",
        "7",
        "--height",
        "96",
        "--width",
        "64",
        "--data-dir",
        data,
    )
    assert first.returncode == 0, first.stderr
    assert "stage 0 ar" in first.stderr and "stage 1 diffusion" in first.stderr  # progress bars
    assert (
        main(
            [
                "run",
                "a red 'cat'",
                "--out",
                str(b),
                "--seed",
                "7",
                "--height",
                "96",
                "--width",
                "64",
                "--data-dir",
                data,
                "--quiet",
            ]
        )
        == 0
    )
    assert a.read_bytes() == b.read_bytes()
    assert Image.open(a).size == (64, 96)
    assert (
        main(
            [
                "run",
                "make it blue",
                "--image",
                str(a),
                "--out",
                str(c),
                "--seed",
                "1",
                "--data-dir",
                data,
                "--quiet",
            ]
        )
        == 0
    )
    assert Image.open(c).size == (64, 96)
    assert c.read_bytes() != a.read_bytes()


def test_bad_inputs_are_usage_errors(tmp_path, capsys):
    data = str(tmp_path / "data")
    assert main(["run", "x", "--out", str(tmp_path / "x.png"), "--height", "50", "--data-dir", data]) == 2
    assert "height: must be a multiple of 32" in capsys.readouterr().err
    assert main(["run", "x", "--data-dir", data]) == 2
    assert "--out FILE is required" in capsys.readouterr().err
    assert (
        main(["run", "x", "--image", str(tmp_path / "missing.png"), "--out", "y.png", "--data-dir", data])
        == 2
    )
    assert "no such file" in capsys.readouterr().err
    out = str(tmp_path / "y.png")
    assert main(["run", "a long prompt", "--out", out, "--max-prompt-chars", "5", "--data-dir", data]) == 2
    assert "prompt: is 13 characters; the limit is 5 (--max-prompt-chars)" in capsys.readouterr().err
    assert main(["run", "bad \udcff byte", "--out", out, "--data-dir", data]) == 2  # argv's surrogateescape
    assert "prompt: is not valid Unicode text" in capsys.readouterr().err
    assert main(["run", "x", "--out", out, "--max-n", "0", "--data-dir", data]) == 2
    assert "--max-n must be a positive integer" in capsys.readouterr().err
    assert main(["run", "hi", "--model", "tiny-chat", "--height", "64", "--data-dir", data]) == 2
    assert "height: tiny-chat (chat) has no diffusion stage" in capsys.readouterr().err


def test_chat_model_streams_text(tmp_path):
    out = tmp_path / "reply.txt"
    assert (
        main(
            [
                "run",
                "hello",
                "--model",
                "tiny-chat",
                "--seed",
                "3",
                "--out",
                str(out),
                "--quiet",
                "--ar-backend",
                "transformers",
                "--data-dir",
                str(tmp_path / "data"),
            ]
        )
        == 0
    )
    assert len(out.read_text().split()) > 2
