"""ServeEngine (the ingress's engine client) against a stand-in for Serve's DeploymentHandle: what a
caller sees when an engine goes away before and after its request streamed, and input errors.
No Ray or Serve runs here."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

import cluster.remote.messages as messages
from cluster import SamplingParams
from cluster.config import EngineConfig
from cluster.errors import EngineDeadError
from cluster.handle import LLMHandle
from cluster.outputs import RequestOutput, StreamDelta
from cluster.serve.serve_engine import MAX_TRIES, ServeEngine

INFO = {"config": EngineConfig().to_dict(), "model_path": "random:unused", "max_model_len": 64, "vocab_size": 100}


def item(rid: str, ids: list[int], *, done_with: list[int] | None = None) -> bytes:
    """One stream item: a delta of `ids`, the last one when `done_with` (every id) is given."""
    out = None
    if done_with is not None:
        out = RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[1, 2], text="", token_ids=done_with,
                            finish_reason="length")
    delta = StreamDelta(rid, "", ids, None, "length" if done_with is not None else None, out)
    return messages.pack([messages.delta_entry(delta)])


class FakeHandle:
    """Each call of `generate` plays the next script: a list of items, or an exception raised
    after the items before it."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)
        self.calls = []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        self.calls.append(request)
        script = self.scripts.pop(0)

        async def stream():
            for step in script:
                if isinstance(step, BaseException):
                    raise step
                yield step
        return stream()


def run(engine: ServeEngine, prompt=(1, 2), max_tokens: int = 3):
    llm = LLMHandle(engine)
    return asyncio.run(llm.agenerate(list(prompt), SamplingParams(max_tokens=max_tokens), request_id="r"))


def test_a_request_whose_engine_died_before_a_token_is_sent_again():
    handle = FakeHandle([ActorDiedError()], [item("r", [7]), item("r", [8, 9], done_with=[7, 8, 9])])
    engine = ServeEngine(handle, INFO)
    out = run(engine)
    assert out.token_ids == [7, 8, 9] and out.finish_reason == "length"
    assert len(handle.calls) == 2 and handle.calls[0] == handle.calls[1]
    assert engine.retries == 1


def test_a_request_that_streamed_ends_with_an_error_and_its_tokens():
    handle = FakeHandle([item("r", [7]), item("r", [8]), ActorDiedError()])
    engine = ServeEngine(handle, INFO)
    out = run(engine)
    assert out.finish_reason == "error" and "lost the engine" in out.error
    assert out.token_ids == [7, 8] and out.prompt_token_ids == [1, 2]  # its usage
    assert len(handle.calls) == 1 and engine.retries == 0


def test_a_request_lost_on_every_try_is_refused_as_with_no_engine():
    handle = FakeHandle(*[[ActorDiedError()] for _ in range(MAX_TRIES)])
    with pytest.raises(EngineDeadError, match=f"lost the engine.*tried {MAX_TRIES} times"):
        run(ServeEngine(handle, INFO))
    assert len(handle.calls) == MAX_TRIES


def test_input_errors_are_raised_as_the_engine_raised_them_and_not_retried():
    refused = RayTaskError("generate", "traceback", ValueError("max_tokens must be >= 1, got 0"))
    handle = FakeHandle([refused])
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        run(ServeEngine(handle, INFO))
    assert len(handle.calls) == 1


def test_a_stream_that_ends_unfinished_counts_as_a_lost_engine():
    handle = FakeHandle([], [item("r", [5], done_with=[5])])
    out = run(ServeEngine(handle, INFO), max_tokens=1)
    assert out.token_ids == [5] and len(handle.calls) == 2
