"""Requests in flight per client, engine-wide: who is the lighter client when several share the engine.

The stages serve lighter clients first (docs/batching.md, "Fair admission"): a stage queue takes the
client with the fewest requests in flight first (then the one served longest ago), the lean AR decode
pauses the rows of a heavy client (:func:`yields_to`) while a much lighter client's rows decode, and a
batched stage keeps heavy clients' jobs out of other clients' batches and holds a heavy client's batch
back, for at most :data:`HOLD_LIMIT_S`, while a much lighter client has a request in flight. On a machine whose two CPU threads share one core, any work beside a request slows it
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
# Who yields: a client holding at least this many requests (or decode rows), and at least twice what
# the lighter one holds. Below it clients are equals: a benchmark's eight clients, one of which briefly
# has two requests in flight, keep batching together at full speed (measured: holding back any client
# with more than the lightest cost bench/throughput.py's 8 clients a third of their rate, p95 3.9 s).
HEAVY_REQUESTS = 4


def yields_to(mine: int, other: int) -> bool:
    """Whether a client holding ``mine`` requests (or rows) gives way to one holding ``other`` (> 0)."""
    return mine >= HEAVY_REQUESTS and other > 0 and 2 * other <= mine


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
        """Whether ``client`` is heavy and another client with a request in flight is much lighter
        (:func:`yields_to`)."""
        with self._lock:
            mine = self._requests.get(client, 0)
            return any(yields_to(mine, count) for count in self._requests.values())

    def heavy(self, client: str) -> bool:
        """Whether ``client`` holds at least :data:`HEAVY_REQUESTS` requests."""
        with self._lock:
            return self._requests.get(client, 0) >= HEAVY_REQUESTS
