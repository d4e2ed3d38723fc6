"""Quantized weights: the formats raylm reads (formats), the linears that hold them (linear),
their arithmetic (weights). The op tables compute them: workers/ops."""

from workers.quant.formats import QuantConfig, QuantConfigError, read_quant_config
from workers.quant.linear import QuantizedLinear, attach, convert_loaded, quant_weight, quantize_at_load
from workers.quant.weights import Int4Weight, Int8Weight, QuantWeight, fuse, reference_linear

__all__ = ["QuantConfig", "QuantConfigError", "read_quant_config", "QuantizedLinear", "attach",
           "convert_loaded", "quant_weight", "quantize_at_load", "Int4Weight", "Int8Weight", "QuantWeight", "fuse",
           "reference_linear"]
