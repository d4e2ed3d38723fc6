"""ModelRunner against HF transformers `generate` (greedy, fp32, the bundled tiny model)."""

from __future__ import annotations

import pytest
import torch

from scheduler.protocol import (
    USE_RESIDENT,
    NewRequest,
    ScheduledRow,
    StepPlan,
    StepResult,
    WorkerSampling,
    sampled_on_device,
)
from tests import oracle
from tests.devices import DEVICES
from tests.plans import PlanDriver
from workers.loader import bundled_model_path, load_tokenizer
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig
from workers.sampling.logits_codec import logits_tensor

BS = 4
NEW = 32
PROMPTS = [[5, 100, 200], list(range(10, 40)), [7] * 17, list(range(300, 345, 2)), [1200, 3, 800, 44, 9, 1]]


@pytest.fixture(scope="module")
def hf():
    return bundled_model_path()


def hf_greedy(path, prompt, n=NEW):
    return oracle.hf_greedy(path, [prompt], n)[0]


@pytest.fixture(scope="module")
def expected(hf):
    return oracle.hf_greedy(hf, PROMPTS, NEW)


def make_runner(device="cpu", **kw):
    kw.setdefault("block_size", BS)
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("max_num_seqs", 8)
    return ModelRunner(RunnerConfig(device=device, **kw))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
@pytest.mark.parametrize("resident", [True, False], ids=["resident", "explicit"])
def test_greedy_batch_matches_hf_generate(device, chunk, resident, expected):
    driver = PlanDriver(make_runner(device), chunk_size=chunk, resident=resident)
    for prompt in PROMPTS:
        driver.add(prompt)
    assert driver.generate(NEW) == expected
    if chunk:  # several chunks per prompt, mixed with other requests' decode rows
        assert any(len(r.slots) < len(PROMPTS) for r in driver.results)


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_served_from_cached_blocks_matches_hf(device, hf):
    driver = PlanDriver(make_runner(device))
    first = driver.add(PROMPTS[1])  # 30 tokens: 7 full blocks
    driver.generate(4)
    k = 5
    second_prompt = PROMPTS[1][: k * BS] + [900, 901, 902, 903, 904, 905]
    second = driver.add(second_prompt, cached_blocks=first.block_table[:k])
    driver.generate(NEW)
    plan = next(p for p in driver.plans if p.new_requests and p.new_requests[0].slot == second.slot)
    admitted = plan.new_requests[0]
    assert admitted.num_computed == k * BS and admitted.block_table[:k] == first.block_table[:k]
    row = next(r for r in plan.rows if r.slot == second.slot)
    assert row.num_tokens == len(second_prompt) - k * BS  # only the uncached tail is computed
    assert second.outputs[:NEW] == hf_greedy(hf, second_prompt)
    assert first.outputs[:NEW] == hf_greedy(hf, PROMPTS[1])


def test_preempted_request_is_recomputed_in_a_reused_slot(hf, expected):
    runner = make_runner()
    driver = PlanDriver(runner)
    req = driver.add(PROMPTS[0])
    driver.generate(6)
    # preempt, then re-admit in the same slot in the same plan with prompt + outputs so far
    blocks = [200, 201, 202]
    tokens = PROMPTS[0] + req.outputs
    plan = StepPlan(step_id=99, preempted=[req.slot],
                    new_requests=[NewRequest(req.slot, tokens, 0, blocks, WorkerSampling())],
                    rows=[ScheduledRow(req.slot, len(tokens))])
    result = runner.execute(plan)
    assert result.slots == [req.slot] and result.sampled_ids() == [expected[0][len(req.outputs)]]
    nxt = runner.execute(StepPlan(step_id=100, rows=[ScheduledRow(req.slot, 1, [], USE_RESIDENT)]))
    assert nxt.sampled_ids() == [expected[0][len(req.outputs) + 1]]


def test_resident_and_explicit_decode_rows_agree_step_by_step():
    a, b = PlanDriver(make_runner(), resident=True), PlanDriver(make_runner(), resident=False)
    for d in (a, b):
        for prompt in PROMPTS[:3]:
            d.add(prompt)
        d.generate(10)
    for pa, pb, ra, rb in zip(a.plans, b.plans, a.results, b.results):
        decode_a = [r.token for r in pa.rows if r.token is not None]
        decode_b = [r.token for r in pb.rows if r.token is not None]
        assert decode_a == [USE_RESIDENT] * len(decode_b) and USE_RESIDENT not in decode_b
        assert ra.slots == rb.slots and ra.sampled_ids() == rb.sampled_ids()


def test_resident_token_needs_a_token_sampled_on_this_worker():
    runner = make_runner(device_outputs=False)  # the driver samples: nothing is resident
    runner.execute(StepPlan(0, new_requests=[NewRequest(0, [1, 2], 0, [0], WorkerSampling())],
                            rows=[ScheduledRow(0, 2)]))
    with pytest.raises(ValueError, match="sampled none"):
        runner.execute(StepPlan(1, rows=[ScheduledRow(0, 1, [], USE_RESIDENT)]))
    assert runner.execute(StepPlan(1, rows=[ScheduledRow(0, 1, [], 7)])).logits_shape[0] == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("env,flag,on_device", [(None, None, True), ("1", None, True), ("0", None, False),
                                                ("0", True, True), ("1", False, False)])
def test_device_outputs_switch(monkeypatch, device, env, flag, on_device, expected):
    if env is None:
        monkeypatch.delenv("RAYLM_DEVICE_OUTPUTS", raising=False)
    else:
        monkeypatch.setenv("RAYLM_DEVICE_OUTPUTS", env)
    runner = make_runner(device, device_outputs=flag)
    driver = PlanDriver(runner, resident=on_device)
    for prompt in PROMPTS[:4]:
        driver.add(prompt)
    host_argmax = lambda r: logits_tensor(r).argmax(dim=-1).tolist()  # noqa: E731  (the driver samples)
    outs = driver.generate(8, ids_from_logits=None if on_device else host_argmax)
    assert outs == [e[:8] for e in expected[:4]]
    real_vocab = len(load_tokenizer(bundled_model_path()))
    for result in driver.results:
        wire = StepResult.from_bytes(result.to_bytes())
        logits = logits_tensor(wire)
        assert sampled_on_device(wire) == on_device
        assert logits.device.type == "cpu" and logits.dtype == torch.float32
        if on_device:
            assert logits.shape == (len(wire.slots), 0) and wire.logits == b""
            assert len(wire.sampled_ids()) == len(wire.slots)
        else:
            assert logits.shape == (len(wire.slots), real_vocab) == (len(wire.slots), runner.vocab_size)
            assert wire.token_ids == b""


def test_resident_buffers_are_reused_across_steps():
    runner = make_runner()
    driver = PlanDriver(runner)
    for prompt in PROMPTS[:4]:
        driver.add(prompt)
    driver.generate(3)
    allocations = runner.stats()["resident_allocations"]
    driver.generate(12)
    stats = runner.stats()
    assert stats["resident_allocations"] == allocations  # decode steps reuse the bucketed buffers
    assert stats["steps"] == len(driver.results) and stats["active_slots"] == 4
    assert stats["tokens"] == sum(p.num_tokens for p in driver.plans)
    runner.outputs.close()  # buffers are reallocated on demand after close
    driver.generate(13)


def test_warmup_leaves_no_state(expected):
    runner = make_runner()
    runner.warmup()
    stats = runner.stats()
    assert stats["steps"] == 0 and stats["active_slots"] == 0
    driver = PlanDriver(runner)
    for prompt in PROMPTS:
        driver.add(prompt)
    assert driver.generate(NEW) == expected


def test_logprobs_and_seeded_sampling_come_back():
    def run():
        runner = make_runner()
        driver = PlanDriver(runner)
        driver.add(PROMPTS[0], WorkerSampling(temperature=0.8, seed=7, logprobs=3))
        driver.add(PROMPTS[1])
        driver.generate(5)
        return driver

    a, b = run(), run()
    assert [r.outputs for r in a.running] == [r.outputs for r in b.running]
    for result in a.results:
        assert [lp.row for lp in result.logprobs] == [0]
        assert len(result.logprobs[0].top_ids) == 3 and result.logprobs[0].sampled <= 0


def _new(tokens, num_computed=0, blocks=(200,), slot=5, sampling=None):
    return [NewRequest(slot, list(tokens), num_computed, list(blocks), sampling or WorkerSampling())]


BAD_PLANS = {
    "unknown slot": (StepPlan(1, rows=[ScheduledRow(3, 1, [], 5)]), "slot 3"),
    "decode before prefill is done": (
        StepPlan(1, new_requests=_new([1, 2], 1), rows=[ScheduledRow(5, 1, [], 9)]), "uncomputed"),
    "too many tokens": (StepPlan(1, new_requests=_new([1, 2, 3]), rows=[ScheduledRow(5, 4)]), "asks for 4 tokens"),
    "block out of range": (StepPlan(1, new_requests=_new([1, 2, 3], blocks=[256]), rows=[ScheduledRow(5, 3)]),
                           "block id 256"),
    "too few blocks": (StepPlan(1, new_requests=_new(range(6)), rows=[ScheduledRow(5, 6)]), "cannot hold 6"),
    "slot out of range": (StepPlan(1, new_requests=_new([1], slot=8)), "slot 8"),
    "slot still busy": (StepPlan(1, new_requests=_new([1], slot=0)), "slot 0"),
    "token out of vocab": (StepPlan(1, new_requests=_new([1, 10**6])), "1000000"),
    "scheduled twice": (StepPlan(1, new_requests=_new([1, 2, 3]), rows=[ScheduledRow(5, 1), ScheduledRow(5, 1)]),
                        "twice"),
    "over token budget": (StepPlan(1, new_requests=_new(range(40), blocks=range(200, 210)),
                                   rows=[ScheduledRow(5, 40)]), "max_num_batched_tokens"),
    "bad sampling": (StepPlan(1, new_requests=_new([1, 2], sampling=WorkerSampling(top_p=0.0)),
                              rows=[ScheduledRow(5, 2)]), "slot 5: top_p"),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plans_raise_and_change_nothing(case, expected):
    runner = make_runner(max_num_batched_tokens=32)
    driver = PlanDriver(runner)
    driver.add(PROMPTS[2])
    driver.generate(2)
    plan, message = BAD_PLANS[case]
    with pytest.raises(ValueError, match=message):
        runner.execute(plan)
    assert runner.stats()["active_slots"] == 1
    assert driver.generate(NEW) == [expected[2]]


def test_runner_reports_its_sizes():
    runner = make_runner(max_model_len=512)
    assert runner.vocab_size == len(load_tokenizer(bundled_model_path()))
    assert runner.max_model_len == 512 and runner.num_kv_blocks == 256
    assert runner.device == torch.device("cpu")
    default = make_runner(num_kv_blocks=None, max_num_seqs=4, max_model_len=512)
    assert default.num_kv_blocks == 4 * 512 // default.config.block_size  # every slot at full length
    empty = runner.execute(StepPlan(step_id=3))
    assert empty.step_id == 3 and empty.slots == [] and empty.token_ids == b""
    runner.close()


def test_big_steps_compute_with_the_prefill_threads_and_small_ones_with_the_step_threads(expected):
    before = torch.get_num_threads()
    try:
        runner = make_runner(num_threads=1, prefill_threads=2, prefill_thread_tokens=20)
        assert runner.stats()["cpu_threads"] == {"step": 1, "prefill": 2, "prefill_min_tokens": 20, "probe": None}
        seen = []
        forward = runner.model.forward

        def spy(*args, **kw):
            seen.append(torch.get_num_threads())
            return forward(*args, **kw)

        runner.model.forward = spy
        driver = PlanDriver(runner)
        for prompt in PROMPTS:  # one step of 3 + 30 + 17 + 23 + 6 prompt tokens, then decode steps of 5 rows
            driver.add(prompt)
        assert driver.generate(NEW) == expected  # the same tokens whatever the threads
        assert seen[0] == 2 and set(seen[1:]) == {1}
        with pytest.raises(ValueError, match="prefill_threads must be >= num_threads 2, got 1"):
            make_runner(num_threads=2, prefill_threads=1)
    finally:
        torch.set_num_threads(before)


def test_a_step_where_no_row_samples_returns_no_ids():
    runner = make_runner()
    plan = StepPlan(0, new_requests=[NewRequest(0, PROMPTS[1], 0, list(range(8)), WorkerSampling())],
                    rows=[ScheduledRow(0, 12)])  # a first chunk: 18 prompt tokens remain uncomputed
    result = runner.execute(plan)
    assert result.slots == [] and result.token_ids == b"" and result.logits_shape == (0, 0)
    rest = runner.execute(StepPlan(1, rows=[ScheduledRow(0, len(PROMPTS[1]) - 12)]))
    assert rest.slots == [0] and len(rest.sampled_ids()) == 1


def test_an_injected_model_runs_without_a_checkpoint():
    from workers.loader import random_qwen3

    model = random_qwen3(layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=97, max_position_embeddings=128,
                         dtype="float32")
    runner = ModelRunner(RunnerConfig(block_size=BS, num_kv_blocks=16, max_num_seqs=2), model=model)
    assert runner.vocab_size == 97 and runner.max_model_len == 128
    result = runner.execute(StepPlan(0, new_requests=[NewRequest(1, [1, 2, 3], 0, [0], WorkerSampling())],
                                     rows=[ScheduledRow(1, 3)]))
    assert result.slots == [1] and 0 <= result.sampled_ids()[0] < 97


@pytest.mark.parametrize("native_half", [False, True])
def test_half_weights_compute_in_fp32_on_a_cpu_without_half_matmuls(tmp_path, monkeypatch, native_half):
    """dtype None: a bf16 checkpoint computes in fp32 where the CPU has no bf16 matmuls, and
    in bf16 where it has them; an explicit dtype is always honored."""
    import json
    import shutil

    from workers import device as dev
    from workers.loader import load_model

    monkeypatch.setattr(dev, "native_half_matmul", lambda device: native_half)
    ckpt = tmp_path / "bf16"
    shutil.copytree(bundled_model_path(), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    want = torch.bfloat16 if native_half else torch.float32

    runner = make_runner(model=str(ckpt))
    assert runner.model.dtype == want and runner.kv_cache.data.dtype == want
    assert runner.stats()["weights_dtype"] == "bfloat16"
    assert runner.stats()["dtype"] == str(want).removeprefix("torch.")
    assert make_runner(model=str(ckpt), dtype="bfloat16").model.dtype == torch.bfloat16
    given = ModelRunner(RunnerConfig(block_size=BS, num_kv_blocks=64), model=load_model(ckpt))
    assert given.model.dtype == want and given.stats()["weights_dtype"] == "bfloat16"


def test_warmup_chooses_the_decode_thread_count_by_measurement_and_reports_it(hf):
    runner = make_runner(num_threads=2, choose_decode_threads=True)
    runner.warmup()
    report = runner.stats()["cpu_threads"]
    assert set(report["probe"]["step_ms"]) == {"1", "2"} and report["probe"]["rows"] > 1
    times = {int(t): ms for t, ms in report["probe"]["step_ms"].items()}
    assert report["step"] == (1 if times[1] < 0.9 * times[2] else 2) and report["prefill"] == 2
    driver = PlanDriver(runner)  # the probe left no request behind: a fresh batch decodes as HF does
    driver.add(PROMPTS[0])
    assert driver.generate(8) == [hf_greedy(hf, PROMPTS[0], 8)]
    fixed = make_runner(num_threads=2)  # a thread count the user chose is kept
    fixed.warmup()
    assert fixed.stats()["cpu_threads"]["step"] == 2 and fixed.stats()["cpu_threads"]["probe"] is None
