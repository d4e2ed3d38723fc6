"""Errors a caller can act on. Bad input is a ValueError naming the field and value."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """No replica can serve: every worker failed beyond its restart budget (HTTP 503).
    `retry_after_s`, when known, is how long until a replica tries to come back."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s
