"""Which quantization a checkpoint uses, read from where the tools that write them put it.

- config.json `quantization_config` with `quant_method: compressed-tensors`: llm-compressor's
  `int-quantized` W8A8 (int8 weights with a scale per output channel, activations quantized
  per token at run time, symmetric), `ignore` naming the linears left in full precision
  (names, or `re:` patterns).
- config.json `quantization_config` with `quant_method: awq`: 4-bit weights in AutoAWQ's GEMM
  packing, a scale and a zero point per group of inputs (`modules_to_not_convert` left alone).
- `quant_model_description.json` beside the weights (msmodelslim, as vllm-ascend reads it):
  `model_quant_type` W8A8 (static per-tensor activations) or W8A8_DYNAMIC, and per weight
  `W8A8`, `W8A8_DYNAMIC` or `FLOAT` (left unquantized).
- `quantization="int8"` on an unquantized checkpoint: every decoder linear and MoE expert quantized
  at load (per output channel; activations per token at run time), as vLLM's online quantization.

A Qwen3-MoE layer's experts are quantized when the format says so for their per-expert names
(`mlp.experts.N.gate_proj`, ...): all of a layer's experts in one scheme, W8A8 with dynamic
activations (workers/quant/linear.py refuses the others by name).

Anything else fails at start with an error naming the field and its value: nothing runs
dequantized in full precision in place of a format raylm does not serve.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from workers.runner_config import check_quantization

DESCRIPTION_FILE = "quant_model_description.json"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # a decoder layer's
SCHEMES = ("w8a8-dynamic", "w8a8-static", "w4a16")
_MODELSLIM_TYPES = {"W8A8": "w8a8-static", "W8A8_DYNAMIC": "w8a8-dynamic", "FLOAT": None}
SUPPORTED = ("compressed-tensors int-quantized W8A8 (dynamic per-token activations), msmodelslim W8A8 / "
             "W8A8_DYNAMIC, AWQ W4A16 (GEMM packing, zero points), quantization='int8' at load")


class QuantConfigError(ValueError):
    """A quantization config raylm cannot serve; the message names the field and the value."""


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "compressed-tensors" | "modelslim" | "awq" | "int8"
    scheme: str  # what the quantized linears compute: one of SCHEMES
    group_size: int = 0  # w4a16: inputs per scale / zero point
    ignore: tuple[str, ...] = ()  # compressed-tensors: names / "re:" patterns left unquantized
    not_converted: tuple[str, ...] = ()  # awq: modules_to_not_convert (substrings of a module's name)
    # modelslim: (module, scheme or None) per linear
    layer_types: tuple[tuple[str, str | None], ...] = field(default=(), repr=False)

    @property
    def in_checkpoint(self) -> bool:
        """Whether the checkpoint holds the quantized tensors (False: quantized at load)."""
        return self.method != "int8"

    def scheme_for(self, module: str) -> str | None:
        """The scheme linear `module` (e.g. "model.layers.0.self_attn.q_proj") computes in, None if
        it stays in full precision."""
        if self.method == "modelslim":
            types = dict(self.layer_types)
            if module not in types and module == "lm_head":  # a tied lm_head is not listed: the embedding's
                return None
            if module not in types:
                raise QuantConfigError(f"{DESCRIPTION_FILE} has no entry for {module}.weight")
            return types[module]
        if self.method == "compressed-tensors" and any(_matches(p, module) for p in self.ignore):
            return None
        if self.method in ("awq", "int8") and module.rpartition(".")[2] not in PROJECTIONS:
            return None  # AutoAWQ and raylm's int8 at load quantize the decoder's projections only
        if self.method == "awq" and any(m in module for m in self.not_converted):
            return None
        return self.scheme

    def describe(self) -> dict:
        return {"method": self.method, "scheme": self.scheme, **({"group_size": self.group_size}
                                                                 if self.group_size else {})}


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern


def read_quant_config(checkpoint: Path, raw: dict, quantization: str | None = None) -> QuantConfig | None:
    """The checkpoint's quantization (config.json's dict `raw`, or the msmodelslim description file
    beside it), checked against what the user asked for (`quantization`); None when neither
    quantizes."""
    try:
        check_quantization(quantization)
    except ValueError as e:
        raise QuantConfigError(str(e)) from None
    found = _in_checkpoint(checkpoint, raw)
    if quantization == "int8":
        if found is not None:
            raise QuantConfigError(f"quantization='int8' quantizes an unquantized checkpoint at load, but "
                                   f"{checkpoint} is already quantized ({found.method})")
        return QuantConfig("int8", "w8a8-dynamic")
    if quantization is not None:
        method = "modelslim" if quantization == "ascend" else quantization
        if found is None or found.method != method:
            raise QuantConfigError(f"quantization={quantization!r}, but {checkpoint} is "
                                   f"{'not quantized' if found is None else found.method + ' quantized'}")
    return found


def _in_checkpoint(checkpoint: Path, raw: dict) -> QuantConfig | None:
    qc = raw.get("quantization_config")
    description = Path(checkpoint) / DESCRIPTION_FILE
    if qc is not None and description.exists():
        raise QuantConfigError(f"{checkpoint} has both a quantization_config and {DESCRIPTION_FILE}: which one "
                               "describes the weights is ambiguous")
    if description.exists():
        return _modelslim(description)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantConfigError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "awq":
        return _awq(qc)
    raise QuantConfigError(f"quantization_config.quant_method {method!r} is not supported; raylm serves {SUPPORTED}")


def _need(ok: bool, field: str, value, want: str) -> None:
    if not ok:
        raise QuantConfigError(f"quantization_config.{field} must be {want}, got {value!r} "
                               f"(raylm serves {SUPPORTED})")


def _compressed_tensors(qc: dict) -> QuantConfig:
    fmt = qc.get("format")
    _need(fmt in ("int-quantized", "naive-quantized"), "format", fmt, "'int-quantized'")
    status = qc.get("quantization_status", "compressed")
    _need(status in ("compressed", "frozen"), "quantization_status", status, "'compressed'")
    groups = qc.get("config_groups")
    _need(isinstance(groups, dict) and len(groups) > 0, "config_groups", groups, "a non-empty object")
    for name, group in groups.items():
        _need(isinstance(group, dict), f"config_groups.{name}", group, "an object")
        targets = group.get("targets")
        _need(targets == ["Linear"], f"config_groups.{name}.targets", targets, "['Linear']")
        w = group.get("weights") or {}
        f = f"config_groups.{name}.weights"
        _need(w.get("num_bits") == 8, f + ".num_bits", w.get("num_bits"), "8")
        _need(w.get("type", "int") == "int", f + ".type", w.get("type"), "'int'")
        _need(w.get("symmetric") is True, f + ".symmetric", w.get("symmetric"), "true")
        _need(w.get("strategy") == "channel", f + ".strategy", w.get("strategy"), "'channel'")
        _need(not w.get("dynamic", False), f + ".dynamic", w.get("dynamic"), "false")
        a = group.get("input_activations")
        f = f"config_groups.{name}.input_activations"
        _need(isinstance(a, dict), f, a, "an object (int8 activations: W8A8)")
        _need(a.get("num_bits") == 8, f + ".num_bits", a.get("num_bits"), "8")
        _need(a.get("type", "int") == "int", f + ".type", a.get("type"), "'int'")
        _need(a.get("symmetric") is True, f + ".symmetric", a.get("symmetric"), "true")
        _need(a.get("strategy") == "token", f + ".strategy", a.get("strategy"), "'token'")
        _need(a.get("dynamic") is True, f + ".dynamic", a.get("dynamic"), "true")
        _need(group.get("output_activations") is None, f"config_groups.{name}.output_activations",
              group.get("output_activations"), "null")
    ignore = qc.get("ignore") or []
    _need(isinstance(ignore, list) and all(isinstance(i, str) for i in ignore), "ignore", ignore, "a list of names")
    return QuantConfig("compressed-tensors", "w8a8-dynamic", ignore=tuple(ignore))


def _awq(qc: dict) -> QuantConfig:
    bits = qc.get("bits", qc.get("w_bit"))
    _need(bits == 4, "bits", bits, "4")
    group = qc.get("group_size", qc.get("q_group_size"))
    _need(isinstance(group, int) and not isinstance(group, bool) and group > 0, "group_size", group,
          "a positive integer (per-channel, -1, is not served)")
    zp = qc.get("zero_point", True)
    _need(zp is True, "zero_point", zp, "true")
    version = qc.get("version", "gemm")
    _need(isinstance(version, str) and version.lower() == "gemm", "version", version, "'gemm'")
    skip = qc.get("modules_to_not_convert") or []
    _need(isinstance(skip, list) and all(isinstance(m, str) for m in skip), "modules_to_not_convert", skip,
          "a list of names")
    return QuantConfig("awq", "w4a16", group_size=group, not_converted=tuple(skip))


def _modelslim(path: Path) -> QuantConfig:
    try:
        desc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise QuantConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(desc, dict):
        raise QuantConfigError(f"{path.name} must hold an object, got {type(desc).__name__}")
    kind = desc.get("model_quant_type")
    if kind not in ("W8A8", "W8A8_DYNAMIC"):
        raise QuantConfigError(f"{path.name}: model_quant_type {kind!r} is not supported (W8A8 or W8A8_DYNAMIC; "
                               f"raylm serves {SUPPORTED})")
    layers = []
    for key, value in desc.items():
        if not key.endswith(".weight"):
            continue
        if value not in _MODELSLIM_TYPES:
            raise QuantConfigError(f"{path.name}: {key} is {value!r}; raylm serves W8A8, W8A8_DYNAMIC and FLOAT")
        layers.append((key.removesuffix(".weight"), _MODELSLIM_TYPES[value]))
    return QuantConfig("modelslim", _MODELSLIM_TYPES[kind], layer_types=tuple(sorted(layers)))
