"""Load a Qwen3 checkpoint directory as Hugging Face writes it.

config.json, then model.safetensors or a sharded model.safetensors.index.json; tied or
untied embeddings; dtype from the config or overridden. Every problem raises a
CheckpointError (a ValueError) that names it: the missing directory or file, the missing
or unexpected weight, both shapes of a mismatch, the architecture that is not Qwen3.

A model spec `random:qwen3-0.6b[?layers=N&seed=S]` instead of a path names a model with
seeded random weights built in memory (benchmarks); it has no tokenizer.

Under tensor parallelism (`parallel`) each rank reads only its slice of each tensor
(safetensors' get_slice), as workers/parallel.py splits them.
"""

from __future__ import annotations

import contextlib
import json
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

import torch
from safetensors import safe_open

from workers.models.qwen3 import PreparedWeights, Qwen3Config, Qwen3ForCausalLM
from workers.parallel import SINGLE, TensorParallel, shard_of
from workers.runner_config import DTYPE_ALIASES, DTYPE_NAMES, canonical_dtype

ARCHITECTURE = "Qwen3ForCausalLM"
# every name a config may give (workers/runner_config.py) -> its torch dtype
DTYPES = {name: getattr(torch, canonical_dtype(name)) for name in (*DTYPE_NAMES, *DTYPE_ALIASES)}
# weights some checkpoints carry that the model recomputes
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as a Qwen3 model."""


def bundled_model_path() -> str:
    """The tiny Qwen3 shipped as package data; what runs when no model is given."""
    return str(Path(__file__).resolve().parent / "tiny_model")


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


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    if isinstance(params, dict):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(f"rope type {rope_type!r} is not supported (only 'default')")
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return float(raw.get("rope_theta", 10000.0))


def config_from_dict(raw: dict) -> Qwen3Config:
    archs = raw.get("architectures") or []
    if archs and ARCHITECTURE not in archs:
        raise CheckpointError(f"architecture {archs[0]!r} is not {ARCHITECTURE!r}")
    if not archs and raw.get("model_type") != "qwen3":
        raise CheckpointError(f"model_type {raw.get('model_type')!r} is not 'qwen3'")
    if raw.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    try:
        heads = raw["num_attention_heads"]
        return Qwen3Config(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"config.json: {e}") from None


def load_config(path) -> Qwen3Config:
    return config_from_dict(_read_json(_checkpoint_dir(path) / "config.json"))


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
                parallel: TensorParallel = SINGLE) -> Qwen3ForCausalLM:
    """A model (this rank's part of it) with uninitialized weights of `dtype` on `device`
    (built on meta: no double allocation)."""
    with torch.device("meta"), _no_init_on_meta():
        model = Qwen3ForCausalLM(config, parallel)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.reset_rotary()
    return model.eval().requires_grad_(False)


def cast_model(model: Qwen3ForCausalLM, dtype: torch.dtype, device=None, *, copy: bool = False) -> Qwen3ForCausalLM:
    """`model` in `dtype` (on `device`), embeddings re-tied and RoPE tables redone in fp32.
    Module.to works in place: copy=True leaves the caller's model as it was."""
    if copy:
        model = deepcopy(model)
    model = model.to(device=device, dtype=dtype)
    model.tie_weights()
    model.reset_rotary()
    model.prepared = PreparedWeights()  # new weights: the op table prepares them again
    return model


@torch.no_grad()
def load_model(path, dtype=None, device="cpu", parallel: TensorParallel = SINGLE) -> Qwen3ForCausalLM:
    d = _checkpoint_dir(path)
    config = load_config(d)
    model = empty_model(config, resolve_dtype(dtype or config.torch_dtype), device, parallel)
    params = dict(model.named_parameters())  # tied: lm_head.weight is the embedding, listed once
    loaded: set[str] = set()
    for file in _weight_files(d):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in params:
                    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                        continue
                    raise CheckpointError(f"unexpected weight {name!r} in {file.name}")
                param = params[name]
                source = f.get_slice(name)  # reads nothing until sliced
                shape = tuple(source.get_shape())
                if shape != _full_shape(model, name, param):
                    raise CheckpointError(
                        f"shape mismatch for {name!r}: checkpoint has {shape}, "
                        f"model expects {_full_shape(model, name, param)}"
                    )
                param.copy_(shard_of(name, source, shape, parallel, config.vocab_size))
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing weight {missing[0]!r}{more} in {str(d)!r}")
    return model


def _full_shape(model: Qwen3ForCausalLM, name: str, param) -> tuple[int, ...]:
    """The whole (unsharded) shape of parameter `name`, as the checkpoint stores it."""
    if not model.parallel.enabled:
        return tuple(param.shape)
    return tuple(_meta_full(model.config).get_parameter(name).shape)


_META_FULL: dict = {}  # Qwen3Config -> the whole model on meta (shapes only)


def _meta_full(config: Qwen3Config) -> Qwen3ForCausalLM:
    if config not in _META_FULL:
        with torch.device("meta"):
            _META_FULL[config] = Qwen3ForCausalLM(config)
    return _META_FULL[config]


@torch.no_grad()
def shard_model(full: Qwen3ForCausalLM, parallel: TensorParallel) -> Qwen3ForCausalLM:
    """This rank's part of a whole in-memory model (random models under TP)."""
    if not parallel.enabled:
        return full
    device = full.model.embed_tokens.weight.device
    model = empty_model(full.config, full.dtype, device, parallel)
    for name, param in model.named_parameters():
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
RANDOM_SHAPES = {"qwen3-0.6b": {}}  # Qwen3Config's defaults are Qwen3-0.6B's shape


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
    if not parallel.enabled:
        return random_qwen3(dtype=dtype, layers=s.layers, seed=s.seed, device=device, **shape)
    full = random_qwen3(dtype=dtype, layers=s.layers, seed=s.seed, device="cpu", **shape)
    return shard_model(full, parallel).to(device)


@torch.no_grad()
def weights_fingerprint(model, stride: int = 997) -> float:
    """A cheap checksum of every parameter (a strided sample of each, weighted by its
    place): two processes that built the same weights get the same number."""
    return sum((i + 1) * float(p.reshape(-1)[::stride].sum(dtype=torch.float64))
               for i, (_, p) in enumerate(model.named_parameters()))
