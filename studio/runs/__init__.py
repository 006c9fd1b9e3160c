"""The one run path: ``service`` (``RunService``: resolve a request, record it, stream it, keep its
outputs; the API, the UI, the CLI and jobs all call it), ``inflight`` (the requests in the engine now:
the ``RequestBoard``) and ``queue`` (the Queue panel's view of them, and who may change what).
"""
