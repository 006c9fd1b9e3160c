"""The run store: every run from the UI, the API and the CLI, searchable, comparable and portable.

``open_store`` gives a :class:`RunStore` (synchronous, thread-safe); wrap it in a :class:`RunRecorder` to
record from engine events without blocking an event loop (its ``start_run`` gives a :class:`RunTracker`
per run, ``tracker.py``). ``export_bundle``/``import_bundle`` move runs between stores as one zip; they,
the journal, the recorder and the tracker are built on top of the store, which imports none of them.
"""

from typing import Any

from studio.store.bundle import export_bundle, import_bundle
from studio.store.errors import AmbiguousRunId, BundleError, RunNotFound, StoreError
from studio.store.models import ACTIVE_STATUSES, OUTPUT_KINDS, RUN_SOURCES, RUN_STATUSES
from studio.store.opening import open_store
from studio.store.records import (
    ImportResult,
    OutputRecord,
    RunCount,
    RunDetail,
    RunFilter,
    RunPage,
    RunSummary,
    StageRecord,
)
from studio.store.store import RunStore

__all__ = [
    "ACTIVE_STATUSES",
    "OUTPUT_KINDS",
    "RUN_SOURCES",
    "RUN_STATUSES",
    "AmbiguousRunId",
    "BundleError",
    "ImportResult",
    "OutputRecord",
    "RunCount",
    "RunDetail",
    "RunFilter",
    "RunNotFound",
    "RunPage",
    "RunRecorder",
    "RunStore",
    "RunSummary",
    "RunTracker",
    "StageRecord",
    "StoreError",
    "export_bundle",
    "import_bundle",
    "open_store",
]


def __getattr__(name: str) -> Any:
    # The recorder speaks engine events, and importing the engine loads torch (seconds); the store
    # alone (history commands, tools, a process opening the database) does not need it.
    if name == "RunRecorder":
        from studio.store.recorder import RunRecorder

        return RunRecorder
    if name == "RunTracker":
        from studio.store.tracker import RunTracker

        return RunTracker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
