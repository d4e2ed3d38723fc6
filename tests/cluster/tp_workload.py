"""The workload of the tensor-parallel tests (test_tensor_parallel.py, test_tensor_parallel_faults.py)."""

from __future__ import annotations

from scheduler.request import SamplingParams

PROMPTS = ["北京故宫是", "Hello there", "The quick brown fox jumps over the lazy dog", "def add(a, b):"]
N = 16
GREEDY = SamplingParams(max_tokens=N, temperature=0)
SEEDED = SamplingParams(max_tokens=N, temperature=1.0, top_k=50, seed=99)
PENALIZED = SamplingParams(max_tokens=N, temperature=1.0, seed=7, ignore_eos=True, frequency_penalty=1.5,
                           repetition_penalty=1.3, logit_bias={"13": 2.0})
