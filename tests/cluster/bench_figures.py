"""What the `raylm bench` end-to-end tests check of every run's figures (its JSON report)."""

from __future__ import annotations

import json
import math

RANDOM_1L = "random:qwen3-0.6b?layers=1"


def load_report(path) -> dict:
    with open(path) as f:
        return json.load(f)


def runs_by_name(doc) -> dict:
    return {r["name"]: r for r in doc["runs"]}


def check_figures(fig: dict, wl: dict) -> None:
    assert fig["num_requests"] == wl["num_requests"]
    assert fig["output_tokens"] == wl["output_tokens"]
    assert fig["prompt_tokens"] == wl["prompt_tokens"]
    assert fig["lengths_ok"] is True  # every request got exactly the tokens it asked for
    assert fig["generated_tokens"] >= fig["output_tokens"]
    assert math.isclose(fig["output_tok_s"], fig["output_tokens"] / fig["elapsed_s"])
    assert math.isclose(fig["total_tok_s"], (fig["output_tokens"] + fig["prompt_tokens"]) / fig["elapsed_s"])
    assert 0 <= fig["ttft_p50_ms"] <= fig["ttft_p99_ms"]
    assert 0 <= fig["tpot_p50_ms"] <= fig["tpot_p99_ms"]
