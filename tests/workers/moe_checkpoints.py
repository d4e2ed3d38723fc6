"""Tiny random Qwen3-MoE checkpoints written by HF transformers (the oracle's own models), with
the bundled tiny model's tokenizer (its ids fit every vocab here), for model, runner, TP/EP and
engine tests.

- "top2": 8 experts, top-2, norm_topk_prob true, GQA (4 query / 2 KV heads), odd sizes
  (hidden 40, head_dim 10, moe_intermediate 28, vocab 131 below the tokenizer's).
- "sparse_step": 6 experts, top-3, norm_topk_prob false, decoder_sparse_step 2 and layer 3 in
  mlp_only_layers (so layers 0 and 2 are dense too), GQA 6 / 2, untied embeddings, written in
  shards (model.safetensors.index.json).
- "stacked": top2's weights under the stacked expert layout (`mlp.experts.gate_up_proj` /
  `down_proj`) instead of Qwen's per-expert names.
- "engine": 8 experts, top-2, the tokenizer's whole vocab (2048), so text prompts and grammars
  work through the engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from workers.loader import bundled_model_path

SHAPES = {
    "top2": dict(vocab_size=131, hidden_size=40, intermediate_size=56, moe_intermediate_size=28,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=10, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True),
    "sparse_step": dict(vocab_size=150, hidden_size=36, intermediate_size=44, moe_intermediate_size=20,
                        num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                        num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
                        mlp_only_layers=[3], tie_word_embeddings=False),
    "engine": dict(vocab_size=2048, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                   num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
}


def _copy_tokenizer(d: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(bundled_model_path()) / name, d / name)


def hf_moe(name: str, seed: int = 0, std: float = 0.2):
    """HF's Qwen3MoeForCausalLM of shape `name`, seeded; weights drawn wider than HF's default so
    the router's choices and the tokens are far from ties."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**SHAPES[name], max_position_embeddings=512, rope_theta=10000.0,
                            initializer_range=std)
    return Qwen3MoeForCausalLM(config).to(torch.float32).eval()


def write_checkpoint(name: str, d: Path) -> str:
    """Checkpoint `name` (see the module docstring) in directory d."""
    d.mkdir(parents=True, exist_ok=True)
    model = hf_moe("top2" if name == "stacked" else name)
    if name == "stacked":
        from safetensors.torch import save_file

        model.save_pretrained(d)  # config.json; the weights are replaced below
        for f in d.glob("model*.safetensors*"):
            f.unlink()
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(d, **({"max_shard_size": "40KB"} if name == "sparse_step" else {}))
    _copy_tokenizer(d)
    config = json.loads((d / "config.json").read_text())
    config["eos_token_id"] = None
    (d / "config.json").write_text(json.dumps(config))
    return str(d)
