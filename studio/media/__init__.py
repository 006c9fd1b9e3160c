"""Output media, encoded once for everything that needs their bytes (API responses, the run store,
downloads): ``images`` (PNG, with its text chunks) and ``audio`` (WAV, FLAC, MP3, OGG/Opus and raw pcm16
through libsndfile, the recipe in WAV/FLAC comments; input audio decoded and resampled; docs/speech.md).
"""
