"""HF transformers as the correctness oracle: greedy generate, one prompt at a time
(no padding), on the same checkpoint in fp32."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    """HF's Qwen3 in fp32 with EOS stopping off: generate makes exactly max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, stop_ids=()) -> list[list[int]]:
    """Greedy continuations by HF generate, cut after the first id in stop_ids (kept),
    as raylm stops on EOS; with stop_ids empty every prompt gets max_new_tokens tokens."""
    import torch

    model = hf_model(path)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
            for i, t in enumerate(y):
                if t in stop_ids:
                    y = y[: i + 1]
                    break
            outs.append(y)
    return outs


def hf_greedy_text(prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """HF's greedy ids for text prompts on the bundled tiny model, stopping at its EOS ids."""
    from workers.loader import bundled_model_path, eos_token_ids, load_tokenizer

    path = bundled_model_path()
    tok = load_tokenizer(path)
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    return hf_greedy(path, ids, max_new_tokens, stop_ids=frozenset(eos_token_ids(path)))
