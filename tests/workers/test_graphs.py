"""Decode graph capture on the CPU, with a fake graph device whose replay re-runs the
captured callable: the NPU table through the torch_npu emulation (eager steps FIA, graphs
paged attention in updated task groups) and the CUDA table through the FlashInfer
emulation (graphs: a use_cuda_graph decode wrapper re-planned before each replay).
Replays must equal eager decode steps while batch sizes and context lengths change."""

from __future__ import annotations

import pytest
import torch

from tests.workers import flashinfer_emulation, npu_emulation
from tests.workers.fake_graphs import FakeGraphDevice
from workers.graphs import DecodeGraphs, check_graph_sizes, default_graph_sizes
from workers.kv_cache import KVCache
from workers.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from workers.ops.base import AttentionMetadata
from workers.ops.cuda import CudaOpTable
from workers.ops.npu import NpuOpTable
from workers.resident import ResidentOutputs

BS = 16
KINDS = [pytest.param("npu", marks=pytest.mark.npu_emulated), "cuda"]


def install(kind: str, monkeypatch):
    """The emulated device's op table and a fake graph device attached to it."""
    if kind == "npu":
        emu = npu_emulation.install(monkeypatch)
        return emu, NpuOpTable(), FakeGraphDevice(emu)
    flashinfer_emulation.install(monkeypatch)
    return None, CudaOpTable(), FakeGraphDevice()


def make_meta(items, num_decode: int) -> AttentionMetadata:
    """items: (block table, cached tokens, new tokens) per sequence, decode rows first."""
    width = max(len(t) for t, _, _ in items)
    slots, qsl, lens = [], [0], []
    for table, cached, new in items:
        slots += [table[p // BS] * BS + p % BS for p in range(cached, cached + new)]
        qsl.append(qsl[-1] + new)
        lens.append(cached + new)
    return AttentionMetadata(
        num_tokens=qsl[-1], num_decode=num_decode, block_size=BS, slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t, _, _ in items], dtype=torch.int32),
        query_lens_host=[n for _, _, n in items], seq_lens_host=lens)


def small_qwen3(ops, seed: int = 0) -> Qwen3ForCausalLM:
    """The real Qwen3 model at a toy shape, random bf16 weights, prepared for `ops`."""
    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0)
    model = Qwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms near 1, embeddings unit scale, linears small
            base, scale = (1.0, 0.08) if "norm" in name else (0.0, 1.0 if "embed" in name else 0.08)
            p.copy_(base + torch.randn(p.shape, generator=g) * scale)
        model = model.to(torch.bfloat16)
        model.reset_rotary()
        model.prepare(ops)
    return model


def new_cache(model, num_blocks: int) -> KVCache:
    c = model.config
    return KVCache(num_layers=c.num_hidden_layers, num_blocks=num_blocks, block_size=BS,
                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=model.dtype)


def eager_logits(model, cache, ids, positions, meta):
    hidden = torch.empty(len(ids), model.config.hidden_size, dtype=model.dtype)
    model.embed(ids, out=hidden)
    h = model(hidden, positions, cache, meta)
    return model.compute_logits(h, torch.empty(len(ids), model.config.vocab_size))


class World:
    """Requests with prompts prefilled eagerly; then decode steps run eagerly and through graphs."""

    def __init__(self, ops, device, prompts=(5, 30, 33, 3, 16), steps=5, sizes=(1, 2, 4, 8)):
        g = torch.Generator().manual_seed(7)
        self.ops = ops
        self.model = small_qwen3(self.ops)
        need = [(p + steps + BS - 1) // BS for p in prompts]
        self.pad_block = sum(need)
        order = torch.randperm(sum(need), generator=g).tolist()
        self.tables, used = [], 0
        for n in need:
            self.tables.append(order[used:used + n])
            used += n
        self.eager_cache = new_cache(self.model, sum(need) + 1)
        self.lens = list(prompts)
        ids = torch.randint(0, self.model.config.vocab_size, (sum(prompts),), generator=g)
        positions = torch.cat([torch.arange(p) for p in prompts])
        meta = make_meta([(t, 0, p) for t, p in zip(self.tables, prompts)], num_decode=0)
        with torch.inference_mode():
            logits = eager_logits(self.model, self.eager_cache, ids, positions, meta)
        ends = torch.tensor(prompts).cumsum(0) - 1
        self.tokens = logits[ends].argmax(-1)  # [R] next input token of each request
        self.graph_cache = new_cache(self.model, sum(need) + 1)
        self.graph_cache.data.copy_(self.eager_cache.data)
        self.device = device
        self.graphs = DecodeGraphs(model=self.model, attention=self.ops.attention, kv_cache=self.graph_cache,
                                   outputs=ResidentOutputs("cpu"), sizes=sizes, max_blocks=max(need),
                                   pad_block=self.pad_block, vocab_size=self.model.config.vocab_size,
                                   graph_device=self.device)

    def decode(self, active: list[int]):
        """One decode step of the `active` requests, eagerly and by replay -> both logits."""
        items = [(self.tables[r], self.lens[r], 1) for r in active]
        ids = self.tokens[active]
        positions = torch.tensor([self.lens[r] for r in active])
        with torch.inference_mode():
            want = eager_logits(self.model, self.eager_cache, ids, positions, make_meta(items, len(items)))
            got = self.graphs.run(ids, positions, make_meta(items, len(items))).clone()
        for i, r in enumerate(active):
            self.lens[r] += 1
            self.tokens[r] = want[i].argmax()
        return got, want


SCHEDULE = [[0, 1, 2, 3, 4], [2], [4, 0, 1], [1, 3], [0, 2, 4, 1, 3]]  # buckets 8, 1, 4, 2, 8


@pytest.mark.parametrize("kind", KINDS)
def test_replays_match_eager_decode(monkeypatch, kind):
    emu, ops, device = install(kind, monkeypatch)
    w = World(ops, device)
    report = w.graphs.capture()
    assert report.sizes == (1, 2, 4, 8) and report.seconds >= 0
    assert w.device.warmups == 4
    if emu:
        emu.calls.clear()
    for active in SCHEDULE:
        got, want = w.decode(active)
        assert got.shape == want.shape == (len(active), w.model.config.vocab_size)
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    assert w.graphs.num_replays == len(SCHEDULE)
    if emu:  # graphs decode with paged attention, patched before every replay; eager steps with FIA
        assert "_npu_paged_attention" in emu.calls and "npu_fused_infer_attention_score" in emu.calls
        assert emu.external_event_records == len(SCHEDULE) * w.model.config.num_hidden_layers
    # padding rows wrote only into the pad block: every request block holds the same K/V
    real = slice(0, w.pad_block)
    torch.testing.assert_close(w.graph_cache.data[:, :, real], w.eager_cache.data[:, :, real], atol=3e-2, rtol=0)
    assert not w.eager_cache.data[:, :, w.pad_block].any()


@pytest.mark.parametrize("kind", KINDS)
def test_without_the_update_replays_are_wrong(monkeypatch, kind):
    """The emulations keep what was captured (host arguments, static page tables), so
    skipping update_graph shows up."""
    w = World(*install(kind, monkeypatch)[1:])
    w.graphs.capture()
    monkeypatch.setattr(w.ops.attention, "update_graph", lambda state, meta: None)
    got, want = w.decode([0, 1, 2, 3, 4])
    assert not torch.allclose(got, want, atol=3e-2, rtol=3e-2)


def test_run_refuses_what_no_graph_holds(monkeypatch):
    w = World(*install("cuda", monkeypatch)[1:], sizes=(1, 2))
    w.graphs.capture()
    items = [(w.tables[r], w.lens[r], 1) for r in range(3)]
    with pytest.raises(ValueError, match="no captured decode graph holds 3 rows"):
        w.graphs.run(w.tokens[:3], torch.tensor(w.lens[:3]), make_meta(items, 3))
    mixed = make_meta([(w.tables[0], w.lens[0], 1), (w.tables[1], w.lens[1], 2)], num_decode=1)
    with pytest.raises(ValueError, match="decode-only"):
        w.graphs.run(w.tokens[:3], torch.tensor([0, 1, 2]), mixed)
    assert w.graphs.bucket_for(2) == 2 and w.graphs.bucket_for(3) is None


def test_backends_that_cannot_be_captured_are_refused(monkeypatch):
    flashinfer_emulation.uninstall(monkeypatch)  # the CUDA table's SDPA fallback has host-sized shapes
    with pytest.raises(ValueError, match="enforce_eager"):
        World(CudaOpTable(), FakeGraphDevice())


def test_graph_sizes():
    assert default_graph_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_graph_sizes(10) == (1, 2, 4, 8, 10)
    assert check_graph_sizes([8, 1, 4, 4], 8) == (1, 4, 8)
    for bad, match in (([], "non-empty"), ([0], "positive"), ([2, 16], "exceeds max_num_seqs 8"), ((1.5,), "positive")):
        with pytest.raises(ValueError, match=match):
            check_graph_sizes(bad, 8)
