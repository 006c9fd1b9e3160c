"""Omni Studio: the web studio, the OpenAI-compatible API, the run store and the CLI around ``engine``."""

__version__ = "0.1.0"
