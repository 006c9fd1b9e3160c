"""What the run store raises."""

from __future__ import annotations


class StoreError(RuntimeError):
    """The run store cannot be opened or used (bad URL, unreachable server, schema too new)."""


class RunNotFound(LookupError):
    """No run has this id (or id prefix)."""


class AmbiguousRunId(LookupError):
    """An id prefix matches more than one run."""


class BundleError(ValueError):
    """A file is not a readable history bundle, or its contents do not check out."""
