"""The worker's per-slot sampling state gives the same SamplingBatch as building it from each
row's params, and a step's small inputs travel through reused staging buffers. No Ray."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from scheduler.protocol import WorkerSampling as W
from tests.devices import DEVICES
from workers.sampling.sampler import Sampler, SamplingBatch
from workers.sampling.slot_sampling import SlotSampling
from workers.staging import StepStaging

NUM_SLOTS = 12
VOCAB = 257


def _random_params(rng: random.Random) -> W:
    if rng.random() < 0.3:
        return W(logprobs=rng.choice([None, 0, 3]))
    return W(temperature=rng.choice([0.5, 1.0, 1.3]), top_k=rng.choice([-1, 0, 5, 40]),
             top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.05]), seed=rng.choice([None, 7, 11]),
             logprobs=rng.choice([None, 2]), ban_until=rng.choice([0, 30]), banned_ids=rng.choice([(), (3, 9)]))


def _slot_batch(state: SlotSampling, staging: StepStaging, params, positions, slots):
    upload = state.prepare(params, positions, slots)
    ints, floats = staging.upload(list(upload.ints.values()), list(upload.floats.values()))
    return state.finish(upload, ints, floats)


def _assert_same(a: SamplingBatch, b: SamplingBatch) -> None:
    for f in dataclasses.fields(SamplingBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None, f.name
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("device", DEVICES)
def test_per_slot_state_gives_the_batch_built_from_params(device):
    dev = torch.device(device)
    rng = random.Random(0)
    state, staging = SlotSampling(NUM_SLOTS, dev, VOCAB), StepStaging(dev)
    held: dict[int, W] = {}
    for _ in range(40):
        for slot in rng.sample(range(NUM_SLOTS), rng.randint(0, 3)):  # requests arriving (some replace others)
            held[slot] = _random_params(rng)
            state.admit(slot, held[slot])
        slots = rng.sample(sorted(held), rng.randint(0, len(held)))  # the step's sampling rows, any order
        params = [held[s] for s in slots]
        positions = [rng.randint(0, 60) for _ in slots]
        batch = _slot_batch(state, staging, params, positions, slots)
        if not slots:
            assert batch is None
            continue
        _assert_same(batch, SamplingBatch.build(params, positions, dev))


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_ids_match_the_reference_path(device):
    dev = torch.device(device)
    rng = random.Random(1)
    params = [_random_params(rng) for _ in range(NUM_SLOTS)]
    slots, positions = list(range(NUM_SLOTS))[::-1], [rng.randint(0, 60) for _ in range(NUM_SLOTS)]
    state, staging = SlotSampling(NUM_SLOTS, dev, VOCAB), StepStaging(dev)
    for s, p in zip(slots, params):
        state.admit(s, p)
    logits = torch.randn(NUM_SLOTS, 257, generator=torch.Generator().manual_seed(2)).to(dev)
    got = Sampler(dev, seed=3)(logits, _slot_batch(state, staging, params, positions, slots))
    want = Sampler(dev, seed=3)(logits, SamplingBatch.build(params, positions, dev))
    assert torch.equal(got.token_ids, want.token_ids)


@pytest.mark.parametrize("device", DEVICES)
def test_staging_reuses_its_buffers_and_carries_floats_bit_for_bit(device):
    dev = torch.device(device)
    staging = StepStaging(dev)
    floats = [0.1, -2.5e-7, float("inf"), 1.0 / 3]
    for step in range(5):
        ints, fl = staging.upload([[step, 2**40, -1], [], [7] * 50], [floats, [0.5]])
        assert [t.tolist() for t in ints] == [[step, 2**40, -1], [], [7] * 50]
        assert all(t.device.type == dev.type and t.dtype == torch.int64 for t in ints)
        assert fl[0].dtype == torch.float32
        assert torch.equal(fl[0].cpu(), torch.tensor(floats, dtype=torch.float32)) and fl[1].tolist() == [0.5]
    assert staging.num_allocations == 1
    staging.upload([list(range(5000))])  # grows once, by doubling
    assert staging.num_allocations == 2


def test_a_reused_slot_samples_with_its_new_requests_params_and_steps_reuse_staging():
    from tests import oracle
    from tests.plans import PlanDriver
    from workers.loader import bundled_model_path
    from workers.runner import ModelRunner
    from workers.runner_config import RunnerConfig

    prompt = list(range(10, 30))
    greedy = oracle.hf_greedy(bundled_model_path(), [prompt], 6)[0]
    runner = ModelRunner(RunnerConfig(block_size=4, num_kv_blocks=64, max_num_seqs=1, device_outputs=True))
    runner.warmup()
    driver = PlanDriver(runner)
    hot = driver.add(prompt, W(temperature=5.0, seed=1))  # slot 0: near-uniform sampling
    driver.generate(6)
    allocated = runner.stats()["staging_allocations"]
    driver.finish(hot)
    cold = driver.add(prompt)  # slot 0 again, greedy this time
    assert cold.slot == hot.slot
    driver.generate(6)
    assert cold.outputs[:6] == greedy != hot.outputs[:6]
    assert runner.stats()["staging_allocations"] == allocated  # no host buffer allocated per step
