"""What the run store hands to callers (plain dataclasses, no database sessions) and how it compares values."""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def iso(value: datetime | None) -> str | None:
    """ISO 8601 text of a timestamp (None stays None)."""
    return value.isoformat() if value is not None else None


def _seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    return max(0.0, (end - start).total_seconds()) if start and end else None


@dataclass(frozen=True)
class StageRecord:
    """One stage of one variant of a run."""

    variant_index: int
    stage_id: int
    kind: str
    status: str
    started_at: datetime | None
    finished_at: datetime | None
    queue_seconds: float
    input_tokens: int
    output_tokens: int
    batch_size: int

    @property
    def seconds(self) -> float | None:
        return _seconds_between(self.started_at, self.finished_at)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(started_at=iso(self.started_at), finished_at=iso(self.finished_at), seconds=self.seconds)
        return data


@dataclass(frozen=True)
class OutputRecord:
    """A file of a run; ``path`` is where its bytes are on this machine."""

    index: int
    kind: str
    sha256: str
    mime: str
    width: int | None
    height: int | None
    size_bytes: int
    path: Path
    duration_seconds: float | None = None  # audio: its length
    sample_rate: int | None = None  # audio: Hz

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"] = str(self.path)
        return data


@dataclass(frozen=True)
class RunSummary:
    """A row of the history list (no request body, stages or files)."""

    id: str
    source: str
    status: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    prompt: str
    model: str
    seed: int | None
    fingerprint: str | None
    config_hash: str | None
    error: str | None
    image_count: int
    thumbnail_sha256: str | None  # the first image, for galleries
    replay_of: str | None = None  # the run this one replays (docs/replay.md); None for a fresh run
    # Runs that speak (docs/speech.md "Runs, files and the CLI"); None otherwise.
    ttfp_seconds: float | None = None
    audio_seconds: float | None = None
    realtime_factor: float | None = None
    audio_count: int = 0  # audio outputs
    audio_sha256: str | None = None  # the first audio output, for players in lists
    owner: str | None = None  # the account the run belongs to (docs/team.md); None without accounts

    @property
    def seconds(self) -> float | None:
        return _seconds_between(self.started_at, self.finished_at)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("created_at", "started_at", "finished_at"):
            data[key] = iso(getattr(self, key))
        data["seconds"] = self.seconds
        return data


@dataclass(frozen=True)
class RunDetail:
    """Everything recorded about a run."""

    id: str
    source: str
    status: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    prompt: str
    model: str
    request: dict[str, Any]
    parameters: dict[str, Any]
    seed: int | None
    config_hash: str | None
    fingerprint: str | None
    error: str | None
    text: str | None
    input_tokens: int | None
    output_tokens: int | None
    stages: list[StageRecord] = field(default_factory=list)
    outputs: list[OutputRecord] = field(default_factory=list)
    config: dict[str, Any] | None = None  # the pipeline-config snapshot (PipelineConfig.to_dict())
    replay_of: str | None = None  # the run this one replays (docs/replay.md); None for a fresh run
    # Runs that speak (docs/run-store.md); None otherwise.
    ttfp_seconds: float | None = None  # submitted -> the first audio its caller received
    audio_seconds: float | None = None  # audio made, every variant
    realtime_factor: float | None = None  # generation seconds / audio seconds
    owner: str | None = None  # the account the run belongs to (docs/team.md); None without accounts

    @property
    def seconds(self) -> float | None:
        return _seconds_between(self.started_at, self.finished_at)

    @property
    def images(self) -> list[OutputRecord]:
        return [o for o in self.outputs if o.kind == "image"]

    @property
    def audio(self) -> list[OutputRecord]:
        return [o for o in self.outputs if o.kind == "audio"]

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("created_at", "started_at", "finished_at"):
            data[key] = iso(getattr(self, key))
        data["stages"] = [s.to_dict() for s in self.stages]
        data["outputs"] = [o.to_dict() for o in self.outputs]
        data["seconds"] = self.seconds
        return data


@dataclass(frozen=True)
class RunFilter:
    """What the history list shows; every field left ``None`` does not filter.

    ``search`` is a case-insensitive prompt substring; ``status`` and ``source`` take one value or several;
    ``config_hash`` may be a prefix (the 8 digits shown in fingerprints); ``since``/``until`` bound
    ``created_at`` (inclusive), as datetimes (naive ones are taken as UTC) or ``time.time()`` stamps.
    ``replay_of`` keeps the replays of one run; ``replays`` True keeps only replays, False only the runs
    that replay nothing (docs/replay.md). ``output_kind`` keeps the runs with at least one output of that
    kind (``audio``: the runs that spoke; one of ``models.OUTPUT_KINDS``) or of any of several.
    ``user`` keeps one account's runs (docs/team.md).
    """

    search: str | None = None
    status: str | Sequence[str] | None = None
    model: str | None = None
    fingerprint: str | None = None
    config_hash: str | None = None
    source: str | Sequence[str] | None = None
    since: datetime | float | None = None
    until: datetime | float | None = None
    replay_of: str | None = None
    replays: bool | None = None
    output_kind: str | Sequence[str] | None = None
    user: str | None = None


@dataclass(frozen=True)
class RunCount:
    """How many runs match: exact up to a cap, beyond it only "more than the cap" (counting stays fast)."""

    value: int  # the exact count, or the cap when there are more
    exact: bool

    @property
    def text(self) -> str:
        """``"1,234"`` or ``"10,000+"``."""
        return f"{self.value:,}" if self.exact else f"{self.value:,}+"


@dataclass(frozen=True)
class RunPage:
    """One page of the history list and the cursor that continues it (``None``: this was the last page)."""

    runs: list[RunSummary]
    next_cursor: str | None


@dataclass(frozen=True)
class ImportResult:
    """What :meth:`RunStore.import_bundle` did."""

    imported: int
    skipped: int  # runs already present (same id)


# -- values -------------------------------------------------------------------------------------------


def as_datetime(value: datetime | float | None) -> datetime | None:
    """A timezone-aware UTC datetime from a datetime (naive = UTC) or a ``time.time()`` stamp."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return datetime.fromtimestamp(float(value), UTC)


def _json_default(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (datetime,)):
        return value.isoformat()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    return str(value)


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types (tuples to lists, enums to values, anything else to its string)."""
    return json.loads(json.dumps(value, default=_json_default))


# What no SQL text or JSON value can hold: lone surrogates (not encodable as UTF-8) and NUL (PostgreSQL
# rejects it in text and in JSON). Each is written as its literal escape (backslash, u, 4 hex digits):
# visible, never dropped.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def storable(value: Any) -> Any:
    """``value`` with every string in it (dict keys too) made storable by any database (see ``_UNSTORABLE``).

    Values that need nothing are returned as they are (the common case costs one regex scan per string).
    """
    if isinstance(value, str):
        return _UNSTORABLE.sub(_escape, value) if _UNSTORABLE.search(value) else value
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value


def config_hash_of(body: Mapping[str, Any]) -> str:
    """The hash ``PipelineConfig.config_hash()`` gives for a config whose ``to_dict()`` is ``body``."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts/lists as ``{"stages.0.engine_args.max_num_seqs": 1, ...}`` (for config diffs)."""
    if isinstance(value, Mapping):
        items: Iterable[tuple[str, Any]] = ((str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    flat: dict[str, Any] = {}
    empty = True
    for key, item in items:
        empty = False
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else key))
    if empty and prefix:
        flat[prefix] = value
    return flat


def diff_mappings(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (a's value, b's value)}`` for every key whose values differ (missing counts as None)."""
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
