"""Speech tempo: play an utterance faster or slower without changing its pitch (docs/speech.md, "Speed").

Resampling changes tempo and pitch together (a voice played 2x fast an octave higher); a time-scale
modification keeps the pitch. :class:`Tempo` runs audiotsm's WSOLA (waveform-similarity overlap-add: frames
taken ``speed`` times further apart than they are laid down, each shifted within a tolerance to line up
with what came before) and is made for streams: chunks pushed one after another give the same samples,
bit for bit, as the whole utterance pushed at once (tested), so a streamed reply and its recorded file
agree.

The stretched utterance lasts ``round(n / speed)`` samples plus half a WSOLA frame (``SLACK``, 21 ms at
24 kHz): WSOLA's first frame starts on silence and may line the speech up to that much later, so the
slack keeps the utterance's last sound (measured: docs/speech.md).
"""

from __future__ import annotations

import numpy as np

MIN_SPEED = 0.25  # OpenAI's range for ``speed``
MAX_SPEED = 4.0
FRAME = 1024  # samples per WSOLA frame (43 ms at 24 kHz: a few pitch periods of any voice)
SLACK = FRAME // 2


class Tempo:
    """One utterance's time stretch: :meth:`push` each piece as it comes, :meth:`finish` once at the end.

    Each returns the stretched samples ready so far (float32, possibly none: the stretcher holds back
    about one frame).
    """

    def __init__(self, speed: float) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be from {MIN_SPEED:g} to {MAX_SPEED:g}, got {speed:g}")
        from audiotsm import wsola

        self.speed = float(speed)
        # Past 2x the analysis hop (synthesis hop x speed) would outgrow the frame and audiotsm skips
        # input wrongly (measured: 4x came out 6x fast); a quarter-frame hop keeps it within one frame.
        hop = FRAME // 2 if speed <= 2.0 else FRAME // 4
        self._tsm = wsola(1, speed=self.speed, frame_length=FRAME, synthesis_hop=hop)
        self._taken = 0  # input samples pushed
        self._given = 0  # output samples returned
        self._finished = False

    def push(self, samples: np.ndarray) -> np.ndarray:
        if self._finished:
            raise RuntimeError("this utterance is finished: make a new Tempo")
        samples = np.asarray(samples, dtype=np.float64).reshape(-1)
        self._taken += samples.size
        return self._limited(self._run(samples), pad=False)

    def finish(self) -> np.ndarray:
        """The rest: what the stretcher held back, the utterance's end flushed out with silence."""
        if self._finished:
            raise RuntimeError("this utterance is already finished")
        self._finished = True
        # The silence pushes the last real frames through before the flush (audiotsm's own flush leaves
        # the final frame or two out); what it adds past the utterance's length is cut below.
        return self._limited(self._run(np.zeros(4 * FRAME), flush=True), pad=True)

    def _run(self, samples: np.ndarray, flush: bool = False) -> np.ndarray:
        from audiotsm.io.array import ArrayReader, ArrayWriter

        reader, writer = ArrayReader(samples[np.newaxis, :]), ArrayWriter(1)
        while True:
            self._tsm.read_from(reader)
            _, drained = self._tsm.write_to(writer)
            if drained and reader.empty:
                break
        while flush:
            _, done = self._tsm.flush_to(writer)
            flush = not done
        return writer.data[0]

    def _limited(self, out: np.ndarray, pad: bool) -> np.ndarray:
        """At most the stretched length in all (``pad``: exactly it, silence added if WSOLA fell short)."""
        length = round(self._taken / self.speed) + (SLACK if self._taken else 0)
        out = out[: max(0, length - self._given)]
        if pad and self._given + out.size < length:
            out = np.pad(out, (0, length - self._given - out.size))
        self._given += out.size
        return out.astype(np.float32)


def stretch(samples: np.ndarray, speed: float) -> np.ndarray:
    """A whole utterance at ``speed`` (1.0: returned as it is)."""
    if speed == 1.0:
        return np.asarray(samples, dtype=np.float32).reshape(-1)
    tempo = Tempo(speed)
    return np.concatenate([tempo.push(samples), tempo.finish()])
