"""Load a Qwen3 or Qwen3-MoE checkpoint directory as Hugging Face writes it.

config.json, then model.safetensors or a sharded model.safetensors.index.json; tied or
untied embeddings; dtype from the config or overridden. A MoE layer's experts come either
under Qwen's per-expert names (`mlp.experts.N.{gate,up,down}_proj.weight`, with `weight_scale`
when quantized) or in the stacked layout (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). Every problem raises a
CheckpointError (a ValueError) that names it: the missing directory or file, the missing
or unexpected weight, both shapes of a mismatch, the architecture that is not Qwen3.

A model spec `random:qwen3-0.6b[?layers=N&seed=S]` instead of a path names a model with
seeded random weights built in memory (benchmarks); it has no tokenizer.

Under tensor parallelism (`parallel`) each rank reads only its slice of each tensor
(safetensors' get_slice), as workers/parallel.py splits them; under expert parallelism it
reads only its own experts.
"""

from __future__ import annotations

import contextlib
import json
import re
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

import torch
from safetensors import safe_open

from workers.models.qwen3 import PreparedWeights, Qwen3Config, Qwen3ForCausalLM
from workers.models.qwen3_moe import Qwen3MoeInt8Experts
from workers.models.rope import RopeConfig
from workers.parallel import SINGLE, TensorParallel, shard_of
from workers.quant import QuantConfig, QuantizedLinear, attach, convert_loaded, quantize_at_load, read_quant_config
from workers.runner_config import DTYPE_ALIASES, DTYPE_NAMES, canonical_dtype

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}  # -> model_type
# every name a config may give (workers/runner_config.py) -> its torch dtype
DTYPES = {name: getattr(torch, canonical_dtype(name)) for name in (*DTYPE_NAMES, *DTYPE_ALIASES)}
# weights some checkpoints carry that the model recomputes
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# one expert's weight under Qwen's per-expert names: (layer's experts prefix, expert, projection)
# (a quantized expert's int8 weight, its scale, or the zero offsets its format writes beside them)
_EXPERT_NAME = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                          r"(weight|weight_scale|weight_offset|weight_zero_point)$")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as a Qwen3 model."""


def bundled_model_path() -> str:
    """The tiny Qwen3 shipped as package data; what runs when no model is given."""
    return str(Path(__file__).resolve().parent / "tiny_model")


def bundled_draft_path() -> str:
    """The bundled tiny Qwen3's draft model (speculative decoding's method draft_model)."""
    return str(Path(bundled_model_path()) / "draft")


def bundled_eagle3_path() -> str:
    """The bundled tiny Qwen3's EAGLE-3 head (speculative decoding's method eagle3)."""
    return str(Path(bundled_model_path()) / "eagle3")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    return DTYPES[canonical_dtype(str(dtype))]


def _checkpoint_dir(path) -> Path:
    if path is None:
        raise CheckpointError("no checkpoint directory given")
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {str(d)!r}")
    return d


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.name} not found in {str(path.parent)!r}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def config_from_dict(raw: dict) -> Qwen3Config:
    archs = raw.get("architectures") or []
    known = " or ".join(repr(a) for a in ARCHITECTURES)
    if archs and not any(a in ARCHITECTURES for a in archs):
        raise CheckpointError(f"architecture {archs[0]!r} is not {known}")
    model_type = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None) or raw.get("model_type")
    if model_type not in ARCHITECTURES.values():
        raise CheckpointError(f"model_type {raw.get('model_type')!r} is not 'qwen3' or 'qwen3_moe'")
    if raw.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    try:
        heads = raw["num_attention_heads"]
        rope = RopeConfig.from_hf(raw)
        return Qwen3Config(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.rope_theta,
            rope_scaling=rope if rope.scaled else None,
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            **(_moe_fields(raw) if model_type == "qwen3_moe" else {}),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"config.json: {e}") from None


def _moe_fields(raw: dict) -> dict:
    """Qwen3MoeConfig's fields (transformers 5 writes num_experts as num_local_experts)."""
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, (list, tuple)):
        raise CheckpointError(f"config.json: mlp_only_layers must be a list of layer numbers, got {only!r}")
    return dict(num_experts=experts, num_experts_per_tok=raw["num_experts_per_tok"],
                moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                decoder_sparse_step=raw.get("decoder_sparse_step", 1), mlp_only_layers=tuple(only))


def load_config(path) -> Qwen3Config:
    return config_from_dict(_read_json(_checkpoint_dir(path) / "config.json"))


def load_quant_config(path, quantization: str | None = None) -> QuantConfig | None:
    """The checkpoint's quantization (workers/quant/formats.py) or the one `quantization` asks
    for at load; None for full precision. Raises QuantConfigError (a ValueError) naming what it
    cannot serve."""
    d = _checkpoint_dir(path)
    return read_quant_config(d, _read_json(d / "config.json"), quantization)


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index.name} has no weight_map")
        files = [d / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name!r} listed in {index.name} is missing")
        return files
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {str(d)!r}")


@contextlib.contextmanager
def _no_init_on_meta():
    """nn.init skips meta tensors while the loader builds its empty model: they hold no data, and
    a meta init runs torch's Python reference, whose first call imports torch._dynamo (~3.5 s of
    every worker's start). Other tensors, in any thread, are initialized as always."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")
    saved = {n: getattr(torch.nn.init, n) for n in names}

    def skipping(init):
        return lambda tensor, *args, **kwargs: tensor if tensor.is_meta else init(tensor, *args, **kwargs)

    try:
        for n, init in saved.items():
            setattr(torch.nn.init, n, skipping(init))
        yield
    finally:
        for n, init in saved.items():
            setattr(torch.nn.init, n, init)


def empty_model(config: Qwen3Config, dtype: torch.dtype, device,
                parallel: TensorParallel = SINGLE, expert_dtype: torch.dtype | None = None,
                quant: QuantConfig | None = None) -> Qwen3ForCausalLM:
    """A model (this rank's part of it) with uninitialized weights of `dtype` on `device`
    (built on meta: no double allocation); MoE experts in `expert_dtype` (None: dtype); the
    linears a checkpoint's `quant` quantizes hold its tensors instead."""
    with torch.device("meta"), _no_init_on_meta():
        model = Qwen3ForCausalLM(config, parallel)
        model = model.to(dtype)
        if quant is not None:
            attach(model, quant)
    store_experts(model, expert_dtype or dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.reset_rotary()
    return model.eval().requires_grad_(False)


def expert_dtype_for(weights_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype MoE experts are kept in: the checkpoint's own where it is narrower than the compute
    dtype (exact; the op table widens them as it reads: half the bytes a decode step reads)."""
    return weights_dtype if weights_dtype.itemsize < dtype.itemsize else dtype


@torch.no_grad()
def store_experts(model: Qwen3ForCausalLM, dtype: torch.dtype) -> None:
    """Keep every MoE layer's experts in `dtype` (in place; nothing for a dense model)."""
    for name, module in model.named_modules():
        if name.endswith("mlp.experts") and not isinstance(module, Qwen3MoeInt8Experts):
            module.to(dtype)


def cast_model(model: Qwen3ForCausalLM, dtype: torch.dtype, device=None, *, copy: bool = False,
               expert_dtype: torch.dtype | None = None) -> Qwen3ForCausalLM:
    """`model` in `dtype` (on `device`; MoE experts in `expert_dtype`, None: dtype), embeddings re-tied
    and RoPE tables redone in fp32. Module.to works in place: copy=True leaves the caller's model as it was."""
    if copy:
        model = deepcopy(model)
    experts = {id(p) for name, m in model.named_modules() if name.endswith("mlp.experts") for p in m.parameters()}
    quantized = {id(p) for m in model.modules() if isinstance(m, (QuantizedLinear, Qwen3MoeInt8Experts))
                 for n, p in m.named_parameters() if n != "bias"}
    for param in model.parameters():  # each straight to its own dtype: never a wide copy of every expert
        if id(param) in quantized:  # a format's tensors (int8, int32, fp32 scales) keep their dtype
            param.data = param.data.to(device=device)
            continue
        param.data = param.data.to(device=device, dtype=(expert_dtype or dtype) if id(param) in experts else dtype)
    model.tie_weights()
    model.reset_rotary()
    model.prepared = PreparedWeights()  # new weights: the op table prepares them again
    return model


@torch.no_grad()
def load_model(path, dtype=None, device="cpu", parallel: TensorParallel = SINGLE,
               expert_dtype=None, quantization: str | None = None) -> Qwen3ForCausalLM:
    """The checkpoint at `path` as this rank's model in `dtype` (None: the config's) on `device`;
    MoE experts in `expert_dtype` (None: dtype). A quantized checkpoint's linears hold its
    quantized tensors; quantization="int8" quantizes an unquantized one's as it loads."""
    d = _checkpoint_dir(path)
    config = load_config(d)
    quant = load_quant_config(d, quantization)
    stored = quant if quant is not None and quant.in_checkpoint else None
    dtype = resolve_dtype(dtype or config.torch_dtype)
    model = empty_model(config, dtype, device, parallel, resolve_dtype(expert_dtype or dtype), stored)
    params = dict(model.named_parameters())  # tied: lm_head.weight is the embedding, listed once
    loaded: set[str] = set()
    experts = _ExpertPieces(model, parallel)
    for file in _weight_files(d):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not model.holds(name):  # another pipeline stage's
                    continue
                if experts.load(name, f, params, file.name):
                    continue
                if name not in params:
                    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings) \
                            or _symmetric_zero_point(name, f, params):
                        continue
                    raise CheckpointError(f"unexpected weight {name!r} in {file.name}")
                param = params[name]
                source = f.get_slice(name)  # reads nothing until sliced
                shape = tuple(source.get_shape())
                if shape != _full_shape(model, name, param, stored):
                    raise CheckpointError(
                        f"shape mismatch for {name!r}: checkpoint has {shape}, "
                        f"model expects {_full_shape(model, name, param, stored)}"
                    )
                param.copy_(convert_loaded(name, shard_of(name, source, shape, parallel, config.vocab_size)))
                loaded.add(name)
    missing = sorted(n for n in set(params) - loaded - experts.complete() if model.holds(n))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing weight {missing[0]!r}{more} in {str(d)!r}")
    if quant is not None and not quant.in_checkpoint:
        quantize_at_load(model, quant)
    model.quant = quant
    return model


def _symmetric_zero_point(name: str, f, params: dict) -> bool:
    """Whether `name` is the zero point of a symmetric int8 weight (compressed-tensors may write
    them, all zeros): nothing to load. Nonzero ones are an asymmetric format raylm does not serve."""
    if not name.endswith(".weight_zero_point") or name.removesuffix("_zero_point") not in params:
        return False
    if f.get_tensor(name).count_nonzero().item():
        raise CheckpointError(f"{name} is not all zeros: asymmetric int8 weights are not supported")
    return True


class _ExpertPieces:
    """Loads experts stored under Qwen's per-expert names into the model's stacked tensors
    (`...mlp.experts.gate_up_proj` [E, 2I, hidden]: gate rows, then up rows; `down_proj`
    [E, hidden, I]; a quantized layer's per-channel scales into `gate_up_proj_scale` [E, 2I] and
    `down_proj_scale` [E, hidden]), this rank's experts and slices only, and tracks which arrived."""

    def __init__(self, model: Qwen3ForCausalLM, parallel: TensorParallel) -> None:
        self.parallel = parallel
        self.shape = model.shape
        self.config = model.config
        self.pieces: dict[str, set] = {}  # stacked parameter -> (local expert, projection) loaded

    def load(self, name: str, f, params: dict, file: str) -> bool:
        """Load `name` from the open safetensors `f` (named `file`) if it is one expert's tensor
        (True), else leave it (False)."""
        m = _EXPERT_NAME.match(name)
        if m is None:
            return False
        prefix, expert, proj, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        target = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if kind in ("weight_offset", "weight_zero_point") and f"{target}_scale" in params:
            if f.get_tensor(name).count_nonzero().item():
                raise CheckpointError(f"{name} is not all zeros: asymmetric int8 experts are not supported")
            return True  # symmetric int8: the zero offsets its format writes carry nothing
        target += "" if kind == "weight" else "_scale"
        if target not in params or expert >= self.config.num_experts:
            raise CheckpointError(f"unexpected weight {name!r} in {file}")
        c = self.config
        full = (c.hidden_size, c.moe_intermediate_size) if proj == "down_proj" else (c.moe_intermediate_size,
                                                                                      c.hidden_size)
        source = f.get_slice(name)  # reads nothing until sliced
        shape = tuple(source.get_shape())
        if kind == "weight_scale":  # one per output channel, [out, 1] as the formats write it (or [out])
            full = (full[0], 1) if len(shape) == 2 else full[:1]
        if shape != full:
            raise CheckpointError(f"shape mismatch for {name!r}: checkpoint has {shape}, model expects {full}")
        local = expert - self.shape.first_expert
        if not 0 <= local < self.shape.num_local_experts:
            return True  # another rank's expert: not read
        # expert parallelism holds whole experts; plain TP this rank's rows (gate, up) or columns (down)
        part = source[:] if self.parallel.expert_parallel else shard_of(name, source, shape, self.parallel,
                                                                       c.vocab_size)
        inter = self.shape.moe_intermediate_size
        param = params[target]
        rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter), "down_proj": slice(None)}[proj]
        param[local, rows].copy_(part.reshape(param[local, rows].shape))
        self.pieces.setdefault(target, set()).add((local, proj))
        return True

    def complete(self) -> set[str]:
        """The stacked parameters every one of whose local experts arrived whole."""
        done = set()
        for target, got in self.pieces.items():
            projs = ("down_proj",) if ".down_proj" in target else ("gate_proj", "up_proj")
            if all((e, p) in got for e in range(self.shape.num_local_experts) for p in projs):
                done.add(target)
        return done


def _full_shape(model: Qwen3ForCausalLM, name: str, param, quant: QuantConfig | None = None) -> tuple[int, ...]:
    """The whole (unsharded) shape of parameter `name`, as the checkpoint stores it."""
    if not model.parallel.enabled:
        return tuple(param.shape)
    return tuple(_meta_full(model.config, quant).get_parameter(name).shape)


_META_FULL: dict = {}  # (Qwen3Config, QuantConfig) -> the whole model on meta (shapes only)


def _meta_full(config: Qwen3Config, quant: QuantConfig | None = None) -> Qwen3ForCausalLM:
    if (config, quant) not in _META_FULL:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(config)
            if quant is not None:
                attach(model, quant)
            _META_FULL[config, quant] = model
    return _META_FULL[config, quant]


@torch.no_grad()
def shard_model(full: Qwen3ForCausalLM, parallel: TensorParallel) -> Qwen3ForCausalLM:
    """This rank's part of a whole in-memory model (random models under TP or PP)."""
    if not parallel.enabled and not parallel.pipeline.enabled:
        return full
    device = full.model.embed_tokens.weight.device
    experts = [p.dtype for n, p in full.named_parameters() if ".experts." in n]
    model = empty_model(full.config, full.dtype, device, parallel, experts[0] if experts else None)
    for name, param in model.named_parameters():
        if not model.holds(name):
            continue
        whole = full.get_parameter(name)
        param.copy_(shard_of(name, whole, tuple(whole.shape), parallel, full.config.vocab_size))
    return model


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_checkpoint_dir(path)))


def tokenizer_size(path) -> int:
    """len(load_tokenizer(path)) without importing transformers (the worker needs only the
    number): tokenizer.json's vocabulary with its added tokens, and any added token id
    tokenizer_config.json declares beyond it. OSError / ValueError where neither can be read."""
    d = _checkpoint_dir(path)
    if not (d / "tokenizer.json").is_file():
        # without any tokenizer file transformers builds an empty tokenizer of the model type's class
        if not any((d / name).is_file() for name in ("tokenizer_config.json", "vocab.json", "tokenizer.model")):
            raise ValueError(f"no tokenizer files in {str(d)!r}")
        return len(load_tokenizer(d))
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # tokenizers raises its own Exception type for a bad file
        raise ValueError(f"unreadable tokenizer.json in {str(d)!r}: {e}") from e
    config = d / "tokenizer_config.json"
    added = (_read_json(config).get("added_tokens_decoder") or {}) if config.is_file() else {}
    return max([size, *(int(i) + 1 for i in added)])


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def eos_token_ids(path, tokenizer=None) -> frozenset[int]:
    """The tokenizer's eos id plus config.json's and generation_config.json's eos ids."""
    d = _checkpoint_dir(path)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(d)
    ids = _ids(tokenizer.eos_token_id) | _ids(_read_json(d / "config.json").get("eos_token_id"))
    gen = d / "generation_config.json"
    if gen.is_file():
        ids |= _ids(_read_json(gen).get("eos_token_id"))
    return frozenset(ids)


def sampling_defaults(path) -> dict:
    """The sampling values a checkpoint's generation_config.json recommends ({} without one),
    as SamplingParams fields, e.g. Qwen3's {"temperature": 0.6, "top_k": 20, "top_p": 0.95}.
    A value SamplingParams refuses is a ValueError naming the file, the field and the value."""
    from scheduler.request import GENERATION_CONFIG_FIELDS, SamplingParams

    gen = _checkpoint_dir(path) / "generation_config.json"
    if not gen.is_file():
        return {}
    raw = _read_json(gen)
    out = {ours: raw[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if raw.get(theirs) is not None}
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{gen}: {e}") from None
    return out


@torch.no_grad()
def random_qwen3(*, dtype=torch.bfloat16, layers: int | None = None, seed: int = 0, device="cpu",
                 std: float = 0.02, **shape_overrides) -> Qwen3ForCausalLM:
    """An in-memory Qwen3 with random weights (Qwen3-0.6B's shape unless overridden)."""
    if layers is not None:
        shape_overrides["num_hidden_layers"] = layers
    config = Qwen3Config(**shape_overrides)
    model = empty_model(config, resolve_dtype(dtype), device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=gen)
    return model


RANDOM_PREFIX = "random:"
RANDOM_SHAPES = {
    "qwen3-0.6b": {},  # Qwen3Config's defaults are Qwen3-0.6B's shape
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}


@dataclass(frozen=True)
class RandomModelSpec:
    """`random:NAME[?layers=N&seed=S]`: a model of a known shape with seeded random weights."""

    name: str
    layers: int | None = None  # None: the shape's own depth
    seed: int = 0

    def __str__(self) -> str:
        query = "&".join(f"{k}={v}" for k, v in (("layers", self.layers), ("seed", self.seed)) if v is not None)
        return f"{RANDOM_PREFIX}{self.name}?{query}"


def is_random_spec(model) -> bool:
    return isinstance(model, str) and model.startswith(RANDOM_PREFIX)


def parse_random_spec(spec: str) -> RandomModelSpec:
    """Parse and validate `random:qwen3-0.6b?layers=4&seed=0` (query optional)."""
    if not is_random_spec(spec):
        raise ValueError(f"a random model spec starts with {RANDOM_PREFIX!r}, got {spec!r}")
    name, _, query = spec[len(RANDOM_PREFIX):].partition("?")
    if name not in RANDOM_SHAPES:
        raise ValueError(f"unknown random model {name!r} in {spec!r}; known: {', '.join(sorted(RANDOM_SHAPES))}")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"options in {spec!r} must be key=value pairs joined by '&'") from None
    opts = {}
    for key, value in pairs:
        if key not in ("layers", "seed"):
            raise ValueError(f"unknown option {key!r} in {spec!r}; known: layers, seed")
        if key in opts:
            raise ValueError(f"option {key!r} given twice in {spec!r}")
        if not value.isdigit() or (key == "layers" and int(value) < 1):
            raise ValueError(f"{key} must be an integer >= {1 if key == 'layers' else 0} in {spec!r}, got {value!r}")
        opts[key] = int(value)
    return RandomModelSpec(name, **opts)


def random_spec_config(spec: RandomModelSpec) -> Qwen3Config:
    """The shape a parsed random spec names."""
    shape = dict(RANDOM_SHAPES[spec.name])
    if spec.layers is not None:
        shape["num_hidden_layers"] = spec.layers
    return Qwen3Config(**shape)


def random_model(spec: str, dtype=None, device="cpu", parallel: TensorParallel = SINGLE) -> Qwen3ForCausalLM:
    """The model a random spec names (this rank's part); dtype None: the shape's own (bfloat16).
    Under TP the whole model is drawn on the CPU, so every rank slices the same weights."""
    s = parse_random_spec(spec)
    shape = RANDOM_SHAPES[s.name]
    dtype = dtype or shape.get("torch_dtype", Qwen3Config.torch_dtype)
    if not parallel.enabled and not parallel.pipeline.enabled:
        return random_qwen3(dtype=dtype, layers=s.layers, seed=s.seed, device=device, **shape)
    full = random_qwen3(dtype=dtype, layers=s.layers, seed=s.seed, device="cpu", **shape)
    return shard_model(full, parallel).to(device)


@torch.no_grad()
def weights_fingerprint(model, stride: int = 997) -> float:
    """A cheap checksum of every parameter (a strided sample of each, weighted by its
    place): two processes that built the same weights get the same number."""
    return sum((i + 1) * float(p.reshape(-1)[::stride].sum(dtype=torch.float64))
               for i, (_, p) in enumerate(model.named_parameters()))
