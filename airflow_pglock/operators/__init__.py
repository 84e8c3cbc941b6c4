"""The operator guard: ``guarded(operator, key=...)``."""
