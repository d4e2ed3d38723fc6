"""Small quantized checkpoints written the way each format's tools write them, from a float
checkpoint (the bundled tiny model by default): the rules of each format applied here in plain
torch, independently of raylm's loader, and the tensors named as those tools name them.

- compressed-tensors int-quantized W8A8 (llm-compressor): `weight` int8 [out, in], `weight_scale`
  [out, 1] in the model's dtype (symmetric per channel), `quantization_config` in config.json,
  lm_head in `ignore`.
- msmodelslim W8A8 (static) / W8A8_DYNAMIC: `weight` int8, `weight_scale` / `weight_offset`
  [out, 1]; static adds `input_scale` / `input_offset` [1] (asymmetric per tensor, calibrated on
  the corpus), `quant_bias` int32 [out] and `deq_scale` [out] (fp32, or int64 holding the fp32's
  bits for an fp16 model); `quant_model_description.json` beside the weights.
- AWQ W4A16 GEMM (AutoAWQ): `qweight` int32 [in, out / 8], `qzeros` int32 [in / g, out / 8]
  (nibble i of each int32 holds column (0, 2, 4, 6, 1, 3, 5, 7)[i]), `scales` fp16 [in / g, out].
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _copy_checkpoint(src: Path, dst: Path) -> tuple[dict, dict]:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":  # one file out
            shutil.copy(f, dst / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    return json.loads((src / "config.json").read_text()), tensors


def _projection(name: str, experts: bool = False) -> bool:
    """A decoder projection's weight; MoE experts' (`mlp.experts.N.gate_proj.weight`) where `experts`."""
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS and \
        (experts or ".experts." not in name)


def _int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(dim=1, keepdim=True) / 127
    return torch.round(w.float() / scale).clamp(-128, 127).to(torch.int8), scale


def _save(dst: Path, config: dict, tensors: dict) -> Path:
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def write_compressed_tensors(src: Path, dst: Path, zero_points: bool = False, experts: bool = False) -> Path:
    """experts: a MoE checkpoint's experts quantized too (under their per-expert names), the router
    left in full precision (in `ignore`); else experts and router both left alone."""
    config, tensors = _copy_checkpoint(Path(src), Path(dst))
    out = {}
    for name, t in tensors.items():
        if _projection(name, experts):
            q, scale = _int8_per_channel(t)
            out[name], out[name + "_scale"] = q, scale.to(t.dtype)
            if zero_points:
                out[name + "_zero_point"] = torch.zeros(t.shape[0], 1, dtype=torch.int8)
        else:
            out[name] = t
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                        "group_size": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True, "observer": None}}},
        "ignore": ["lm_head", "re:.*mlp[.]gate$"] + ([] if experts else ["re:.*[.]experts[.].*"]),
        "kv_cache_scheme": None}
    return _save(Path(dst), config, out)


def write_modelslim(src: Path, dst: Path, dynamic: bool, input_ranges: dict | None = None,
                    experts: bool = False) -> Path:
    """input_ranges (static): linear name -> (min, max) of its inputs, as msmodelslim calibrates.
    experts: a MoE checkpoint's experts quantized too (W8A8_DYNAMIC; the router stays FLOAT)."""
    config, tensors = _copy_checkpoint(Path(src), Path(dst))
    dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
    out, description = {}, {"model_quant_type": "W8A8_DYNAMIC" if dynamic else "W8A8"}
    for name, t in tensors.items():
        description[name] = "FLOAT"
        if not _projection(name, experts):
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        q, scale = _int8_per_channel(t)
        out[name], out[prefix + ".weight_scale"] = q, scale.to(dtype)
        out[prefix + ".weight_offset"] = torch.zeros_like(scale).to(dtype)
        description[name] = "W8A8_DYNAMIC" if dynamic else "W8A8"
        if dynamic:
            continue
        lo, hi = input_ranges[prefix]
        in_scale = (hi - lo) / 255
        offset = round(-128 - lo / in_scale)
        deq = (in_scale * scale[:, 0]).float()
        out[prefix + ".input_scale"] = torch.tensor([in_scale], dtype=dtype)
        out[prefix + ".input_offset"] = torch.tensor([offset], dtype=dtype)
        out[prefix + ".quant_bias"] = (-offset * q.to(torch.int32).sum(dim=1)).to(torch.int32)
        out[prefix + ".deq_scale"] = deq if dtype != torch.float16 else \
            deq.view(torch.int32).to(torch.int64)
        for key in ("weight_scale", "weight_offset", "input_scale", "input_offset", "quant_bias", "deq_scale"):
            description[f"{prefix}.{key}"] = "W8A8"
    (Path(dst) / "quant_model_description.json").write_text(json.dumps(description, indent=2))
    return _save(Path(dst), config, out)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """uint [rows, cols] 0..15 -> int32 [rows, cols / 8], AutoAWQ's GEMM order."""
    rows, cols = values.shape
    v = values.to(torch.int64).view(rows, cols // 8, 8)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= v[:, :, column] << (4 * nibble)
    return (packed - (packed >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32)  # as two's complement


def write_awq(src: Path, dst: Path, group_size: int = 128) -> Path:
    config, tensors = _copy_checkpoint(Path(src), Path(dst))
    out = {}
    for name, t in tensors.items():
        if not _projection(name):
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        w = t.float().t()  # [in, out]
        n_in, n_out = w.shape
        g = w.view(n_in // group_size, group_size, n_out)
        lo, hi = g.amin(dim=1), g.amax(dim=1)  # [in / g, out]
        scales = ((hi - lo).clamp(min=1e-5) / 15).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, 15)
        q = (torch.round(g / scales.float()[:, None]) + zeros[:, None]).clamp(0, 15).view(n_in, n_out)
        out[prefix + ".qweight"] = _pack_awq(q)
        out[prefix + ".qzeros"] = _pack_awq(zeros)
        out[prefix + ".scales"] = scales
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                     "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    return _save(Path(dst), config, out)


@torch.no_grad()
def calibrate_input_ranges(path, token_ids: list[list[int]]) -> dict:
    """Each decoder projection's input (min, max) over sequences of the float checkpoint at `path`,
    through HF transformers (what msmodelslim's static calibration measures)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ranges, hooks = {}, []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            def hook(_, args, __, name=name):
                lo, hi = ranges.get(name, (0.0, 0.0))
                ranges[name] = (min(lo, args[0].min().item()), max(hi, args[0].max().item()))
            hooks.append(module.register_forward_hook(hook))
    for ids in token_ids:
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return ranges
