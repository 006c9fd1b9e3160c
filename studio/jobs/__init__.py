"""Batch and grid jobs: the job document and its cells (``spec``), the queue (``service``:
``JobService``) and its runner (``runner``: ``JobRunner``), and the labelled grid of a finished job
(``grid``; recorded as a run by ``grid_run``).

The job rows live in the run store (``studio/store/jobs.py``); cells run through ``RunService``.
"""
