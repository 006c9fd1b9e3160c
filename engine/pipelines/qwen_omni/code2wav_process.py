"""code2wav in a process of its own for streamed chunks: the vocoder for every stream, and every other
stream's chunks end to end (docs/speech.md, "The second process").

One Python process runs one bytecode at a time (the GIL): BigVGAN over a chunk, or a DiT evaluation, is
hundreds of small torch calls, and run on a second thread beside the DiT they mostly wait for the lock
(measured: no faster, and a later first chunk). A child process with the same token2wav weights renders
the chunks' samples while this process integrates the next DiT batch, and renders the chunks of the
streams the scheduler gives it end to end (their DiT windows, then their samples) while this process
integrates the others'. It is the same code on the same CPU with the same thread count, so it gives this
process's bits; :meth:`Code2WavProcess.start` checks that on a random mel and a random DiT window before
the process is used, and any difference or failure leaves the work in this process.

The child renders with the chunk vocoder this process uses (:func:`~engine.pipelines.qwen_omni.bigvgan_cpu.
chunk_vocoder`), a batch of windows of one length in one call where :func:`~engine.pipelines.qwen_omni.
bigvgan_cpu.batch_holds` finds on the child's own thread that a batch gives each window its alone bits:
:meth:`Code2WavProcess.start` asks it for the lengths the streams' chunks usually have
(:attr:`Code2WavProcess.batch_frames`); a batch of another length is never sent. DiT windows sent together
are integrated as one batch where the child's :func:`~engine.pipelines.qwen_omni.dit_batch.batch_holds`
holds for their length, else one by one.

The protocol: length-prefixed pickles over the child's stdin and a duplicate of its stdout (the child's
own stdout goes to its stderr, so nothing a library prints can corrupt a reply). A request is
``("render", mels)``, float32 mels (batch, mels, frames) as numpy, answered by their samples (batch, n
float32 numpy); ``("batches", frames, max_batch)``, answered by the lengths among ``frames`` whose vocoder
batches of up to ``max_batch`` windows hold; ``("integrate", windows)``, DiT windows of one key as dicts
of numpy arrays and numbers, answered by their mels (windows, mels, frames); or ``("chunks", windows,
spans)``, answered by each window's vocoder samples of its mel frames ``spans[i]`` (low, high). A failure
is answered by its text.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from engine.pipelines.qwen_omni.bigvgan_cpu import Vocoder, chunk_vocoder
from engine.pipelines.qwen_omni.bigvgan_cpu import batch_holds as vocoder_batch_holds
from engine.pipelines.qwen_omni.checkpoint import load_token2wav
from engine.pipelines.qwen_omni.dit_batch import BatchedFlow, DiTWindow, random_windows
from engine.pipelines.qwen_omni.dit_batch import batch_holds as dit_batch_holds

HEADER = struct.Struct("<Q")  # the pickle's length
START_TIMEOUT_S = 120.0  # importing torch and transformers and loading token2wav, on a busy machine
CHECK_FRAMES = 40  # the random mel and DiT window the start-up check renders both ways


def _write(stream: IO[bytes], payload: Any) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError("the code2wav process closed its pipe")
    (size,) = HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the code2wav process closed its pipe")
    return pickle.loads(data)  # noqa: S301  # our own child's replies


def load_vocoder(model_path: Path) -> torch.nn.Module:
    """BigVGAN from the checkpoint's ``token2wav`` weights, in float32."""
    return load_token2wav(model_path).code2wav_bigvgan_model


def _window_payload(window: DiTWindow) -> dict[str, Any]:
    return {
        "start": window.start.detach().cpu().numpy(),
        "condition": window.condition.detach().cpu().numpy(),
        "guidance": window.guidance,
        "steps": window.steps,
        "cfg": window.cfg,
        "real": window.real,
    }


def _window_of(payload: dict[str, Any]) -> DiTWindow:
    return DiTWindow(
        torch.from_numpy(payload["start"]),
        torch.from_numpy(payload["condition"]),
        payload["guidance"],
        payload["steps"],
        payload["cfg"],
        payload["real"],
    )


class Code2WavProcess:
    """A child process with the model's token2wav: renders mels to samples and integrates DiT windows,
    one request at a time."""

    batch_frames: frozenset[int] = frozenset()  # window lengths it vocodes in batches (checked there)

    def __init__(self, model_path: Path, threads: int, dit_batch: int) -> None:
        self._child = subprocess.Popen(
            [sys.executable, "-m", __name__, str(model_path), str(threads), str(dit_batch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
        )
        self._lock = threading.Lock()  # one request in flight

    @classmethod
    def start(
        cls,
        model_path: Path,
        threads: int,
        vocoder: Vocoder,
        flow: BatchedFlow,
        batch_frames: tuple[int, ...] = (),
        vocoder_batch: int = 1,
        dit_batch: int = 1,
    ) -> Code2WavProcess | None:
        """A started child whose samples are ``vocoder``'s (this process's chunk vocoder) and whose DiT
        mels are ``flow``'s, bit for bit, on a random mel and a random window (call on a thread with the
        stage's thread count, in inference mode), or None (the child is stopped). It vocodes batches of up
        to ``vocoder_batch`` windows of those of ``batch_frames`` where its check finds them to hold
        (:attr:`batch_frames`), and is sent DiT batches of up to ``dit_batch`` windows."""
        try:
            process = cls(model_path, threads, dit_batch)
        except OSError:  # no interpreter to start: render in this process
            return None
        try:
            generator = torch.Generator().manual_seed(0)
            mels = int(flow.dit.config.mel_dim)
            mel = torch.randn((1, mels, CHECK_FRAMES), generator=generator)
            window = random_windows(flow, CHECK_FRAMES, True, 1, generator)[0]
            ready = threading.Event()
            answers: list[torch.Tensor] = []
            errors: list[BaseException] = []

            def ask() -> None:
                try:
                    answers.append(process.render(mel))
                    answers.append(process.integrate([window]))
                    if batch_frames and vocoder_batch > 1:
                        lengths = process._ask(("batches", list(batch_frames), vocoder_batch))
                        process.batch_frames = frozenset(lengths)
                except BaseException as exc:  # noqa: BLE001  # reported below
                    errors.append(exc)
                ready.set()

            threading.Thread(target=ask, daemon=True).start()
            if not ready.wait(START_TIMEOUT_S) or errors or len(answers) < 2:
                raise RuntimeError("the code2wav process did not answer")
            if not torch.equal(answers[0], vocoder(mel)):
                raise RuntimeError("the code2wav process's samples differ from this process's")
            if not torch.equal(answers[1], flow.integrate([window])):
                raise RuntimeError("the code2wav process's DiT mels differ from this process's")
            return process
        except Exception:
            process.close()
            return None

    def render(self, mels: torch.Tensor) -> torch.Tensor:
        """The samples (batch, n float32) of ``mels`` (batch, mels, frames; a batch only of a length in
        :attr:`batch_frames`); RuntimeError if the child fails."""
        mels = mels.detach().to("cpu", torch.float32).contiguous()
        return torch.from_numpy(self._ask(("render", mels.numpy())))

    def integrate(self, windows: list[DiTWindow]) -> torch.Tensor:
        """The DiT's mels (windows, mels, frames) of ``windows`` (one :attr:`DiTWindow.key`), each its
        alone bits; RuntimeError if the child fails."""
        return torch.from_numpy(self._ask(("integrate", [_window_payload(w) for w in windows])))

    def render_chunks(self, windows: list[DiTWindow], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Streamed chunks rendered there end to end: the DiT's mels of ``windows`` (one
        :attr:`DiTWindow.key`), then each window's vocoder samples (1-D) of its mel frames ``spans[i]``
        (low, high), each its alone bits; RuntimeError if the child fails."""
        payload = [_window_payload(w) for w in windows]
        return [torch.from_numpy(wave) for wave in self._ask(("chunks", payload, spans))]

    def _ask(self, request: tuple[Any, ...]) -> Any:
        assert self._child.stdin is not None and self._child.stdout is not None
        with self._lock:
            _write(self._child.stdin, request)
            reply = _read(self._child.stdout)
        if isinstance(reply, str):
            raise RuntimeError(f"the code2wav process failed: {reply}")
        return reply

    def close(self) -> None:
        try:
            if self._child.stdin is not None:
                self._child.stdin.close()
            self._child.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._child.kill()
            self._child.wait()


class _Child:
    """What the child process does with each request."""

    def __init__(self, model_path: Path, dit_batch: int) -> None:
        model = load_token2wav(model_path)
        self.vocoder = chunk_vocoder(model.code2wav_bigvgan_model)
        self.flow = BatchedFlow(model.code2wav_dit_model)
        self.mels = int(model.code2wav_bigvgan_model.config.mel_dim)
        self.dit_batch = dit_batch  # the most DiT windows a request holds
        self.batching: dict[tuple[int, bool], bool] = {}  # (frames, guided) -> DiT batch_holds here
        self.vocoder_lengths: set[int] = set()  # vocoder inputs it renders in batches (checked here)
        self.vocoder_batch = 1

    def answer(self, request: tuple[Any, ...]) -> Any:
        kind = request[0]
        if kind == "render":
            return np.ascontiguousarray(self.vocoder(torch.from_numpy(request[1])).numpy())
        if kind == "batches":
            _, lengths, max_batch = request
            self.vocoder_batch = max_batch
            self.vocoder_lengths = {
                f for f in lengths if vocoder_batch_holds(self.vocoder, self.mels, f, max_batch)
            }
            return sorted(self.vocoder_lengths)
        if kind == "integrate":
            mels = self._integrate([_window_of(payload) for payload in request[1]])
            return np.ascontiguousarray(mels.numpy())
        if kind == "chunks":
            mels = self._integrate([_window_of(payload) for payload in request[1]])
            inputs = [mels[i : i + 1, :, low:high].contiguous() for i, (low, high) in enumerate(request[2])]
            lengths = {int(x.shape[-1]) for x in inputs}
            length = next(iter(lengths))
            if len(inputs) > 1 and len(lengths) == 1 and length in self.vocoder_lengths:
                waves = [
                    wave
                    for start in range(0, len(inputs), self.vocoder_batch)
                    for wave in self.vocoder(torch.cat(inputs[start : start + self.vocoder_batch]))
                ]
            else:
                waves = [self.vocoder(x)[0] for x in inputs]
            return [np.ascontiguousarray(wave.numpy()) for wave in waves]
        raise ValueError(f"unknown request {kind!r}")

    def _integrate(self, windows: list[DiTWindow]) -> torch.Tensor:
        """The windows' mels, as one batch where this process's check holds for their length."""
        first = windows[0]
        key = (first.frames, first.cfg)
        if len(windows) > 1 and key not in self.batching:
            self.batching[key] = dit_batch_holds(self.flow, first.frames, first.cfg, self.dit_batch)
        if len(windows) == 1 or self.batching[key]:
            return self.flow.integrate(windows)
        return torch.cat([self.flow.integrate([w]) for w in windows], dim=0)


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what anything prints goes to stderr, never into a reply
    model_path, threads, dit_batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    child = _Child(model_path, dit_batch)
    requests = sys.stdin.buffer
    with torch.inference_mode():
        while True:
            try:
                request = _read(requests)
            except EOFError:
                return
            try:
                _write(replies, child.answer(request))
            except Exception as exc:  # noqa: BLE001  # the parent does this work itself
                _write(replies, f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
