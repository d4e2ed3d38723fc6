"""Failures the fuzz suite (test_openapi_fuzz.py) found, each kept as a named test of the HTTP
layer without Ray: a FastAPI TestClient over build_app, with a handle that answers as the
engine did for the request that failed.

- A top-n logprob of -inf (a token the grammar rules out: with response_format json_object,
  `{"prompt": [14], "logprobs": 14, "response_format": {"type": "json_object"}}` asks for 14
  alternatives where the grammar allows two) made /v1/completions and /v1/chat/completions
  answer 500 ("Out of range float values are not JSON compliant") and streams send
  `-Infinity`, which is not JSON. Found with RAYLM_FUZZ_SEED=7 and 99.
"""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient

from cluster.openai.app import ServerState, build_app
from cluster.outputs import RequestOutput, StreamDelta, TokenLogprob

MODEL = "m"
RULED_OUT = -math.inf  # what the engine reports for a token its grammar masks out


def _logprobs() -> list[TokenLogprob]:
    return [TokenLogprob(123, "{", -0.3, [(123, "{", -0.3), (32, " ", -1.3), (40, "(", RULED_OUT)])]


def _output() -> RequestOutput:
    return RequestOutput("r", None, [14], "{", [123], "length", logprobs=_logprobs())


class _Tokenizer:
    def __len__(self) -> int:
        return 256


class GrammarLogprobsHandle:
    """What the routes call on an LLMHandle; every request gets one token whose top logprobs
    include a ruled-out (-inf) one, as the engine answers under a grammar."""

    sampling_defaults: dict = {}
    max_model_len = 128
    tokenizer = _Tokenizer()

    def apply_chat_template(self, messages, tools=None, kwargs=None) -> str:
        return "".join(m["content"] for m in messages)

    async def agenerate(self, prompt, params) -> RequestOutput:
        return _output()

    async def astream_batches(self, prompt, params):
        yield [StreamDelta("r", "{", [123], _logprobs(), "length", _output())]


def _client() -> TestClient:
    state = ServerState([MODEL], None)
    state.handle = GrammarLogprobsHandle()
    return TestClient(build_app(state))


def strict_json(text: str):
    """JSON as the standard has it: no NaN or Infinity (Python's json module takes them)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _floats(value) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [f for v in value for f in _floats(v)]
    return []


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": [14], "logprobs": 3, "max_tokens": 1}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 3, "max_tokens": 1}),
])
def test_a_ruled_out_top_logprob_is_answered_as_valid_json(path, body):
    """A -inf logprob is not a server error: the answer is 200 and strict JSON, the ruled-out
    alternative listed with a finite floor (vLLM's -9999.0) below every real logprob."""
    r = _client().post(path, json=body)
    assert r.status_code == 200, r.text
    answer = strict_json(r.text)
    logprobs = _floats(answer["choices"][0]["logprobs"])
    assert -0.3 in logprobs and -1.3 in logprobs
    assert min(logprobs) == -9999.0


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": [14], "logprobs": 3, "max_tokens": 1, "stream": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 3, "max_tokens": 1, "stream": True}),
])
def test_a_ruled_out_top_logprob_streams_as_valid_json(path, body):
    """Every SSE event of a stream whose top logprobs include a -inf one is strict JSON."""
    r = _client().post(path, json=body)
    assert r.status_code == 200, r.text
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [strict_json(e) for e in events[:-1]]
    with_logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert with_logprobs and min(_floats(with_logprobs)) == -9999.0
