"""Requests in flight per client, engine-wide: who is the lighter client when several share the engine.

The stages serve lighter clients first (docs/batching.md, "Fair admission"): a stage queue takes the
client with the fewest requests in flight first (then the one served longest ago), the lean AR decode
steps the rows of the clients holding the fewest rows while others wait, and a batched stage holds a
batch of heavier clients' jobs back, for at most :data:`HOLD_LIMIT_S`, while a lighter client has a
request in flight. On a machine whose two CPU threads share one core, any work beside a request slows it
(measured: two processes of small products each run ~2x slower together), so a quiet client's request
runs at nearly its alone speed only if the busy client's work waits; the busy client's work fills the
gaps, and the hold limit bounds how long any of it waits.

The lock here is a leaf: nothing is called while holding it, so the engine (under its own lock) and the
stage workers (under their queues' conditions) may both use it.
"""

from __future__ import annotations

import threading
from collections import Counter

# The longest a batch of a heavier client's jobs is held back while a lighter client's request is in
# flight elsewhere in the engine (a few of a small request's service times): nothing starves.
HOLD_LIMIT_S = 1.0


class ClientLoad:
    """How many requests each client has in flight (submitted, not yet finished)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()

    def add(self, client: str) -> None:
        with self._lock:
            self._requests[client] += 1

    def remove(self, client: str) -> None:
        with self._lock:
            left = self._requests[client] - 1
            if left > 0:
                self._requests[client] = left
            else:
                del self._requests[client]

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self._requests)

    def lighter_than(self, client: str) -> bool:
        """Whether another client has fewer requests in flight than ``client`` (and at least one)."""
        with self._lock:
            mine = self._requests.get(client, 0)
            return any(0 < count < mine for count in self._requests.values())
