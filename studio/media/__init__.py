"""Output media, encoded once for everything that needs their bytes (API responses, the run store,
downloads): ``images`` (PNG, with its text chunks). Audio lands here next, as its own module.
"""
