"""Quantized weights as raylm holds them between the loader and an op table, whatever format
they came in, and the arithmetic that defines each (the reference every fast path is held to).

- Int8Weight, W8A8: int8 weights [out, in] with one scale per output channel, activations
  quantized to int8 per token at run time ("dynamic": compressed-tensors' int-quantized W8A8,
  msmodelslim's W8A8_DYNAMIC, raylm's quantization="int8") or with one static per-tensor scale
  and offset (msmodelslim's W8A8, whose int32 sums take a quant_bias and a deq_scale per channel).
- Int4Weight, W4A16: 4-bit weights [out, in] (unpacked, one per uint8) with a scale and a zero
  point per group of `group_size` inputs (AWQ); activations stay in the compute dtype.

Linears that read one input (q/k/v, gate/up) are fused along out with `fuse`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

INT8_MIN, INT8_MAX = -128, 127


class _Shaped:
    """[out, in] of a quantized weight's values."""

    qweight: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]


@dataclass
class Int8Weight(_Shaped):
    qweight: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # fp32 [out]: dynamic: the weight's per-channel scale
    dynamic: bool = True  # per-token activation scales; False: the static ones below
    input_scale: float = 1.0  # static: x_q = clamp(round(x / input_scale + input_offset))
    input_offset: int = 0
    quant_bias: torch.Tensor | None = None  # static: int32 [out], added to the int32 sums
    deq_scale: torch.Tensor | None = None  # static: fp32 [out], multiplies (sums + quant_bias)

    @property
    def scheme(self) -> str:
        return "w8a8-dynamic" if self.dynamic else "w8a8-static"


@dataclass
class Int4Weight(_Shaped):
    qweight: torch.Tensor  # uint8 [out, in], values 0..15
    scales: torch.Tensor  # [out, in / group_size] (the checkpoint's float dtype)
    zeros: torch.Tensor  # uint8 [out, in / group_size], values 0..15
    group_size: int

    scheme = "w4a16"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, dtype)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """(q - zero) * scale per group of `group_size` inputs, in fp32, then rounded once to `dtype`: [out, in]."""
    out, inp = qweight.shape
    q = qweight.view(out, inp // group_size, group_size).float()
    w = (q - zeros.float()[:, :, None]) * scales.float()[:, :, None]
    return w.view(out, inp).to(dtype)


QuantWeight = Int8Weight | Int4Weight


def fuse(parts: list[QuantWeight]) -> QuantWeight:
    """Weights that read one input, concatenated along out (q/k/v; gate/up). Static W8A8 parts
    must share their activation scale and offset (one input is quantized once)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(type(p) is not type(first) or p.scheme != first.scheme for p in parts):
        raise ValueError(f"cannot fuse linears of different quantization schemes: {[p.scheme for p in parts]}")
    if isinstance(first, Int4Weight):
        if any(p.group_size != first.group_size for p in parts):
            raise ValueError("cannot fuse 4-bit linears of different group sizes")
        return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.zeros for p in parts]), first.group_size)
    if not first.dynamic and any((p.input_scale, p.input_offset) != (first.input_scale, first.input_offset)
                                 for p in parts):
        raise ValueError("linears that read one input have different static input_scale / input_offset: "
                         f"{[(p.input_scale, p.input_offset) for p in parts]}")
    def cat(name):
        return None if getattr(first, name) is None else torch.cat([getattr(p, name) for p in parts])
    return replace(first, qweight=torch.cat([p.qweight for p in parts]), scale=torch.cat([p.scale for p in parts]),
                   quant_bias=cat("quant_bias"), deq_scale=cat("deq_scale"))


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """A float weight [..., out, in] (a linear's, or a layer's stacked experts') -> symmetric int8
    per output channel (scale [..., out] = max |w| / 127), for activations quantized per token:
    what quantization="int8" does at load."""
    w = weight.float()
    scale = w.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(w / scale[..., None]).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, in] -> (int8 [T, in], fp32 scales [T]): symmetric per token,
    scale = max |x| / 127, x_q = round-half-even(x / scale)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    return torch.round(xf / scale[:, None]).clamp_(INT8_MIN, INT8_MAX).to(torch.int8), scale


def quantize_static(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """Activations [T, in] -> int8 by the static per-tensor scale and offset."""
    q = torch.round(x.float() / w.input_scale + w.input_offset)
    return q.clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


def int8_sums(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """Exact int32-valued sums xq @ qweight.T, in float64 (every partial sum of int8 products
    is an integer below 2^53), as float64 [T, out]."""
    return xq.double() @ qweight.double().t()


def reference_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The format's arithmetic in plain torch: x [T, in] -> [T, out] in x.dtype. Defines correct."""
    if isinstance(w, Int4Weight):
        return F.linear(x, w.dequantized(x.dtype), bias)
    if w.dynamic:
        xq, sx = quantize_rows(x)
        y = (int8_sums(xq, w.qweight) * sx.double()[:, None] * w.scale.double()[None, :]).to(x.dtype)
    else:
        acc = int8_sums(quantize_static(x, w), w.qweight) + w.quant_bias.double()[None, :]
        y = (acc * w.deq_scale.double()[None, :]).to(x.dtype)
    return y if bias is None else y + bias
