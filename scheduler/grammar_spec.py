"""GrammarSpec: what a request's output must match (structured output), as it travels.

Pure Python and small: a kind and a text, sent once in a request's NewRequest. The worker
compiles it with xgrammar (workers/sampling/grammar.py) and keeps the matcher next to the request;
nothing about the grammar crosses the wire per step.

Kinds:
- "json_object": any JSON object (OpenAI's response_format {"type": "json_object"});
- "json_schema": `text` is a JSON schema, as JSON text;
- "ebnf": `text` is a grammar in xgrammar's EBNF (the tool-call grammar of tool_choice
  "required" or a named function is built this way, cluster/openai/tool_grammar.py).
"""

from __future__ import annotations

from dataclasses import dataclass

GRAMMAR_KINDS = ("json_object", "json_schema", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"grammar text must be a string, got {type(self.text).__name__}")
        if self.kind != "json_object" and not self.text.strip():
            raise ValueError(f"a {self.kind} grammar needs a non-empty text")
