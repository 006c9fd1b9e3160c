"""The ways the studio's commands stop on purpose: a user error, a failed start-up, a SIGTERM.

Both are raised anywhere below the command line (settings, launcher, run service) and turned into a
message and an exit code by ``studio.cli`` only.
"""

from __future__ import annotations


class UserError(Exception):
    """A user error (a bad flag or value): printed without a traceback, exit code 2."""


class StartupError(Exception):
    """The studio cannot start; the message says why and what to change (exit code 1)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a service manager, a container stop), raised in the main thread so that the
    process stops the way Ctrl+C stops it: through every ``finally`` that stops the engine and writes what
    the run recorder still has queued (exit code 143). A KeyboardInterrupt, so that what handles Ctrl+C
    (Gradio closing its server and share tunnel) handles it too."""
