"""QuantizedLinear: a decoder linear whose parameters are a quantized format's tensors, under
the names the format's tools write them (so the loader reads them like any weight, each rank
its own slice: workers/parallel.py), and the model-side steps: `attach` swaps the linears a
QuantConfig quantizes for these before the weights load, `quantize_at_load` turns a loaded
model's linears into int8 (quantization="int8"), `quant_weight` hands one to the op table.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from workers.quant.formats import PROJECTIONS, QuantConfig, QuantConfigError
from workers.quant.weights import Int4Weight, Int8Weight, QuantWeight, quantize_int8

AWQ_PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i of an int32 holds column AWQ_ORDER[i]


class QuantizedLinear(nn.Module):
    """in_features -> out_features through a quantized weight; parameters named as the format's
    checkpoints name them (method, scheme: workers/quant/formats.py)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.dtype | None, method: str, scheme: str,
                 group_size: int = 0, name: str = "") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method, self.scheme, self.group_size = method, scheme, group_size
        p = self._param
        if scheme == "w4a16":
            if in_features % group_size or out_features % AWQ_PACK:
                raise QuantConfigError(f"{name}: {in_features} inputs / {out_features} outputs (this rank's) do not "
                                       f"split into AWQ groups of {group_size} and packs of {AWQ_PACK}")
            p("qweight", (in_features, out_features // AWQ_PACK), torch.int32)
            p("qzeros", (in_features // group_size, out_features // AWQ_PACK), torch.int32)
            p("scales", (in_features // group_size, out_features), torch.float32)
        else:
            p("weight", (out_features, in_features), torch.int8)
            p("weight_scale", (out_features, 1), torch.float32)
            if method == "modelslim":
                p("weight_offset", (out_features, 1), torch.float32)  # zeros for int8: unused, as vllm-ascend
            if scheme == "w8a8-static":
                p("input_scale", (1,), torch.float32)
                p("input_offset", (1,), torch.float32)
                p("quant_bias", (out_features,), torch.int32)
                p("deq_scale", (out_features,), torch.float32)
        self.bias = None if bias is None else nn.Parameter(torch.empty(out_features, dtype=bias), requires_grad=False)

    def _param(self, name: str, shape, dtype) -> None:
        self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.method} {self.scheme}"


def quant_weight(m: QuantizedLinear) -> QuantWeight:
    """The module's tensors as the op tables take them (views: nothing copied but AWQ's unpacking)."""
    if m.scheme == "w4a16":
        q = unpack_awq(m.qweight).t().contiguous()  # [out, in]
        zeros = unpack_awq(m.qzeros).t().contiguous()  # [out, in / group]
        return Int4Weight(q, m.scales.t().contiguous(), zeros, m.group_size)
    scale = m.weight_scale.view(-1)
    if m.scheme == "w8a8-dynamic":
        return Int8Weight(m.weight, scale)
    return Int8Weight(m.weight, scale, dynamic=False, input_scale=float(m.input_scale),
                      input_offset=int(m.input_offset), quant_bias=m.quant_bias, deq_scale=m.deq_scale)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] in AutoAWQ's GEMM order -> uint8 [rows, cols], values 0..15."""
    rows, n = packed.shape
    out = torch.empty(rows, n, AWQ_PACK, dtype=torch.uint8, device=packed.device)
    for nibble, column in enumerate(AWQ_ORDER):
        out[:, :, column] = ((packed >> (4 * nibble)) & 0xF).to(torch.uint8)
    return out.view(rows, n * AWQ_PACK)


def convert_loaded(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor as its parameter holds it: msmodelslim writes an fp16 model's deq_scale
    as int64 holding the float32's bits."""
    if name.endswith(".deq_scale") and tensor.dtype == torch.int64:
        return (tensor & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return tensor


def _dtype(bias: torch.Tensor | None) -> torch.dtype | None:
    return None if bias is None else bias.dtype


def _check_unquantized(config: QuantConfig, name: str, what: str) -> None:
    if config.scheme_for(name) is not None:
        raise QuantConfigError(f"{config.method}: {what} {name} is quantized ({config.scheme_for(name)}); raylm "
                               "keeps it in full precision and does not serve it quantized")


def _experts_scheme(config: QuantConfig, name: str, num_experts: int) -> str | None:
    """The one scheme every expert projection of MoE layer `name` (its `...mlp.experts`) computes
    in; an error where they differ (a layer's experts are one stacked tensor) or where it is one
    raylm's MoE kernels do not run (only W8A8 with dynamic activations)."""
    schemes = {config.scheme_for(f"{name}.{e}.{p}") for e in range(num_experts)
               for p in ("gate_proj", "up_proj", "down_proj")}
    if len(schemes) > 1:
        raise QuantConfigError(f"{config.method}: the experts of {name} mix quantization schemes "
                               f"({sorted(map(str, schemes))}); raylm stacks a layer's experts and needs one")
    scheme = schemes.pop()
    if scheme not in (None, "w8a8-dynamic"):
        raise QuantConfigError(f"{config.method}: MoE experts {name}.* are {scheme}; raylm serves quantized "
                               "experts as W8A8 with dynamic per-token activations only (w8a8-dynamic)")
    return scheme


def attach(model: nn.Module, config: QuantConfig) -> None:
    """Swap each decoder linear `config` quantizes for a QuantizedLinear of the same (this rank's)
    shape, and each MoE layer's experts it quantizes for Qwen3MoeInt8Experts, in place; refuse a
    format that quantizes what raylm serves only unquantized (the lm_head, a MoE router)."""
    # imported here: the model's modules import the op tables, which import workers.quant
    from workers.models.qwen3_moe import Qwen3MoeInt8Experts

    if not config.in_checkpoint:
        return
    _check_unquantized(config, "lm_head", "the lm_head")
    for name, module in list(model.named_modules()):
        if name.endswith(".mlp.experts"):
            if _experts_scheme(config, name, module.num_experts) is not None:
                model.get_submodule(name.rsplit(".", 1)[0]).experts = Qwen3MoeInt8Experts(model.config,
                                                                                          model.parallel)
            continue
        if not isinstance(module, nn.Linear) or name == "lm_head":
            continue
        if name.endswith(".mlp.gate"):
            _check_unquantized(config, name, "the MoE router")
            continue
        scheme = config.scheme_for(name)
        if scheme is None:
            continue
        parent, attr = name.rsplit(".", 1)
        q = QuantizedLinear(module.in_features, module.out_features, _dtype(module.bias), config.method,
                            scheme, config.group_size, name)
        setattr(model.get_submodule(parent), attr, q)


@torch.no_grad()
def quantize_at_load(model: nn.Module, config: QuantConfig) -> None:
    """quantization="int8": each decoder projection and MoE expert of a loaded model -> int8 per
    output channel (dynamic per-token activations), its float weight freed."""
    from workers.models.qwen3_moe import Qwen3MoeExperts, Qwen3MoeInt8Experts  # as in attach

    for name, module in list(model.named_modules()):
        if isinstance(module, Qwen3MoeExperts):
            q = Qwen3MoeInt8Experts(model.config, model.parallel).to(module.gate_up_proj.device)
            for proj in ("gate_up_proj", "down_proj"):
                for e, weight in enumerate(getattr(module, proj)):  # one expert at a time: a small fp32 copy
                    w = quantize_int8(weight)
                    getattr(q, proj)[e].copy_(w.qweight)
                    getattr(q, proj + "_scale")[e].copy_(w.scale)
            model.get_submodule(name.rsplit(".", 1)[0]).experts = q
            continue
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in PROJECTIONS \
                or config.scheme_for(name) is None:
            continue
        w = quantize_int8(module.weight)
        q = QuantizedLinear(module.in_features, module.out_features, _dtype(module.bias), "int8",
                            "w8a8-dynamic", name=name).to(module.weight.device)
        q.weight.copy_(w.qweight)
        q.weight_scale.copy_(w.scale[:, None])
        if module.bias is not None:
            q.bias.copy_(module.bias)
        parent, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), attr, q)
