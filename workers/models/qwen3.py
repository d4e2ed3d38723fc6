"""The Qwen3 dense forward over a paged KV cache.

Parameter names match Hugging Face checkpoints (`model.layers.0.self_attn.q_proj.weight`,
...), so a checkpoint's state dict loads as is. One forward takes a flat batch of tokens
that mixes prefill chunks and decode rows; how each token attends is described by an
AttentionMetadata built once per step. The model knows nothing of plans, slots or Ray.

Under tensor parallelism (workers/parallel.py) each module holds its rank's slice: this
rank's heads in attention, its part of the MLP's intermediate dim, its rows of the vocab;
o_proj and down_proj outputs are all-reduced, embed and logits do their vocab-parallel parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.attention import AttentionMetadata, paged_attention
from workers.kv_cache import KVCache
from workers.parallel import SINGLE, ShardedShape, TensorParallel


@dataclass(frozen=True)
class Qwen3Config:
    """The shape of a Qwen3 dense model (the fields of its config.json that matter)."""

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalize in fp32, cast back, then scale (HF's exact op order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin for each position, computed like HF (fp32, then cast). [T, 1, head_dim] each."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate-half RoPE as in HF."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        shape = ShardedShape.of(config, parallel)
        self.parallel = parallel
        self.num_heads = shape.num_heads  # this rank's heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache: KVCache, layer: int, attn: AttentionMetadata):
        t = x.shape[0]  # x: [T, hidden]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        kv_cache.write(layer, k, v, attn.slot_mapping)
        out = paged_attention(q, k, v, kv_cache, layer, attn)  # [T, H * D]
        return self.parallel.all_reduce(self.o_proj(out))  # [T, hidden], summed over the ranks


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        inter = ShardedShape.of(config, parallel).intermediate_size  # this rank's part
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.parallel.all_reduce(out)  # summed over the ranks


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, parallel)
        self.mlp = Qwen3MLP(config, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache: KVCache, layer: int, attn: AttentionMetadata):
        # x is never written in place: the first layer's input is the resident next_hidden buffer.
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, layer, attn)
        h = h.add_(x)  # residual
        out = self.mlp(self.post_attention_layernorm(h))
        return out.add_(h)


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(ShardedShape.of(config, parallel).vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, parallel) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config  # the whole model's shape; the modules hold this rank's part
        self.parallel = parallel
        self.shape = ShardedShape.of(config, parallel)
        self.model = Qwen3Model(config, parallel)
        self.lm_head = nn.Linear(config.hidden_size, self.shape.vocab_rows, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float) / config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** exponents)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tie_weights(self) -> None:
        """Re-point lm_head at the embedding (after `to_empty`, which unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_rotary(self) -> None:
        """Recompute inv_freq in fp32 on the model's device (after `to_empty` or a dtype cast)."""
        c = self.config
        device = self.model.embed_tokens.weight.device
        exponent = torch.arange(0, c.head_dim, 2, dtype=torch.float, device=device) / c.head_dim
        self.inv_freq = 1.0 / (c.rope_theta ** exponent)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def embed(self, input_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> out [T, hidden], written in place."""
        weight = self.model.embed_tokens.weight
        if not self.parallel.enabled:
            return torch.index_select(weight, 0, input_ids, out=out)
        # vocab-parallel: each rank looks up the ids it holds, zeros the rest; the sum is the lookup
        local = input_ids - self.shape.vocab_start
        outside = (local < 0) | (local >= self.shape.vocab_rows)  # [T]
        torch.index_select(weight, 0, local.masked_fill(outside, 0), out=out)
        out.masked_fill_(outside[:, None], 0)
        return self.parallel.all_reduce(out)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden] (embedded inputs), positions [T] -> [T, hidden] before the final norm."""
        if self.inv_freq.dtype != torch.float32 or self.inv_freq.device != hidden.device:
            self.reset_rotary()  # a .to(dtype) cast it, or the model moved: recompute in fp32
        cos, sin = rotary_cos_sin(positions, self.inv_freq, hidden.dtype)
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin, kv_cache, i, attn)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """hidden [B, hidden] -> out [B, V] (float32), V <= vocab_size: only the first V ids.
        Vocab-parallel: each rank's rows are gathered to rank 0; other ranks return None."""
        h = self.model.norm(hidden)
        if self.parallel.enabled:
            parts = self.parallel.gather_to_first(torch.mm(h, self.lm_head.weight.t()))  # [B, V / world] each
            if parts is None:
                return None
            return out.copy_(torch.cat(parts, dim=1)[:, : out.shape[1]])
        weight = self.lm_head.weight[: out.shape[1]]  # [V, hidden]
        if out.dtype == h.dtype:
            return torch.mm(h, weight.t(), out=out)
        return out.copy_(torch.mm(h, weight.t()))
