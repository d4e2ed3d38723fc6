"""The lm_head fused with the greedy argmax, checked the same way for every CPU kernel that has it
(the narrow bf16 copy, raylm's bf16 packing)."""

from __future__ import annotations

import torch


def tied_weight(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A [1000, 64] lm_head whose rows 3, 700 and 900 are equal: their logits tie in every row."""
    weight = torch.randn(1000, 64, generator=gen).bfloat16().to(dtype)
    weight[700] = weight[3]
    weight[900] = weight[3]
    return weight


def check_fused_argmax(ops, handle, weight: torch.Tensor, x_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """ops.linear_argmax against the argmax of ops.linear's logits over the first n outputs, for
    several row counts and trimmed vocabularies: ties to the lowest index, a NaN row to 0.
    Returns the last batch of rows (for the caller's own refusals)."""
    for rows in (1, 5, 16, 40, 300):
        x = torch.randn(rows, 64, generator=gen).to(x_dtype)
        x[0] = weight[3] * 50  # row 0's largest logit is the tied one, at 3, 700 and 900
        if rows > 1:
            x[1, 5] = float("nan")
        for n in (1000, 950, 701, 17):  # the vocab trimmed: ids past n never win
            want = ops.linear(x, handle)[:, :n].float().argmax(dim=-1)
            got = ops.linear_argmax(x, handle, n)
            assert got.dtype == torch.int64 and torch.equal(got, want), (rows, n)
        assert ops.linear_argmax(x, handle, 1000)[0] == 3
        if rows > 1:
            assert ops.linear_argmax(x, handle, 1000)[1] == 0
    return x
