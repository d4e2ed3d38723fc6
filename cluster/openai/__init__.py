"""The OpenAI-compatible HTTP layer: routes, SSE, request and response models, reasoning and
tool-call parsing, the tool-call grammar, connection limits and the HTTP server's start."""
