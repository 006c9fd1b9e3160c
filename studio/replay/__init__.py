"""Replaying recorded runs (docs/replay.md): selecting runs and replaying them through the one run path
(``replayer``: ``select_runs``, ``Replayer``), and what a replay found (``report``).
"""
