"""Speech in the studio in a real browser (headless Debian Chromium, Playwright) against
`omni-studio ui --model tiny-qwen-omni` on 127.0.0.1 (docs/speech.md "In the studio"): the voice picker,
a spoken reply that plays (live, then as an `<audio>` in the conversation), an uploaded WAV heard as
speech in, History playing the run, Stop, the Speech tab, a dropped FLAC's recipe, and the model picker
switching the speech controls off and on.

With ``OMNI_STUDIO_SCREENSHOT_DIR`` set, the Chat tab with a spoken reply and the Speech tab with its
result are saved there as ``chat-speech.png`` and ``speech.png`` (how docs/screenshots/ gets them).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile  # type: ignore[import-untyped]  # ships no type information
from PIL import Image

from studio.store import RunFilter
from tests.browser import open_tab, send_prompt, set_number
from tests.servers import running_server

pytestmark = pytest.mark.browser

WAIT_S = 120  # bounds a hang only; every wait is on a state of the page or the store


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    with running_server(
        ["ui", "--model", "tiny-qwen-omni"], tmp_path_factory.mktemp("studio-speech")
    ) as server:
        yield server


def wait_js(page, expression: str, arg: Any = None) -> Any:
    return page.wait_for_function(expression, arg=arg, timeout=WAIT_S * 1000)


def wait_text(page, selector: str, text: str) -> None:
    wait_js(page, "([s, t]) => (document.querySelector(s)?.innerText || '').includes(t)", [selector, text])


def recorded(studio, find: Any) -> Any:
    """The run ``find(store)`` names, once the studio's recorder has written its outcome."""
    from studio.store import open_store

    deadline = time.monotonic() + WAIT_S
    while True:
        with open_store(None, studio.data_dir) as store, contextlib.suppress(LookupError):
            run = store.get_run(find(store))
            if run.status not in ("queued", "running") and (run.status != "succeeded" or run.outputs):
                return run
        assert time.monotonic() < deadline, "the run was never recorded as expected"
        time.sleep(0.2)


def chat_run(page, studio, after: str = "") -> Any:
    """The Chat tab's run once it is done (the status line names its id's first 12 characters); ``after``:
    the id of the run before it, whose line must give way first."""
    wait_js(
        page,
        "([s, t, before]) => { const line = document.querySelector(s)?.innerText || '';"
        " return line.includes(t) && !(before && line.includes(before)); }",
        ["#omni-chat-status", "Done in", after[:12]],
    )
    match = re.search(r"run ([0-9a-f]{12})", page.inner_text("#omni-chat-status"))
    assert match, page.inner_text("#omni-chat-status")
    return recorded(studio, lambda store: store.resolve_run_id(match.group(1)))


def ready_duration(page, audio) -> float:
    """An `<audio>` element's duration in seconds once the browser has read its metadata."""
    handle = audio.element_handle()
    wait_js(page, "a => a.readyState >= 1 && a.duration > 0", handle)
    return float(handle.evaluate("a => a.duration"))


def test_the_voice_picker_lists_the_models_voices(page):
    page.locator("#omni-voice input").click()
    options = page.get_by_role("option")
    options.first.wait_for()
    # Each option's name (the selected one is ticked: "✓" on a line before it).
    assert [o.split()[-1] for o in options.all_inner_texts()] == ["Chelsie", "Ethan"]
    page.keyboard.press("Escape")
    assert page.locator("#omni-voice input").input_value() == "Chelsie"  # the default voice first
    reply_as = page.locator("#omni-reply-as")
    for choice in ("text+audio", "audio", "text"):
        assert reply_as.get_by_label(choice, exact=True).count() == 1
    # The speech controls replace the image ones.
    assert page.locator("#omni-audio-in").is_visible()
    assert not page.locator("#omni-width").is_visible() and not page.locator("#omni-modalities").is_visible()


def test_a_spoken_reply_plays_as_it_streams_and_stays_in_the_conversation(page, studio):
    prompt = f"say hello {uuid.uuid4().hex[:8]}"
    set_number(page, "omni-seed", "7")
    page.locator("#omni-voice input").click()
    page.get_by_role("option", name="Ethan", exact=True).click()
    send_prompt(page, prompt)
    run = chat_run(page, studio)
    assert run.status == "succeeded" and run.parameters["voice"] == "Ethan" and run.seed == 7
    (stored,) = run.audio
    assert stored.duration_seconds and stored.duration_seconds > 0

    # The live speaker played every chunk as it came: as many seconds as the stored reply.
    speaker = page.locator("#omni-speaker [data-chunks]")
    wait_js(page, "e => e.dataset.state === 'spoken'", speaker.element_handle())
    assert int(speaker.get_attribute("data-chunks") or 0) >= 1
    assert float(speaker.get_attribute("data-seconds") or 0) == pytest.approx(
        stored.duration_seconds, abs=1e-3
    )
    assert speaker.get_attribute("data-context") == "running"  # the page's audio clock is going

    # The finished reply: its transcript, and a player of the very WAV the run store keeps (the chatbot
    # shows each part of a message in a bubble of its own).
    bubbles = page.locator("#omni-chatbot [data-testid='bot']")
    assert run.text and bubbles.nth(-2).inner_text().strip() == run.text.strip()
    reply = bubbles.last
    audio = reply.locator("audio[src]")
    assert audio.get_attribute("src")
    assert ready_duration(page, audio) == pytest.approx(stored.duration_seconds, abs=0.05)
    link = page.locator("#omni-chatbot a[href$='.wav']").last.get_attribute("href")  # its download button
    assert link
    served = httpx.get(link if link.startswith("http") else studio.url + link, timeout=WAIT_S)
    assert served.status_code == 200
    assert hashlib.sha256(served.content).hexdigest() == stored.sha256
    # Pressing play plays it: its clock moves.
    reply.get_by_role("button", name=re.compile("play", re.I)).first.click()
    wait_js(page, "a => a.currentTime > 0", audio.element_handle())

    progress = page.inner_text("#omni-progress")
    for label in ("stage 0 · thinker", "stage 1 · talker", "stage 2 · code2wav", "tokens", "codes"):
        assert label in progress, label
    assert page.locator("#omni-progress [data-status='succeeded']").count() == 3

    target = os.environ.get("OMNI_STUDIO_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(target) / "chat-speech.png"))


def tone(path: Path, seconds: float = 1.0, rate: int = 16000) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    soundfile.write(path, (0.4 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, subtype="PCM_16")
    return path


def test_an_uploaded_wav_is_heard_as_speech_in(page, studio, tmp_path):
    prompt = f"what do you hear {uuid.uuid4().hex[:8]}"
    set_number(page, "omni-seed", "3")
    send_prompt(page, prompt)  # first without audio: the baseline prompt length
    plain = chat_run(page, studio)

    page.set_input_files("#omni-audio-in input[type=file]", str(tone(tmp_path / "tone.wav")))
    page.locator("#omni-audio-in audio[src]").wait_for(state="attached")  # the clip is loaded
    send_prompt(page, prompt)
    heard = chat_run(page, studio, after=plain.id)
    assert heard.id != plain.id and heard.status == "succeeded"
    # The thinker read the clip: its audio positions lengthen the prompt.
    assert heard.input_tokens and plain.input_tokens and heard.input_tokens > plain.input_tokens
    # The clip is in the conversation as the user's turn, and the box is empty again for the next one.
    clip = page.locator("#omni-chatbot [data-testid='user'] audio[src]").last
    assert ready_duration(page, clip) == pytest.approx(1.0, abs=0.05)
    assert page.locator("#omni-audio-in audio[src]").count() == 0


def test_history_plays_a_spoken_run_with_its_figures_and_waveform(page, studio):
    prompt = f"say it again {uuid.uuid4().hex[:8]}"
    response = httpx.post(
        studio.url + "/v1/chat/completions",
        timeout=WAIT_S,
        json={
            "messages": [{"role": "user", "content": prompt}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "Chelsie", "format": "wav"},
            "seed": 11,
        },
    )
    assert response.status_code == 200, response.text
    run = recorded(studio, lambda store: response.headers["x-run-id"])
    (stored,) = run.audio
    assert run.ttfp_seconds is not None and run.realtime_factor is not None

    open_tab(page, "History")
    page.fill("#omni-h-search textarea, #omni-h-search input", prompt)
    page.click("#omni-h-find")
    wait_text(page, "#omni-h-table", prompt)
    page.locator("#omni-h-table").get_by_text(prompt).filter(visible=True).first.click()
    wait_text(page, "#omni-h-detail", prompt)
    detail = " ".join(page.inner_text("#omni-h-detail").split())
    assert f"Audio {run.audio_seconds:.2f} s" in detail
    assert f"TTFP {run.ttfp_seconds:.3f} s" in detail and f"RTF {run.realtime_factor:.2f}" in detail

    row = page.locator(".omni-h-audio").first
    row.wait_for()
    assert f"audio 0 · {stored.duration_seconds:.2f} s" in row.inner_text()
    assert ready_duration(page, row.locator("audio[src]")) == pytest.approx(stored.duration_seconds, abs=0.05)
    # The waveform picture: the requested size, and the wave drawn in it (not a blank image).
    src = row.locator(".omni-h-waveform img").get_attribute("src")
    assert src
    picture = httpx.get(src if src.startswith("http") else studio.url + src, timeout=WAIT_S)
    pixels = np.asarray(Image.open(io.BytesIO(picture.content)).convert("RGB"))
    assert pixels.shape == (120, 640, 3)
    assert (pixels == (37, 99, 235)).all(axis=-1).sum() > 640  # the wave's colour, at least a line's worth


@contextlib.contextmanager
def engine_held(studio) -> Any:
    """A slow spoken request streaming from the API (code2wav at 500 steps a chunk), from its first audio
    bytes until the block exits (then its client leaves, which cancels it): meanwhile code2wav renders it
    and any other request waits behind it, so a run sent now cannot finish on its own first."""
    client = httpx.Client(timeout=WAIT_S)
    body = {"model": "tiny-qwen-omni", "input": "hold the engine", "voice": "Chelsie", "seed": 1}
    body.update(num_inference_steps=500, response_format="pcm", stream_format="audio")
    try:
        with client.stream("POST", studio.url + "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            next(response.iter_bytes())  # the first chunk is out: code2wav is on the next one
            yield
    finally:
        client.close()


def test_stop_silences_the_reply_and_frees_the_engine(page, studio):
    prompt = f"an answer to stop {uuid.uuid4().hex[:8]}"
    with engine_held(studio):
        send_prompt(page, prompt)
        page.wait_for_selector("#omni-progress [data-stage='0']", timeout=WAIT_S * 1000)
        page.click("#omni-stop")
        wait_text(page, "#omni-chat-status", "Stopped")
    assert "Stopped" in page.inner_text("#omni-chatbot")
    speaker = page.locator("#omni-speaker [data-chunks]")
    # Silent after Stop: 'stopped' when the speaker had begun this run, 'idle' when Stop came before its
    # first update; never 'speaking' or 'spoken'.
    wait_js(page, "e => ['stopped', 'idle'].includes(e.dataset.state)", speaker.element_handle())
    run = recorded(studio, lambda store: store.list_runs(RunFilter(search=prompt), limit=1)[0].id)
    assert run.status == "cancelled" and not run.audio
    # The engine is free: the next spoken request is answered.
    response = httpx.post(
        studio.url + "/v1/audio/speech",
        timeout=WAIT_S,
        json={"model": "tiny-qwen-omni", "input": "after stop", "voice": "Chelsie"},
    )
    assert response.status_code == 200 and response.content[:4] == b"RIFF"


def test_the_speech_tab_speaks_the_text_plays_it_and_records_it(page, studio):
    """The Speech tab: the same request as POST /v1/audio/speech (the text spoken word for word, voice,
    format, speed, seed), played live, then a player and a download of the file, its waveform, recorded."""
    text = f"speak these words {uuid.uuid4().hex[:6]}"
    open_tab(page, "Speech")
    page.fill("#omni-speech-input textarea", text)
    page.locator("#omni-speech-voice input").click()
    page.get_by_role("option", name="Ethan", exact=True).click()
    page.locator("#omni-speech-format input").click()
    page.get_by_role("option", name="flac", exact=True).click()
    set_number(page, "omni-speech-seed", "4")
    speed = page.locator("#omni-speech-speed input[type=number]")
    speed.fill("1.5")
    speed.press("Enter")
    page.click("#omni-speech-go")
    wait_text(page, "#omni-speech-status", "s of audio")
    status = page.inner_text("#omni-speech-status")
    assert "flac" in status and "seed 4" in status and "real-time factor" in status
    run_prefix = re.search(r"run ([0-9a-f]{12})", status)
    assert run_prefix, status
    run = recorded(studio, lambda store: store.resolve_run_id(run_prefix.group(1)))
    assert run.status == "succeeded" and run.parameters["voice"] == "Ethan" and run.seed == 4
    assert run.parameters["speak_text"] == text and run.parameters["speed"] == 1.5
    assert run.request["input"] == text and run.request["response_format"] == "flac"
    (stored,) = run.audio
    # The same request through the API gives the same samples.
    api = httpx.post(
        studio.url + "/v1/audio/speech",
        timeout=WAIT_S,
        json={"model": "tiny-qwen-omni", "input": text, "voice": "Ethan", "seed": 4, "speed": 1.5},
    )
    api_samples, _ = soundfile.read(io.BytesIO(api.content), dtype="int16")
    # The live speaker played it all as it came.
    speaker = page.locator("#omni-speech-live [data-chunks]")
    wait_js(page, "e => e.dataset.state === 'spoken'", speaker.element_handle())
    assert float(speaker.get_attribute("data-seconds") or 0) == pytest.approx(
        api_samples.size / 24000, abs=1e-3
    )
    # A player of the FLAC, and its download: the API's samples, the recipe inside.
    audio = page.locator("#omni-speech-audio audio[src]")
    assert ready_duration(page, audio) == pytest.approx(stored.duration_seconds, abs=0.05)
    link = page.locator("#omni-speech-file a[href]").first.get_attribute("href")
    assert link and link.split("?")[0].endswith(".flac")
    served = httpx.get(link if link.startswith("http") else studio.url + link, timeout=WAIT_S)
    flac_samples, rate = soundfile.read(io.BytesIO(served.content), dtype="int16")
    assert rate == 24000 and np.array_equal(flac_samples, api_samples)
    from studio.media.audio import read_audio_recipe

    assert read_audio_recipe(served.content)["parameters"]["speed"] == 1.5
    waveform = page.locator("#omni-speech-waveform img[src]")
    assert waveform.count() == 1
    target = os.environ.get("OMNI_STUDIO_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(target) / "speech.png"))


def test_the_speech_tab_names_a_bad_input(page):
    open_tab(page, "Speech")
    page.fill("#omni-speech-input textarea", "   ")
    page.click("#omni-speech-go")
    wait_text(page, "#omni-speech-status", "input is blank")


def test_a_dropped_flac_restores_its_spoken_request(page, studio, tmp_path):
    """A FLAC from /v1/audio/speech dropped on Chat: its prompt, seed, voice and 'reply with' come back
    (the note says the words were given, not the model's); sending it speaks in that voice."""
    text = f"recipe words {uuid.uuid4().hex[:6]}"
    made = httpx.post(
        studio.url + "/v1/audio/speech",
        timeout=WAIT_S,
        json={
            "model": "tiny-qwen-omni",
            "input": text,
            "voice": "Ethan",
            "seed": 11,
            "response_format": "flac",
        },
    )
    assert made.status_code == 200 and made.content[:4] == b"fLaC"
    path = tmp_path / "spoken.flac"
    path.write_bytes(made.content)
    page.set_input_files("#omni-recipe input[type=file]", str(path))
    wait_text(page, "#omni-recipe-note", "Restored")
    note = page.inner_text("#omni-recipe-note")
    assert "voice" in note and "reply with" in note and "word for word" in note
    assert page.locator("#omni-voice input").input_value() == "Ethan"
    assert page.locator("#omni-reply-as").get_by_label("audio", exact=True).is_checked()
    assert page.locator("#omni-seed input[type=number]").input_value() == "11"
    assert page.locator("#omni-message textarea").input_value() == text
    page.locator("#omni-message textarea").press("Enter")
    run = chat_run(page, studio)
    assert run.parameters["voice"] == "Ethan" and run.seed == 11 and run.parameters["modalities"] == ["audio"]
    # A file with no recipe says so.
    plain = tmp_path / "plain.wav"
    soundfile.write(plain, np.zeros(2400, dtype=np.float32), 24000)
    page.set_input_files("#omni-recipe input[type=file]", str(plain))
    wait_text(page, "#omni-recipe-note", "carries no recipe")


def test_the_system_tab_shows_the_spoken_replies_figures(page, studio):
    """After this module's spoken runs (Chat, Speech tab, API): the System tab's speech table."""
    response = httpx.post(
        studio.url + "/v1/audio/speech",
        timeout=WAIT_S,
        json={"model": "tiny-qwen-omni", "input": "figures", "voice": "Chelsie", "seed": 3},
    )
    assert response.status_code == 200
    open_tab(page, "System")
    table = page.locator("#omni-system-speech")
    table.wait_for()
    row = table.locator("tr", has_text="tiny-qwen-omni").inner_text().split("\t")
    assert int(row[1]) >= 1 and float(row[2]) > 0 and float(row[4]) > 0, row


def test_the_model_picker_turns_the_speech_controls_off_and_on(page):
    """Last in this module: it switches the module's studio to tiny-chat and back."""
    picker = page.locator("#omni-model input")
    picker.click()
    page.get_by_role("option", name="tiny-chat", exact=True).click()
    try:
        wait_text(page, "#omni-chat-status", "Now serving tiny-chat")
        page.locator("#omni-voice").wait_for(state="hidden", timeout=WAIT_S * 1000)
        page.locator("#omni-modalities").wait_for(timeout=WAIT_S * 1000)  # the image/text controls are back
        assert not page.locator("#omni-audio-in").is_visible()
    finally:
        picker.click()
        page.get_by_role("option", name="tiny-qwen-omni", exact=True).click()
        wait_text(page, "#omni-chat-status", "Now serving tiny-qwen-omni")
    page.locator("#omni-voice").wait_for(timeout=WAIT_S * 1000)
    assert page.locator("#omni-audio-in").is_visible() and not page.locator("#omni-modalities").is_visible()
