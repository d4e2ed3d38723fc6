"""RoPE scaling types match transformers' ROPE_INIT_FUNCTIONS and Qwen3RotaryEmbedding bit for bit;
the served length follows vLLM's rule; unsupported types and bad values name their problem."""

from __future__ import annotations

import math

import pytest
import torch

from workers.models.rope import SUPPORTED_ROPE_TYPES, RopeConfig
from workers.ops import get_op_table

BASE = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=128, hidden_size=1024,
            intermediate_size=64, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
            head_dim=128, max_position_embeddings=40960)
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
POSITIONS = [0, 1, 4095, 32767, 32768, 40000, 100000, 131071]


def legacy(theta: float, scaling: dict | None, **extra) -> dict:
    """A transformers-4 config.json: rope_theta at the top level, rope_scaling beside it."""
    return {**BASE, **extra, "rope_theta": theta, "rope_scaling": scaling}


def v5(params: dict, **extra) -> dict:
    """A transformers-5 config.json: everything in rope_parameters."""
    return {**BASE, **extra, "rope_parameters": params}


# (id, config.json, expected served length)
CASES = [
    ("default", v5({"rope_type": "default", "rope_theta": 1e6}), 40960),
    ("default-no-rope-keys", {**BASE}, 40960),
    ("qwen3-yarn-legacy-rope_type", legacy(1e6, dict(QWEN3_YARN)), 131072),
    ("qwen3-yarn-legacy-type", legacy(1e6, {"type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32768}), 131072),
    ("qwen3-yarn-v5", v5({**QWEN3_YARN, "rope_theta": 1e6}), 131072),
    ("yarn-int-theta-int-factor", legacy(1000000, {"rope_type": "yarn", "factor": 4,
                                                   "original_max_position_embeddings": 32768}), 131072),
    ("yarn-attention-factor-betas", v5({**QWEN3_YARN, "rope_theta": 1e6, "attention_factor": 0.8,
                                        "beta_fast": 16, "beta_slow": 2}), 131072),
    ("yarn-mscale", v5({**QWEN3_YARN, "rope_theta": 1e6, "mscale": 1.0, "mscale_all_dim": 0.5}), 131072),
    ("yarn-mscale-equal", v5({**QWEN3_YARN, "rope_theta": 1e6, "mscale": 0.707, "mscale_all_dim": 0.707}),
     131072),
    ("yarn-mscale-only", v5({**QWEN3_YARN, "rope_theta": 1e6, "mscale": 2.0}), 131072),
    ("yarn-truncate-false", v5({**QWEN3_YARN, "rope_theta": 1e6, "truncate": False}), 131072),
    ("yarn-small-head", v5({"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 4096,
                            "rope_theta": 10000.0}, head_dim=64), 10240),
    ("yarn-original-from-max", v5({"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}), 81920),
    ("yarn-original-top-level", legacy(1e6, {"type": "yarn", "factor": 4.0},
                                       original_max_position_embeddings=8192), 32768),
    ("yarn-no-head-dim", {**legacy(1e6, dict(QWEN3_YARN)), "head_dim": None, "hidden_size": 512,
                          "num_attention_heads": 8}, 131072),
    ("linear-legacy", legacy(10000.0, {"type": "linear", "factor": 2.0}, head_dim=64), 81920),
    ("linear-v5", v5({"rope_type": "linear", "factor": 3.0, "rope_theta": 1e6}), 122880),
    ("llama3", v5({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
                  max_position_embeddings=131072), 131072),
    ("llama3-legacy", legacy(500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             head_dim=64, max_position_embeddings=131072), 131072),
]


def hf_config(raw: dict):
    from transformers import Qwen3Config

    raw = dict(raw)
    if raw.get("head_dim") is None:  # HF's Qwen3Config wants an int; derive it as config_from_dict does
        raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    return Qwen3Config.from_dict(raw)


def hf_init(config) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return Qwen3RotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


def cos_sin(rope: RopeConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's recipe: fp32 math, scale by attention_factor, then cast."""
    freqs = positions.float()[:, None] * rope.inv_freq("cpu")[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rope.attention_factor).to(dtype), (emb.sin() * rope.attention_factor).to(dtype)


@pytest.mark.parametrize("raw,max_len", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_hf(raw, max_len):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rope = RopeConfig.from_hf(raw)
    config = hf_config(raw)
    assert rope.rope_type == config.rope_parameters["rope_type"]
    assert rope.rope_theta == config.rope_parameters["rope_theta"]

    expected_inv, expected_factor = hf_init(config)
    inv = rope.inv_freq("cpu")
    assert inv.dtype == torch.float32 and inv.shape == (rope.head_dim // 2,)
    assert torch.equal(inv, expected_inv.float()), (inv - expected_inv).abs().max()
    assert rope.attention_factor == pytest.approx(expected_factor, rel=1e-12, abs=0)
    assert rope.max_position_embeddings == max_len

    # cos / sin past the original length, as Qwen3RotaryEmbedding.forward produces them
    hf_rotary = Qwen3RotaryEmbedding(config)
    assert torch.equal(hf_rotary.inv_freq, inv)
    assert hf_rotary.attention_scaling == pytest.approx(rope.attention_factor, rel=1e-12, abs=0)
    positions = torch.tensor(POSITIONS)
    for dtype in (torch.float32, torch.bfloat16):
        hf_cos, hf_sin = hf_rotary(torch.zeros(1, dtype=dtype), positions[None])
        cos, sin = cos_sin(rope, positions, dtype)
        assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0]), dtype


def test_op_table_path_matches_hf():
    """The op table's fp32 cos/sin, scaled by attention_factor then cast, is HF's (the integration path)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    raw = legacy(1e6, dict(QWEN3_YARN))
    rope = RopeConfig.from_hf(raw)
    hf_cos, hf_sin = Qwen3RotaryEmbedding(hf_config(raw))(torch.zeros(1, dtype=torch.bfloat16),
                                                          torch.tensor([POSITIONS]))
    cos, sin = get_op_table("cpu", "reference").rotary_cos_sin(torch.tensor(POSITIONS), rope.inv_freq("cpu"),
                                                               torch.float32)
    cos = (cos * rope.attention_factor).to(torch.bfloat16)
    sin = (sin * rope.attention_factor).to(torch.bfloat16)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_qwen3_yarn_fields():
    rope = RopeConfig.from_hf(legacy(1e6, dict(QWEN3_YARN)))
    assert rope.scaled
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    assert (rope.beta_fast, rope.beta_slow, rope.truncate) == (32.0, 1.0, True)
    assert rope.attention_factor == 0.1 * math.log(4.0) + 1.0
    assert rope.config_max_position_embeddings == 40960
    assert rope.max_position_embeddings == 131072
    # both spellings give the same config
    assert RopeConfig.from_hf(v5({**QWEN3_YARN, "rope_theta": 1e6})) == rope
    assert RopeConfig.from_hf(legacy(1e6, {"type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 32768})) == rope


def test_default_matches_plain_rope():
    rope = RopeConfig.from_hf(legacy(1e6, None))
    assert not rope.scaled and rope.attention_factor == 1.0
    exponents = torch.arange(0, 128, 2, dtype=torch.float) / 128
    assert torch.equal(rope.inv_freq(), 1.0 / (1e6 ** exponents))
    # rope_theta inside rope_parameters wins over the top level's; absent everywhere: 10000
    assert RopeConfig.from_hf({**BASE, "rope_theta": 5.0, "rope_parameters": {"rope_theta": 7.0}}).rope_theta == 7.0
    assert RopeConfig.from_hf({**BASE}).rope_theta == 10000.0


def test_inv_freq_device():
    rope = RopeConfig.from_hf(legacy(1e6, dict(QWEN3_YARN)))
    meta = rope.inv_freq(torch.device("meta"))
    assert meta.device.type == "meta" and meta.dtype == torch.float32 and meta.shape == (64,)
    assert rope.inv_freq().device.type == "cpu"


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su", "proportional", "mrope"])
def test_unsupported_types_refused(rope_type):
    with pytest.raises(ValueError) as e:
        RopeConfig.from_hf(legacy(1e6, {"type": rope_type, "factor": 2.0}))
    message = str(e.value)
    assert repr(rope_type) in message
    for supported in SUPPORTED_ROPE_TYPES:
        assert supported in message
    with pytest.raises(ValueError, match=repr(rope_type)):
        RopeConfig.from_hf(v5({"rope_type": rope_type, "factor": 2.0, "rope_theta": 1e6}))


@pytest.mark.parametrize("params,field,value", [
    ({"rope_type": "yarn", "factor": 0}, "factor", "0"),
    ({"rope_type": "yarn", "factor": -2.0}, "factor", "-2.0"),
    ({"rope_type": "linear", "factor": "4"}, "factor", "'4'"),
    ({"rope_type": "linear", "factor": None}, "factor", "None"),
    ({"rope_type": "linear", "factor": True}, "factor", "True"),
    ({"rope_type": "linear", "factor": float("nan")}, "factor", "nan"),
    ({"rope_type": "yarn"}, "factor", "'yarn'"),
    ({"rope_type": "linear"}, "factor", "'linear'"),
    ({**QWEN3_YARN, "attention_factor": 0.0}, "attention_factor", "0.0"),
    ({**QWEN3_YARN, "attention_factor": "big"}, "attention_factor", "'big'"),
    ({**QWEN3_YARN, "beta_fast": -1}, "beta_fast", "-1"),
    ({**QWEN3_YARN, "mscale": "x"}, "mscale", "'x'"),
    ({**QWEN3_YARN, "truncate": "no"}, "truncate", "'no'"),
    ({**QWEN3_YARN, "original_max_position_embeddings": 0}, "original_max_position_embeddings", "0"),
    ({**QWEN3_YARN, "original_max_position_embeddings": 1.5}, "original_max_position_embeddings", "1.5"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor", "'llama3'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     "high_freq_factor", "1.0"),
    ({"rope_type": "default", "rope_theta": 0}, "rope_theta", "0"),
    ({**QWEN3_YARN, "partial_rotary_factor": 0.5}, "partial_rotary_factor", "0.5"),
])
def test_bad_values_name_field_and_value(params, field, value):
    with pytest.raises(ValueError) as e:
        RopeConfig.from_hf(v5(params))
    assert field in str(e.value) and value in str(e.value), str(e.value)


@pytest.mark.parametrize("raw,needle", [
    ({**BASE, "rope_parameters": {"rope_type": "yarn", "factor": 4.0},
      "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({**BASE, "rope_scaling": {"rope_type": "yarn", "type": "linear", "factor": 2.0}}, "disagree"),
    ({**BASE, "rope_scaling": [1, 2]}, "rope_scaling"),
    ({**BASE, "rope_parameters": {"full_attention": {"rope_type": "default"}}}, "full_attention"),
    (legacy(1e6, dict(QWEN3_YARN), original_max_position_embeddings=8192), "8192"),
    ({**BASE, "head_dim": None, "hidden_size": None}, "head_dim"),
    ({**BASE, "head_dim": 127}, "127"),
    ({**BASE, "max_position_embeddings": 0}, "max_position_embeddings"),
    ({**BASE, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_malformed_configs_refused(raw, needle):
    with pytest.raises(ValueError, match=needle):
        RopeConfig.from_hf(raw)


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="'dynamic'"):
        RopeConfig(rope_type="dynamic")
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeConfig(rope_type="yarn", factor=4.0)
    assert RopeConfig().max_position_embeddings == 32768
