"""An EAGLE-3 draft head for Qwen3, as published for it (LlamaForCausalLMEagle3 checkpoints,
vLLM's and SGLang's `method: eagle3`, and the `speculators` format).

The head drafts from the target's own features: three of the target's hidden states (the
residual stream entering `aux_layer_ids`; id 0 is the embedding) concatenated and projected by
`fc` to one hidden vector per position. Its single decoder layer (`midlayer`) reads, at position
p, the embedding of token p + 1 (input_layernorm) beside that feature (hidden_norm), so its
q/k/v project 2 x hidden; attention (no q/k norm, rotate-half RoPE) runs over its own KV at the
target's positions. Its output before the final norm stands in for the next position's feature
when it drafts further; after `norm`, `lm_head` scores a draft vocabulary, mapped to target ids
by `d2t` (target = draft + d2t[draft]).

Weight names are the checkpoint's: `fc.weight`, `midlayer.*` (or `layers.0.*`), `norm.weight`,
`lm_head.weight`, `d2t`, `t2d` (unused), and an optional `embed_tokens.weight` (absent: the
target's embedding). `forward` computes through the op table over a paged KV; `reference` is
the same arithmetic in plain torch over whole sequences (the test oracle, and what training uses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from scheduler.checks import check_positive_ints
from workers.kv_cache import KVCache
from workers.models.qwen3 import Qwen3Config, Qwen3MLP, RMSNorm, _prepare_linear
from workers.ops.base import AttentionMetadata, OpTable

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel")


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's choice when a head names none: early, middle and late."""
    return 2, num_target_layers // 2, num_target_layers - 3


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None = None  # None: default_aux_layers of the target
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    norm_before_residual: bool = False
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, raw: dict) -> Eagle3Config:
        """From a head's config.json: a Llama-shaped config (LlamaForCausalLMEagle3), or the
        speculators format (the layer's shape under `transformer_layer_config`)."""
        if not isinstance(raw, dict):
            raise ValueError(f"an EAGLE-3 config is a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures") or []
        if archs and not any(a in ARCHITECTURES for a in archs):
            raise ValueError(f"architecture {archs[0]!r} is not an EAGLE-3 head ({', '.join(ARCHITECTURES)})")
        layer = raw.get("transformer_layer_config") or raw
        eagle = raw.get("eagle_config") or {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if layer.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"num_hidden_layers {layer['num_hidden_layers']!r}: an EAGLE-3 head has one layer")
        if layer.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {layer['hidden_act']!r} is not supported (only 'silu')")
        if layer.get("rope_scaling") or raw.get("rope_scaling"):
            raise ValueError("an EAGLE-3 head with rope_scaling is not supported")
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError("an EAGLE-3 head without aux hidden states (use_aux_hidden_state false) "
                             "is not supported")
        try:
            hidden = layer["hidden_size"]
            heads = layer["num_attention_heads"]
            vocab = layer.get("vocab_size") or raw["vocab_size"]
            config = cls(
                hidden_size=hidden, intermediate_size=layer["intermediate_size"], num_attention_heads=heads,
                num_key_value_heads=layer.get("num_key_value_heads", heads),
                head_dim=layer.get("head_dim") or hidden // heads, vocab_size=vocab,
                draft_vocab_size=raw.get("draft_vocab_size") or vocab,
                target_hidden_size=raw.get("target_hidden_size") or hidden,
                aux_layer_ids=None if ids is None else tuple(ids),
                rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=layer.get("rope_theta", 1e6),
                norm_before_residual=bool(raw.get("norm_before_residual", layer.get("norm_before_residual", False))),
                attention_bias=bool(layer.get("attention_bias", False)))
        except KeyError as e:
            raise ValueError(f"an EAGLE-3 config needs {e.args[0]!r}") from None
        config.check()
        return config

    def check(self) -> None:
        check_positive_ints(self, ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "vocab_size", "draft_vocab_size", "target_hidden_size"),
                            "EAGLE-3 config ")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"EAGLE-3 config num_attention_heads {self.num_attention_heads} must be a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"EAGLE-3 config draft_vocab_size {self.draft_vocab_size} exceeds vocab_size "
                             f"{self.vocab_size}")
        if self.aux_layer_ids is not None and (
                len(self.aux_layer_ids) != 3 or not all(isinstance(i, int) and i >= 0 for i in self.aux_layer_ids)):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids must be three layer numbers, "
                             f"got {list(self.aux_layer_ids)!r}")

    def layers_for(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose input the head reads (vLLM's numbering: 0 is the embedding)."""
        ids = self.aux_layer_ids or default_aux_layers(num_target_layers)
        bad = [i for i in ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(ids)} name layers {bad} outside the "
                             f"target's 0..{num_target_layers - 1}")
        return tuple(ids)

    def to_dict(self) -> dict:
        """config.json of a head (LlamaForCausalLMEagle3, as published)."""
        out = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
               "num_hidden_layers": 1, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
               "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
               "head_dim": self.head_dim, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
               "target_hidden_size": self.target_hidden_size, "rms_norm_eps": self.rms_norm_eps,
               "rope_theta": self.rope_theta, "rope_scaling": None, "tie_word_embeddings": False,
               "attention_bias": self.attention_bias, "norm_before_residual": self.norm_before_residual}
        if self.aux_layer_ids is not None:
            out["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        return out

    def qwen3_shape(self) -> Qwen3Config:
        """The shape its MLP and RoPE share with a Qwen3 layer."""
        return Qwen3Config(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta)


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        c, bias = config, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=bias)


class Eagle3Layer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = Qwen3MLP(config.qwen3_shape())
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, own_embedding: bool = False) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size if own_embedding else 0, config.hidden_size)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        shape = config.qwen3_shape()
        self.register_buffer("inv_freq", shape.inv_freq("cpu"), persistent=False)
        self.ops: OpTable | None = None
        self.handles: dict = {}

    @property
    def has_embedding(self) -> bool:
        return self.embed_tokens.num_embeddings > 0

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def prepare(self, ops: OpTable) -> None:
        """The op table's handles for every linear (q/k/v and gate/up fused)."""
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        self.ops = ops
        self.inv_freq = self.config.qwen3_shape().inv_freq(self.fc.weight.device)
        self.handles = {"fc": _prepare_linear(ops, None, self.fc),
                        "qkv": _prepare_linear(ops, None, attn.q_proj, attn.k_proj, attn.v_proj),
                        "o": _prepare_linear(ops, None, attn.o_proj), **mlp.prepare(ops),
                        "lm": ops.prepare_linear(self.lm_head.weight, None)}

    # -- through the op table, over a paged KV --------------------------------------------

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's three aux hidden states side by side [N, 3 x target hidden] -> [N, hidden]."""
        return self.ops.linear(features, self.handles["fc"])

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> RoPE's cos, sin [T, head_dim] each, in the head's dtype."""
        return self.ops.rotary_cos_sin(positions, self.inv_freq, self.dtype)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """embeds [T, hidden] (token p + 1's), hidden [T, hidden] (the feature at p), positions [T]
        -> the layer's output before the final norm [T, hidden]; writes its K/V at the positions.
        rotary: `self.rotary(positions)` where the caller has it already."""
        ops, w, layer, c = self.ops, self.handles, self.midlayer, self.config
        t = embeds.shape[0]
        e = ops.rms_norm(embeds, layer.input_layernorm.weight, c.rms_norm_eps)
        h = ops.rms_norm(hidden, layer.hidden_norm.weight, c.rms_norm_eps)
        residual = h if c.norm_before_residual else hidden
        qn, kvn = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        q, k, v = ops.linear(torch.cat([e, h], dim=-1), w["qkv"]).split([qn, kvn, kvn], dim=-1)
        cos, sin = rotary or self.rotary(positions)
        q, k = ops.apply_rotary(q.reshape(t, c.num_attention_heads, c.head_dim),
                                k.reshape(t, c.num_key_value_heads, c.head_dim), cos, sin)
        v = v.reshape(t, c.num_key_value_heads, c.head_dim)
        attn = ops.attention.prepare(attn)
        ops.attention.write_kv(kv_cache, 0, k, v, attn)
        a = ops.linear(ops.attention.forward(q, k, v, kv_cache, 0, attn), w["o"])
        h, residual = ops.add_rms_norm(a, residual, layer.post_attention_layernorm.weight, c.rms_norm_eps)
        return layer.mlp(ops, w, h) + residual

    def greedy_ids(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> each row's most likely draft token, as a target id (int64 [N])."""
        h = self.ops.rms_norm(prenorm, self.norm.weight, self.config.rms_norm_eps)
        ids = self.ops.linear_argmax(h, self.handles["lm"], self.config.draft_vocab_size).to(torch.int64)
        return ids + self.d2t.index_select(0, ids)

    # -- plain torch, whole sequences -----------------------------------------------------

    def reference(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor]:
        """embeds [B, S, hidden] (token p + 1's), features [B, S, 3 x target hidden] (the target's
        at p), positions [S] -> (output before the final norm [B, S, hidden], draft-vocab logits
        [B, S, draft vocab]), causal over each sequence. Gradients flow (training)."""
        return self.reference_step(embeds, self.fc(features), positions, None)

    def reference_step(self, embeds, hidden, positions, keys_values):
        """One pass of the layer over [B, S] inputs whose features are already combined: causal
        with keys_values None; else training's unrolled drafts, keys_values the K, V of the passes
        before ([B, KVH, S, D] each, appended to): chain i reads pass 0's keys 0..i and its own key
        in every later pass (`_unrolled_mask`). Returns (prenorm, logits)."""
        c, layer = self.config, self.midlayer
        att = layer.self_attn
        b, s, _ = embeds.shape
        e = _rms(embeds, layer.input_layernorm.weight, c.rms_norm_eps)
        h = _rms(hidden, layer.hidden_norm.weight, c.rms_norm_eps)
        residual = h if c.norm_before_residual else hidden
        x = torch.cat([e, h], dim=-1)
        q = att.q_proj(x).view(b, s, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = att.k_proj(x).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = att.v_proj(x).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = c.num_attention_heads // c.num_key_value_heads
        if keys_values is None:
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               is_causal=True, scale=1 / math.sqrt(c.head_dim))
        else:
            ks = torch.cat([*[kv[0] for kv in keys_values], k], dim=2)
            vs = torch.cat([*[kv[1] for kv in keys_values], v], dim=2)
            scores = q @ ks.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(c.head_dim)  # [B, H, S, S']
            total = ks.shape[2]
            mask = _unrolled_mask(s, total, len(keys_values), device=q.device)
            o = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vs.repeat_interleave(rep, 1)
            keys_values.append((k, v))
        o = o.transpose(1, 2).reshape(b, s, -1)
        h2 = att.o_proj(o) + residual
        m, w, eps = layer.mlp, layer.post_attention_layernorm.weight, c.rms_norm_eps
        # the norm is taken once per projection: the bundled head was trained with this autograd
        # graph, and one shared norm would sum its gradients in another order (other weights)
        prenorm = m.down_proj(F.silu(m.gate_proj(_rms(h2, w, eps))) * m.up_proj(_rms(h2, w, eps))) + h2
        logits = self.lm_head(_rms(prenorm, self.norm.weight, c.rms_norm_eps))
        return prenorm, logits


def _unrolled_mask(s: int, total: int, passes: int, device) -> torch.Tensor:
    """Which keys the queries of unrolled pass `passes` read, keys laid out pass after pass (s
    each): chain i (its drafts began after position i) sees the target-featured keys 0..i of pass
    0 and its own entry (index i) in every later pass, itself the last."""
    i = torch.arange(s, device=device)
    mask = torch.zeros(s, total, dtype=torch.bool, device=device)
    mask[:, :s] = i[None, :] <= i[:, None]
    for j in range(1, passes + 1):
        mask[i, j * s + i] = True
    return mask


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return weight * (x.to(torch.float32) * torch.rsqrt(var + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
