"""Errors a caller can act on. Bad input is a ValueError naming the field and value."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """No replica can serve: every worker failed beyond its restart budget (HTTP 503).
    `retry_after_s`, when known, is how long until a replica tries to come back."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestRefused(ValueError):
    """A request the engine accepted and then refused for its own input (e.g. a grammar that did
    not compile in time): bad input (HTTP 400), raised to the request's reader."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id
