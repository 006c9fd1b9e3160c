"""PNG recipes (docs/recipes.md): the format every output PNG carries, built, attached and read back
(``recipe``), and the way from a PNG back to its recorded runs and what re-running it takes (``runs``).
"""
