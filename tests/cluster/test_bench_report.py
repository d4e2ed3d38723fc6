"""The targets `raylm bench` reports against vLLM: issue 35's two workloads have two goals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.bench import report


class Run:
    def __init__(self, name: str, tok_s: float) -> None:
        self.name, self.kind, self.rounds, self.tok_s = name, name, [tok_s], tok_s
        self.spec = SimpleNamespace(batch_size=64)

    def summary(self) -> dict:
        return {"output_tok_s": self.tok_s}


def bench(input_len, raylm: float, vllm: float):
    b = SimpleNamespace(a=SimpleNamespace(batch_size=[64], input_len=input_len), report={},
                        runs=[Run("raylm", raylm), Run("vllm", vllm)])
    b.replica_configs = lambda: [(1, 2)]
    return b


@pytest.mark.parametrize(("input_len", "target", "key"), [
    ((42, 251), 1.25, "raylm >= 1.25x vLLM"),
    ((700, 1000), 1.1, f"raylm >= 1.1x vLLM, prompts of {report.LONG_PROMPT}+ tokens"),
])
def test_the_goal_against_vllm_follows_the_prompt_lengths(input_len, target, key):
    b = bench(input_len, raylm=115.0, vllm=100.0)
    assert report.ratios(b)["raylm / vllm"] == pytest.approx(1.15)
    assert b.report["targets"] == {key: {"value": pytest.approx(1.15), "target": target, "met": 1.15 >= target}}
