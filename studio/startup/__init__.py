"""Starting the studio, kept together: what it runs with (``settings``: ``StudioSettings``, built once
from the command line, and ``limits``: ``InputLimits``), the app that holds the port while it loads
(``starting``), and ``launch``, which starts the recorder, the engine, the API and the UI in order.
"""
