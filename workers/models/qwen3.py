"""The Qwen3 forward (dense, or MoE: workers/models/qwen3_moe.py) over a paged KV cache.

Parameter names match Hugging Face checkpoints (`model.layers.0.self_attn.q_proj.weight`,
...), so a checkpoint's state dict loads as is. One forward takes a flat batch of tokens
that mixes prefill chunks and decode rows; how each token attends is described by an
AttentionMetadata built once per step. Every computation goes through the op table the
runner hands to `prepare` (linear, norms, RoPE, SwiGLU, paged attention); the model knows
nothing of plans, slots, devices or Ray.

Under tensor parallelism (workers/parallel.py) each module holds its rank's slice: this
rank's heads in attention, its part of the MLP's intermediate dim (or of each expert's, or its
experts under expert parallelism), its rows of the vocab; o_proj, down_proj and MoE outputs are
all-reduced, embed and logits do their vocab-parallel parts.

Under pipeline parallelism (workers/pipeline.py) a stage holds only its layers (the others are
parameterless placeholders, so names and layer numbers stay the checkpoint's), the first stage
the embedding, the last the lm_head (and the embedding too when they are tied); forward runs
the stage's layers and returns the residual stream after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from scheduler.checks import check_positive_ints
from workers.kv_cache import KVCache
from workers.models.qwen3_moe import Qwen3SparseMoeBlock
from workers.models.rope import RopeConfig
from workers.ops.base import AttentionMetadata, OpTable
from workers.parallel import SINGLE, ShardedShape, TensorParallel
from workers.quant.linear import QuantizedLinear, quant_weight
from workers.quant.weights import fuse


@dataclass(frozen=True)
class Qwen3Config:
    """The shape of a Qwen3 model, dense or MoE (the fields of its config.json that matter).

    num_experts 0 is a dense model. Otherwise a layer's MLP is a sparse MoE block of
    `num_experts` experts (`num_experts_per_tok` active per token, each of
    `moe_intermediate_size`) when it is not in `mlp_only_layers` and its number + 1 is a multiple
    of `decoder_sparse_step`, as HF's Qwen3MoeDecoderLayer decides; the other layers keep a dense
    MLP of `intermediate_size`."""

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
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rope_scaling: RopeConfig | None = None  # None: plain RoPE of rope_theta

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model serves: a scaled RoPE's length (YaRN: original * factor)."""
        return self.rope_scaling.max_position_embeddings if self.rope_scaling else self.max_position_embeddings

    def inv_freq(self, device) -> torch.Tensor:
        """RoPE's inverse frequencies [head_dim / 2] in fp32 on `device`, as HF computes them."""
        if self.rope_scaling is not None:
            return self.rope_scaling.inv_freq(device)
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device) / self.head_dim
        return 1.0 / (self.rope_theta ** exponent)

    @property
    def rope_attention_factor(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention scaling; 1 otherwise)."""
        return self.rope_scaling.attention_factor if self.rope_scaling else 1.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a sparse MoE block."""
        return self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.is_sparse(i) for i in range(self.num_hidden_layers))

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"))
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
        if not isinstance(self.num_experts, int) or isinstance(self.num_experts, bool) or self.num_experts < 0:
            raise ValueError(f"num_experts must be a non-negative integer, got {self.num_experts!r}")
        if self.is_moe:
            check_positive_ints(self, ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"))
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                                 f"num_experts ({self.num_experts})")
        if not isinstance(self.mlp_only_layers, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers must be a tuple of layer numbers, got {self.mlp_only_layers!r}")


class RMSNorm(nn.Module):
    """Qwen3RMSNorm's weight; the op table computes it (normalize in fp32, cast back, scale)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Qwen3Attention(nn.Module):
    """q/k/v/o projections under HF's names; `prepare` fuses q, k and v into one weight
    (concatenated along the output dim) for the op table's linear."""

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

    def prepare(self, ops: OpTable, dtype: torch.dtype | None = None) -> dict:
        return {"qkv": _prepare_linear(ops, dtype, self.q_proj, self.k_proj, self.v_proj),
                "o": _prepare_linear(ops, dtype, self.o_proj)}

    def forward(self, ops: OpTable, w: dict, x, cos, sin, kv_cache: KVCache, layer: int,
                attn: AttentionMetadata):
        t = x.shape[0]  # x: [T, hidden]
        qn, kvn = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = ops.linear(x, w["qkv"]).split([qn, kvn, kvn], dim=-1)  # [T, qn], [T, kvn], [T, kvn]
        q, k = ops.qk_norm_rope(q.reshape(t, self.num_heads, self.head_dim),
                                k.reshape(t, self.num_kv_heads, self.head_dim), self.q_norm.weight,
                                self.k_norm.weight, self.q_norm.eps, cos, sin)  # [T, H, D], [T, KVH, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        ops.attention.write_kv(kv_cache, layer, k, v, attn)
        out = ops.attention.forward(q, k, v, kv_cache, layer, attn)  # [T, H * D]
        return self.parallel.all_reduce(ops.linear(out, w["o"]))  # [T, hidden], summed over the ranks


class Qwen3MLP(nn.Module):
    """gate/up/down under HF's names; `prepare` fuses gate and up (gate rows first)."""

    def __init__(self, config: Qwen3Config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        inter = ShardedShape.of(config, parallel).intermediate_size  # this rank's part
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def prepare(self, ops: OpTable, dtype: torch.dtype | None = None) -> dict:
        return {"gate_up": _prepare_linear(ops, dtype, self.gate_proj, self.up_proj),
                "down": _prepare_linear(ops, dtype, self.down_proj)}

    def forward(self, ops: OpTable, w: dict, x: torch.Tensor) -> torch.Tensor:
        out = ops.linear(ops.silu_and_mul(ops.linear(x, w["gate_up"])), w["down"])  # [T, hidden]
        return self.parallel.all_reduce(out)  # summed over the ranks


def _prepare_linear(ops: OpTable, dtype: torch.dtype | None, *linears: nn.Module):
    """The op table's handle for linears that read one input (q/k/v, gate/up: fused along out; or
    one linear), full precision or quantized (workers/quant; computing in `dtype`)."""
    if not isinstance(linears[0], QuantizedLinear):
        return ops.prepare_linear(*_fused(*linears)) if len(linears) > 1 else \
            ops.prepare_linear(linears[0].weight, linears[0].bias)
    if not all(isinstance(m, QuantizedLinear) for m in linears):
        raise ValueError("linears that read one input must all be quantized or none: "
                         f"{[type(m).__name__ for m in linears]}")
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    return ops.prepare_quantized_linear(fuse([quant_weight(m) for m in linears]), bias, dtype=dtype)


@torch.no_grad()
def _fused(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights (and biases) of linears that read the same input, concatenated along out.
    The linears' own parameters become views of the fused tensors (no second copy; the
    HF names still load and save)."""
    fused = []
    for attr in ("weight", "bias"):
        if getattr(linears[0], attr) is None:
            fused.append(None)
            continue
        parts = [getattr(m, attr) for m in linears]
        if _adjacent(parts):
            t = parts[0].data.as_strided((sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                                         parts[0].stride())
        else:
            t = torch.cat([p.data for p in parts])
            row = 0
            for p in parts:
                p.data = t[row:row + p.shape[0]]
                row += p.shape[0]
        fused.append(t)
    return fused[0], fused[1]


def _adjacent(parts: list[torch.Tensor]) -> bool:
    """Whether contiguous tensors already sit back to back in one storage (fused before)."""
    p0 = parts[0]
    if not all(p.is_contiguous() and p.untyped_storage().data_ptr() == p0.untyped_storage().data_ptr()
               for p in parts):
        return False
    offset = p0.storage_offset()
    for p in parts:
        if p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer: int, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, parallel)
        self.mlp = Qwen3SparseMoeBlock(config, parallel) if config.is_sparse(layer) else Qwen3MLP(config, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, ops: OpTable, w: dict, x, residual, cos, sin, kv_cache: KVCache, layer: int,
                attn: AttentionMetadata):
        """x: this layer's input before its norm: the embedding for layer 0 (residual None),
        else the previous layer's MLP output with `residual` its residual stream. Neither is
        written in place: the first layer's input is the resident next_hidden buffer."""
        norm = self.input_layernorm
        if residual is None:
            h, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(ops, w, h, cos, sin, kv_cache, layer, attn)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(ops, w, h), residual


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: no weights, never called."""


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        stage = parallel.pipeline.layers(config.num_hidden_layers)
        embedding = stage.is_first or (stage.is_last and config.tie_word_embeddings)  # tied: the lm_head too
        self.embed_tokens = nn.Embedding(ShardedShape.of(config, parallel).vocab_rows if embedding else 0,
                                         config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i, parallel) if i in stage.indices else MissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config  # the whole model's shape; the modules hold this rank's part
        self.parallel = parallel
        self.shape = ShardedShape.of(config, parallel)
        self.stage = parallel.pipeline.layers(config.num_hidden_layers)  # the layers this rank holds
        self.model = Qwen3Model(config, parallel)
        self.lm_head = nn.Linear(config.hidden_size, self.shape.vocab_rows if self.stage.is_last else 0, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # on the CPU even under torch.device("meta") (the loader's empty model): a factory on meta
        # runs torch's Python reference, whose first call imports torch._dynamo (~2 s of every start);
        # reset_rotary recomputes it where the model lands
        self.register_buffer("inv_freq", config.inv_freq("cpu"), persistent=False)
        self.prepared = PreparedWeights()  # set by prepare(ops)
        self.released = False  # set by prepare(release=True)
        self.quant = None  # the QuantConfig its quantized linears came from (workers/quant), set by the loader
        self.embedding_in_lm_head = False  # a tied embedding's lookups read the lm_head's prepared copy

    def holds(self, name: str) -> bool:
        """Whether this rank's part of the model has checkpoint weight `name` (a pipeline stage
        holds its own layers, and the embedding or lm_head only where it uses them)."""
        if name.startswith("model.layers."):
            return int(name.split(".", 3)[2]) in self.stage.indices
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens.num_embeddings > 0
        if name.startswith("lm_head."):
            return self.stage.is_last
        return True

    def tie_weights(self) -> None:
        """Re-point lm_head at the embedding (after `to_empty`, which unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_rotary(self) -> None:
        """Recompute inv_freq in fp32 on the model's device (after `to_empty` or a dtype cast)."""
        self.inv_freq = self.config.inv_freq(self.model.embed_tokens.weight.device)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its norms'; the embedding may be stored narrower)."""
        return self.model.norm.weight.dtype

    def embed(self, input_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> out [T, hidden], written in place (widened where the embedding is
        stored narrower than the model computes)."""
        if not self.parallel.enabled:
            return self._lookup(input_ids, out)
        # vocab-parallel: each rank looks up the ids it holds, zeros the rest; the sum is the lookup
        local = input_ids - self.shape.vocab_start
        outside = (local < 0) | (local >= self.shape.vocab_rows)  # [T]
        self._lookup(local.masked_fill(outside, 0), out)
        out.masked_fill_(outside[:, None], 0)
        return self.parallel.all_reduce(out)

    def _lookup(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.embedding_in_lm_head:
            return self.prepared.ops.linear_rows(self.prepared.lm, ids, out)
        weight = self.model.embed_tokens.weight
        if weight.dtype == out.dtype:
            return torch.index_select(weight, 0, ids, out=out)
        return out.copy_(torch.index_select(weight, 0, ids))

    def store_embedding(self, dtype: torch.dtype) -> None:
        """Keep the embedding in `dtype` (narrower than the compute dtype where every value fits,
        e.g. a bf16 checkpoint's: exact, half the bytes; lookups widen the rows they read). A tied
        one is the lm_head's weight too: left as it is until the op table's lm_head handle holds a
        copy of its own; then, where the table can read every row back from that copy, lookups do
        and the embedding is freed (held once), else it is narrowed."""
        weight = self.model.embed_tokens.weight
        if self.config.tie_word_embeddings and self.stage.is_last:  # elsewhere no lm_head reads it
            if self.prepared.ops is None or not self.released or weight.numel() == 0:
                return  # the lm_head may still be prepared from it, or read it where it lies
            if _storage_key(weight) in {_storage_key(t) for t in _tensors_in(self.prepared.lm)}:
                return
            probe = torch.arange(min(2, weight.shape[0]), device=weight.device)
            row = torch.empty(len(probe), weight.shape[1], dtype=self.dtype, device=weight.device)
            rows = weight.shape[0]
            if (self.prepared.ops.linear_rows(self.prepared.lm, probe, row) is not None
                    and getattr(self.prepared.lm, "out_features", rows) == rows
                    and torch.equal(row, weight[probe].to(self.dtype))):
                weight.data = weight.data.new_empty((0, 0))
                self.embedding_in_lm_head = True
                return
        weight.data = weight.data.to(dtype)

    def weight_bytes(self) -> int:
        """The bytes of weights held: the parameters and the op table's prepared copies, each
        storage once."""
        seen: dict[int, int] = {}
        for t in [*self.parameters(), *_tensors_in(self.prepared.layers), *_tensors_in(self.prepared.lm)]:
            seen[_storage_key(t)] = _nbytes(t)
        return sum(seen.values())

    def prepare(self, ops: OpTable, logits_rows: int | None = None, release: bool = False) -> None:
        """Hand the model its op table and let the table prepare every linear's weights once
        (q/k/v and gate/up fused, packed where the table packs); logits_rows: the vocab rows
        the lm_head computes (None: all). Call again after the weights change.

        release: free, layer by layer as it goes (so a layer's copy and its original are held
        together only while it is prepared), the storage of every weight matrix the forward reads
        only through the table's handles when no handle holds it (they hold copies: packed, fused
        or narrowed): a weight is then held once. The embedding stays (lookups read it). The model
        cannot be prepared again afterwards."""
        if self.released:
            raise RuntimeError("this model's weights were released after it was prepared: load it again")
        keep = {_storage_key(self.model.embed_tokens.weight)}
        layers = []
        for i in self.stage.indices:
            layer = self.model.layers[i]
            layers.append({**layer.self_attn.prepare(ops, self.dtype), **layer.mlp.prepare(ops, self.dtype)})
            if release:
                _release(layer.parameters(), layers[-1], keep)
        weight = self.lm_head.weight
        if self.parallel.enabled:  # every rank computes its whole slice; rank 0 trims after the gather
            logits_rows = None
        lm = None
        if self.stage.is_last:
            lm = ops.prepare_linear(weight if logits_rows is None else weight[:logits_rows], None)
        if release:
            if lm is not None:
                _release([weight], lm, keep)
            self.released = True
        self.prepared = PreparedWeights(ops, layers, lm)

    def _prepared(self) -> PreparedWeights:
        if self.prepared.ops is None:
            from workers.ops import get_op_table

            with torch.inference_mode(False), torch.no_grad():  # the weights stay ordinary tensors
                self.prepare(get_op_table(self.model.embed_tokens.weight.device, "reference"))
        return self.prepared

    @property
    def ops(self) -> OpTable:
        return self._prepared().ops

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> RoPE's cos, sin [T, head_dim] each, in dtype."""
        if self.inv_freq.dtype != torch.float32 or self.inv_freq.device != positions.device:
            self.reset_rotary()  # a .to(dtype) cast it, or the model moved: recompute in fp32
        return self._prepared().ops.rotary_cos_sin(positions, self.inv_freq, dtype, self.config.rope_attention_factor)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata, aux_layers: tuple[int, ...] = (),
                aux_out: list[torch.Tensor] | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """hidden [T, hidden] (embedded inputs, or the previous pipeline stage's output), positions
        [T] -> [T, hidden]: the residual stream after this stage's layers (before the final norm).
        aux_out gets the residual stream entering each of `aux_layers`, in their order (an EAGLE-3
        head's features; layer 0's is the embedding). rotary: `self.rotary(positions)` where the
        caller has it already (a drafter computes its passes' at once)."""
        p = self._prepared()
        ops = p.ops
        cos, sin = rotary or self.rotary(positions, hidden.dtype)  # [T, head_dim] each
        attn = ops.attention.prepare(attn)
        x, residual = hidden, None
        taken: dict[int, torch.Tensor] = {}
        for j, i in enumerate(self.stage.indices):  # j: the layer's place in this stage's KV cache
            if i in aux_layers:
                taken[i] = x if residual is None else x + residual
            x, residual = self.model.layers[i](ops, p.layers[j], x, residual, cos, sin, kv_cache, j, attn)
        if aux_out is not None:
            aux_out.extend(taken[i] for i in aux_layers)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """hidden [B, hidden] -> out [B, V] (float32), V <= vocab_size: only the first V ids.
        Vocab-parallel: each rank's rows are gathered to rank 0; other ranks return None."""
        p = self._prepared()
        h = p.ops.rms_norm(hidden, self.model.norm.weight, self.model.norm.eps)
        if self.parallel.enabled:
            parts = self.parallel.gather_to_first(p.ops.linear(h, p.lm))  # [B, V / world] each
            if parts is None:
                return None
            return out.copy_(torch.cat(parts, dim=1)[:, : out.shape[1]])
        return p.ops.linear_into(h, p.lm, out)

    def greedy_ids(self, hidden: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """hidden [B, hidden] -> the argmax of each row's logits over the first `vocab` ids, int64
        [B], with no [B, V] logits written where the op table fuses the lm_head with the argmax.
        None under tensor parallelism (each rank holds a slice of the vocab: compute_logits)."""
        if self.parallel.enabled:
            return None
        p = self._prepared()
        h = p.ops.rms_norm(hidden, self.model.norm.weight, self.model.norm.eps)
        return p.ops.linear_argmax(h, p.lm, vocab)


def _tensors_in(obj, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor an op table's prepared handle holds (handles are tensors, tuples, lists, dicts
    or plain objects of them)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors_in(item, seen)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors_in(item, seen)]
    if type(obj).__module__.startswith("workers.") and not isinstance(obj, (OpTable, nn.Module)):
        return _tensors_in(getattr(obj, "__dict__", {}), seen)  # a handle class of an op table
    return []


@torch.no_grad()
def _release(params, handles, keep: set[int]) -> None:
    """Free the storage of each 2-d+ parameter no handle holds and not in keep (storage keys)."""
    held = {_storage_key(t) for t in _tensors_in(handles)} | keep
    for param in params:
        if param.dim() >= 2 and param.numel() > 0 and _storage_key(param) not in held:
            param.data = param.data.new_empty((0,) * param.dim())


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # opaque tensors (oneDNN's packed weights)
        return id(t)


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.nbytes


class PreparedWeights:
    """The op table and its prepared linear handles (per layer: qkv, o, gate_up, down; the lm_head).
    Not copied with the model (deepcopy gives an empty one): a copy prepares its own."""

    def __init__(self, ops: OpTable | None = None, layers: list | None = None, lm=None) -> None:
        self.ops, self.layers, self.lm = ops, layers or [], lm

    def __deepcopy__(self, memo) -> PreparedWeights:
        return PreparedWeights()
