"""The two ways the studio's commands stop on purpose: a user error and a failed start-up.

Both are raised anywhere below the command line (settings, launcher, run service) and turned into a
message and an exit code by ``studio.cli`` only.
"""

from __future__ import annotations


class UserError(Exception):
    """A user error (a bad flag or value): printed without a traceback, exit code 2."""


class StartupError(Exception):
    """The studio cannot start; the message says why and what to change (exit code 1)."""
