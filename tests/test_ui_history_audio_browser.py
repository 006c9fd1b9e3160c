"""History with spoken runs in a real browser (headless Debian Chromium, Playwright) against
`omni-studio ui --model tiny-qwen-omni` on 127.0.0.1 (docs/speech.md "In the studio"): the runs list's
audio seconds, TTFP and RTF and its players, the Output filter, a run's detail, audio Compare of two
spoken runs (both players, waveforms, lengths, max sample difference, SNR), export/import carrying the
WAVs, and Replay playing before and after.

The spoken runs are made through the studio's own `/v1/audio/speech` (recorded like any run). With
``OMNI_STUDIO_SCREENSHOT_DIR`` set, ``history-speech.png`` (a spoken run's detail with its player and
waveform) and ``compare-speech.png`` (audio Compare) are saved there.
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from studio.media.audio_compare import file_difference, format_max, format_snr
from studio.store import open_store
from tests.browser import open_tab
from tests.servers import running_server
from tests.test_ui_speech_browser import WAIT_S, ready_duration, recorded, wait_js, wait_text

pytestmark = pytest.mark.browser

TAG = uuid.uuid4().hex[:8]  # this module's runs: a search for it finds them and nothing else
WORDS = f"good night {TAG}"


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    with running_server(
        ["ui", "--model", "tiny-qwen-omni"], tmp_path_factory.mktemp("studio-history-audio")
    ) as server:
        yield server


def speak(studio, words: str, voice: str, seeds: range) -> Any:
    """A `/v1/audio/speech` request with the first of ``seeds`` that makes audio (the tiny model's talker
    picks its end id at once for some texts and seeds: a 500 naming no_audio); its recorded run."""
    for seed in seeds:
        response = httpx.post(
            studio.url + "/v1/audio/speech",
            timeout=WAIT_S,
            json={"model": "tiny-qwen-omni", "input": words, "voice": voice, "seed": seed},
        )
        if response.status_code == 500 and "no_audio" in response.text:
            continue
        assert response.status_code == 200 and response.content[:4] == b"RIFF", response.text
        run_id = response.headers["x-run-id"]
        return recorded(studio, lambda store, run_id=run_id: run_id)
    raise AssertionError(f"no seed of {seeds} made audio")


@pytest.fixture(scope="module")
def runs(studio) -> dict[str, Any]:
    """Two spoken runs of the same words (Chelsie, Ethan; other seeds) and a text-only chat run with the
    same tag."""
    first = speak(studio, WORDS, "Chelsie", range(1, 9))
    second = speak(studio, WORDS, "Ethan", range(11, 19))
    response = httpx.post(
        studio.url + "/v1/chat/completions",
        timeout=WAIT_S,
        json={"messages": [{"role": "user", "content": f"write {WORDS}"}], "modalities": ["text"], "seed": 3},
    )
    assert response.status_code == 200, response.text
    text = recorded(studio, lambda store: response.headers["x-run-id"])
    assert first.audio and second.audio and not text.audio
    return {"first": first, "second": second, "text": text}


def search(page, text: str, output: str | None = None) -> None:
    """Search the History for ``text`` (with the Output filter set to ``output`` first, when given)."""
    open_tab(page, "History")
    if output is not None:
        page.locator("#omni-h-output input").click()
        page.get_by_role("option", name=output, exact=True).click()
    page.fill("#omni-h-search textarea, #omni-h-search input", text)
    page.click("#omni-h-find")


def table(page, *ids: str) -> list[dict[str, str]]:
    """The runs list as the page shows it, once it lists exactly the runs ``ids`` (in any order): one
    {column: cell text} per row (Gradio's grid: column headers, then cells by data-row / data-col)."""
    rows = """() => {
        const root = document.querySelector('#omni-h-table');
        const heads = [...root.querySelectorAll('[role=columnheader]')].map(e => e.innerText.trim());
        const rows = {};
        for (const cell of root.querySelectorAll('[role=gridcell][data-row][data-col]')) {
            (rows[cell.dataset.row] ??= {})[heads[+cell.dataset.col]] = cell.innerText.trim();
        }
        return Object.values(rows);
    }"""
    wanted = sorted(i[:12] for i in ids)
    wait_js(page, f"ids => JSON.stringify(({rows})().map(r => r.id).sort()) === JSON.stringify(ids)", wanted)
    return page.evaluate(rows)


def screenshot(page, name: str) -> None:
    target = os.environ.get("OMNI_STUDIO_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(target) / name), full_page=True)


def test_the_runs_list_shows_and_plays_spoken_runs_and_filters_them(page, studio, runs):
    search(page, TAG)
    wait_text(page, "#omni-h-count", "3 run(s) match")
    rows = {row["id"]: row for row in table(page, *(r.id for r in runs.values()))}
    for key in ("first", "second"):
        run = runs[key]
        row = rows[run.id[:12]]
        assert float(row["audio s"]) == pytest.approx(run.audio_seconds, abs=0.006)
        assert float(row["TTFP s"]) == pytest.approx(run.ttfp_seconds, abs=0.0006)
        assert float(row["RTF"]) == pytest.approx(run.realtime_factor, abs=0.006)
    assert rows[runs["text"].id[:12]]["audio s"] in ("", "NaN", "None", "—")  # a text run has no figures

    # A player per spoken run under the list, labelled with its id and figures; it plays.
    players = page.locator(".omni-h-list-audio")
    for key in ("first", "second"):
        run = runs[key]
        player = players.filter(has_text=run.id[:12])
        assert f"TTFP {run.ttfp_seconds:.3f} s · RTF {run.realtime_factor:.2f}" in player.inner_text()
        audio = player.locator("audio[src]")
        assert ready_duration(page, audio) == pytest.approx(run.audio[0].duration_seconds, abs=0.05)
    assert players.count() == 2  # none for the text run
    player.get_by_role("button", name="Play", exact=True).click()
    wait_js(page, "a => a.currentTime > 0", audio.element_handle())

    # Output "audio": the spoken runs only; "text": the chat run and nothing that spoke only.
    search(page, TAG, output="audio")
    wait_text(page, "#omni-h-count", "2 run(s) match")
    table(page, runs["first"].id, runs["second"].id)
    search(page, TAG, output="text")
    wait_text(page, "#omni-h-count", "1 run(s) match")
    table(page, runs["text"].id)
    assert page.locator(".omni-h-list-audio").count() == 0


def test_a_spoken_runs_detail_plays_it_beside_its_waveform(page, studio, runs):
    run = runs["second"]
    search(page, WORDS, output="audio")
    wait_text(page, "#omni-h-count", "2 run(s) match")
    page.locator("#omni-h-table").get_by_text(run.id[:12]).filter(visible=True).first.click()
    wait_text(page, "#omni-h-detail", run.id)
    assert f"TTFP {run.ttfp_seconds:.3f} s" in " ".join(page.inner_text("#omni-h-detail").split())
    row = page.locator(".omni-h-audio").first
    row.wait_for()
    assert ready_duration(page, row.locator("audio[src]")) == pytest.approx(
        run.audio[0].duration_seconds, abs=0.05
    )
    row.locator(".omni-h-waveform img[src]").wait_for()
    screenshot(page, "history-speech.png")


def test_compare_plays_both_runs_and_shows_the_audio_figures(page, studio, runs):
    a, b = runs["first"], runs["second"]
    open_tab(page, "History")
    page.fill("#omni-h-run-a textarea, #omni-h-run-a input", a.id)
    page.fill("#omni-h-run-b textarea, #omni-h-run-b input", b.id)
    page.click("#omni-h-compare")
    figures = page.locator("#omni-h-audio-diff")
    figures.wait_for(timeout=WAIT_S * 1000)
    # The figures of the two stored WAVs, decoded (studio/media/audio_compare.py).
    expected = file_difference(a.audio[0].path, b.audio[0].path)
    assert figures.get_attribute("data-compared") == "true"
    assert float(figures.get_attribute("data-seconds-a") or 0) == pytest.approx(a.audio[0].duration_seconds)
    assert float(figures.get_attribute("data-seconds-b") or 0) == pytest.approx(b.audio[0].duration_seconds)
    assert figures.get_attribute("data-snr") == format_snr(expected.snr_db)
    assert float(figures.get_attribute("data-max") or 0) == pytest.approx(expected.max_abs)
    assert expected.max_abs and expected.max_abs > 0  # two voices, two seeds: not the same samples
    shown = " ".join(figures.inner_text().split())
    assert f"Max sample difference {format_max(expected.max_abs)}" in shown
    assert f"SNR (B against A) {format_snr(expected.snr_db)} dB" in shown
    # Both players, each as long as its run's audio, and both waveform pictures.
    for side, run in (("a", a), ("b", b)):
        audio = page.locator(f"#omni-h-audio-{side} audio[src]")
        assert ready_duration(page, audio) == pytest.approx(run.audio[0].duration_seconds, abs=0.05)
        page.locator(f"#omni-h-wave-{side} img[src]").wait_for()
    assert "seed" in page.inner_text("#omni-h-diff")  # the parameter diff is still there
    screenshot(page, "compare-speech.png")


def test_export_and_import_carry_the_audio(page, studio, runs, tmp_path):
    run = runs["first"]
    search(page, WORDS, output="audio")
    wait_text(page, "#omni-h-count", "2 run(s) match")
    page.click("#omni-h-export")
    link = page.locator("#omni-h-bundle a[href]").first
    link.wait_for(timeout=WAIT_S * 1000)
    href = link.get_attribute("href") or ""
    bundle = httpx.get(href if href.startswith("http") else studio.url + href, timeout=WAIT_S).content
    with zipfile.ZipFile(io.BytesIO(bundle)) as archive:
        names = set(archive.namelist())
        for spoken in (runs["first"], runs["second"]):
            (stored,) = spoken.audio
            data = archive.read(f"files/{stored.sha256}.wav")
            assert hashlib.sha256(data).hexdigest() == stored.sha256
    assert not any(runs["text"].id in name for name in names)  # the filter chose what was exported
    saved = tmp_path / "spoken.zip"
    saved.write_bytes(bundle)

    # Delete the run (its WAV goes with it), then import the bundle: the run and its audio are back.
    with open_store(None, studio.data_dir) as store:
        assert store.delete_run(run.id)
    assert not run.audio[0].path.exists()
    page.set_input_files("#omni-h-import input[type=file]", str(saved))
    wait_text(page, "#omni-h-import-status", "Imported 1 run(s); 1 already present")
    with open_store(None, studio.data_dir) as store:
        back = store.get_run(run.id)
    assert [o.sha256 for o in back.audio] == [run.audio[0].sha256] and back.audio[0].path.exists()
    assert back.audio_seconds == run.audio_seconds and back.ttfp_seconds == run.ttfp_seconds
    player = page.locator(".omni-h-list-audio").filter(has_text=run.id[:12]).locator("audio[src]")
    assert ready_duration(page, player) == pytest.approx(run.audio[0].duration_seconds, abs=0.05)


def test_replay_of_a_spoken_run_plays_before_and_after(page, studio, runs):
    run = runs["second"]
    open_tab(page, "History")
    page.fill("#omni-h-run-id textarea, #omni-h-run-id input", run.id)
    page.keyboard.press("Enter")
    wait_text(page, "#omni-h-detail", run.id)
    page.click("#omni-h-replay")
    wait_text(page, "#omni-h-replay-report", "Summary: 1 run: 1 identical, 0 changed, 0 failed")
    report = " ".join(page.inner_text("#omni-h-replay-report").split())
    assert "max sample difference 0 · SNR inf dB" in report
    wait_text(page, "#omni-h-replay-audio-figures", "identical samples")
    with open_store(None, studio.data_dir) as store:
        (again,) = [store.get_run(r.id) for r in store.list_runs() if r.replay_of == run.id]
    assert again.parameters == run.parameters  # the same voice, words and modalities
    for side in ("before", "after"):
        audio = page.locator(f"#omni-h-replay-{side} audio[src]")
        assert ready_duration(page, audio) == pytest.approx(run.audio[0].duration_seconds, abs=0.05)
