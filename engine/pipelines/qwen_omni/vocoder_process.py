"""code2wav's vocoder in a process of its own, for streamed chunks (docs/speech.md, "The vocoder on the
second core").

One Python process runs one bytecode at a time (the GIL): BigVGAN over a chunk is ~230 small convolutions
and element-wise ops, and run on a second thread beside the DiT it mostly waits for the lock (measured: no
faster, and a later first chunk). A child process with the same BigVGAN weights renders the chunks'
samples while this process integrates the next DiT batch. It is the same code on the same CPU with the
same thread count, so it gives the in-process vocoder's bits; :meth:`VocoderProcess.start` checks that on
a random mel before the process is used, and any difference or failure leaves the vocoding in process.

The child renders with the chunk vocoder this process uses (:func:`~engine.pipelines.qwen_omni.bigvgan_cpu.
chunk_vocoder`), a batch of windows of one length in one call where :func:`~engine.pipelines.qwen_omni.
bigvgan_cpu.batch_holds` finds on the child's own thread that a batch gives each window its alone bits:
:meth:`VocoderProcess.start` asks it for the lengths the streams' chunks usually have
(:attr:`VocoderProcess.batch_frames`); a batch of another length is never sent.

The protocol: length-prefixed pickles over the child's stdin and a duplicate of its stdout (the child's
own stdout goes to its stderr, so nothing a library prints can corrupt a reply). A request is
``("render", mels)``, float32 mels (batch, mels, frames) as numpy, answered by their samples (batch, n
float32 numpy); or ``("batches", frames, max_batch)``, answered by the lengths among ``frames`` whose
batches of up to ``max_batch`` windows hold. A failure is answered by its text.
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

from engine.pipelines.qwen_omni.bigvgan_cpu import Vocoder, batch_holds, chunk_vocoder

HEADER = struct.Struct("<Q")  # the pickle's length
START_TIMEOUT_S = 120.0  # importing torch and transformers and loading BigVGAN, on a busy machine
CHECK_FRAMES = 40  # the random mel the start-up check renders both ways


def _write(stream: IO[bytes], payload: Any) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError("the vocoder process closed its pipe")
    (size,) = HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the vocoder process closed its pipe")
    return pickle.loads(data)  # noqa: S301  # our own child's replies


def load_vocoder(model_path: Path) -> torch.nn.Module:
    """BigVGAN from the checkpoint's ``token2wav`` weights, in float32 (as code2wav loads it)."""
    from transformers import Qwen2_5OmniToken2WavModel

    from engine.pipelines.qwen_omni.checkpoint import omni_config, part_state_dict

    config = omni_config(model_path).token2wav_config
    model = Qwen2_5OmniToken2WavModel._from_config(config)
    model.load_state_dict(part_state_dict(model_path, "token2wav."))
    return model.float().eval().code2wav_bigvgan_model


class VocoderProcess:
    """A child process rendering mels to samples with the model's BigVGAN, one request at a time."""

    batch_frames: frozenset[int] = frozenset()  # window lengths it renders in batches (checked there)

    def __init__(self, model_path: Path, threads: int) -> None:
        self._child = subprocess.Popen(
            [sys.executable, "-m", __name__, str(model_path), str(threads)],
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
        local: Vocoder,
        mels: int,
        batch_frames: tuple[int, ...] = (),
        max_batch: int = 1,
    ) -> VocoderProcess | None:
        """A started child whose samples are ``local``'s (this process's chunk vocoder) bit for bit on a
        random mel (call on a thread with the stage's thread count, in inference mode), or None (the child
        is stopped). It renders batches of up to ``max_batch`` windows of those of ``batch_frames`` where
        its check finds them to hold (:attr:`batch_frames`)."""
        try:
            process = cls(model_path, threads)
        except OSError:  # no interpreter to start: vocode in this process
            return None
        try:
            generator = torch.Generator().manual_seed(0)
            mel = torch.randn((1, mels, CHECK_FRAMES), generator=generator)
            ready = threading.Event()
            answer: list[torch.Tensor] = []
            errors: list[BaseException] = []

            def ask() -> None:
                try:
                    answer.append(process.render(mel))
                    if batch_frames and max_batch > 1:
                        process.batch_frames = frozenset(
                            process._ask(("batches", list(batch_frames), max_batch))
                        )
                except BaseException as exc:  # noqa: BLE001  # reported below
                    errors.append(exc)
                ready.set()

            threading.Thread(target=ask, daemon=True).start()
            if not ready.wait(START_TIMEOUT_S) or errors or not answer:
                raise RuntimeError("the vocoder process did not answer")
            if not torch.equal(answer[0], local(mel)):
                raise RuntimeError("the vocoder process's samples differ from this process's")
            return process
        except Exception:
            process.close()
            return None

    def render(self, mels: torch.Tensor) -> torch.Tensor:
        """The samples (batch, n float32) of ``mels`` (batch, mels, frames; a batch only of a length in
        :attr:`batch_frames`); RuntimeError if the child fails."""
        return torch.from_numpy(
            self._ask(("render", mels.detach().to("cpu", torch.float32).contiguous().numpy()))
        )

    def _ask(self, request: tuple[Any, ...]) -> Any:
        assert self._child.stdin is not None and self._child.stdout is not None
        with self._lock:
            _write(self._child.stdin, request)
            reply = _read(self._child.stdout)
        if isinstance(reply, str):
            raise RuntimeError(f"the vocoder process failed: {reply}")
        return reply

    def close(self) -> None:
        try:
            if self._child.stdin is not None:
                self._child.stdin.close()
            self._child.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._child.kill()
            self._child.wait()


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what anything prints goes to stderr, never into a reply
    model_path, threads = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(threads)
    module: Any = load_vocoder(model_path)
    vocoder = chunk_vocoder(module)
    mels = int(module.config.mel_dim)
    requests = sys.stdin.buffer
    with torch.inference_mode():
        while True:
            try:
                request = _read(requests)
            except EOFError:
                return
            try:
                if request[0] == "batches":
                    _, lengths, max_batch = request
                    _write(replies, [f for f in lengths if batch_holds(vocoder, mels, f, max_batch)])
                else:
                    samples = vocoder(torch.from_numpy(request[1])).numpy()
                    _write(replies, np.ascontiguousarray(samples))
            except Exception as exc:  # noqa: BLE001  # the parent renders these chunks itself
                _write(replies, f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
