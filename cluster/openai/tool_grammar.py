"""The grammar of a forced tool call: tool_choice "required" or a named function.

The prompt already ends with the call's start (ChatCompletionRequest.forced_prefix: up to
`"arguments":` for a named function, up to the opening quote of the name for "required");
the grammar constrains the rest of Qwen3's format, so the call is well formed:

    named:     ' ' ARGS '}\\n</tool_call>'
    required:  NAME '", "arguments": ' ARGS '}\\n</tool_call>'   for one of the offered tools

where ARGS is a JSON object valid against that tool's `parameters` schema (any object when
it has none). One call: a finished grammar allows only EOS. It travels as EBNF text (xgrammar's
own, printed from the composed grammar), compiled on the worker like any other grammar.
"""

from __future__ import annotations

from scheduler.grammar_spec import GrammarSpec
from workers.sampling.grammar import build_grammar, import_xgrammar, json_schema_grammar, literal_grammar

CALL_TAIL = "}\n</tool_call>"


def _arguments(tool: dict, index: int):
    params = tool.get("parameters")
    try:
        return build_grammar(GrammarSpec("json_object")) if params is None else json_schema_grammar(params)
    except ValueError as e:
        raise ValueError(f"tools[{index}].function.parameters is not a JSON schema raylm can constrain to: "
                         f"{e}") from None


def tool_call_grammar(tools: list[dict], name: str | None) -> GrammarSpec:
    """tools: each offered function as {"name": ..., "parameters": {...} or None}; name: the
    function tool_choice names, or None for "required" (any of them)."""
    xgr = import_xgrammar(f"tool_choice {name!r}" if name is not None else "tool_choice 'required'")
    if name is not None:
        index = next(i for i, t in enumerate(tools) if t["name"] == name)
        grammar = xgr.Grammar.concat(literal_grammar(" "), _arguments(tools[index], index), literal_grammar(CALL_TAIL))
    else:
        calls = [xgr.Grammar.concat(literal_grammar(t["name"] + '", "arguments": '), _arguments(t, i),
                                    literal_grammar(CALL_TAIL)) for i, t in enumerate(tools)]
        grammar = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    return GrammarSpec("ebnf", str(grammar))
