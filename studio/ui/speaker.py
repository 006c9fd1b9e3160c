"""The Chat tab's live speaker: a spoken reply played while it streams (docs/speech.md "In the studio").

An HTML block the reply's audio is appended to, chunk by chunk, as base64 pcm16 (Gradio sends an appended
string as its new tail only); its script (:data:`SPEAKER_JS`, the block's ``js_on_load``) plays each new
chunk right after the last through the Web Audio API, and stops at its tab's Stop (the Chat's, the Speech
panel's). Gradio's own
streaming audio output re-encodes every chunk through ffmpeg, which a machine may not have.
"""

from __future__ import annotations

import base64
import html

from engine.events import AudioDelta
from studio.media.audio import pcm16_chunk

SPEAKER_IDLE = "<div class='omni-live'><span class='omni-live-label'>Spoken replies play here</span></div>"
SPEAKER_JS_TEMPLATE = """
const st = {ctx: null, run: null, played: -1, next: 0, sources: [], seconds: 0, state: 'idle'};
const show = () => {
  const context = st.ctx ? st.ctx.state : 'none';
  Object.assign(element.dataset, {state: st.state, seconds: st.seconds.toFixed(3), chunks: st.played + 1, context});
  const label = element.querySelector('.omni-live-label');
  if (label && st.run) label.textContent = `Live audio: ${st.state} · ${st.seconds.toFixed(2)} s`;
};
const stop = () => {
  for (const s of st.sources) { try { s.stop(); } catch (e) {} }
  Object.assign(st, {sources: [], next: 0, state: st.run ? 'stopped' : st.state});
  show();
};
const play = (chunk) => {
  const raw = atob(chunk.dataset.pcm), n = raw.length >> 1;
  if (!n) return;
  st.ctx = st.ctx || new AudioContext();
  if (st.ctx.state === 'suspended') st.ctx.resume();
  const buffer = st.ctx.createBuffer(1, n, Number(chunk.dataset.rate)), data = buffer.getChannelData(0);
  for (let i = 0; i < n; i++) {
    const v = raw.charCodeAt(2 * i) | (raw.charCodeAt(2 * i + 1) << 8);
    data[i] = (v > 32767 ? v - 65536 : v) / 32767;
  }
  const source = st.ctx.createBufferSource(), at = Math.max(st.ctx.currentTime + 0.05, st.next);
  source.buffer = buffer;
  source.connect(st.ctx.destination);
  source.start(at);
  st.next = at + buffer.duration;
  st.sources.push(source);
  source.onended = () => { st.sources = st.sources.filter((s) => s !== source); };
  st.seconds += buffer.duration;
};
const update = () => {
  const root = element.querySelector('.omni-live');
  const run = (root && root.dataset.run) || null;
  if (run !== st.run) {
    stop();
    Object.assign(st, {run, played: -1, seconds: 0, state: run ? 'speaking' : 'idle'});
  }
  for (const chunk of root ? root.querySelectorAll('.omni-live-chunk') : []) {
    const seq = Number(chunk.dataset.seq);
    if (seq <= st.played) continue;
    st.played = seq;
    if (st.state === 'speaking') play(chunk);
  }
  const end = root && root.querySelector('.omni-live-end');
  if (end && end.dataset.state === 'stopped') stop();
  else if (end && st.state === 'speaking') st.state = 'spoken';
  show();
};
watch('value', update);
update();
document.addEventListener('click', (e) => { if (e.target.closest && e.target.closest('#STOP_ID')) stop(); }, true);
"""


def speaker_js(stop_id: str) -> str:
    """The speaker's script, silenced by a click on the element with id ``stop_id`` (its tab's Stop)."""
    return SPEAKER_JS_TEMPLATE.replace("STOP_ID", stop_id)


SPEAKER_JS = speaker_js("omni-stop")  # the Chat tab's


def speaker_start(run_id: str) -> str:
    return f"<div class='omni-live' data-run='{html.escape(run_id)}'><span class='omni-live-label'></span>"


def speaker_chunk(seq: int, delta: AudioDelta) -> str:
    pcm, rate = base64.b64encode(pcm16_chunk(delta.samples)).decode(), delta.sample_rate
    return f"<i class='omni-live-chunk' data-seq='{seq}' data-rate='{rate}' data-pcm='{pcm}'></i>"


def speaker_end(state: str) -> str:
    return f"<i class='omni-live-end' data-state='{state}'></i>"
