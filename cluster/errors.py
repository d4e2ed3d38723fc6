"""Errors a caller can act on. Bad input is a ValueError naming the field and value."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """No replica can serve: every worker failed beyond its restart budget (HTTP 503)."""
