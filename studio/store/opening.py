"""Opening the run store: connect and migrate (:meth:`RunStore.open`), then replay the journal.

The journal (:mod:`studio.store.journal`) is built on top of the store: it takes a store and writes
through it. So opening, which replays it before anything is served, lives here, above both; the store
itself imports neither the journal nor the bundles.
"""

from __future__ import annotations

from pathlib import Path

from studio.store.files import OutputFiles
from studio.store.journal import replay_journals
from studio.store.store import RunStore


def _replay(store: RunStore) -> None:
    store.replayed_at_open = replay_journals(store)


def open_store(url: str | None, data_dir: Path, files: OutputFiles | None = None) -> RunStore:
    """Open (creating and migrating as needed) the run store; ``url`` None means SQLite in ``data_dir``.

    Writes journaled by an earlier process while its database was down are made first (how many runs
    in ``store.replayed_at_open``). Runs left queued/running by a process that is gone are then marked
    ``interrupted``; how many is in ``store.interrupted_at_open``. Raises :class:`StoreError` when the
    database cannot be used.
    """
    return RunStore.open(url, data_dir, files, before_serving=_replay)
