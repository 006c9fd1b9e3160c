"""Which account each UI browser session is logged in as (docs/team.md).

The UI records a session's login when its page loads (``studio/ui/app.py``), so the run path can tell whose
a UI run is from the session id the tabs already pass (``Studio.run``). Bounded: the oldest sessions are
forgotten first. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_SESSIONS = 10_000


class SessionUsers:
    """UI session id -> the account logged in there."""

    def __init__(self, limit: int = MAX_SESSIONS) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._users: OrderedDict[str, str] = OrderedDict()

    def remember(self, session: str | None, user: str | None) -> None:
        if not session:
            return
        with self._lock:
            self._users.pop(session, None)
            if user:
                self._users[session] = user
                while len(self._users) > self.limit:
                    self._users.popitem(last=False)

    def user_of(self, session: str | None) -> str | None:
        if not session:
            return None
        with self._lock:
            return self._users.get(session)
