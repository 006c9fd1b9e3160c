"""Batch and grid jobs: the job document and its cells (``spec``), the queue and its runner
(``service``: ``JobService``), and the labelled grid of a finished job (``grid``).

The job rows live in the run store (``studio/store/jobs.py``); cells run through ``RunService``.
"""
