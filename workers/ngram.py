"""Prompt-lookup (n-gram) drafts: the tokens that followed the last earlier occurrence of the
sequence's suffix, trying suffixes from `max_n` down to `min_n` tokens long."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, *, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft ids continuing `tokens` ([N] int), or [] when no suffix of min_n..max_n
    tokens occurred earlier. The latest earlier occurrence wins (the most recent context)."""
    n_tokens = len(tokens)
    if k < 1:
        return []
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        suffix = tokens[n_tokens - n:]
        # windows starting at 0 .. n_tokens - n - 1: every earlier occurrence (the suffix itself excluded)
        windows = sliding_window_view(tokens[:n_tokens - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
