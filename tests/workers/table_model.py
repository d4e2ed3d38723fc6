"""A small decoder written against an OpTable (the shape of Qwen3's forward), for graph
and backend tests: embed, per layer RMSNorm -> q/k/v -> q/k norm -> RoPE -> paged
attention -> o_proj -> residual RMSNorm -> SwiGLU MLP, final norm, logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.kv_cache import KVCache


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 96
    hidden_size: int = 64
    intermediate_size: int = 96
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6


class TableModel(torch.nn.Module):
    def __init__(self, ops, config: TinyConfig = TinyConfig(), dtype=torch.bfloat16, seed: int = 0) -> None:
        super().__init__()
        self.ops, self.config = ops, config
        c = config
        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale=0.08):
            return (torch.randn(*shape, generator=g) * scale).to(dtype)

        self.embed_weight = w(c.vocab_size, c.hidden_size, scale=1.0)
        h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.layers = [dict(
            ln1=1 + w(c.hidden_size), ln2=1 + w(c.hidden_size), qn=1 + w(d), kn=1 + w(d),
            qkv=ops.prepare_linear(w((h + 2 * kv) * d, c.hidden_size)), o=ops.prepare_linear(w(c.hidden_size, h * d)),
            gate_up=ops.prepare_linear(w(2 * c.intermediate_size, c.hidden_size)),
            down=ops.prepare_linear(w(c.hidden_size, c.intermediate_size)),
        ) for _ in range(c.num_hidden_layers)]
        self.norm = 1 + w(c.hidden_size)
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    def new_cache(self, num_blocks: int, block_size: int) -> KVCache:
        c = self.config
        return KVCache(num_layers=c.num_hidden_layers, num_blocks=num_blocks, block_size=block_size,
                       num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.dtype)

    def embed(self, input_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.embed_weight, 0, input_ids, out=out)

    def forward(self, hidden, positions, kv_cache, meta):
        c, ops = self.config, self.ops
        t = hidden.shape[0]
        h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos, sin = ops.rotary_cos_sin(positions, self.inv_freq, hidden.dtype)
        meta = ops.attention.prepare(meta)  # once per step, as Qwen3's forward does
        residual = hidden
        x = ops.rms_norm(hidden, self.layers[0]["ln1"], c.rms_norm_eps)
        for i, p in enumerate(self.layers):
            if i:
                x, residual = ops.add_rms_norm(x, residual, p["ln1"], c.rms_norm_eps)
            qkv = ops.linear(x, p["qkv"])
            q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
            q = ops.rms_norm(q.reshape(t, h, d), p["qn"], c.rms_norm_eps)
            k = ops.rms_norm(k.reshape(t, kv, d), p["kn"], c.rms_norm_eps)
            v = v.reshape(t, kv, d).contiguous()
            q, k = ops.apply_rotary(q, k, cos, sin)
            ops.attention.write_kv(kv_cache, i, k, v, meta)
            a = ops.linear(ops.attention.forward(q, k, v, kv_cache, i, meta), p["o"])
            x, residual = ops.add_rms_norm(a, residual, p["ln2"], c.rms_norm_eps)
            x = ops.linear(ops.silu_and_mul(ops.linear(x, p["gate_up"])), p["down"])
        return x + residual

    def compute_logits(self, hidden, out):
        h = self.ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return out.copy_(torch.mm(h, self.embed_weight[: out.shape[1]].t()))
