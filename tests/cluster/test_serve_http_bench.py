"""The HTTP load client's figures, from records it would have taken (no server)."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.bench.serve_http import RequestRecord, drive, figures, random_prompts
from workers.loader import bundled_model_path, load_tokenizer


def test_figures_follow_vllms_definitions():
    recs = [RequestRecord(ok=True, status=200, ttft=0.5, latency=2.5, output_tokens=5, prompt_tokens=10,
                          itl=[0.5, 0.5, 0.5, 0.5]),
            RequestRecord(ok=True, status=200, ttft=1.0, latency=2.0, output_tokens=3, prompt_tokens=10,
                          itl=[0.25, 0.75]),
            RequestRecord(ok=False, status=429, latency=0.01, error="queue full")]
    f = figures(recs, elapsed=4.0)
    assert f["completed"] == 2 and f["failed"] == {"429": 1}
    assert f["output_throughput"] == pytest.approx(8 / 4.0)
    assert f["total_token_throughput"] == pytest.approx(28 / 4.0)
    assert f["tpot_median"] == pytest.approx((0.5 + 0.5) / 2)  # (latency - ttft) / (tokens - 1) each
    assert f["ttft_median"] == pytest.approx(0.75)
    assert f["itl_mean"] == pytest.approx(3.0 / 6)


def test_random_prompts_are_seeded_text_of_about_the_asked_length():
    tok = load_tokenizer(bundled_model_path())
    a, b = random_prompts(tok, 4, 64, seed=3), random_prompts(tok, 4, 64, seed=3)
    assert a == b and len(set(a)) == 4
    assert all(48 <= len(tok.encode(p, add_special_tokens=False)) <= 80 for p in a)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _text(t: str) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": None}]}


async def _serve_once(writes: list[bytes], pause: float = 0.01):
    """A one-shot HTTP server that answers every connection with `writes`, one write each,
    `pause` seconds apart, then closes; returns (base URL, server, the requests it read)."""
    seen = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
        seen.append((head, json.loads(await reader.readexactly(length))))
        for w in writes:
            writer.write(w)
            await writer.drain()
            await asyncio.sleep(pause)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}", server, seen


def test_the_load_client_reads_chunked_sse_split_anywhere_and_times_each_text_event():
    stream = (_chunk(_sse(_text("a"))) + _chunk(_sse(_text("b")) + _sse(_text("c")))
              + _chunk(_sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}))
              + _chunk(_sse(b"[DONE]")) + b"0\r\n\r\n")
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    # split the bytes at awkward places: inside the status line, a chunk size, an event
    cuts = [5, len(head) + 1, len(head) + 9, len(head) + 40, len(head) + 61]
    writes = [(head + stream)[a:b] for a, b in zip([0, *cuts], [*cuts, None])]

    async def main():
        base, server, seen = await _serve_once(writes)
        async with server:
            records, _ = await drive(base, "m", ["p1", "p2"], output_len=3)
        return records, seen

    records, seen = asyncio.run(main())
    assert [r.ok for r in records] == [True, True] and all(r.status == 200 for r in records)
    assert all(r.output_tokens == 3 and r.prompt_tokens == 7 for r in records)
    # "b" and "c" arrived in one write: one gap between them of ~0
    assert all(r.ttft is not None and len(r.itl) == 2 for r in records)
    assert sorted(body["prompt"] for _, body in seen) == ["p1", "p2"]
    assert all(body["stream"] and body["max_tokens"] == 3 and body["model"] == "m" for _, body in seen)


def test_the_load_client_records_error_statuses_and_streams_cut_short():
    async def run(writes):
        base, server, _ = await _serve_once(writes)
        async with server:
            records, _ = await drive(base, "m", ["p"], output_len=3)
        return records[0]

    body = b'{"error": {"message": "queue full"}}'
    busy = asyncio.run(run([b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: %d\r\n\r\n" % len(body), body]))
    assert not busy.ok and busy.status == 429 and "queue full" in busy.error
    assert figures([busy], 1.0)["failed"] == {"429": 1}

    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    cut = asyncio.run(run([head, _chunk(_sse(_text("a")))]))  # the server closes mid-stream
    assert not cut.ok and cut.ttft is not None and "closed" in cut.error
    ended = asyncio.run(run([head, _chunk(_sse(_text("a"))), b"0\r\n\r\n"]))  # chunks end, no [DONE]
    assert not ended.ok and "[DONE]" in ended.error
