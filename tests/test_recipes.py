"""PNG recipes (docs/recipes.md): every PNG the studio writes carries A1111's `parameters` chunk and our
`omni_studio` JSON chunk, with no clock in them (same request + seed -> same bytes, from the API, the UI
or the CLI alike); the Chat tab's "Load recipe", `omni-studio run --recipe` and
`omni-studio history show --png` read them back."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import struct
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from studio import __version__
from studio.cli import main
from studio.recipes.recipe import A1111, RecipeError, RecipeStamper, RunRecipe, read_recipe
from studio.recipes.runs import BY_FILE, BY_RECIPE, runs_for_file
from tests.servers import running_server

pytest.register_assert_rewrite("conftest_store")
from conftest_store import resolved_request, success_events  # noqa: E402

pytest_plugins = ["conftest_store"]

REPO_ROOT = Path(__file__).resolve().parent.parent

A1111_TEXT = (
    "masterpiece, a lighthouse at dusk\n"
    "on a cliff\n"
    "Negative prompt: lowres, blurry\n"
    "Steps: 3, Sampler: Euler a, Schedule type: Karras, CFG scale: 2.5, Seed: 99, Size: 64x96, "
    'Model hash: 6ce0161689, Model: v1-5-pruned-emaonly, Lora hashes: "detail: 7c6bad76eb54, x: 1", '
    "Version: v1.10.1"
)


# -- reading PNGs the way any tool would (Pillow and the raw chunk list, not the studio's reader) ------


def text_chunks(data: bytes) -> dict[str, str]:
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return dict(image.text)


def chunk_types(data: bytes) -> list[str]:
    """The PNG's chunk types in file order."""
    types, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        types.append(data[pos + 4 : pos + 8].decode("ascii"))
        pos += 12 + length
    return types


def omni(data: bytes) -> dict[str, Any]:
    return json.loads(text_chunks(data)["omni_studio"])


def assert_no_clock(data: bytes) -> None:
    """No tIME chunk, and nothing in the recipe that reads like a time (a key or a current timestamp)."""
    assert "tIME" not in chunk_types(data)
    now = time.time()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                assert not any(w in key.lower() for w in ("time", "date", "created", "_at")), path + key
                walk(item, f"{path}{key}.")
        elif isinstance(value, list):
            for item in value:
                walk(item, path)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            assert not now - 3e7 < value < now + 3e7, f"{path} looks like a time stamp: {value}"

    walk(omni(data), "")


def a1111_png(path: Path, text: str = A1111_TEXT) -> Path:
    """A PNG as A1111 saves it: only the `parameters` text chunk."""
    info = PngInfo()
    info.add_text("parameters", text)
    Image.new("RGB", (16, 16), (40, 80, 120)).save(path, pnginfo=info)
    return path


def plain_png(path: Path) -> Path:
    Image.new("RGB", (16, 16), (9, 9, 9)).save(path)
    return path


def resaved(data: bytes) -> bytes:
    """The same picture and text chunks written again by another tool (other compression: other bytes)."""
    info = PngInfo()
    for key, value in text_chunks(data).items():
        info.add_text(key, value)
    buffer = io.BytesIO()
    with Image.open(io.BytesIO(data)) as image:
        image.save(buffer, format="PNG", pnginfo=info, compress_level=1)
    return buffer.getvalue()


def pixels(data: bytes) -> bytes:
    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB").tobytes()


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- the format ----------------------------------------------------------------------------------


def test_a1111_text_is_what_a1111_writes_and_reads_back(tmp_path):
    recipe = read_recipe(a1111_png(tmp_path / "a1111.png").read_bytes())
    assert recipe.origin == A1111
    assert recipe.prompt == "masterpiece, a lighthouse at dusk\non a cliff"
    assert recipe.parameters == {
        "negative_prompt": "lowres, blurry",
        "num_inference_steps": 3,
        "guidance_scale": 2.5,
        "seed": 99,
        "width": 64,
        "height": 96,
    }
    assert recipe.model == "v1-5-pruned-emaonly"
    assert recipe.unmapped == (
        "Sampler: Euler a",
        "Schedule type: Karras",
        "Model hash: 6ce0161689",
        "Lora hashes: detail: 7c6bad76eb54, x: 1",  # a quoted value keeps its commas and colons
        "Version: v1.10.1",
    )
    # No settings line (fewer than three "Key: value" items): the whole text is the prompt.
    only_prompt = read_recipe(a1111_png(tmp_path / "p.png", "a cat: orange").read_bytes())
    assert (only_prompt.prompt, only_prompt.parameters) == ("a cat: orange", {})


def test_files_without_a_recipe_are_named_in_the_error(tmp_path):
    with pytest.raises(RecipeError, match=r"x\.png is not a PNG, WAV or FLAC file"):
        read_recipe(b"GIF89a...", "x.png")
    with pytest.raises(
        RecipeError, match="plain.png carries no recipe: it has no 'omni_studio' or 'parameters'"
    ):
        read_recipe(plain_png(tmp_path / "plain.png").read_bytes(), "plain.png")
    with pytest.raises(RecipeError, match="not a readable PNG"):
        read_recipe(b"\x89PNG\r\n\x1a\n" + b"\0" * 20, "cut.png")
    broken = PngInfo()
    broken.add_text("omni_studio", "{not json")
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG", pnginfo=broken)
    with pytest.raises(RecipeError, match="b.png: the 'omni_studio' chunk is not valid JSON"):
        read_recipe(buffer.getvalue(), "b.png")
    broken.add_text("parameters", "a fox\nSteps: 2, CFG scale: 1, Seed: 5")  # A1111's chunk is the fallback
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG", pnginfo=broken)
    recipe = read_recipe(buffer.getvalue(), "b.png")
    assert (recipe.origin, recipe.seed) == (A1111, 5) and "not valid JSON" in recipe.notes[0]


# -- stamping and finding runs in the store (both databases) ---------------------------------------


def test_each_output_carries_its_own_recipe_and_is_found_by_file_then_by_recipe(
    store, recorder, pipeline_config
):
    source = Image.new("RGB", (32, 32), (5, 6, 7))
    resolved = resolved_request("a red fox", seed=40, n=2, source_image=source)
    recipe = RunRecipe.of(resolved, pipeline_config, "omni-studio-test")
    tracker = RecipeStamper(
        recorder.start_run("api", resolved, pipeline_config, "fox-model", "omni-studio-test", {}), recipe
    )
    events = success_events(resolved)
    for event in events:
        tracker.observe(event)
    assert recorder.flush(30)
    run = store.get_run(tracker.run_id)
    stored = {o.index: o.path.read_bytes() for o in run.images}
    first, second = (omni(stored[i]) for i in (0, 1))
    assert (first["parameters"]["seed"], second["parameters"]["seed"]) == (40, 41)  # each output's own seed
    assert first["parameters"]["n"] == second["parameters"]["n"] == 1
    assert first["request"] == {
        "prompt": "a red fox",
        "source_image_sha256": next(o.sha256 for o in run.outputs if o.kind == "source"),
    }
    assert first["config_hash"] == run.config_hash and first["config"] == run.config
    assert first["fingerprint"] == "omni-studio-test" and first["studio_version"] == __version__
    assert text_chunks(stored[1])["parameters"] == (
        "a red fox\nSteps: 4, Seed: 41, Size: 32x32, Model: tiny-glm-image"
    )

    assert store.runs_with_output(hashlib.sha256(stored[1]).hexdigest()) == [run.id]
    source_sha = next(o.sha256 for o in run.outputs if o.kind == "source")
    assert store.runs_with_output(source_sha) == []  # a run's input is not what it made
    found = runs_for_file(store, stored[1], read_recipe(stored[1]))
    assert (found.matched_by, found.run_ids) == (BY_FILE, [run.id])
    copy = resaved(stored[1])
    assert copy != stored[1]
    found = runs_for_file(store, copy, read_recipe(copy))
    assert (found.matched_by, found.run_ids) == (BY_RECIPE, [run.id])
    elsewhere = read_recipe(copy)
    other_seed = replace(elsewhere, parameters={**elsewhere.parameters, "seed": 42})
    assert runs_for_file(store, copy, other_seed).run_ids == []  # outside the run's seeds 40, 41


# -- a running studio: API, UI and the CLI against its data dir ------------------------------------


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    with running_server(["ui", "--ar-backend", "transformers"], tmp_path_factory.mktemp("recipes")) as server:
        yield server


@pytest.fixture(scope="module")
def client(studio):
    from gradio_client import Client

    return Client(studio.url + "/", verbose=False)


CHAT = {
    "seed": 11,
    "negative_prompt": "blurry, dark",
    "num_inference_steps": 4,
    "guidance_scale": 1.5,
    "size": "64x64",
}


def api_png(studio, prompt: str, **fields: Any) -> tuple[bytes, httpx.Response]:
    body = {"messages": [{"role": "user", "content": prompt}], **CHAT, **fields}
    response = httpx.post(studio.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    url = response.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    return base64.b64decode(url.split(",", 1)[1]), response


def test_api_pngs_carry_the_recipe_and_no_clock(studio):
    prompt = f"a red circle {uuid.uuid4().hex[:6]}"
    first, response = api_png(studio, prompt)
    time.sleep(1.1)  # a second later: a clock anywhere in the file would change its bytes
    again, _ = api_png(studio, prompt)
    assert first == again
    assert_no_clock(first)
    types = chunk_types(first)
    assert types.index("tEXt") < types.index("IDAT")  # readers that stop at the pixels still see it
    assert text_chunks(first)["parameters"] == (
        f"{prompt}\nNegative prompt: blurry, dark\n"
        "Steps: 4, CFG scale: 1.5, Seed: 11, Size: 64x64, Model: tiny-glm-image"
    )
    recipe = omni(first)
    assert recipe["recipe"] == 1 and recipe["request"] == {"prompt": prompt}
    assert recipe["fingerprint"] == response.json()["system_fingerprint"]
    assert recipe["config_hash"][:8] in recipe["fingerprint"]  # the served config's hash
    assert recipe["model"] == "tiny-glm-image" and recipe["studio_version"] == __version__
    expected = {
        "seed": 11,
        "n": 1,
        "num_inference_steps": 4,
        "guidance_scale": 1.5,
        "width": 64,
        "height": 64,
    }
    assert expected.items() <= recipe["parameters"].items()
    assert recipe["parameters"]["negative_prompt"] == "blurry, dark"

    # A stream's final image part: the same file.
    body = {"messages": [{"role": "user", "content": prompt}], **CHAT, "stream": True}
    with httpx.stream("POST", studio.url + "/v1/chat/completions", json=body, timeout=120) as stream:
        lines = [line[6:] for line in stream.iter_lines() if line.startswith("data: {")]
    parts = [
        part
        for chunk in map(json.loads, lines)
        for choice in chunk["choices"]
        if isinstance(choice["delta"].get("content"), list)
        for part in choice["delta"]["content"]
        if part.get("type") == "image_url"
    ]
    [streamed] = [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]) for p in parts]
    assert streamed == first

    # The images endpoint: inline and as a stored file, the same bytes and recipe.
    images = {"model": "tiny-glm-image", "prompt": prompt, "seed": 11, "size": "64x64", "n": 2}
    inline = httpx.post(studio.url + "/v1/images/generations", json=images, timeout=120).json()
    by_url = httpx.post(
        studio.url + "/v1/images/generations", json={**images, "response_format": "url"}, timeout=120
    ).json()
    pngs = [base64.b64decode(item["b64_json"]) for item in inline["data"]]
    files = [httpx.get(item["url"], timeout=30).content for item in by_url["data"]]
    assert pngs == files
    assert [omni(p)["parameters"]["seed"] for p in pngs] == [11, 12]
    assert "Seed: 12, Size: 64x64" in text_chunks(pngs[1])["parameters"]


def test_the_ui_writes_the_same_png_as_the_api(studio, client):
    """The recipe holds what decides the picture, not where the request came from."""
    prompt = f"a blue square {uuid.uuid4().hex[:6]}"
    from_api, _ = api_png(studio, prompt)
    result = client.predict(
        {"text": prompt, "files": []},
        [],
        11,
        64,
        64,
        4,
        1.5,
        "blurry, dark",
        32,
        0.8,
        [],
        0,
        api_name="/chat",
    )
    history = result[0]
    [part] = history[-1]["content"]
    from_ui = Path(part["file"]).read_bytes()
    assert from_ui == from_api


def test_load_recipe_restores_the_chat_form(studio, client, tmp_path):
    from gradio_client import handle_file

    prompt = f"a green triangle {uuid.uuid4().hex[:6]}"
    data, _ = api_png(studio, prompt, seed=5, size="96x64", num_inference_steps=6)
    path = tmp_path / "ours.png"
    path.write_bytes(data)
    # Outputs: message, seed, width, height, steps, guidance, negative prompt, modalities, voice, reply
    # with, max tokens (the last three: spoken runs' WAV/FLAC recipes), note, drop zone.
    restored = client.predict(handle_file(str(path)), api_name="/load_recipe")
    message, seed, width, height, steps, guidance, negative, modalities, *speech, note, zone = restored
    assert all(value == {"__type__": "update"} for value in speech)  # an image's recipe: left as they are
    assert zone is None  # emptied, ready for the next PNG
    assert message == {"text": prompt, "files": []}
    assert (seed, width, height, steps, guidance, negative) == (5, 96, 64, 6, 1.5, "blurry, dark")
    assert modalities == ["image"]
    assert "Restored from an Omni Studio recipe" in note and "the running model and config" in note

    a1111 = client.predict(handle_file(str(a1111_png(tmp_path / "a1111.png"))), api_name="/load_recipe")
    assert a1111[0] == {"text": "masterpiece, a lighthouse at dusk\non a cliff", "files": []}
    assert a1111[1:7] == (99, 64, 96, 3, 2.5, "lowres, blurry")
    assert "Restored from an A1111 recipe" in a1111[11] and "Sampler: Euler a" in a1111[11]
    assert "`v1-5-pruned-emaonly` is not one of this studio's" in a1111[11]

    none = client.predict(handle_file(str(plain_png(tmp_path / "plain.png"))), api_name="/load_recipe")
    assert "plain.png carries no recipe" in none[11]
    assert all(value == {"__type__": "update"} for value in none[:11])  # the form is left as it was


def test_history_show_png_finds_the_run(studio, capsys, tmp_path):
    prompt = f"a yellow star {uuid.uuid4().hex[:6]}"
    data, response = api_png(studio, prompt, seed=21)
    run_id = response.headers["x-run-id"]
    path, copy = tmp_path / "out.png", tmp_path / "copy.png"
    path.write_bytes(data)
    copy.write_bytes(resaved(data))
    data_dir = str(studio.data_dir)
    for _ in range(50):  # the server records outputs on its writer thread
        code, out, err = cli(capsys, "history", "show", "--png", str(path), "--data-dir", data_dir)
        if code == 0:
            break
        time.sleep(0.2)
    assert code == 0, err
    assert "1 run — the file is an output of this run" in out and f"run {run_id}" in out and prompt in out
    code, out, _ = cli(capsys, "history", "show", "--png", str(copy), "--data-dir", data_dir, "--json")
    found = json.loads(out)
    assert code == 0 and found["matched_by"] == "recipe" and [r["id"] for r in found["runs"]] == [run_id]

    code, _, err = cli(
        capsys, "history", "show", "--png", str(plain_png(tmp_path / "p.png")), "--data-dir", data_dir
    )
    assert code != 0 and "no run recorded for this file" in err
    code, _, err = cli(
        capsys, "history", "show", "--png", str(a1111_png(tmp_path / "a.png")), "--data-dir", data_dir
    )
    assert code != 0 and "no run recorded for this file" in err
    (tmp_path / "notes.png").write_text("not a picture")
    code, _, err = cli(
        capsys, "history", "show", "--png", str(tmp_path / "notes.png"), "--data-dir", data_dir
    )
    assert code == 2 and "notes.png is not a PNG, WAV or FLAC file" in err
    code, _, err = cli(capsys, "history", "show", run_id, "--png", str(path), "--data-dir", data_dir)
    assert code == 2 and "not both" in err


def test_the_recipes_model_and_deploy_config_are_one_click_away(studio, client, capsys, tmp_path):
    """A PNG made on another deploy config (here by the CLI, 3 steps by default): the drop offers the
    recipe's config, the studio switches to it, and the same request in the UI gives the same pixels.
    Last in this module: it changes the running studio's config."""
    from gradio_client import handle_file

    deploy = (REPO_ROOT / "assets" / "deploy" / "tiny-glm-image.yaml").read_text()
    custom = tmp_path / "three-steps.yaml"
    custom.write_text(deploy.replace("num_inference_steps: 4", "num_inference_steps: 3"))
    made = tmp_path / "made.png"
    args = (
        "--deploy-config",
        str(custom),
        "--ar-backend",
        "transformers",
        "--data-dir",
        str(tmp_path / "cli"),
    )
    code, _, err = cli(capsys, "run", "a purple moon", "--seed", "8", "--out", str(made), "--quiet", *args)
    assert code == 0, err
    note = client.predict(handle_file(str(made)), api_name="/load_recipe")[11]
    assert "Use the button below to switch" in note
    recipe = read_recipe(made.read_bytes())
    switched, model = client.predict(api_name="/use_recipe_pipeline")  # the note and the model picker
    assert (
        f"with the recipe's deploy config `{recipe.config_hash[:8]}`" in switched
        and model["value"] == "tiny-glm-image"
    )
    result = client.predict(
        {"text": "a purple moon", "files": []}, [], 8, 64, 64, 3, 1.5, "", 32, 0.8, [], 0, api_name="/chat"
    )
    [part] = result[0][-1]["content"]
    from_ui = Path(part["file"]).read_bytes()
    assert pixels(from_ui) == pixels(made.read_bytes())
    assert omni(from_ui)["config_hash"] == recipe.config_hash


# -- the command line --------------------------------------------------------------------------------


def test_run_recipe_reproduces_the_bytes_and_flags_override_it(capsys, tmp_path):
    data = str(tmp_path / "data")
    a, i2i, again, fewer = (tmp_path / f"{name}.png" for name in ("a", "i2i", "again", "fewer"))
    base = ("--ar-backend", "transformers", "--data-dir", data, "--quiet")
    code, _, err = cli(
        capsys, "run", "a red 'cat'", "--seed", "7", "--out", str(a), "--negative-prompt", "dark", *base
    )
    assert code == 0, err
    assert omni(a.read_bytes())["fingerprint"] is None  # nothing is served from the terminal
    code, _, err = cli(
        capsys, "run", "make it blue", "--image", str(a), "--seed", "3", "--out", str(i2i), *base
    )
    assert code == 0, err
    assert omni(i2i.read_bytes())["request"]["source_image_sha256"]

    # Image-to-image: the source image comes back from the run store by its sha256.
    code, out, err = cli(capsys, "run", "--recipe", str(i2i), "--out", str(again), *base)
    assert code == 0, err
    assert again.read_bytes() == i2i.read_bytes() and "identical bytes to the recipe's PNG" in err
    code, out, _ = cli(capsys, "history", "show", "--png", str(again), "--data-dir", data)
    assert code == 0 and "2 runs — the file is an output of each of these runs" in out

    code, _, err = cli(capsys, "run", "--recipe", str(a), "--steps", "2", "--out", str(fewer), *base)
    assert code == 0, err
    assert "different pixels from the recipe's PNG" in err
    changed = omni(fewer.read_bytes())["parameters"]
    assert (changed["num_inference_steps"], changed["seed"], changed["negative_prompt"]) == (2, 7, "dark")


def test_run_recipe_from_an_a1111_png_uses_what_maps(capsys, tmp_path):
    out = tmp_path / "out.png"
    source = a1111_png(tmp_path / "a1111.png")
    code, _, err = cli(
        capsys,
        "run",
        "--recipe",
        str(source),
        "--out",
        str(out),
        "--ar-backend",
        "transformers",
        "--quiet",
        "--data-dir",
        str(tmp_path / "data"),
    )
    assert code == 0, err
    assert "Sampler: Euler a" in err and "'v1-5-pruned-emaonly' is not one of this studio's" in err
    recipe = omni(out.read_bytes())
    assert recipe["request"]["prompt"] == "masterpiece, a lighthouse at dusk\non a cliff"
    assert {k: recipe["parameters"][k] for k in ("seed", "num_inference_steps", "guidance_scale")} == {
        "seed": 99,
        "num_inference_steps": 3,
        "guidance_scale": 2.5,
    }
    assert Image.open(out).size == (64, 96) and recipe["parameters"]["negative_prompt"] == "lowres, blurry"


def test_run_recipe_refuses_files_without_one(capsys, tmp_path):
    data = ("--data-dir", str(tmp_path / "data"))
    out = ("--out", str(tmp_path / "x.png"))
    (tmp_path / "notes.png").write_text("hello")
    for path, message in (
        (tmp_path / "missing.png", "--recipe: no such file"),
        (tmp_path / "notes.png", "notes.png is not a PNG, WAV or FLAC file"),
        (plain_png(tmp_path / "plain.png"), "plain.png carries no recipe"),
    ):
        code, _, err = cli(capsys, "run", "--recipe", str(path), *out, *data)
        assert code == 2 and message in err, err
    code, _, err = cli(capsys, "run", *out, *data)
    assert code == 2 and "give a PROMPT, or --recipe FILE to re-run" in err
    code, _, err = cli(capsys, "history", "show", *data)
    assert code == 2 and "give a run ID (or --png FILE.png)" in err
