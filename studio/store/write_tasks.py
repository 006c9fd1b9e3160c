"""One queued write of the run recorder, as data: what ``studio/store/recorder.py`` queues and writes (or
journals), and ``studio/store/tracker.py`` submits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from studio.media.images import png_bytes
from studio.store.store import RunStore


class WriteTask:
    """One queued write, as data: a :class:`RunStore` method (``op``) and its JSON-able keyword arguments, so
    that a write the database refuses can go to the journal (:mod:`studio.store.journal`).

    ``prepare`` (run once, on the writer thread, before the first attempt) finishes the arguments: it
    encodes and stores an output file, or reads what the run's earlier writes left (output errors).
    ``extra`` holds arguments that are not journaled (the file's bytes). A task with ``call`` and no
    ``op`` (:meth:`studio.store.recorder.RunRecorder.submit`) cannot be journaled.
    """

    __slots__ = ("description", "op", "run_id", "args", "prepare", "extra", "call", "on_error")

    def __init__(
        self,
        description: str,
        op: str | None = None,
        run_id: str | None = None,
        args: dict[str, Any] | None = None,
        prepare: Callable[[WriteTask], None] | None = None,
        call: Callable[[], Any] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.description = description
        self.op = op
        self.run_id = run_id
        self.args = args or {}
        self.prepare = prepare
        self.extra: dict[str, Any] = {}
        self.call = call
        self.on_error = on_error


def prepare_output_file(store: RunStore, content: Any) -> Callable[[WriteTask], None]:
    """A task's ``prepare`` for an output: encode it on the writer thread (PNG for an image; a function
    that returns the bytes, such as an audio output's WAV encoding, is called) and put the file in the
    content-addressed tree, which needs no database; the task then records its sha256."""

    def prepare(task: WriteTask) -> None:
        if isinstance(content, bytes):
            data = content
        elif callable(content):
            data = content()
        else:
            data = png_bytes(content)
        sha256, _path = store.write_file(data, task.args["mime"])
        task.args.update(sha256=sha256, size_bytes=len(data))
        task.extra["data"] = data

    return prepare
