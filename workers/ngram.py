"""Prompt-lookup (n-gram) drafts: the tokens that followed the last earlier occurrence of the
sequence's suffix, trying suffixes from `max_n` down to `min_n` tokens long.

Every earlier occurrence of a suffix ends where the sequence's last token occurs, so the search
starts from those places (one comparison over the sequence) and extends each match backwards
only there: a step costs one pass over the tokens plus the few places the last token recurs,
not a window of n comparisons at every position for each n."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, *, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft ids continuing `tokens` ([N] int), or [] when no suffix of min_n..max_n
    tokens occurred earlier. The longest suffix found wins, and of its occurrences the latest
    (the most recent context)."""
    n_tokens = len(tokens)
    longest = min(max_n, n_tokens - 1)
    if k < 1 or longest < min_n:
        return []
    ends = np.flatnonzero(tokens[:n_tokens - 1] == tokens[-1])  # where an earlier occurrence could end
    if not ends.size:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # how many of the suffix's last tokens each end matches
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, longest):
        back = ends - j
        alive &= back >= 0
        alive[alive] = tokens[back[alive]] == tokens[n_tokens - 1 - j]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    start = int(ends[np.flatnonzero(matched == best)[-1]]) + 1
    return tokens[start:start + k].tolist()
