"""The SSE path of the HTTP server without an engine: the chunk JSON written from a
per-stream prefix, and the event stream written straight to ASGI send (order, [DONE], a
failed delta, a client that disconnects while the next batch is awaited)."""

from __future__ import annotations

import asyncio
import json
import random

from cluster.openai import api_models as oa
from cluster.openai.app import _CompletionEvents, _EventStream
from cluster.outputs import RequestOutput, StreamDelta


def test_completion_chunk_text_is_the_chunk_dict_encoded():
    rng = random.Random(0)
    alphabet = ['a', ' ', '"', '\\', '\n', '\t', '\x01', 'é', '北', '😀', '</s>', '\u2028']
    fast = oa.CompletionChunkText('cmpl-"x"', "mod\\el", 1700000000)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 6)))
        reason = rng.choice([None, None, "length", "stop", "abort"])
        d = StreamDelta("r", text, [1], finish_reason=reason, index=rng.randrange(3))
        want = oa.completion_chunk('cmpl-"x"', "mod\\el", 1700000000, d, 0)
        got = fast(d)
        assert json.loads(got) == want
        assert got == json.dumps(want, ensure_ascii=False)  # the very same text, key order included


class _Body:
    model, n, include_usage = "m", 1, False


def _output(texts, reason, error=None):
    return RequestOutput("r", None, [1, 2], "".join(texts), list(range(len(texts))), reason, error=error)


def _deltas(texts, reason="length"):
    return [StreamDelta("r", t, [i], finish_reason=reason, output=_output(texts, reason))
            if i == len(texts) - 1 and reason else StreamDelta("r", t, [i]) for i, t in enumerate(texts)]


class _Batches:
    """astream_batches' shape: an async iterator of delta lists, with aclose."""

    def __init__(self, batches, hang=False):
        self.batches, self.hang, self.closed = list(batches), hang, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.batches:
            return self.batches.pop(0)
        if self.hang:
            await asyncio.sleep(3600)
        raise StopAsyncIteration

    async def aclose(self):
        self.closed = True


def _run(stream, disconnect_after: float | None = None):
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        if disconnect_after is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def main():
        await asyncio.wait_for(stream({"type": "http"}, receive, send), 10)

    asyncio.run(main())
    return sent


def _events(sent) -> list[str]:
    body = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    return [e.removeprefix("data: ") for e in body.split("\n\n") if e]


def test_event_stream_writes_each_batch_once_then_done():
    deltas = _deltas(["Hel", "lo", " wor", "ld"])
    batches = _Batches([deltas[1:3], deltas[3:]])
    sent = _run(_EventStream([deltas[0]], batches, _CompletionEvents("cmpl-1", _Body())))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert not any(k == b"content-length" for k, _ in sent[0]["headers"])
    assert len(sent) == 1 + 3 + 1 + 1  # start, one write per batch, [DONE], the end
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    events = _events(sent)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert batches.closed


def test_a_failed_delta_ends_the_stream_with_its_error_then_done():
    deltas = _deltas(["a", "b"], reason=None) + [
        StreamDelta("r", "", [], finish_reason="error", output=_output(["a", "b"], "error", "worker died"))]
    batches = _Batches([deltas[1:]])
    sent = _run(_EventStream([deltas[0]], batches, _CompletionEvents("cmpl-2", _Body())))
    events = _events(sent)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"] == oa.error_body(
        "generation failed: worker died", "service_unavailable")["error"]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == ["a", "b"]
    assert batches.closed and sent[-1]["more_body"] is False


def test_a_client_that_disconnects_closes_the_batches_and_ends_without_done():
    batches = _Batches([], hang=True)  # the engine has nothing more yet
    sent = _run(_EventStream(_deltas(["x"], reason=None), batches, _CompletionEvents("cmpl-3", _Body())),
                disconnect_after=0.05)
    assert batches.closed  # what aborts the request
    assert "[DONE]" not in _events(sent) and sent[-1]["more_body"] is True


def test_a_send_that_fails_closes_the_batches_without_raising():
    batches = _Batches([_deltas(["b"], reason=None)], hang=True)
    sent = []

    async def send(message):
        if len(sent) == 2:
            raise OSError("connection reset")
        sent.append(message)

    async def receive():
        await asyncio.sleep(3600)

    stream = _EventStream(_deltas(["a"], reason=None), batches, _CompletionEvents("cmpl-4", _Body()))
    asyncio.run(asyncio.wait_for(stream({"type": "http"}, receive, send), 10))
    assert batches.closed and len(sent) == 2  # the start and the first batch
