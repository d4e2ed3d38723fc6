"""The HTTP load client's figures, from records it would have taken (no server)."""

from __future__ import annotations

import pytest

from cluster.bench.serve_http import RequestRecord, figures, random_prompts
from workers.loader import bundled_model_path, load_tokenizer


def test_figures_follow_vllms_definitions():
    recs = [RequestRecord(ok=True, status=200, ttft=0.5, latency=2.5, output_tokens=5, prompt_tokens=10,
                          itl=[0.5, 0.5, 0.5, 0.5]),
            RequestRecord(ok=True, status=200, ttft=1.0, latency=2.0, output_tokens=3, prompt_tokens=10,
                          itl=[0.25, 0.75]),
            RequestRecord(ok=False, status=429, latency=0.01, error="queue full")]
    f = figures(recs, elapsed=4.0)
    assert f["completed"] == 2 and f["failed"] == {"429": 1}
    assert f["output_throughput"] == pytest.approx(8 / 4.0)
    assert f["total_token_throughput"] == pytest.approx(28 / 4.0)
    assert f["tpot_median"] == pytest.approx((0.5 + 0.5) / 2)  # (latency - ttft) / (tokens - 1) each
    assert f["ttft_median"] == pytest.approx(0.75)
    assert f["itl_mean"] == pytest.approx(3.0 / 6)


def test_random_prompts_are_seeded_text_of_about_the_asked_length():
    tok = load_tokenizer(bundled_model_path())
    a, b = random_prompts(tok, 4, 64, seed=3), random_prompts(tok, 4, 64, seed=3)
    assert a == b and len(set(a)) == 4
    assert all(48 <= len(tok.encode(p, add_special_tokens=False)) <= 80 for p in a)
