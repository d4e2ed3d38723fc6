"""Qwen3's rotary position embedding and its scaling types, computed as Hugging Face computes them.

`RopeConfig.from_hf(raw)` reads a whole config.json dict in either spelling:

- transformers 5.x: `"rope_parameters": {"rope_type": ..., "rope_theta": ..., <scaling keys>}`;
- older: `"rope_scaling": {"type" or "rope_type": ..., <scaling keys>}` with `rope_theta` at the top level.

Supported types (`SUPPORTED_ROPE_TYPES`), each as transformers 5.x's `ROPE_INIT_FUNCTIONS`
(modeling_rope_utils.py) computes inv_freq and the attention factor:

- "default": inv_freq = 1 / theta^(2i/d) (Qwen3RotaryEmbedding.compute_default_rope_parameters);
  attention factor 1.
- "linear": the default inv_freq divided by `factor`; attention factor 1.
- "yarn": per frequency, a blend of the default inv_freq (extrapolation: the high frequencies, more than
  `beta_fast` rotations over `original_max_position_embeddings`) and inv_freq / factor (interpolation:
  the low frequencies, fewer than `beta_slow` rotations), with a linear ramp between the two correction
  dims (floored / ceiled unless `truncate` is false). The attention factor is `attention_factor` when
  given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set and non-zero,
  else mscale(factor) = 0.1 * ln(factor) + 1 (1 for factor <= 1).
- "llama3": the default inv_freq, divided by `factor` for wavelengths above
  original / low_freq_factor, kept below original / high_freq_factor, smoothly interpolated between;
  attention factor 1.

"dynamic" (NTK, its inv_freq depends on the current sequence length), "longrope", "su" and every other
type are refused with a ValueError naming the type and listing the supported ones.

How the caller applies the attention factor (HF's Qwen3RotaryEmbedding.forward): in fp32,

    freqs = positions.float()[:, None] * inv_freq[None, :]        # [T, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)                        # [T, head_dim]
    cos = (emb.cos() * attention_factor).to(dtype)
    sin = (emb.sin() * attention_factor).to(dtype)

i.e. multiply cos and sin by the Python float `attention_factor` in fp32, *then* cast to the model's
dtype; never scale after the cast, nor fold the factor into q or k. With attention_factor == 1.0 the
multiply is an exact no-op and may be skipped.

`max_position_embeddings` is the length the model serves, by vLLM's rule
(vllm/config/model.py, `_get_and_verify_max_len`): for every type but "longrope"/"su"/"llama3" the
config's length is multiplied by the type's `factor` (1 for "default"), and for "yarn" the length
multiplied is `original_max_position_embeddings` instead of config.json's `max_position_embeddings`.
So: default -> max_position_embeddings; linear -> int(max_position_embeddings * factor);
yarn -> int(original_max_position_embeddings * factor); llama3 -> max_position_embeddings as is (Llama
3.1's config already holds the scaled length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "yarn", "llama3")
_NEEDS_ORIGINAL = ("yarn", "llama3")
_DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
_DEFAULT_MAX_POSITIONS = 32768  # Qwen3Config's default


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_number(name: str, value: Any) -> float:
    if not _is_number(value) or not value > 0:
        raise ValueError(f"rope {name} must be a number > 0, got {value!r}")
    return float(value)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _optional_number(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if not _is_number(value):
        raise ValueError(f"rope {name} must be a number, got {value!r}")
    return float(value)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's Eq. 21 (transformers' yarn_get_mscale): 0.1 * mscale * ln(scale) + 1, 1 for scale <= 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope_dict(raw: dict) -> dict:
    """The rope parameters of a config.json dict, from whichever key holds them (a copy)."""
    params = raw.get("rope_parameters")
    legacy = raw.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{name} must be an object, got {value!r}")
    if params and legacy and params != legacy:
        # transformers lets rope_scaling win; vLLM reads rope_parameters: refuse rather than guess
        raise ValueError(f"config.json has both rope_parameters {params!r} and a different rope_scaling {legacy!r}")
    chosen = dict(params or legacy or {})
    nested = [key for key, value in chosen.items() if isinstance(value, dict)]
    if nested:
        raise ValueError(f"per-layer-type rope parameters ({', '.join(map(repr, nested))}) are not supported")
    return chosen


@dataclass(frozen=True)
class RopeConfig:
    """One model's rotary embedding: its type and parameters, validated.

    Build it with `from_hf(config_json_dict)`; `inv_freq(device)` gives the fp32 frequencies,
    `attention_factor` the scale of cos and sin, `max_position_embeddings` the length served.
    """

    rope_type: str = "default"
    rope_theta: float = _DEFAULT_THETA
    head_dim: int = 128
    config_max_position_embeddings: int = _DEFAULT_MAX_POSITIONS  # config.json's max_position_embeddings
    factor: float = 1.0  # linear, yarn, llama3
    original_max_position_embeddings: int | None = None  # yarn, llama3: the pretraining length
    attention_factor: float = 1.0  # cos and sin are multiplied by it (yarn: given or derived)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: floor / ceil the correction range
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        _positive_number("rope_theta", self.rope_theta)
        _positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        _positive_int("max_position_embeddings", self.config_max_position_embeddings)
        _positive_number("factor", self.factor)
        _positive_number("attention_factor", self.attention_factor)
        if self.rope_type in _NEEDS_ORIGINAL:
            _positive_int("original_max_position_embeddings", self.original_max_position_embeddings)
        if self.rope_type == "yarn":
            _positive_number("beta_fast", self.beta_fast)
            _positive_number("beta_slow", self.beta_slow)
            if not isinstance(self.truncate, bool):
                raise ValueError(f"rope truncate must be true or false, got {self.truncate!r}")
        if self.rope_type == "llama3":
            _positive_number("low_freq_factor", self.low_freq_factor)
            _positive_number("high_freq_factor", self.high_freq_factor)
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(
                    f"rope high_freq_factor ({self.high_freq_factor!r}) must be greater than "
                    f"low_freq_factor ({self.low_freq_factor!r})"
                )

    @classmethod
    def from_hf(cls, raw: dict) -> RopeConfig:
        """The rotary embedding of a whole config.json dict (either rope spelling); ValueError naming
        the type, field and value on anything unsupported or malformed."""
        params = _rope_dict(raw)
        if "rope_type" in params and "type" in params and params["rope_type"] != params["type"]:
            raise ValueError(
                f"rope_type {params['rope_type']!r} and type {params['type']!r} disagree in the rope parameters"
            )
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

        # the parameters' own rope_theta / partial_rotary_factor win over the top level's (as in transformers)
        theta = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_THETA))
        theta = _positive_number("rope_theta", theta)
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial is not None and partial != 1:
            raise ValueError(f"partial_rotary_factor {partial!r} is not supported (only 1.0: the whole head rotates)")

        head_dim = raw.get("head_dim")
        if head_dim is None:
            hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
            if not (_is_number(hidden) and _is_number(heads) and heads > 0):
                raise ValueError(
                    f"config.json has no head_dim and no hidden_size / num_attention_heads to derive it "
                    f"(hidden_size={hidden!r}, num_attention_heads={heads!r})"
                )
            head_dim = int(hidden) // int(heads)
        head_dim = _positive_int("head_dim", head_dim)
        max_positions = _positive_int(
            "max_position_embeddings", raw.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS)
        )

        fields: dict[str, Any] = dict(rope_type=rope_type, rope_theta=theta, head_dim=head_dim,
                                      config_max_position_embeddings=max_positions)
        if rope_type == "default":
            return cls(**fields)

        if "factor" not in params:
            raise ValueError(f"rope type {rope_type!r} needs 'factor' in the rope parameters")
        factor = _positive_number("factor", params["factor"])
        fields["factor"] = factor

        if rope_type in _NEEDS_ORIGINAL:
            fields["original_max_position_embeddings"] = _original_max_positions(raw, params, max_positions)

        if rope_type == "yarn":
            attention = params.get("attention_factor")
            mscale = _optional_number("mscale", params.get("mscale"))
            mscale_all_dim = _optional_number("mscale_all_dim", params.get("mscale_all_dim"))
            if attention is None:
                if mscale and mscale_all_dim:
                    attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                else:
                    attention = _yarn_mscale(factor)
            fields["attention_factor"] = _positive_number("attention_factor", attention)
            # transformers: `get("beta_fast") or 32`, so null and 0 mean the default too
            fields["beta_fast"] = _positive_number("beta_fast", params.get("beta_fast") or 32)
            fields["beta_slow"] = _positive_number("beta_slow", params.get("beta_slow") or 1)
            truncate = params.get("truncate", True)
            if not isinstance(truncate, bool):
                raise ValueError(f"rope truncate must be true or false, got {truncate!r}")
            fields["truncate"] = truncate

        if rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor"):
                if name not in params:
                    raise ValueError(f"rope type 'llama3' needs {name!r} in the rope parameters")
                fields[name] = _positive_number(name, params[name])
        return cls(**fields)

    @property
    def max_position_embeddings(self) -> int:
        """The length the model serves (vLLM's rule, see the module docstring)."""
        if self.rope_type == "linear":
            return int(self.config_max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            assert self.original_max_position_embeddings is not None
            return int(self.original_max_position_embeddings * self.factor)
        return self.config_max_position_embeddings  # default, llama3

    @property
    def scaled(self) -> bool:
        """Whether the type changes anything from the plain 1 / theta^(2i/d) RoPE."""
        return self.rope_type != "default"

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """float32 [head_dim // 2]: computed on the CPU in fp32 with transformers' ops in its order (so the
        values are bit for bit those of HF's CPU init), then moved to `device` (meta works too)."""
        dim = self.head_dim
        base = self.rope_theta
        with torch.device("cpu"):  # even where the caller builds on meta (the loader's empty model)
            if self.rope_type == "default":
                inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            elif self.rope_type == "linear":
                inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
                inv /= self.factor
            elif self.rope_type == "yarn":
                inv = self._yarn_inv_freq()
            else:
                inv = self._llama3_inv_freq()
        return inv.to(device=device) if device is not None else inv

    def _yarn_inv_freq(self) -> torch.Tensor:
        dim, base, factor = self.head_dim, self.rope_theta, self.factor
        original = self.original_max_position_embeddings
        assert original is not None

        def correction_dim(rotations: float) -> float:
            # the dim whose wavelength makes `rotations` turns over the original length
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no zero-width ramp

        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (factor * pos_freqs)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_weight = 1 - ramp
        return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight

    def _llama3_inv_freq(self) -> torch.Tensor:
        dim, base, factor = self.head_dim, self.rope_theta, self.factor
        original = self.original_max_position_embeddings
        low_ff, high_ff = self.low_freq_factor, self.high_freq_factor
        assert original is not None
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        low_freq_wavelen = original / low_ff
        high_freq_wavelen = original / high_ff
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
        smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def _original_max_positions(raw: dict, params: dict, max_positions: int) -> int:
    """yarn / llama3's pretraining length: the rope parameters', else config.json's top-level one, else
    max_position_embeddings (transformers' standardization). Both present and different: refused, since
    transformers computes with the top-level one and vLLM sizes the context with the parameters' one."""
    inner = params.get("original_max_position_embeddings")
    outer = raw.get("original_max_position_embeddings")
    if inner is not None and outer is not None and inner != outer:
        raise ValueError(
            f"original_max_position_embeddings is {inner!r} in the rope parameters but {outer!r} at the top level"
        )
    value = inner if inner is not None else outer if outer is not None else max_positions
    return _positive_int("original_max_position_embeddings", value)
