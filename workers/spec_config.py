"""SpeculativeConfig: how a worker speculates, from a user's `speculative_config` (vLLM's keys).

No torch here: the driver's config module validates it once and hands it to the workers.
`method` "ngram" drafts by prompt lookup over the request's own tokens (the longest suffix of
`prompt_lookup_min`..`prompt_lookup_max` tokens that occurred before, and the tokens that
followed it); "draft_model" drafts greedily with `model`, a smaller Qwen3 checkpoint (or a
random spec) with the target's vocab, run by the same worker (workers/draft_model.py);
"eagle3" drafts greedily with `model`, an EAGLE-3 head for the target (a published head's
directory, or `random:eagle3[?seed=S&draft_vocab=N]`), from the target's own hidden states
(workers/eagle3_drafter.py);
`num_speculative_tokens` k is the most drafts a row verifies in one step; with
`disable_by_batch_size` n, no row drafts while n or more requests run (a step of many rows
gains little from verifying more positions per row).
vLLM's other methods are named so a user's config gets a clear refusal, not a silent no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from scheduler.checks import check_int, is_int

METHODS = ("ngram", "draft_model", "eagle3")
NOT_YET = ("eagle", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
NGRAM_MODELS = ("ngram", "[ngram]")  # vLLM's older way of naming the method
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
# vLLM's keys that raylm reads; any other key is refused by name
KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
        "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    model: str | None = None  # the draft model (method draft_model)
    disable_by_batch_size: int | None = None  # no drafts while this many requests or more run

    @classmethod
    def from_dict(cls, value) -> SpeculativeConfig | None:
        """A validated config from a `speculative_config` mapping (or a SpeculativeConfig, or None);
        ValueError naming the key and value otherwise."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping of vLLM's keys ({', '.join(KEYS)}), "
                             f"got {value!r:.80}")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config key(s) {unknown} are not supported; known keys: {list(KEYS)}")
        method = value.get("method")
        model = value.get("model")
        if method is None and model is not None:  # vLLM infers the method from the model
            method = ("ngram" if model in NGRAM_MODELS else "eagle3" if isinstance(model, str) and
                      "eagle3" in model.lower() else "draft_model")
        if method in NOT_YET:
            raise ValueError(f"speculative_config method {method!r} is not supported yet; supported: "
                             f"{', '.join(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {method!r}")
        if method == "ngram" and model is not None and model not in NGRAM_MODELS:
            raise ValueError(f"speculative_config model {model!r} is for a draft model or head; method "
                             f"'ngram' drafts from the request's own tokens (leave model unset)")
        if method in ("draft_model", "eagle3"):
            if not isinstance(model, str) or not model:
                what = "an EAGLE-3 head's directory" if method == "eagle3" else "a checkpoint directory"
                raise ValueError(f"speculative_config method {method!r} needs model, {what}; got {model!r}")
            if os.path.isdir(os.path.expanduser(model)):  # workers may start elsewhere than the driver
                model = os.path.abspath(os.path.expanduser(model))
        else:
            model = None
        k = value.get("num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config needs num_speculative_tokens (drafts verified per step)")
        check_int("speculative_config num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if n is not None and (not is_int(n) or n < 1):
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {n!r}")
        if low is None and high is None:
            low = high = DEFAULT_LOOKUP
        elif low is None:
            low = high
        elif high is None:
            high = low
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min {low} must be <= prompt_lookup_max {high}")
        off = value.get("disable_by_batch_size")
        check_int("speculative_config disable_by_batch_size", off, 1, optional=True)
        return cls(method, k, low, high, model, off)

    def describe(self) -> dict:
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method in ("draft_model", "eagle3"):
            out["model"] = self.model
        else:
            out.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        return out
