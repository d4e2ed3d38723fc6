"""Penalties and logit_bias: the one function against a per-token reference, the worker's
per-slot device state against counting each row's history, and the runner's tokens against
an HF model decoded greedily with the reference penalties. No Ray."""

from __future__ import annotations

import random

import pytest
import torch

from scheduler.protocol import MAX_LOGIT_BIAS
from scheduler.protocol import WorkerSampling as W
from tests.devices import DEVICES
from workers.sampling.penalties import PenaltyLayout, PenaltyRows, apply_penalties
from workers.sampling.sampler import Sampler, SamplingBatch
from workers.sampling.slot_sampling import SlotSampling
from workers.staging import StepStaging

V = 50


def reference_penalized(logits: list[float], sp: W, prompt: list[int], outputs: list[int]) -> list[float]:
    """One row, token by token, from the definitions (OpenAI's and vLLM's)."""
    out = list(logits)
    for t, b in sp.logit_bias:
        out[t] += b
    for t in range(len(out)):
        count = outputs.count(t)
        if (count or t in prompt) and sp.repetition_penalty != 1:
            out[t] = out[t] / sp.repetition_penalty if out[t] > 0 else out[t] * sp.repetition_penalty
        out[t] -= sp.frequency_penalty * count + sp.presence_penalty * (count > 0)
    return out


def _random_penalties(rng: random.Random) -> W:
    kind = rng.random()
    if kind < 0.25:
        return W(temperature=rng.choice([0.0, 0.8]), seed=rng.choice([None, 5]))  # no penalties
    bias = tuple(sorted((t, rng.uniform(-100, 100)) for t in rng.sample(range(V), rng.randint(0, 4))))
    return W(temperature=rng.choice([0.0, 0.7, 1.2]), seed=rng.randint(0, 99),
             presence_penalty=rng.choice([0.0, 0.5, -1.5, 2.0]), frequency_penalty=rng.choice([0.0, 1.0, -0.3]),
             repetition_penalty=rng.choice([1.0, 1.3, 0.7]), logit_bias=bias)


def _history(rng: random.Random) -> tuple[list[int], list[int]]:
    return ([rng.randrange(V) for _ in range(rng.randint(1, 12))],
            [rng.randrange(V // 3) for _ in range(rng.randint(0, 15))])  # outputs repeat a few ids


def test_apply_penalties_matches_the_per_token_reference():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        params = [_random_penalties(rng) for _ in range(rng.randint(1, 7))]
        if not any(sp.has_penalties for sp in params):
            params[0] = W(frequency_penalty=1.0)
        hist = [_history(rng) for _ in params]
        logits = torch.randn(len(params), V, generator=gen) * 3
        layout = PenaltyLayout.of(params, [i for i, sp in enumerate(params) if sp.has_penalties])
        rows = PenaltyRows.build(layout, params, hist, V, torch.device("cpu"))
        got = logits.clone()
        apply_penalties(got, rows)
        want = torch.tensor([reference_penalized(logits[i].tolist(), sp, *hist[i]) if sp.has_penalties
                             else logits[i].tolist() for i, sp in enumerate(params)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        unpenalized = [i for i, sp in enumerate(params) if not sp.has_penalties]
        assert torch.equal(got[unpenalized], logits[unpenalized])  # other rows are left bit for bit


def test_penalties_change_greedy_argmax_and_the_sampler_leaves_its_input_alone():
    logits = torch.tensor([[3.0, 2.5, 1.0, 0.0], [3.0, 2.5, 1.0, 0.0]])
    params = [W(frequency_penalty=1.0), W(logit_bias=((3, 10.0),))]
    hist = [([2], [0]), ([2], [])]  # row 0 generated token 0 once: 3 - 1 = 2 < 2.5
    batch = SamplingBatch.build(params, [2, 1], "cpu", hist, vocab_size=4)
    before = logits.clone()
    assert Sampler(torch.device("cpu"))(logits, batch).token_ids.tolist() == [1, 3]
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="histories"):
        SamplingBatch.build(params, [2, 1], "cpu")


def _upload(state: SlotSampling, staging: StepStaging, params, positions, slots):
    upload = state.prepare(params, positions, slots)
    ints, floats = staging.upload(list(upload.ints.values()), list(upload.floats.values()))
    return state.finish(upload, ints, floats)


@pytest.mark.parametrize("device", DEVICES)
def test_per_slot_device_state_counts_like_the_histories(device):
    """Requests arrive (some recomputed with outputs), steps sample and count on the device;
    the penalized logits equal those from counting each row's history on the host."""
    dev = torch.device(device)
    rng = random.Random(3)
    num_slots = 6
    state, staging = SlotSampling(num_slots, dev, V), StepStaging(dev)
    held: dict[int, tuple[W, list[int], list[int]]] = {}
    gen = torch.Generator().manual_seed(4)
    for step in range(40):
        for slot in rng.sample(range(num_slots), rng.randint(0, 2)):
            sp = _random_penalties(rng)
            prompt, outputs = _history(rng) if rng.random() < 0.5 else (_history(rng)[0], [])
            held[slot] = (sp, prompt, list(outputs))
            state.admit(slot, sp, prompt + outputs, len(prompt))
        slots = rng.sample(sorted(held), rng.randint(0, len(held)))
        params = [held[s][0] for s in slots]
        positions = [len(held[s][1]) + len(held[s][2]) for s in slots]
        batch = _upload(state, staging, params, positions, slots)
        if batch is None or batch.penalties is None:
            assert not any(sp.has_penalties for sp in params)
            if batch is not None:  # nothing counted this step: the rows' outputs still grow
                ids = torch.randint(0, V, (len(slots),), generator=gen)
                for s, t in zip(slots, ids.tolist()):
                    held[s][2].append(t)
            continue
        want = SamplingBatch.build(params, positions, dev, [(held[s][1], held[s][2]) for s in slots], V)
        logits = torch.randn(len(slots), V, generator=gen).to(dev)
        got_logits, want_logits = logits.clone(), logits.clone()
        apply_penalties(got_logits, batch.penalties)
        apply_penalties(want_logits, want.penalties)
        assert torch.equal(got_logits, want_logits), f"step {step}"
        ids = torch.randint(0, V // 3, (len(slots),), generator=gen, dtype=torch.int32).to(dev)
        state.record(batch, ids)
        for s, t in zip(slots, ids.tolist()):
            held[s][2].append(t)
    assert state.penalties.nbytes > 0


def test_no_penalty_state_is_allocated_until_a_request_needs_it():
    state, staging = SlotSampling(4, torch.device("cpu"), V), StepStaging(torch.device("cpu"))
    for slot in range(4):
        state.admit(slot, W(temperature=0.5, top_k=3), [1, 2, 3], 3)
    batch = _upload(state, staging, [W(temperature=0.5, top_k=3)] * 4, [3] * 4, [0, 1, 2, 3])
    assert batch.penalties is None and state.penalties.nbytes == 0
    state.admit(1, W(logit_bias=((7, 5.0),)), [1, 2], 2)
    batch = _upload(state, staging, [W(logit_bias=((7, 5.0),))], [2], [1])
    assert batch.penalties.counts is None and batch.penalties.bias_ids.shape == (1, 1)
    assert state.penalties.nbytes == 4 * MAX_LOGIT_BIAS * (8 + 4) + 3 * 4 * 4  # bias pairs and three floats


# ---- the runner, end to end on the bundled tiny model ---------------------------------------

@pytest.fixture(scope="module")
def runners():
    """A device-sampling and a host-logits runner, shared: each test's driver frees its slots."""
    from workers.runner import ModelRunner
    from workers.runner_config import RunnerConfig

    made = {}
    for device_outputs in (True, False):
        made[device_outputs] = ModelRunner(RunnerConfig(block_size=4, num_kv_blocks=256, max_num_seqs=4,
                                                        device_outputs=device_outputs))
        made[device_outputs].warmup()
    yield made
    for r in made.values():
        r.close()


def _generate(runner, prompts, params, n, ids_from_logits=None, generated=None, slots=None):
    """Each prompt's n next tokens through a PlanDriver; its slots are free again afterwards."""
    from scheduler.protocol import StepPlan
    from tests.plans import PlanDriver

    driver = PlanDriver(runner, resident=runner.device_outputs)
    if slots is not None:
        driver.free_slots = list(slots)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        driver.add(p, sp, generated=generated[i] if generated else ())
    if ids_from_logits is not None:
        out = driver.generate(n, lambda result: ids_from_logits(driver, result))
    else:
        out = driver.generate(n)
    slots_used = [r.slot for r in driver.running]
    runner.execute(StepPlan(step_id=driver.step_id, finished=slots_used))
    return out


def _hf_greedy_penalized(prompt: list[int], sp: W, n: int) -> list[int]:
    """HF's model in fp32, decoded greedily with the reference penalties applied each step."""
    from tests.oracle import hf_model
    from workers.loader import bundled_model_path

    model = hf_model(bundled_model_path())
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].tolist()
            ids.append(max(range(len(logits)),
                           key=reference_penalized(logits, sp, prompt, ids[len(prompt):]).__getitem__))
    return ids[len(prompt):]


PROMPT = [367, 1887, 1890, 1876]  # "The quick brown fox": its greedy continuation repeats EOS (2039)


ECHO = [1017, 11, 1780, 0, 1169, 379, 690, 757, 30, 550, 494, 371, 1189, 336, 953, 13]  # "Hello, world! How
# are you today? The capital of Korea is Seoul.": its greedy continuation repeats the prompt's sentence


@pytest.mark.parametrize("prompt,sp", [(PROMPT, W(frequency_penalty=2.0, presence_penalty=0.5)),
                                       (ECHO, W(repetition_penalty=1.8)),
                                       (PROMPT, W(logit_bias=((13, 8.0), (2039, -100.0))))],
                         ids=["frequency-presence", "repetition", "logit-bias"])
def test_greedy_with_penalties_matches_hf_with_the_reference_penalties(runners, prompt, sp):
    want = _hf_greedy_penalized(prompt, sp, 16)
    plain = _hf_greedy_penalized(prompt, W(), 16)
    assert want != plain  # the penalty matters on this prompt
    # a companion without penalties keeps its plain greedy tokens
    assert _generate(runners[True], [prompt, prompt], [sp, W()], 16) == [want, plain]


def test_a_recomputed_request_counts_its_earlier_outputs(runners):
    """Preempted (or after a worker restart) it arrives again with prompt + outputs, in the slot
    that held it: its tokens equal an uninterrupted run's."""
    params = [W(frequency_penalty=2.0, presence_penalty=2.0, logit_bias=((3, 4.0),)),
              W(repetition_penalty=2.0, temperature=0.9, seed=21)]
    runner = runners[True]
    want = _generate(runner, [PROMPT] * 2, params, 20, slots=[2, 3])
    head = [w[:10] for w in want]
    tail = _generate(runner, [PROMPT] * 2, params, 10, generated=head, slots=[2, 3])
    assert [h + t for h, t in zip(head, tail)] == want


def test_device_sampling_equals_host_logits_sampling_with_penalties(runners):
    from workers.sampling.sampler import sample_host

    n = 20
    params = [W(temperature=1.0, seed=1, frequency_penalty=2.0, presence_penalty=0.5),
              W(temperature=0.7, top_k=20, seed=2, repetition_penalty=1.5),
              W(logit_bias=((40, 3.0), (2039, -5.0)), frequency_penalty=0.8),
              W(temperature=1.2, seed=4)]
    prompts = [PROMPT, PROMPT[:3], [747, 296], [100, 200, 300]]
    want = _generate(runners[True], prompts, params, n)
    sampler = Sampler(torch.device("cpu"))

    def ids_from_logits(driver, result):
        by_slot = {r.slot: r for r in driver.running}
        reqs = [by_slot[s] for s in result.slots]
        rows = [(r.sampling, len(r.tokens)) for r in reqs]
        return sample_host(result, rows, sampler, [(r.tokens[:r.num_prompt], r.outputs) for r in reqs])[0]

    assert _generate(runners[False], prompts, params, n, ids_from_logits) == want
    unpenalized = _generate(runners[True], prompts, [W(temperature=sp.temperature, top_k=sp.top_k, seed=sp.seed)
                                                     for sp in params], n)
    assert unpenalized[1:3] != want[1:3] and unpenalized[3] == want[3]  # only the penalties changed tokens
    assert runners[True].stats()["penalty_state_bytes"] > 0
