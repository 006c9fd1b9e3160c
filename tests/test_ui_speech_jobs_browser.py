"""Speech in the Batch, Queue, System and Pipeline tabs, in a real browser (headless Debian Chromium,
Playwright) against `omni-studio ui --model tiny-qwen-omni` on 127.0.0.1 (docs/jobs.md, docs/speech.md):
a job of 1 prompt x 2 seeds x 2 voices plays as a table of four players of the run store's WAVs, the Queue
lists a spoken request with its voice, the System tab names the three stages with their backends and batch
sizes, and the Pipeline tab edits code2wav's chunk_size and steps, refuses a bad chunk_size naming it, and
applies a good one (the next spoken run is made with it).

With ``OMNI_STUDIO_SCREENSHOT_DIR`` set, the job's table of players is saved there as ``batch-speech.png``
and the Pipeline tab as ``pipeline-speech.png``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from studio.store import open_store
from tests.browser import open_tab
from tests.servers import running_server
from tests.test_ui_speech_browser import WAIT_S, recorded, wait_js, wait_text

pytestmark = pytest.mark.browser

VOICES = ["Chelsie", "Ethan"]


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    with running_server(
        ["ui", "--model", "tiny-qwen-omni"], tmp_path_factory.mktemp("studio-speech-jobs")
    ) as server:
        yield server


def screenshot(page, name: str) -> None:
    target = os.environ.get("OMNI_STUDIO_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(target) / name), full_page=True)


def fill(page, elem_id: str, value: str) -> None:
    page.fill(f"#{elem_id} textarea, #{elem_id} input", value)


def test_a_speech_job_plays_as_a_table_of_players(page, studio):
    prompt = f"say hello {uuid.uuid4().hex[:8]}"
    name = f"voices {uuid.uuid4().hex[:6]}"
    open_tab(page, "Batch")
    # A studio that speaks starts the form on its voices across (code2wav's steps kept few).
    assert page.locator("#omni-batch-x-param input").input_value() == "voice"
    assert page.locator("#omni-batch-x-values textarea, #omni-batch-x-values input").input_value() == (
        "Chelsie, Ethan"
    )
    fill(page, "omni-batch-prompts", prompt)
    fill(page, "omni-batch-seeds", "1, 2")
    fill(page, "omni-batch-steps", "4")
    fill(page, "omni-batch-name", name)
    page.click("#omni-batch-submit")
    wait_text(page, "#omni-batch-status", "Submitted job")
    job_id = page.inner_text("#omni-batch-status").split("job ", 1)[1].split()[0]

    # Four players, each with a source the browser reads a length from.
    players = page.locator("#omni-batch-players audio")
    wait_js(page, "() => document.querySelectorAll('#omni-batch-players audio').length === 4")
    wait_js(
        page,
        "() => [...document.querySelectorAll('#omni-batch-players audio')]"
        ".every(a => a.readyState >= 1 && a.duration > 0)",
    )
    wait_text(page, "#omni-batch-detail", "4/4 cells done: 4 succeeded")
    assert "audio · voices Chelsie, Ethan" in page.inner_text("#omni-batch-detail")
    cells = page.evaluate(
        "() => [...document.querySelectorAll('#omni-batch-players td.omni-player')].map(td => ({"
        " index: Number(td.dataset.index), src: td.querySelector('audio').src,"
        " duration: td.querySelector('audio').duration, label: td.innerText }))"
    )
    assert sorted(cell["index"] for cell in cells) == [0, 1, 2, 3]
    listed = httpx.get(f"{studio.url}/v1/studio/jobs", timeout=WAIT_S).json()["data"]
    (full_id,) = [j["id"] for j in listed if j["id"].startswith(job_id) and j["name"] == name]
    job = httpx.get(f"{studio.url}/v1/studio/jobs/{full_id}", timeout=WAIT_S)
    assert job.status_code == 200 and job.json()["status"] == "succeeded"
    items = {item["index"]: item for item in job.json()["items"]}
    with open_store(None, studio.data_dir) as store:
        for cell in cells:
            item = items[cell["index"]]
            seed, voice = item["axes"]["seed"], item["axes"]["x"]["value"]
            assert f"seed {seed}" in cell["label"] and f"voice {voice}" in cell["label"]
            run = store.get_run(item["run_id"])
            (audio,) = run.audio
            assert run.parameters["voice"] == voice and run.seed == seed
            assert cell["duration"] == pytest.approx(audio.duration_seconds, abs=0.05)
            assert f"{audio.duration_seconds:.2f} s" in cell["label"]
            # The player plays the run store's very WAV.
            served = httpx.get(cell["src"], timeout=WAIT_S)
            assert served.status_code == 200 and hashlib.sha256(served.content).hexdigest() == audio.sha256
    # Pressed, a player plays: its clock moves.
    first = players.first
    first.click()  # a user gesture for the page
    first.evaluate("a => a.play()")
    wait_js(page, "a => a.currentTime > 0", first.element_handle())
    page.wait_for_selector("#omni-batch-grid img")  # the waveform grid, recorded once the job is done
    screenshot(page, "batch-speech.png")


def test_the_queue_lists_a_spoken_request_with_its_voice(page, studio):
    open_tab(page, "Queue")  # its table refreshes itself while it is shown
    wait_text(page, "#omni-queue-who", "queued or running")
    # Three clients speak back to back until the table has shown a spoken request: the engine is busy
    # with them at the table's refreshes however fast one request goes through it.
    words = " ".join(["hello there, how are you today"] * 20)
    answers: list[httpx.Response] = []
    shown = threading.Event()

    def speak(seed: int) -> None:
        body = {"model": "tiny-qwen-omni", "input": words, "voice": "Ethan", "seed": seed}
        while not shown.is_set():
            answers.append(httpx.post(studio.url + "/v1/audio/speech", json=body, timeout=WAIT_S))

    # Fixed seeds: the tiny talker may end an utterance at once for some (nothing to speak: no audio).
    speakers = [threading.Thread(target=speak, args=(seed,), daemon=True) for seed in (1, 3, 4)]
    for speaker in speakers:
        speaker.start()
    try:
        wait_text(page, "#omni-queue-table", "audio · Ethan")
        row = next(
            r for r in page.locator("#omni-queue-table [role=row]").all_inner_texts() if "audio · Ethan" in r
        )
        assert "request" in row and "api" in row and "hello there" in row
    finally:
        shown.set()
        for speaker in speakers:
            speaker.join(WAIT_S)
    assert len(answers) >= 3 and {a.status_code for a in answers} == {200}, [a.text[:200] for a in answers]
    assert all(a.content[:4] == b"RIFF" for a in answers)


def stage_rows(page) -> list[dict[str, str]]:
    return page.evaluate(
        "() => { const t = document.querySelector('#omni-system-stages');"
        " const heads = [...t.querySelectorAll('thead th')].map(h => h.innerText.trim());"
        " return [...t.querySelectorAll('tbody tr')].map(r => Object.fromEntries("
        " [...r.querySelectorAll('td')].map((c, i) => [heads[i], c.innerText.trim()]))); }"
    )


def test_the_system_tab_lists_the_three_speech_stages(page):
    open_tab(page, "System")
    page.wait_for_selector("#omni-system-stages")
    rows = stage_rows(page)
    assert [(r["stage"], r["name"], r["kind"]) for r in rows] == [
        ("0", "thinker", "ar"),
        ("1", "talker", "ar"),
        ("2", "code2wav", "diffusion"),
    ]
    assert [r["backend"] for r in rows] == ["transformers", "transformers", "torch"]
    assert [r["runner"] for r in rows] == ["ThinkerStage", "TalkerStage", "Code2WavStage"]
    assert [r["batch size"] for r in rows] == ["8", "8", "8"]  # the preset's max_num_seqs
    assert [r["chunk size"] for r in rows] == ["—", "—", "24"]  # code2wav streams (the preset)
    assert "Chelsie, Ethan" in page.inner_text("#omni-system-cards")


def test_the_pipeline_tab_edits_validates_and_applies_the_speech_stages(page, studio):
    open_tab(page, "Pipeline")
    chunk = page.locator("#omni-stage2-chunk-size input")
    chunk.wait_for()
    headers = [page.inner_text(f"#omni-stage{i}-header") for i in range(3)]
    assert [h.split(" · ")[1] for h in headers] == ["thinker", "talker", "code2wav"]
    # code2wav's chunk_size, steps and guidance; no picture size; chunk_size on no other stage.
    assert chunk.input_value() == "24"
    assert not page.locator("#omni-stage0-chunk-size").is_visible()
    assert not page.locator("#omni-stage1-chunk-size").is_visible()
    assert not page.locator("#omni-stage2-sampling2").is_visible()  # height: not for audio
    talker = {
        page.inner_text(f"#omni-stage1-sampling{i}").split(" ")[0]: page.locator(
            f"#omni-stage1-sampling{i} input"
        ).input_value()
        for i in range(5)
    }
    assert talker == {
        "temperature": "0.9",
        "top_p": "0.8",
        "top_k": "40",
        "max_tokens": "60",
        "repetition_penalty": "1.05",
    }

    # A bad chunk_size: refused beside its stage, naming the field; nothing is applied.
    chunk.fill("0")
    page.click("#omni-form-to-yaml")
    wait_text(page, "#omni-deploy-yaml", "chunk_size: 0")
    page.click("#omni-validate")
    page.wait_for_selector("#omni-stage2-errors .omni-errors")
    errors = page.inner_text("#omni-stage2-errors")
    assert "chunk_size" in errors and "greater than or equal to 1" in errors
    assert "Invalid" in page.inner_text("#omni-pipeline-result")

    # A good one, and fewer code2wav steps: applied, and the next spoken run is made with them.
    chunk.fill("12")
    steps = page.locator("#omni-stage2-sampling0 input")
    steps.fill("6")
    page.click("#omni-form-to-yaml")
    wait_text(page, "#omni-deploy-yaml", "chunk_size: 12")
    assert "num_inference_steps: 6" in page.inner_text("#omni-deploy-yaml")
    page.click("#omni-apply")
    page.wait_for_selector("#omni-pipeline-result .omni-ok", timeout=WAIT_S * 1000)
    assert "Applied" in page.inner_text("#omni-pipeline-result")
    screenshot(page, "pipeline-speech.png")
    response = httpx.post(
        studio.url + "/v1/audio/speech",
        json={"model": "tiny-qwen-omni", "input": "after apply", "voice": "Chelsie"},
        timeout=WAIT_S,
    )
    assert response.status_code == 200, response.text
    run: Any = recorded(studio, lambda store: response.headers["x-run-id"])
    assert run.parameters["num_inference_steps"] == 6
    code2wav = next(s for s in run.config["stages"] if s["stage_id"] == 2)
    assert code2wav["engine_args"]["chunk_size"] == 12
