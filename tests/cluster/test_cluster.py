"""The whole stack on a local Ray: launch -> handle.generate -> replicas -> workers.

HF transformers' greedy generate on the same tiny checkpoint is the oracle."""

from __future__ import annotations

import math
import time

import pytest

import cluster
from cluster import SamplingParams
from tests.oracle import hf_greedy
from workers.loader import bundled_model_path, eos_token_ids

pytestmark = pytest.mark.ray

PROMPTS = [
    "北京故宫是",
    "Hello",
    "The quick brown fox jumps over the lazy dog, and then the dog wakes up and chases the fox around the yard.",
    "Once upon a time",
    "数据并行的副本各自拥有自己的 KV 缓存和调度器。",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A Ray actor owns one accelerator and keeps logits on the device.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny():
    from workers.loader import load_tokenizer

    path = bundled_model_path()
    return path, load_tokenizer(path), frozenset(eos_token_ids(path))


def _expected(tiny, prompts, max_tokens=MAX_TOKENS):
    path, tok, eos = tiny
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    return hf_greedy(path, ids, max_tokens, stop_ids=eos)


def _pool_forcing_preemption(tiny, prompts, block_size, outputs, num_replicas=1):
    """A KV pool per replica that holds the largest request alone but far from its share of
    them at once, sized from the real output lengths (the model stops at EOS)."""
    _, tok, _ = tiny
    need = [math.ceil((len(tok.encode(p, add_special_tokens=False)) + len(o)) / block_size)
            for p, o in zip(prompts, outputs)]
    return max(max(need) + 1, sum(need) // (3 * num_replicas))


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_greedy_parity_under_preemption_and_chunked_prefill(ray_session, tiny, num_replicas):
    expected = _expected(tiny, PROMPTS)
    pool = _pool_forcing_preemption(tiny, PROMPTS, 4, expected, num_replicas)
    with cluster.launch(num_replicas=num_replicas, block_size=4, num_kv_blocks=pool,
                        max_num_batched_tokens=16, max_num_seqs=8, threads_per_worker=1) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert [o.prompt for o in outs] == PROMPTS
    assert stats["num_preemptions"] > 0, "the pool was meant to force preemption"
    assert stats["kv_blocks_used"] == 0
    assert stats["num_replicas"] == num_replicas
    if num_replicas == 2:
        assert all(r["generated_tokens"] > 0 for r in stats["replicas"]), "routing used one replica only"


def test_prefix_cache_hits_keep_parity(ray_session, tiny):
    _, tok, _ = tiny
    prefix = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [prefix + q for q in ("What is Ray?", "什么是昇腾?", "Why page the KV cache?", "Name a prime.")]
    expected = _expected(tiny, prompts, max_tokens=12)
    with cluster.launch(block_size=4, num_kv_blocks=256, threads_per_worker=1) as llm:
        first = llm.generate(prompts[0], SamplingParams(max_tokens=12, temperature=0))
        rest = llm.generate(prompts[1:], SamplingParams(max_tokens=12, temperature=0))
        stats = llm.stats()
    assert [first.token_ids] + [o.token_ids for o in rest] == expected
    prefix_blocks = len(tok.encode(prefix, add_special_tokens=False)) // 4
    assert stats["prefix_hit_tokens"] >= 3 * (prefix_blocks - 1) * 4
    assert 0 < stats["prefix_hit_rate"] < 1
    assert all(o.metrics.num_cached_tokens > 0 for o in rest)


def test_pipelining_on_and_off_give_identical_outputs(ray_session, tiny):
    params = SamplingParams(max_tokens=16, temperature=0)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    results = []
    for depth in (1, 2):
        with cluster.launch(pipeline_depth=depth, num_kv_blocks=128, threads_per_worker=1) as llm:
            results.append(([o.token_ids for o in llm.generate(PROMPTS, params)],
                            [o.token_ids for o in llm.generate(PROMPTS[:3], seeded)],
                            llm.stats()["pipeline_depth"]))
    (greedy1, seeded1, d1), (greedy2, seeded2, d2) = results
    assert (d1, d2) == (1, 2)
    assert greedy1 == greedy2 == _expected(tiny, PROMPTS, max_tokens=16)
    assert seeded1 == seeded2


def test_steps_over_the_socket_channel_and_as_ray_calls_give_identical_outputs(ray_session, tiny):
    params = SamplingParams(max_tokens=16, temperature=0)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, logprobs=2)
    results = {}
    for channel in ("socket", "ray"):
        with cluster.launch(step_channel=channel, num_kv_blocks=128, threads_per_worker=1) as llm:
            info = llm.stats()["replicas"][0]["info"]
            greedy = [o.token_ids for o in llm.generate(PROMPTS, params)]
            sampled = llm.generate(PROMPTS[:3], seeded)
            results[channel] = (info["step_channel"], greedy, [o.token_ids for o in sampled],
                                [[lp.logprob for lp in o.logprobs] for o in sampled])
            assert isinstance(info["step_channel"], str)  # the channel's address and secret stay out of stats
    assert results["socket"][0] == "socket" and results["ray"][0] == "ray"
    assert results["socket"][1] == _expected(tiny, PROMPTS, max_tokens=16)
    assert results["socket"][1:3] == results["ray"][1:3]
    # logprobs to fp32 rounding: which step a request joins depends on timing, and on some CPUs
    # (AVX-512 seen) the GEMMs' summation order depends on the batch's row count
    for lp_socket, lp_ray in zip(results["socket"][3], results["ray"][3], strict=True):
        assert lp_socket == pytest.approx(lp_ray, rel=1e-4, abs=1e-5)


def test_stream_chinese_deltas_never_split_a_character(ray_session, tiny):
    _, tok, _ = tiny
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1) as llm:
        deltas = list(llm.stream("北京故宫是", SamplingParams(max_tokens=48, temperature=0)))
    final = deltas[-1].output
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == final.text
    assert sum((d.token_ids for d in deltas), []) == final.token_ids
    # Splitting into deltas adds no replacement character the whole decode doesn't have.
    whole = tok.decode(final.token_ids, skip_special_tokens=True)
    assert final.text == whole
    assert sum(d.text.count("\ufffd") for d in deltas) == whole.count("\ufffd")


def test_concurrent_streams_get_each_step_with_one_wake_up_of_their_loop(ray_session, tiny):
    """Eight asyncio streams on one loop: every step's deltas for all of them arrive in one
    hand-over to the loop (not one per delta), in order, and equal what generate gives."""
    import asyncio

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = PROMPTS + ["one more"]
    with cluster.launch(num_kv_blocks=128, threads_per_worker=1) as llm:
        expected = llm.generate(prompts, params)

        async def run():
            loop = asyncio.get_running_loop()
            calls = []
            real = loop.call_soon_threadsafe
            loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
            steps0 = llm.stats()["steps_returned"]

            async def one(p):
                return [d async for d in llm.astream(p, params)]

            got = await asyncio.gather(*[one(p) for p in prompts])
            del loop.call_soon_threadsafe
            return got, len(calls), llm.stats()["steps_returned"] - steps0

        got, wakeups, steps = asyncio.run(run())
    deliveries = sum(len(d) for d in got)
    assert steps > 0 and wakeups <= steps < deliveries
    for deltas, want in zip(got, expected):
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        assert sum((d.token_ids for d in deltas), []) == want.token_ids
        assert "".join(d.text for d in deltas) == want.text == deltas[-1].output.text


@pytest.mark.parametrize("env", [None, "1", "0"])
def test_bytes_pulled_per_decode_step(ray_session, tiny, monkeypatch, env):
    if env is None:
        monkeypatch.delenv("RAYLM_DEVICE_OUTPUTS", raising=False)
    else:
        monkeypatch.setenv("RAYLM_DEVICE_OUTPUTS", env)
    batch = 4
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with cluster.launch(num_kv_blocks=128, threads_per_worker=1) as llm:
        outs = llm.generate(PROMPTS[:batch], params)
        stats = llm.stats()
        vocab = llm.engine.vocab_size
    assert all(len(o.token_ids) == 12 for o in outs)
    assert stats["decode_steps"] > 0
    assert stats["rows_per_decode_step"] == pytest.approx(batch, abs=1)
    per_step = stats["bytes_pulled_per_decode_step"]
    if env == "0":
        assert stats["device_outputs"] is False
        assert per_step >= 4 * vocab * (batch - 1)
        assert [o.token_ids for o in outs] == _expected_no_eos(tiny, PROMPTS[:batch], 12)
    else:
        assert stats["device_outputs"] is True
        assert per_step <= 16 * batch + 256


def _expected_no_eos(tiny, prompts, n):
    path, tok, _ = tiny
    return hf_greedy(path, [tok.encode(p, add_special_tokens=False) for p in prompts], n)


def test_idle_engine_does_not_spin(ray_session):
    with cluster.launch(num_kv_blocks=32, threads_per_worker=1) as llm:
        llm.generate("Hello", SamplingParams(max_tokens=4))
        time.sleep(0.2)  # let the loop settle into its wait
        before = llm.stats()["loop_iterations"]
        time.sleep(1.0)
        idle = llm.stats()["loop_iterations"] - before
        llm.generate("Hello", SamplingParams(max_tokens=4))
        busy = llm.stats()["loop_iterations"] - before
    assert idle == 0
    assert busy > 0


def test_faked_npus_get_their_own_visible_devices(ray_session):
    with cluster.launch(num_replicas=2, accelerator_resource="NPU", num_kv_blocks=32, threads_per_worker=1) as llm:
        infos = [r["info"] for r in llm.stats()["replicas"]]
        out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
    visible = [i["visible_devices"]["ASCEND_RT_VISIBLE_DEVICES"] for i in infos]
    assert sorted(visible) == ["0", "1"]
    assert len(out.token_ids) == 4


def test_abort_mid_stream_frees_blocks_and_stop_strings_cut_text(ray_session, tiny):
    with cluster.launch(num_kv_blocks=64, threads_per_worker=1) as llm:
        stream = llm.stream("Once upon a time", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                            request_id="to-abort")
        first = next(stream)
        assert not first.finished
        assert llm.abort("to-abort") is True
        rest = list(stream)
        assert rest[-1].finish_reason == "abort"
        assert llm.stats()["kv_blocks_used"] == 0
        assert llm.abort("to-abort") is False

        free = llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        stop = free.text[5:8]  # a piece of text the model really produces
        cut = llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                              stop=[stop]))
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert stop not in cut.text
        assert free.text.startswith(cut.text) and cut.text == free.text[: free.text.index(stop)]
        assert llm.stats()["kv_blocks_used"] == 0
        worker_ids = [r["info"]["pid"] for r in llm.stats()["replicas"]]
    assert worker_ids
    assert _alive_worker_actors(ray_session) == []


def _alive_worker_actors(ray):
    """WorkerActors still alive in this Ray (GCS table; no dashboard needed)."""
    from ray._private import state

    return [a for a in state.actors().values()
            if a.get("State") == "ALIVE" and "Worker" in str(a.get("ActorClassName"))]


def test_bad_input_is_refused_and_the_engine_keeps_serving(ray_session):
    with cluster.launch(num_kv_blocks=32, threads_per_worker=1, max_model_len=64) as llm:
        with pytest.raises(ValueError, match="prompt"):
            llm.generate("")
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate("word " * 80)
        with pytest.raises(ValueError, match="max_tokens"):
            llm.generate("Hello", SamplingParams(max_tokens=100))
        with pytest.raises(ValueError, match="top_p"):
            llm.generate("Hello", SamplingParams(top_p=1.5))
        assert len(llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0)).token_ids) == 3
        fill = llm.generate("Hello", SamplingParams(max_tokens=None, ignore_eos=True))
        assert fill.num_prompt_tokens + len(fill.token_ids) == 64 and fill.finish_reason == "length"
    with pytest.raises(ValueError, match="num_replicas"):
        cluster.launch(num_replicas=0)
    with pytest.raises(ValueError, match="unknown config"):
        cluster.launch(bogus_option=1)
