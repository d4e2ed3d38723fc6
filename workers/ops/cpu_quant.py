"""Quantized linears on the CPU (workers/quant), each format by a library kernel chosen by
measurement per weight shape when the weight is prepared.

W8A8 (int8 weights, activations quantized per token or by a static scale): int8 x int8 -> int32
sums, then the scales, by either
- "onednn-int8": oneDNN's quantized inner product (`torch.ops.onednn.qlinear_pointwise` over a
  weight prepacked once by `qlinear_prepack`: AVX2 / AVX512-VNNI / AMX-INT8 kernels, whichever
  the CPU has), the per-channel scales applied inside, the per-token ones after; or
- "int-mm": `torch._int_mm` (int32 sums) and the scales applied after; or
- "avx2-int8": raylm's AVX2 kernel (workers/ops/csrc/int8_linear.cpp) for CPUs without VNNI, where
  oneDNN's int8 saturates and runs slower than fp32: weights widened to int16 in registers, VPMADDWD;
  or
- "amx-int8": raylm's AMX-INT8 kernel (workers/ops/csrc/amx_int8_linear.cpp), whose epilogue applies
  both scales (and a static format's bias) and rounds to the compute dtype as the sums leave the tiles:
  oneDNN's takes per-channel scales only, so its fp32 product is written and read again for the
  per-token ones, a pass that at a prefill chunk's rows moves more bytes than the int8 GEMM;
whichever is faster at 1-64 rows here, among those whose int32 sums are exact on a probe of
extreme values (a kernel that saturates 16-bit pair sums, as pre-VNNI int8 instructions can, is
never chosen).

W4A16 (AWQ: 4-bit weights, a scale and a zero point per group): `_weight_int4pack_mm_for_cpu`
over a weight repacked once ("int4pack"; torch's own kernel, which unpacks each row of weights
per output row and so is fast at a few rows only), and for more rows the weight dequantized to the
compute dtype for that call and a GEMM ("dequant-gemm"); the row count where one overtakes the
other is measured. The weight is held at 4 bits either way.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace

import torch
import torch.nn.functional as F

from workers.ops import cpu_kernels
from workers.ops.cpu_narrow import best_of
from workers.ops.kernel_choices import remembered
from workers.quant.weights import Int4Weight, Int8Weight, dequantize_int4, quantize_rows, quantize_static

INT8_ENV = "RAYLM_CPU_INT8_GEMM"  # onednn-int8 | int-mm | avx2-int8 | amx-int8: that kernel, not the measured one
INT4_ENV = "RAYLM_CPU_INT4_ROWS"  # N: int4pack up to N rows (0: never), not the measured crossover
INT8_PATHS = ("onednn-int8", "int-mm", "avx2-int8", "amx-int8")
_AMX_K = 64  # the AMX-INT8 kernel takes input sizes that are a multiple of a tile's 64 columns
_PROBE_ROWS = (1, 16, 64)
_INT4_ROWS = (1, 2, 4, 8, 16, 32, 64)
_INT4_TILES = 2  # innerKTiles of torch's int4 packing (K must be a multiple of 16 * this)


class Int8Paths:
    """The int32 sums of int8 activations and an Int8Weight, by the kernel measured fastest;
    activations quantized and the sums finished (scales, bias, the compute dtype) by raylm's fused
    kernels (workers/ops/csrc/elementwise.cpp) where they built, else by torch's ops."""

    def __init__(self, kernels=None) -> None:
        self.chosen: dict[tuple[int, int], str] = {}  # weight shape -> path
        self.kernels = kernels  # torch.ops.raylm, or None

    def prepare(self, w: Int8Weight, dtype: torch.dtype):
        """-> (path name, run(x [T, in]) -> [T, out] in x.dtype, the tensors run holds, the weight
        as the handle keeps it: without its int8 values where the kernel holds its own packed copy,
        so they are held once)."""
        shape = tuple(w.qweight.shape)
        name = _forced(INT8_ENV, INT8_PATHS, w.qweight)
        if name is not None and not _exact(name, *shape):
            raise RuntimeError(f"{INT8_ENV}={name}: that kernel's int32 sums are not exact on this CPU (its 16-bit "
                               f"pair sums saturate); unset {INT8_ENV} to let raylm choose an exact one")
        name = name or self.chosen.get(shape)
        if name is None:
            name = self.chosen[shape] = _fastest_exact(w)
        sums, held = _int8_sums(name, w.qweight)
        kept = replace(w, qweight=_shape_only(w.qweight)) if held else w
        if self.kernels is None:
            run = _torch_run(None, sums, kept)
        else:
            fused = _amx_epilogue(self.kernels, held[0], shape[0]) if name == "amx-int8" else None
            run = _fused_run(self.kernels, sums, kept, fused)
        return name, run, held, kept


def _torch_run(_, sums, w: Int8Weight):
    scale = w.scale
    if w.dynamic:
        def run(x):
            xq, sx = quantize_rows(x)
            return sums(xq, scale).mul_(sx[:, None]).to(x.dtype)
        return run
    bias = (w.quant_bias.double() * w.deq_scale.double()).float()  # (sums + quant_bias) * deq, distributed

    def run(x):
        return sums(quantize_static(x, w), w.deq_scale).add_(bias).to(x.dtype)
    return run


def _fused_run(k, sums, w: Int8Weight, fused=None):
    """The same arithmetic as _torch_run's, each elementwise stage one pass of a fused kernel; with
    `fused` (xq, col_scale, row_scale, bias, dtype) -> out, a GEMM whose own epilogue finishes the sums."""

    def finish(xq, col_scale, x, row_scale, bias):
        if fused is not None:
            return fused(xq, col_scale, row_scale, bias, x.dtype)
        acc = sums(xq, col_scale)
        out = acc if x.dtype == torch.float32 else torch.empty(acc.shape, dtype=x.dtype)
        k.scale_rows(out, acc, row_scale, bias)
        return out

    if w.dynamic:
        scale = w.scale

        def run(x):
            x = x if x.stride(-1) == 1 else x.contiguous()
            xq, sx = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[0])
            k.quant_rows_int8(xq, sx, x)
            return finish(xq, scale, x, sx, None)
        return run
    bias = (w.quant_bias.double() * w.deq_scale.double()).float()
    in_scale, in_offset = float(w.input_scale), float(w.input_offset)

    def run(x):
        x = x if x.stride(-1) == 1 else x.contiguous()
        xq = torch.empty(x.shape, dtype=torch.int8)
        k.quant_static_int8(xq, x, in_scale, in_offset)
        return finish(xq, w.deq_scale, x, None, bias)
    return run


def _amx_epilogue(k, packed, rows: int):
    """amx-int8's GEMM, scaled, biased and rounded to the compute dtype as the sums leave the tiles."""

    def fused(xq, col_scale, row_scale, bias, dtype):
        out = torch.empty(xq.shape[0], rows, dtype=dtype)
        k.amx_int8_linear(out, xq, packed, col_scale, row_scale, bias)
        return out
    return fused


def _shape_only(t: torch.Tensor) -> torch.Tensor:
    """A stand-in of t's shape and dtype over one element (t's values are held elsewhere)."""
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


def _forced(env: str, choices: tuple[str, ...], qweight: torch.Tensor | None = None) -> str | None:
    value = os.environ.get(env)
    if value is not None and value not in choices:
        raise ValueError(f"{env} must be one of {', '.join(choices)}, got {value!r}")
    if value == "onednn-int8" and not has_onednn_int8():
        raise RuntimeError(f"{env}={value}, but oneDNN's int8 inner product is not in this torch build")
    if value == "avx2-int8" and not has_avx2_int8():
        raise RuntimeError(f"{env}={value}, but raylm's CPU kernels were not built with AVX2 here")
    if value == "avx2-int8" and qweight is not None and not _serves(value, qweight):
        raise ValueError(f"{env}={value} cannot run a {tuple(qweight.shape)} weight: its input size is odd")
    if value == "amx-int8" and not has_amx_int8():
        raise RuntimeError(f"{env}={value}, but this CPU has no AMX-INT8 (or raylm's kernels did not build for it)")
    if value == "amx-int8" and qweight is not None and not _serves(value, qweight):
        raise ValueError(f"{env}={value} cannot run a {tuple(qweight.shape)} weight: its input size is not a "
                         f"multiple of {_AMX_K}")
    return value


def has_onednn_int8() -> bool:
    return hasattr(torch.ops.onednn, "qlinear_prepack") and hasattr(torch.ops.onednn, "qlinear_pointwise")


def has_avx2_int8() -> bool:
    kernels = cpu_kernels.load()
    return kernels is not None and bool(kernels.int8_linear_available())


def has_amx_int8() -> bool:
    kernels = cpu_kernels.load()
    return kernels is not None and bool(kernels.amx_int8_linear_available())


def _serves(name: str, qweight: torch.Tensor) -> bool:
    """Whether path `name` takes this weight (the AVX2 kernel: an even input size; the AMX one: whole tiles)."""
    if name == "avx2-int8":
        return has_avx2_int8() and qweight.shape[1] % 2 == 0
    if name == "amx-int8":
        return has_amx_int8() and qweight.shape[1] % _AMX_K == 0
    return True


def _int8_sums(name: str, qweight: torch.Tensor):
    """-> (sums(xq [T, in], scale [out]) -> fp32 [T, out] = (xq @ qweight.T) * scale, tensors it holds)."""
    if name == "onednn-int8":
        packed = torch.ops.onednn.qlinear_prepack(qweight, None)  # oneDNN's blocked int8 layout
        return (lambda xq, scale: _onednn_scaled(xq, packed, scale)), [packed]
    if name in ("avx2-int8", "amx-int8"):  # raylm's kernels: a packing of their own, fp32 out
        kernels = cpu_kernels.load()
        pack, linear = ((kernels.int8_linear_pack, kernels.int8_linear) if name == "avx2-int8" else
                        (kernels.amx_int8_pack, kernels.amx_int8_linear))
        packed = pack(qweight)
        rows = qweight.shape[0]

        def sums(xq, scale):
            y = torch.empty(xq.shape[0], rows)
            linear(y, xq if xq.stride(-1) == 1 else xq.contiguous(), packed, scale)
            return y
        return sums, [packed]
    return (lambda xq, scale: torch._int_mm(xq.contiguous(), qweight.t()).float().mul_(scale)), []


def _onednn_scaled(xq: torch.Tensor, packed, scale: torch.Tensor) -> torch.Tensor:
    zeros = torch.zeros(scale.shape[0], dtype=torch.int64)
    return torch.ops.onednn.qlinear_pointwise(xq.contiguous(), 1.0, 0, packed, scale, zeros, None, 1.0, 0,
                                               torch.float32, "none", [], "")


def _fastest_exact(w: Int8Weight) -> str:
    """The fastest path at _PROBE_ROWS rows among those that take this weight and whose sums are exact
    on _exact's probe of extreme operands."""
    n, k = w.qweight.shape
    names = [name for name in INT8_PATHS if (name != "onednn-int8" or has_onednn_int8()) and _serves(name, w.qweight)]
    times = {}
    for name in names:
        if not _exact(name, n, k):
            continue
        sums, _ = _int8_sums(name, w.qweight)
        times[name] = sum(best_of(functools.partial(sums, torch.ones(r, k, dtype=torch.int8), w.scale), 3)
                          for r in _PROBE_ROWS)
    if not times:
        raise RuntimeError(f"no exact int8 GEMM on this CPU for a {n}x{k} weight (tried {', '.join(names)})")
    return min(times, key=times.get)


def saturates(name: str) -> bool:
    """Whether int8 path `name` loses exactness on this CPU (e.g. oneDNN's without VNNI): it is then never
    chosen, and forcing it is an error."""
    return (name != "onednn-int8" or has_onednn_int8()) and not _exact(name, 16, 64)


@functools.cache
def _exact(name: str, n: int, k: int) -> bool:
    """Whether path `name`'s sums are exact for an [n, k] weight whose rows take the extremes (all -128,
    all 127, the two alternating) against activations at theirs (likewise): where 16-bit pair sums
    saturate, whichever way a kernel shifts its operands to unsigned bytes, one of these pairs does."""
    hi = torch.full((k,), 127, dtype=torch.int8)
    lo = torch.full((k,), -128, dtype=torch.int8)
    mixed = torch.where(torch.arange(k) % 2 == 0, hi, lo)
    weight = torch.stack([lo, hi, mixed, mixed.flip(0)])[torch.arange(n) % 4]
    low_x, mixed_x = torch.full((k,), -128, dtype=torch.int8), torch.where(torch.arange(k) % 2 == 0, 127, -128)
    x = torch.stack([low_x, hi, mixed_x.to(torch.int8), mixed_x.flip(0).to(torch.int8)])[torch.arange(17) % 4]
    probe, _ = _int8_sums(name, weight)
    want = (x.long() @ weight.long().t()).float()
    return bool(torch.equal(probe(x, torch.ones(n)), want))


class Int4Paths:
    """Int4Weight (AWQ) linears: torch's int4 kernel at few rows, a dequantized GEMM past the row
    count measured for that weight shape and dtype."""

    def __init__(self, agree=None) -> None:
        self.rows: dict[tuple, int] = {}  # (out, in, group, dtype) -> most rows int4pack runs (0: never)
        self.agree = agree or (lambda value: value)  # OpTable.agree: the crossover every rank takes

    def prepare(self, w: Int4Weight, dtype: torch.dtype):
        """-> (path name, run(x [T, in]) -> [T, out] in x.dtype, the tensors run holds, the weight
        as the handle keeps it: its 4-bit values held two to a byte for the dequantized GEMM, beside
        torch's own packing where its kernel runs)."""
        nibbles = pack_nibbles(w.qweight)
        kept = replace(w, qweight=_shape_only(w.qweight))  # what the closures below may hold: not the values

        def dequant(x):
            return F.linear(x, dequantize_int4(unpack_nibbles(nibbles), kept.scales, kept.zeros, kept.group_size,
                                               x.dtype))

        name, run, held = self._choose(w, kept, dtype, dequant)
        return name, run, [nibbles, *held], kept

    def _choose(self, w: Int4Weight, kept: Int4Weight, dtype: torch.dtype, dequant):
        packed = _int4_pack(w, dtype)
        if packed is None:
            return "dequant-gemm", dequant, []
        weight, scales_zeros = packed
        group = kept.group_size

        def int4(x):
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), weight, group, scales_zeros)

        key = (*w.qweight.shape, w.group_size, dtype)
        forced = os.environ.get(INT4_ENV)
        if forced is not None and not forced.isdecimal():
            raise ValueError(f"{INT4_ENV} must be a row count (0: never int4pack), got {forced!r}")
        if forced is None and key not in self.rows:
            self.rows[key] = self.agree(remembered("int4_rows", (*w.qweight.shape, w.group_size, str(dtype)),
                                                   lambda: _int4_crossover(int4, dequant, w.in_features, dtype)))
        rows = int(forced) if forced is not None else self.rows[key]
        if rows == 0:
            return "dequant-gemm", dequant, []
        return f"int4pack(<={rows} rows)", lambda x: int4(x) if x.shape[0] <= rows and x.dtype == dtype \
            else dequant(x), [weight, scales_zeros]


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] of 0..15 -> uint8 [out, in / 2]: input 2j in the low nibble, 2j + 1 in the high."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], dim=-1).view(p.shape[0], 2 * p.shape[1])


def _int4_pack(w: Int4Weight, dtype: torch.dtype):
    """(torch's packed int4 weight, scales_and_zeros [in / g, out, 2]) in torch's convention
    w = (q - 8) * scale + zero, i.e. zero = (8 - awq_zero) * scale; None where the kernel is absent
    or does not take this shape / dtype."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.in_features % (16 * _INT4_TILES) \
            or w.group_size not in (32, 64, 128, 256):
        return None
    try:
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.qweight.to(torch.int32), _INT4_TILES)
    except (AttributeError, RuntimeError):
        return None
    scale = w.scales.float().t()  # [in / g, out]
    zero = (8 - w.zeros.float().t()) * scale
    return weight, torch.stack([scale, zero], dim=-1).to(dtype).contiguous()


def _int4_crossover(int4, dequant, k: int, dtype: torch.dtype) -> int:
    """The most rows at which int4 is faster than dequant (0: at none)."""
    rows = 0
    for r in _INT4_ROWS:
        x = torch.randn(r, k).to(dtype)
        if best_of(functools.partial(int4, x), 3) >= best_of(functools.partial(dequant, x), 3):
            break
        rows = r
    return rows
