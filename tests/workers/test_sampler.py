"""Device sampler: policies row by row, seeded reproducibility, frequencies, logprobs, bans.

Frequency tests draw thousands of samples with fixed seeds, so they are deterministic;
their bounds are loose enough that any correct sampler passes for almost every seed.
"""

from __future__ import annotations

import pytest
import torch

from scheduler.protocol import StepResult
from scheduler.protocol import WorkerSampling as W
from workers.resident import ResidentOutputs
from workers.sampling.logits_codec import encode_logits
from workers.sampling.sampler import SAMPLER_ENV, Sampler, SamplingBatch, row_logprobs, sample_host

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device")]),
]
N_DRAWS = 20000


@pytest.fixture(params=["fused", "torch"])
def cpu_draw(request, monkeypatch):
    """The random draw's tests run twice on the CPU: raylm's sampling kernel, and the
    exponential race in torch ops."""
    monkeypatch.setenv(SAMPLER_ENV, request.param)
    return request.param


def sample(device, logits, params, positions=None, seed=0, sampler=None):
    device = torch.device(device)
    positions = list(range(len(params))) if positions is None else positions
    batch = SamplingBatch.build(params, positions, device)
    sampler = sampler or Sampler(device, seed=seed)
    return sampler(logits.to(device), batch), batch


def counts_of(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids.long().cpu(), minlength=vocab).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs.double() * n
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def chi_square_bound(df: int) -> float:
    # mean df, sd sqrt(2 df): 6 sd above the mean never fails by chance in practice
    return df + 6 * (2 * df) ** 0.5


def reference_allowed(probs: torch.Tensor, top_k=-1, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """An independent filter written from the definitions, on one row of probabilities."""
    allowed = torch.ones_like(probs, dtype=torch.bool)
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    if top_k > 0:
        allowed[order[top_k:]] = False
    p = probs * allowed
    p = p / p.sum()
    if top_p < 1:
        mass = 0.0
        for i in order:
            if not allowed[i]:
                continue
            if mass >= top_p:
                allowed[i] = False
            mass += float(p[i])
    if min_p > 0:
        allowed &= probs >= min_p * probs.max()
    return allowed


@pytest.fixture
def small_logits():
    # six tokens with distinct, well separated probabilities
    return torch.tensor([2.0, 1.2, 0.7, 0.1, -0.6, -1.5])


@pytest.mark.parametrize("device", DEVICES)
def test_all_greedy_batch_is_argmax_int32_on_device(device):
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(1))
    out, batch = sample(device, logits, [W()] * 7)
    assert batch.all_greedy
    assert out.token_ids.dtype == torch.int32
    assert out.token_ids.device.type == torch.device(device).type
    assert out.token_ids.cpu().tolist() == logits.argmax(-1).tolist()
    assert out.sampled_logprobs is None and out.top_ids is None


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_one_tiny_top_p_and_full_min_p_equal_greedy(device):
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(2)) * 2
    params = [W(temperature=1.3, top_k=1), W(temperature=0.9, top_p=1e-6),
              W(temperature=2.0, min_p=1.0), W(temperature=1.0, top_k=1, seed=5),
              W(temperature=1.0, top_p=1e-6, seed=6), W()]
    for seed in range(5):
        out, _ = sample(device, logits, params, seed=seed)
        assert out.token_ids.cpu().tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_keeps_greedy_rows_at_argmax(device, cpu_draw):
    logits = torch.randn(8, 400, generator=torch.Generator().manual_seed(3))
    params = [W(), W(temperature=1.0), W(), W(temperature=0.8, top_p=0.5, seed=1),
              W(), W(temperature=1.0, min_p=0.1), W(temperature=0.7, top_k=4), W()]
    out, batch = sample(device, logits, params)
    assert not batch.all_greedy
    ids = out.token_ids.cpu()
    for row in (0, 2, 4, 7):
        assert ids[row] == logits[row].argmax()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_frequencies_match_the_distribution(device, small_logits, temperature, seeded, cpu_draw):
    params = [W(temperature=temperature, seed=i if seeded else None) for i in range(N_DRAWS)]
    out, _ = sample(device, small_logits.expand(N_DRAWS, -1).contiguous(), params, positions=[9] * N_DRAWS)
    probs = torch.softmax(small_logits.double() / temperature, -1)
    counts = counts_of(out.token_ids, len(small_logits))
    assert chi_square(counts, probs) < chi_square_bound(len(small_logits) - 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("filters", [
    dict(top_k=3), dict(top_p=0.6), dict(top_p=0.9), dict(min_p=0.2), dict(min_p=0.08),
    dict(top_k=4, top_p=0.7), dict(top_k=5, min_p=0.1), dict(top_p=0.8, min_p=0.3),
])
def test_filters_hit_only_allowed_ids_with_renormalized_frequencies(device, small_logits, filters, cpu_draw):
    temperature = 1.2
    params = [W(temperature=temperature, **filters)] * N_DRAWS
    out, _ = sample(device, small_logits.expand(N_DRAWS, -1).contiguous(), params)
    probs = torch.softmax(small_logits.double() / temperature, -1)
    allowed = reference_allowed(probs, **filters)
    assert 1 <= int(allowed.sum()) < len(probs)  # the case really filters something
    counts = counts_of(out.token_ids, len(probs))
    assert counts[~allowed].sum() == 0
    renormalized = probs * allowed / (probs * allowed).sum()
    assert chi_square(counts, renormalized) < chi_square_bound(int(allowed.sum()) - 1)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_ignores_companions_row_index_and_sampler(device, cpu_draw):
    vocab = 2000
    gen = torch.Generator().manual_seed(4)
    row = torch.randn(vocab, generator=gen) * 1.5
    seeded = W(temperature=1.1, top_k=200, top_p=0.95, seed=1234)
    positions = list(range(30, 60))

    alone = []
    for pos in positions:
        out, _ = sample(device, row[None], [seeded], positions=[pos])
        alone.append(int(out.token_ids[0]))

    companions = [W(), W(temperature=1.0), W(temperature=0.6, top_p=0.3), W(temperature=1.0, seed=7),
                  W(temperature=1.0, min_p=0.2, logprobs=3)]
    for index, seed in [(0, 99), (3, 5), (5, 0)]:
        together = []
        sampler = Sampler(torch.device(device), seed=seed)  # a fresh worker, as after preemption
        for pos in positions:
            params = companions[:index] + [seeded] + companions[index:]
            logits = torch.randn(len(params), vocab, generator=gen)
            logits[index] = row
            out, _ = sample(device, logits, params, positions=[3] * index + [pos] + [8] * (5 - index),
                            sampler=sampler)
            together.append(int(out.token_ids[index]))
        assert together == alone
    assert len(set(alone)) > 5  # the position really changes the draw

    other_seed = []
    for pos in positions:
        out, _ = sample(device, row[None], [W(temperature=1.1, top_k=200, top_p=0.95, seed=4321)], positions=[pos])
        other_seed.append(int(out.token_ids[0]))
    assert other_seed != alone


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_rows_follow_the_sampler_seed(device, cpu_draw):
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(5))
    params = [W(temperature=1.0)] * 32
    a, _ = sample(device, logits, params, seed=11)
    b, _ = sample(device, logits, params, seed=11)
    c, _ = sample(device, logits, params, seed=12)
    assert torch.equal(a.token_ids, b.token_ids)
    assert not torch.equal(a.token_ids, c.token_ids)


@pytest.mark.parametrize("top_k", [-1, 5, 40, 2980])
def test_top_p_shortcuts_match_the_full_sort(top_k):
    """Top-p without a sort (nucleus among the top-k, or among the CPU's top candidates)
    and with a full sort pick the same tokens for the same seeded rows."""
    gen = torch.Generator().manual_seed(6)
    peaked = torch.randn(4, 3000, generator=gen) * 4  # small nuclei
    flat = torch.randn(4, 3000, generator=gen) * 0.3  # nuclei of thousands of tokens
    logits = torch.cat([peaked, flat])
    params = [W(temperature=1.0, top_k=top_k + 3 * i if top_k > 0 else -1, top_p=p, seed=i)  # k differs by row
              for i, p in enumerate([0.5, 0.9, 0.99, 0.7] * 2)]
    shortcut, full = Sampler(torch.device("cpu")), Sampler(torch.device("cpu"))
    shortcut.top_p_candidates, full.top_p_candidates = 64, 0
    # in `full`, a companion row without top-k forces the sort for the whole batch;
    # in `shortcut`, a top-k-only companion comes first, so rows are remapped
    companion, first = W(temperature=1.0, top_p=0.5), W(temperature=1.0, top_k=7)
    for pos in range(20):
        a, _ = sample("cpu", torch.cat([logits[:1], logits]), [first] + params, positions=[pos] * 9,
                      sampler=shortcut)
        a.token_ids = a.token_ids[1:]
        b, _ = sample("cpu", torch.cat([logits, logits[:1]]), params + [companion], positions=[pos] * 9,
                      sampler=full)
        assert a.token_ids.tolist() == b.token_ids[:8].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_the_raw_distribution(device):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 800, generator=gen) * 3
    params = [W(logprobs=3), W(temperature=0.5, top_k=10, logprobs=0), W(temperature=1.0),
              W(temperature=1.5, top_p=0.8, logprobs=20, seed=3),
              W(logprobs=5, ban_until=100, banned_ids=(int(logits[4].argmax()),)), W()]
    out, batch = sample(device, logits, params, positions=[10] * 6)
    reference = torch.log_softmax(logits.double(), -1)
    ids = out.token_ids.cpu().long()
    rows = row_logprobs(out, batch)
    assert [r.row for r in rows] == [0, 1, 3, 4]
    for r in rows:
        n = params[r.row].logprobs
        assert r.sampled == pytest.approx(float(reference[r.row, ids[r.row]]), abs=1e-4)
        top = reference[r.row].topk(n) if n else None
        assert len(r.top_ids) == len(r.top_logprobs) == n
        if n:
            assert r.top_ids == top.indices.tolist()
            assert r.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
            assert all(isinstance(i, int) for i in r.top_ids)


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_ban_masks_ids_before_ban_until(device):
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(1, 50, generator=gen)
    best2 = logits[0].topk(2).indices.tolist()
    greedy = W(ban_until=20, banned_ids=(best2[0],))
    out, _ = sample(device, logits, [greedy], positions=[19])
    assert int(out.token_ids[0]) == best2[1]
    out, _ = sample(device, logits, [greedy], positions=[20])
    assert int(out.token_ids[0]) == best2[0]

    # random rows: the banned ids hold most of the mass yet never appear
    row = torch.zeros(50)
    row[[3, 7]] = 6.0
    params = [W(temperature=1.0, ban_until=5, banned_ids=(3, 7), seed=i % 2 or None) for i in range(4000)]
    out, _ = sample(device, row.expand(4000, -1).contiguous(), params, positions=[4] * 4000)
    assert not set(out.token_ids.cpu().tolist()) & {3, 7}
    out, _ = sample(device, row.expand(4000, -1).contiguous(), params, positions=[5] * 4000)
    assert {3, 7} <= set(out.token_ids.cpu().tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_logits_are_not_modified(device):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(9)).to(device)
    before = logits.clone()
    for params in ([W(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)] * 5,
                   [W(), W(temperature=0.5), W(ban_until=9, banned_ids=(1, 2)), W(temperature=1, seed=2), W()],
                   [W(ban_until=9, banned_ids=(4,))] * 5):
        sample(device, logits, params, positions=[3] * 5)
        assert torch.equal(logits, before)


def test_bad_input_raises_value_errors():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="positions"):
        SamplingBatch.build([W()], [1, 2], cpu)
    # parameters are checked once, when a request arrives at the worker (not every step)
    for bad, field in [(W(top_p=0.0), "top_p"), (W(logprobs=21), "logprobs"), (W(top_k=-2), "top_k"),
                       (W(min_p=1.5), "min_p"), (W(temperature=-1.0), "temperature"),
                       (W(temperature=float("nan")), "temperature"), (W(banned_ids=(-1,)), "banned_ids")]:
        with pytest.raises(ValueError, match=field):
            bad.check()
    W(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3, logprobs=20, ban_until=4, banned_ids=(1,)).check()
    with pytest.raises(ValueError, match="position"):
        SamplingBatch.build([W()], [-1], cpu)
    batch = SamplingBatch.build([W(), W()], [0, 0], cpu)
    with pytest.raises(ValueError, match="logits"):
        Sampler(cpu)(torch.zeros(3, 10), batch)
    batch = SamplingBatch.build([W(ban_until=5, banned_ids=(10,))], [0], cpu)
    with pytest.raises(ValueError, match="banned id 10"):
        Sampler(cpu)(torch.zeros(1, 10), batch)


def test_empty_batch():
    out, batch = sample("cpu", torch.zeros(0, 10), [])
    assert batch.size == 0 and out.token_ids.shape == (0,)
    assert row_logprobs(out, batch) == []


def test_sample_host_decodes_and_samples_like_the_device_path():
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(3, 64, generator=gen)
    padded = torch.cat([logits, torch.full((3, 8), 100.0)], dim=1)  # padding must be trimmed away
    data, shape, dtype = encode_logits(padded, vocab_size=64)
    result = StepResult.from_bytes(StepResult(step_id=1, slots=[0, 1, 2], logits=data, logits_shape=shape,
                                              logits_dtype=dtype).to_bytes())
    rows = [(W(logprobs=2), 5), (W(temperature=0.8, seed=3), 6), (W(ban_until=9, banned_ids=(0,)), 7)]
    ids, lps = sample_host(result, rows, Sampler(torch.device("cpu")))
    device_out, batch = sample("cpu", logits, [p for p, _ in rows], positions=[pos for _, pos in rows])
    assert ids == device_out.token_ids.tolist()
    assert ids[0] == int(logits[0].argmax())
    assert lps == row_logprobs(device_out, batch)
    assert [lp.row for lp in lps] == [0]

    with pytest.raises(ValueError, match="device"):
        sample_host(StepResult(step_id=2, slots=[0], logits_shape=(1, 0)), rows[:1], Sampler(torch.device("cpu")))
    with pytest.raises(ValueError, match="rows"):
        sample_host(result, rows[:2], Sampler(torch.device("cpu")))


@pytest.mark.parametrize("device", DEVICES)
def test_scratch_buffers_are_reused_across_steps(device):
    dev = torch.device(device)
    shared = ResidentOutputs(dev)
    sampler = Sampler(dev, buffers=shared)
    params = [W(temperature=0.9, top_p=0.8), W(), W(temperature=1.0, ban_until=5, banned_ids=(1,))]
    for step in range(6):
        rows = 1 + step % 3  # batch sizes within one bucket
        sample(device, torch.randn(rows, 100), params[:rows], sampler=sampler)
        if step == 2:
            allocated = shared.num_allocations
    assert allocated > 0 and shared.num_allocations == allocated
    sampler.close()  # a shared cache is its owner's to close
    assert len(shared) > 0
    own = Sampler(dev)
    sample(device, torch.randn(2, 100), [W(temperature=1.0)] * 2, sampler=own)
    assert len(own.buffers) > 0
    own.close()
    assert len(own.buffers) == 0


def test_the_cpu_draw_is_chosen_by_the_environment(cpu_draw, monkeypatch):
    sampler = Sampler(torch.device("cpu"))
    assert (sampler.kernels is not None) == (cpu_draw == "fused")
    monkeypatch.setenv(SAMPLER_ENV, "fast")
    with pytest.raises(ValueError, match="RAYLM_CPU_SAMPLER must be torch or fused, got 'fast'"):
        Sampler(torch.device("cpu"))


def test_a_row_with_one_allowed_token_always_draws_it(cpu_draw):
    logits = torch.full((64, 3000), -1e4)
    logits[:, 1234] = 0.0
    params = [W(temperature=1.0, min_p=0.5, seed=i if i % 2 else None) for i in range(64)]
    out, _ = sample("cpu", logits, params)
    assert out.token_ids.tolist() == [1234] * 64
