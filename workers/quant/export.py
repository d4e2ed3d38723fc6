"""Write a float checkpoint's W8A8 copy in compressed-tensors' `int-quantized` format, the one
llm-compressor's W8A8 recipes write and vLLM and raylm both serve: every decoder projection's
weight as int8 [out, in] with a symmetric scale per output channel (`weight_scale` [out, 1] in the
checkpoint's float dtype), activations marked dynamic per token, the lm_head and any MoE routers
left in full precision and named in `ignore`. A Qwen3-MoE checkpoint's experts are quantized the
same way under Qwen's per-expert names (`mlp.experts.N.gate_proj.weight`, ...), however the source
stores them (per expert, or stacked `mlp.experts.gate_up_proj` / `down_proj`, which are split).

The weights are rounded to nearest (no SmoothQuant / GPTQ calibration): `raylm quantize` is for a
checkpoint nobody published quantized, and for benchmarks that need the same W8A8 weights in every
engine. The scale is rounded to the stored dtype before the weights are divided by it, so the
int8 values are the nearest to what the stored scale dequantizes.

    raylm quantize SRC DST   (or export_w8a8(SRC, DST))
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from workers.quant.formats import PROJECTIONS
from workers.quant.weights import INT8_MAX, INT8_MIN


def _quantizable(name: str, tensor: torch.Tensor) -> bool:
    parts = name.split(".")
    return (name.endswith(".weight") and len(parts) >= 2 and parts[-2] in PROJECTIONS
            and tensor.dim() == 2 and tensor.is_floating_point())


def _per_expert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked experts tensor (`...mlp.experts.gate_up_proj` [E, 2I, hidden], `...down_proj`
    [E, hidden, I]) as Qwen's per-expert weights; {name: tensor} for anything else."""
    prefix, _, last = name.rpartition(".")
    if not prefix.endswith("mlp.experts") or last not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
        return {name: tensor}
    if last == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": w for e, w in enumerate(tensor)}
    gate, up = tensor.chunk(2, dim=1)
    return {f"{prefix}.{e}.{p}.weight": w[e] for e in range(tensor.shape[0]) for p, w in (("gate_proj", gate),
                                                                                            ("up_proj", up))}


def quantize_channel_int8(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], scale [out, 1] in scale_dtype): symmetric per channel,
    scale = max |w| / 127 rounded to scale_dtype, q = round-half-even(w / scale) clamped."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).to(scale_dtype)
    tiny = torch.finfo(scale_dtype).tiny
    scale = torch.where(scale > 0, scale, torch.full_like(scale, tiny))
    q = torch.round(w / scale.float()).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)
    return q, scale


def compressed_tensors_config() -> dict:
    """config.json's quantization_config for int8 W8A8, channel-wise weights, dynamic token-wise
    activations (llm-compressor's W8A8 preset as it writes it)."""
    return {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                        "group_size": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True, "observer": None}}},
        "ignore": ["lm_head", "re:.*mlp\\.gate$"], "kv_cache_scheme": None}


def export_w8a8(src, dst) -> Path:
    """The float checkpoint at `src` as compressed-tensors W8A8 at `dst` (created; files other than
    config.json and the safetensors copied as they are). Returns dst."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} is not a checkpoint directory (no config.json)")
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method")
        raise ValueError(f"{src} is already quantized (quantization_config.quant_method={method!r})")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} holds no *.safetensors weights")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():
                for name, t in _per_expert(stored, f.get_tensor(stored)).items():
                    if _quantizable(name, t):
                        out[name], out[name + "_scale"] = quantize_channel_int8(t, t.dtype)
                    else:
                        out[name] = t
    raw["quantization_config"] = compressed_tensors_config()
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"))
    return dst
