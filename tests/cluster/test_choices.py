"""SamplingParams(n=...) through the Python API of a launched engine: RequestOutput.outputs
holds the n choices (vLLM's shape; the output's own fields stay choice 0's), streams tag
deltas with their choice, the prompt is computed once (its choices stay on one of the two
replicas), and aborts end every choice."""

from __future__ import annotations

import asyncio
import time

import pytest

import cluster
from cluster import SamplingParams
from scheduler.request import Request

SEEDED = SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=11)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(ray_session):
    with cluster.launch(num_replicas=2, block_size=4, num_kv_blocks=256, threads_per_worker=1) as handle:
        yield handle


def _idle(llm, timeout=60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = llm.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        assert time.monotonic() < deadline, f"requests still running: {s['num_running']}"
        time.sleep(0.05)


def test_generate_n_gives_every_choice_in_outputs(llm):
    out = llm.generate(PROMPT, SEEDED, request_id="story")
    assert out.request_id == "story" and [c.index for c in out.outputs] == [0, 1, 2]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) == 3, texts
    assert (out.text, out.token_ids, out.finish_reason) == (texts[0], out.outputs[0].token_ids,
                                                            out.outputs[0].finish_reason)
    assert all(c.finished and c.metrics is not None for c in out.outputs)
    assert out.num_generated_tokens == sum(len(c.token_ids) for c in out.outputs)
    assert [c.text for c in llm.generate(PROMPT, SEEDED).outputs] == texts  # seeded: run to run
    single = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=1.0, seed=11))
    assert single.text == texts[0] and len(single.outputs) == 1 and single.outputs[0].text == single.text
    assert _idle(llm)["kv_blocks_used"] == 0


def test_the_prompt_is_computed_once_for_all_choices(llm):
    prompt = "Three choices of one request share this prompt's blocks: " + "the cat sat on the mat. " * 6
    before = _idle(llm)
    out = llm.generate(prompt, SEEDED)
    after = _idle(llm)
    p, bs = out.num_prompt_tokens, llm.config.block_size
    shared = (p - 1) // bs * bs
    assert after["prompt_tokens"] - before["prompt_tokens"] == p + 2 * (p - shared)
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 2 * shared
    assert sorted(c.metrics.num_cached_tokens for c in out.outputs) == [0, shared, shared]
    assert after["kv_blocks_used"] == 0
    computed = [a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after["replicas"], before["replicas"])]
    assert sorted(computed) == [0, p + 2 * (p - shared)]  # all three on one replica


def test_greedy_choices_equal_n1(llm):
    one = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))
    two = llm.generate([PROMPT, "北京故宫是"], SamplingParams(n=2, max_tokens=12, temperature=0))
    assert [c.token_ids for c in two[0].outputs] == [one.token_ids] * 2
    assert len(two[1].outputs) == 2 and two[1].outputs[0].token_ids == two[1].outputs[1].token_ids


def test_stream_deltas_carry_their_choice(llm):
    whole = llm.generate(PROMPT, SEEDED)
    deltas = list(llm.stream(PROMPT, SEEDED))
    for c in whole.outputs:
        mine = [d for d in deltas if d.index == c.index]
        assert "".join(d.text for d in mine) == c.text
        assert [d.finished for d in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].output.token_ids == c.token_ids
    assert {d.index for d in deltas} == {0, 1, 2}


def test_async_generate_with_n(llm):
    async def main():
        return await llm.agenerate(PROMPT, SEEDED)

    assert [c.text for c in asyncio.run(main()).outputs] == [c.text for c in llm.generate(PROMPT, SEEDED).outputs]


def test_leaving_a_stream_or_aborting_ends_every_choice(llm):
    long = SamplingParams(n=3, max_tokens=400, temperature=0, ignore_eos=True)
    for d in llm.stream(PROMPT, long):
        if d.index == 2:
            break  # leaving the loop aborts all three
    assert _idle(llm)["kv_blocks_used"] == 0
    ended, aborted = [], False
    for d in llm.stream(PROMPT, long, request_id="to-abort"):
        if not aborted:
            aborted = llm.abort("to-abort")
            assert aborted
        if d.finished:
            ended.append((d.index, d.finish_reason))
    assert sorted(ended) == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert _idle(llm)["kv_blocks_used"] == 0


def test_a_request_id_in_use_is_refused(llm):
    long = SamplingParams(n=2, max_tokens=400, temperature=0, ignore_eos=True)
    stream = llm.stream(PROMPT, long, request_id="taken")
    next(stream)
    with pytest.raises(ValueError, match="taken"):
        llm.generate(PROMPT, long, request_id="taken")
    stream.close()
    assert _idle(llm)["kv_blocks_used"] == 0


def test_the_scheduler_takes_single_choices_only():
    with pytest.raises(ValueError, match="params.n"):
        Request("r", [1, 2, 3], SamplingParams(n=2))
