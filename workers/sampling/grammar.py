"""Grammars for structured output, through xgrammar: from a GrammarSpec to a compiled grammar.

xgrammar is an optional dependency (`pip install raylm[structured]`), imported only when a
request asks for structured output. `build_grammar` is the one place that turns a spec into
an xgrammar Grammar (the driver calls it to check a request before accepting it; the worker
to compile it); `GrammarCompilerCache` compiles against one tokenizer, once per distinct spec.

JSON is generated compactly (", " and ": " separators, no other whitespace): a model may
not pad its output with whitespace until max_tokens runs out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections import OrderedDict

from scheduler.grammar_spec import GrammarSpec

CACHE_SIZE = 64  # compiled grammars kept per worker
REFUSED_CACHE_SIZE = 256  # grammars a replica remembers refusing, so a repeat is refused without a compile
COMPILE_THREADS = min(8, os.cpu_count() or 1)  # a large vocab's first compile is the slow part


def import_xgrammar(purpose: str = "structured output"):
    """The xgrammar module; ValueError naming `purpose` and saying how to install it when it is absent."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"{purpose} needs xgrammar, which is not installed: pip install 'raylm[structured]' "
                         f"({e})") from None
    return xgrammar


def xgrammar_available() -> bool:
    try:
        import_xgrammar()
    except ValueError:
        return False
    return True


def xgrammar_installed() -> bool:
    """Whether xgrammar and what it imports are installed, without importing them (a worker
    reports this when it starts, so the driver refuses grammars its workers cannot compile)."""
    return all(importlib.util.find_spec(m) is not None for m in ("xgrammar", "tvm_ffi"))


def build_grammar(spec: GrammarSpec):
    """The spec as an xgrammar Grammar; ValueError (with xgrammar's reason) when it is invalid."""
    xgr = import_xgrammar()
    if not isinstance(spec, GrammarSpec):
        raise ValueError(f"grammar must be a GrammarSpec, got {spec!r:.80}")
    try:
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
        if spec.kind == "json_schema":
            schema = json.loads(spec.text)
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            return xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
        return xgr.Grammar.from_ebnf(spec.text)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input as RuntimeError
        raise ValueError(f"invalid {spec.kind} grammar: {_reason(e)}") from None


def json_schema_grammar(schema: dict):
    """An xgrammar Grammar for one JSON schema (dict), with build_grammar's options."""
    return build_grammar(GrammarSpec("json_schema", json.dumps(schema)))


def literal_grammar(text: str):
    """A grammar that matches exactly `text`."""
    return build_grammar(GrammarSpec("ebnf", "root ::= " + json.dumps(text)))


def _reason(e: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(": ", 1)[1] if text.startswith("/") and ": " in text else text


class GrammarCompilerCache:
    """Compiles specs against one tokenizer; the same spec gets the same compiled grammar.
    Thread-safe: a spec another thread is compiling is waited for, not compiled twice (the
    worker compiles an arriving request's grammar ahead of its step, on the actor's thread,
    while steps run on the step channel's; xgrammar compiles without the GIL)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_threads: int = COMPILE_THREADS,
                 cache_size: int = CACHE_SIZE) -> None:
        xgr = import_xgrammar()
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiled = 0  # cache misses
        self._lock = threading.Lock()
        self._compiling: dict[GrammarSpec, threading.Event] = {}

    def compiled(self, spec: GrammarSpec):
        while True:
            with self._lock:
                hit = self._compiled.get(spec)
                if hit is not None:
                    self._compiled.move_to_end(spec)
                    return hit
                busy = self._compiling.get(spec)
                if busy is None:
                    self._compiling[spec] = done = threading.Event()
                    break
            busy.wait()  # then look again: it is cached, or its compile failed and this one tries
        try:
            compiled = self.compiler.compile_grammar(build_grammar(spec))
            with self._lock:
                self.num_compiled += 1
                self._compiled[spec] = compiled
                if len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
            return compiled
        finally:
            with self._lock:
                del self._compiling[spec]
            done.set()

    def matcher(self, spec: GrammarSpec):
        """A fresh GrammarMatcher for `spec` (at the start of its output)."""
        return self.xgr.GrammarMatcher(self.compiled(spec))
