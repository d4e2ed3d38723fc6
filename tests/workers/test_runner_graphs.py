"""ModelRunner with decode graphs, on the CPU: the bundled tiny Qwen3 in bf16 on the NPU
table (torch_npu emulation), graphs through the fake graph device, against the same runner
with enforce_eager. Both are fed the same tokens; their logits must agree every step while
batches grow, shrink and mix prefill with decode (mixed steps stay eager)."""

from __future__ import annotations

import pytest
import torch

import workers.runner as runner_module
from tests.plans import PlanDriver
from tests.workers import npu_emulation
from tests.workers.fake_graphs import FakeGraphDevice
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig
from workers.sampling.logits_codec import logits_tensor

pytestmark = pytest.mark.npu_emulated


def _config(**kw) -> RunnerConfig:
    base = dict(device="cpu", ops="npu", dtype="bfloat16", block_size=16, num_kv_blocks=32, max_num_seqs=4,
                max_model_len=256, device_outputs=False, graph_sizes=(1, 2, 4))
    return RunnerConfig(**{**base, **kw})


@pytest.fixture
def emu(monkeypatch):
    emu = npu_emulation.install(monkeypatch)
    monkeypatch.setattr(runner_module, "graph_device_for", lambda device: FakeGraphDevice(emu))
    return emu


def test_graph_runner_matches_eager_runner(emu):
    graphed, eager = ModelRunner(_config()), ModelRunner(_config(enforce_eager=True))
    assert graphed.graphs is not None and eager.graphs is None
    assert graphed.kv_cache.num_blocks == graphed.num_kv_blocks + 1  # the pad block no request gets
    drivers = PlanDriver(graphed, resident=False), PlanDriver(eager, resident=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1800, (n,), generator=g).tolist() for n in (5, 17, 30, 9)]
    reqs = [[d.add(p) for p in prompts[:3]] for d in drivers]

    def step():
        want = drivers[1].step(lambda r: logits_tensor(r).argmax(-1).tolist())
        ids = logits_tensor(want).argmax(-1).tolist()
        got = drivers[0].step(lambda r: ids)
        torch.testing.assert_close(logits_tensor(got), logits_tensor(want), atol=5e-2, rtol=5e-2)

    for _ in range(4):  # prefill, then decode batches of 3 (bucket 4)
        step()
    for d, r in zip(drivers, reqs):
        d.finish(r[1])
    for _ in range(2):  # batches of 2
        step()
    for d in drivers:
        d.add(prompts[3])
    for _ in range(3):  # a mixed step (eager), then batches of 3
        step()
    stats = graphed.stats()["decode_graphs"]
    assert stats["sizes"] == [1, 2, 4] and stats["replays"] == 7  # every decode-only step replayed
    assert eager.stats()["decode_graphs"] is None


def test_no_graphs_on_the_cpu_device():
    runner = ModelRunner(RunnerConfig(device="cpu", num_kv_blocks=8, max_num_seqs=2))
    assert runner.graphs is None and runner.kv_cache.num_blocks == runner.num_kv_blocks


def test_npu_block_sizes_the_kernels_refuse(emu):
    with pytest.raises(ValueError, match="block_size must be a multiple of 16"):
        ModelRunner(_config(block_size=8))


@pytest.mark.parametrize("bad", [(), (0, 2), (8,), (2.5,)])
def test_graph_sizes_are_checked_where_the_runner_captures(emu, bad):
    with pytest.raises(ValueError, match="graph size"):
        ModelRunner(_config(graph_sizes=bad))
