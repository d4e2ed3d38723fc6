"""Quantized checkpoints (compressed-tensors W8A8, msmodelslim W8A8 / W8A8_DYNAMIC, AWQ W4A16,
int8 at load): written here by each format's rules (tests/workers/quant_checkpoints.py), loaded by
raylm, and checked against the format's arithmetic applied to HF transformers' model, against the
fp32 model (teacher-forced top-1 agreement), backend by backend against the reference, and for
clear errors where a config is malformed or unsupported."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.workers.quant_checkpoints import (
    calibrate_input_ranges,
    write_awq,
    write_compressed_tensors,
    write_modelslim,
)
from workers.kv_cache import KVCache
from workers.loader import bundled_model_path, load_model, load_quant_config
from workers.ops import get_op_table
from workers.ops.metadata import SequenceRows, build_metadata
from workers.quant import Int4Weight, Int8Weight, QuantConfigError, fuse, reference_linear
from workers.quant.weights import quantize_int8
from workers.tiny_model.corpus import CHINESE, ENGLISH

BS = 16
# logits vs the format's arithmetic on HF's model, as a fraction of the largest |logit|: summation order, and
# the rare activation that lands on a rounding boundary of its int8 grid in one and not the other
TOLERANCE = 4e-3
FORMATS = ("compressed-tensors", "modelslim-w8a8", "modelslim-w8a8-dynamic", "awq", "int8")
AGREEMENT = {"compressed-tensors": 0.95, "modelslim-w8a8": 0.95, "modelslim-w8a8-dynamic": 0.95, "awq": 0.90,
             "int8": 0.95}


def corpus_ids(n: int = 6) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    texts = [" ".join(ENGLISH[i::n]) for i in range(n // 2)] + ["".join(CHINESE[i::n]) for i in range(n // 2)]
    return [tok(t, add_special_tokens=False).input_ids[:160] for t in texts]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    src = bundled_model_path()
    d = tmp_path_factory.mktemp("quant")
    ranges = calibrate_input_ranges(src, corpus_ids())
    return {"compressed-tensors": (str(write_compressed_tensors(src, d / "ct")), None),
            "modelslim-w8a8": (str(write_modelslim(src, d / "ms", dynamic=False, input_ranges=ranges)), None),
            "modelslim-w8a8-dynamic": (str(write_modelslim(src, d / "msd", dynamic=True)), None),
            "awq": (str(write_awq(src, d / "awq", group_size=64)), None),
            "int8": (src, "int8")}


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    c = model.config
    cache = KVCache(num_layers=c.num_hidden_layers, num_blocks=-(-len(ids) // BS), block_size=BS,
                    num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=model.dtype)
    attn = build_metadata([SequenceRows(0, len(ids), list(range(-(-len(ids) // BS))))], num_decode=0, block_size=BS)
    with torch.inference_mode():
        hidden = torch.empty(len(ids), c.hidden_size, dtype=model.dtype)
        model.embed(torch.tensor(ids), out=hidden)
        out = model(hidden, torch.arange(len(ids)), cache, attn)
        return model.compute_logits(out, out=torch.empty(len(ids), c.vocab_size))


def fake_quant_hf(path: str, fmt: str):
    """HF's Qwen3 with each decoder projection computing the format's arithmetic from the float
    weights by the format's rules (dequantized weights; activations rounded as the format does),
    independently of raylm's loader."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.float32).eval()
    tensors = load_file(f"{path}/model.safetensors")
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] not in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"):
            continue
        if fmt == "awq":
            from tests.workers.quant_checkpoints import AWQ_ORDER
            qw, qz, s = tensors[name + ".qweight"], tensors[name + ".qzeros"], tensors[name + ".scales"].float()

            def unpack(p):
                cols = [None] * 8
                for nibble, col in enumerate(AWQ_ORDER):
                    cols[col] = (p >> (4 * nibble)) & 0xF
                return torch.stack(cols, dim=-1).reshape(p.shape[0], -1).float()
            q, z = unpack(qw), unpack(qz)  # [in, out], [in / g, out]
            g = q.shape[0] // z.shape[0]
            module.weight.data = ((q - z.repeat_interleave(g, 0)) * s.repeat_interleave(g, 0)).t().contiguous()
            continue
        if fmt == "int8":
            q, scale = quantize_int8(module.weight.data).qweight, None
        else:
            q = tensors[name + ".weight"]
        scale = (module.weight.data.abs().amax(1, keepdim=True) / 127) if fmt == "int8" else \
            tensors[name + ".weight_scale"].float()
        module.weight.data = q.float() * scale
        if fmt == "modelslim-w8a8":
            s, o = tensors[name + ".input_scale"].item(), tensors[name + ".input_offset"].item()
            module.register_forward_pre_hook(
                lambda _, args, s=s, o=o: ((torch.round(args[0] / s + o).clamp(-128, 127) - o) * s,))
        else:  # per token, symmetric
            def per_token(_, args):
                sx = args[0].abs().amax(-1, keepdim=True) / 127
                return (torch.round(args[0] / sx).clamp(-128, 127) * sx,)
            module.register_forward_pre_hook(per_token)
    return hf


@pytest.mark.parametrize("fmt", FORMATS)
def test_loaded_logits_equal_the_formats_arithmetic(checkpoints, fmt):
    path, quantization = checkpoints[fmt]
    model = load_model(path, quantization=quantization)
    hf = fake_quant_hf(path, fmt)
    ids = corpus_ids()[0][:64]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    got = forward_logits(model, ids)
    print(f"{fmt}: max |logits - expected| {(got - expected).abs().max().item():.2e}, max |logit| "
          f"{expected.abs().max().item():.1f}")
    torch.testing.assert_close(got, expected, atol=TOLERANCE * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_teacher_forced_top1_agreement_with_fp32(checkpoints, fmt):
    path, quantization = checkpoints[fmt]
    fp32 = load_model(bundled_model_path())
    quantized = load_model(path, quantization=quantization)
    quantized.prepare(get_op_table("cpu", "cpu"))
    same = total = 0
    for ids in corpus_ids():
        a, b = forward_logits(fp32, ids).argmax(-1), forward_logits(quantized, ids).argmax(-1)
        same, total = same + int((a == b).sum()), total + len(ids)
    print(f"{fmt}: teacher-forced top-1 agreement with fp32 {same}/{total} = {same / total:.3f}")
    assert same / total >= AGREEMENT[fmt]


def _weights(scheme: str, out: int, inp: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if scheme == "w4a16":
        return Int4Weight(torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8),
                          torch.rand(out, inp // 64, generator=g) * 0.02 + 0.001,
                          torch.randint(0, 16, (out, inp // 64), generator=g, dtype=torch.uint8), 64)
    w = quantize_int8(torch.randn(out, inp, generator=g))
    if scheme == "w8a8-static":
        w.dynamic, w.input_scale, w.input_offset = False, 0.05, -3
        w.quant_bias = torch.randint(-5000, 5000, (out,), generator=g, dtype=torch.int32)
        w.deq_scale = w.scale * w.input_scale
    return w


@pytest.mark.parametrize("scheme", ["w8a8-dynamic", "w8a8-static", "w4a16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["measured", "forced-a", "forced-b", "forced-c", "forced-d", "torch-elementwise"])
def test_cpu_quantized_linear_equals_the_reference(monkeypatch, scheme, dtype, path):
    """Each CPU path (forced through its switch, or as measured; activations quantized by the fused
    kernels or by torch's ops) against the reference arithmetic on seeded batches of 1-70 rows,
    fused weights and a bias included. A forced int8 kernel whose sums saturate on this CPU (oneDNN's
    without VNNI) is refused with an error instead of computing other numbers."""
    from workers.ops.cpu_quant import has_amx_int8, has_avx2_int8, saturates

    forced = {"forced-a": ("onednn-int8", "64"), "forced-b": ("int-mm", "0"), "forced-c": ("avx2-int8", "64"),
              "forced-d": ("amx-int8", "64")}.get(path)
    if path == "forced-c" and (scheme == "w4a16" or not has_avx2_int8()):
        pytest.skip("the AVX2 int8 kernel serves W8A8 where raylm's kernels built with AVX2")
    if path == "forced-d" and (scheme == "w4a16" or not has_amx_int8()):
        pytest.skip("the AMX-INT8 kernel serves W8A8 where the CPU has AMX-INT8")
    if path == "torch-elementwise":
        monkeypatch.setenv("RAYLM_CPU_ELEMENTWISE", "eager")
    if forced:
        monkeypatch.setenv("RAYLM_CPU_INT8_GEMM", forced[0])
        monkeypatch.setenv("RAYLM_CPU_INT4_ROWS", forced[1])
    ops = get_op_table("cpu", "cpu")
    w = fuse([_weights(scheme, 96, 256, 1), _weights(scheme, 64, 256, 2)])
    if scheme == "w8a8-static":
        w = fuse([_weights(scheme, 96, 256, 1), _weights(scheme, 64, 256, 1)])
    bias = torch.randn(160).to(dtype)
    if forced and scheme != "w4a16" and saturates(forced[0]):
        with pytest.raises(RuntimeError, match=f"RAYLM_CPU_INT8_GEMM={forced[0]}: .* not exact on this CPU"):
            ops.prepare_quantized_linear(w, bias, dtype=dtype)
        return
    handle = ops.prepare_quantized_linear(w, bias, dtype=dtype)
    for rows in (1, 3, 16, 70):
        x = (torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
        got = ops.linear(x, handle)
        want = reference_linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (rows, 160)
        tol = 2e-5 if dtype == torch.float32 and scheme != "w4a16" else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)
    assert ops.describe()["quantized"].startswith(scheme)


@pytest.mark.parametrize("scheme,env", [
    ("w4a16", {"RAYLM_CPU_INT4_ROWS": "64"}), ("w4a16", {"RAYLM_CPU_INT4_ROWS": "0"}),
    ("w8a8-dynamic", {"RAYLM_CPU_INT8_GEMM": "onednn-int8"}), ("w8a8-static", {"RAYLM_CPU_INT8_GEMM": "onednn-int8"}),
    ("w8a8-dynamic", {"RAYLM_CPU_INT8_GEMM": "amx-int8"}), ("w8a8-static", {"RAYLM_CPU_INT8_GEMM": "amx-int8"})])
def test_a_prepared_linear_lets_the_values_it_repacked_go(monkeypatch, scheme, env):
    """Where the CPU table holds its own packing of the values, nothing it prepared (handle or the
    closures it runs) keeps the weight's original tensor alive; the handle still computes the format."""
    import gc
    import weakref

    from workers.ops.cpu_quant import has_amx_int8, has_onednn_int8, saturates

    if env.get("RAYLM_CPU_INT8_GEMM") == "onednn-int8" and (not has_onednn_int8() or saturates("onednn-int8")):
        pytest.skip("this torch has no oneDNN int8 inner product, or its sums saturate on this CPU")
    if env.get("RAYLM_CPU_INT8_GEMM") == "amx-int8" and not has_amx_int8():
        pytest.skip("this CPU has no AMX-INT8")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    w = _weights(scheme, 64, 256, 1)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    want = reference_linear(x, w)
    values = weakref.ref(w.qweight)
    handle = get_op_table("cpu", "cpu").prepare_quantized_linear(w, None, dtype=torch.float32)
    del w
    gc.collect()
    assert values() is None
    torch.testing.assert_close(handle(x), want, atol=2e-5 * want.abs().max().item(), rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_activation_quantization_is_the_references_bit_for_bit(dtype):
    """The fused kernels quantize (per token, and by a static scale) and finish the sums exactly as
    the reference's torch ops: halves that round to even, all-zero rows, values past the int8 range
    of a static scale, strided rows."""
    from workers.ops import cpu_kernels
    from workers.quant.weights import quantize_rows, quantize_static

    k = cpu_kernels.load()
    if k is None:
        pytest.skip(f"kernels not built: {cpu_kernels.failure()}")
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 300, generator=g) * 3).to(dtype)
    x[1] = 0
    x[2, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: the halves land on ties
    x[2, 4:] = 0
    x = torch.cat([x, x], dim=1)[:, :300] if dtype == torch.float32 else x  # fp32: rows 600 apart
    xq, sx = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[0])
    k.quant_rows_int8(xq, sx, x)
    want_q, want_s = quantize_rows(x)
    assert torch.equal(xq, want_q) and torch.equal(sx, want_s)
    static = Int8Weight(torch.zeros(1, 1, dtype=torch.int8), torch.ones(1), dynamic=False, input_scale=0.0125,
                        input_offset=-7)
    k.quant_static_int8(xq, x, static.input_scale, float(static.input_offset))
    assert torch.equal(xq, quantize_static(x, static))
    acc, bias = torch.randn(37, 50, generator=g) * 1e3, torch.randn(50, generator=g)
    out = torch.empty(acc.shape, dtype=dtype)
    k.scale_rows(out, acc, sx, None)
    assert torch.equal(out, acc.mul(sx[:, None]).to(dtype))
    k.scale_rows(out, acc, None, bias)
    assert torch.equal(out, acc.add(bias).to(dtype))


def test_reference_arithmetic_by_hand():
    """Each scheme's reference on a 1x2 case worked by hand."""
    x = torch.tensor([[1.0, -0.5]])
    w8 = Int8Weight(torch.tensor([[127, -64]], dtype=torch.int8), torch.tensor([0.01]))
    # x_q = round(x / (1 / 127)) = [127, -64] (-63.5 rounds to even); sums 127*127 + 64*64 = 20225
    torch.testing.assert_close(reference_linear(x, w8), torch.tensor([[20225 * (1 / 127) * 0.01]]))
    static = Int8Weight(w8.qweight, w8.scale, dynamic=False, input_scale=0.5, input_offset=1,
                        quant_bias=torch.tensor([-3], dtype=torch.int32), deq_scale=torch.tensor([0.25]))
    # x_q = round([2, -1] + 1) = [3, 0]; (3 * 127 + 0 - 3) * 0.25
    torch.testing.assert_close(reference_linear(x, static), torch.tensor([[378 * 0.25]]))
    w4 = Int4Weight(torch.tensor([[15, 0]], dtype=torch.uint8), torch.tensor([[0.5]]),
                    torch.tensor([[8]], dtype=torch.uint8), 2)
    # w = ([15, 0] - 8) * 0.5 = [3.5, -4]
    torch.testing.assert_close(reference_linear(x, w4), torch.tensor([[3.5 + 2.0]]))


def _config_with(tmp_path, quantization_config) -> str:
    d = tmp_path / "ckpt"
    shutil.copytree(bundled_model_path(), d)
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"] = quantization_config
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


CT = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
      "config_groups": {"g": {"targets": ["Linear"],
                              "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                              "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                    "strategy": "token", "dynamic": True}}}}


def _ct(**patch) -> dict:
    qc = json.loads(json.dumps(CT))
    for path, value in patch.items():
        node = qc
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return qc


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "fp8"}, "quant_method 'fp8'"),
    (_ct(format="float-quantized"), "format"),
    (_ct(config_groups__g__input_activations__dynamic=False), "input_activations.dynamic"),
    (_ct(config_groups__g__weights__strategy="group"), "weights.strategy"),
    (_ct(config_groups__g__weights__num_bits=4), "weights.num_bits"),
    (_ct(config_groups__g__input_activations=None), "input_activations"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": -1}, "group_size"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ("int8", "must be an object"),
])
def test_unsupported_or_malformed_configs_are_named(tmp_path, qc, named):
    path = _config_with(tmp_path, qc)
    with pytest.raises(QuantConfigError, match=named):
        load_model(path)


def test_a_quantized_lm_head_is_refused(tmp_path):
    with pytest.raises(QuantConfigError, match="lm_head"):
        load_model(_config_with(tmp_path, _ct(ignore=[])))


def test_modelslim_descriptions_are_checked(tmp_path, checkpoints):
    d = tmp_path / "ms"
    shutil.copytree(checkpoints["modelslim-w8a8-dynamic"][0], d)
    desc = json.loads((d / "quant_model_description.json").read_text())
    (d / "quant_model_description.json").write_text(json.dumps({**desc, "model_quant_type": "W4A8_DYNAMIC"}))
    with pytest.raises(QuantConfigError, match="W4A8_DYNAMIC"):
        load_model(str(d))
    del desc["model.layers.0.self_attn.q_proj.weight"]
    (d / "quant_model_description.json").write_text(json.dumps(desc))
    with pytest.raises(QuantConfigError, match="q_proj.weight"):
        load_model(str(d))


def test_what_the_user_asks_for_must_match_the_checkpoint(checkpoints):
    with pytest.raises(QuantConfigError, match="already quantized"):
        load_quant_config(checkpoints["awq"][0], "int8")
    with pytest.raises(QuantConfigError, match="not quantized"):
        load_quant_config(bundled_model_path(), "awq")
    with pytest.raises(QuantConfigError, match="is awq quantized"):
        load_quant_config(checkpoints["awq"][0], "compressed-tensors")
    with pytest.raises(QuantConfigError, match="quantization must be one of"):
        load_quant_config(bundled_model_path(), "gptq")
    assert load_quant_config(checkpoints["modelslim-w8a8"][0], "ascend").scheme == "w8a8-static"


def test_nonzero_zero_points_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    d = write_compressed_tensors(bundled_model_path(), tmp_path / "ct", zero_points=True)
    assert load_model(str(d)).quant.method == "compressed-tensors"  # all-zero points: symmetric, loaded
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight_zero_point"][3] = 2
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.weight_zero_point is not all zeros"):
        load_model(str(d))


def bytes_saved(quantized: str) -> tuple[int, int]:
    """(the weight bytes the tiny model's checkpoint `quantized` holds less than the fp32 one, the fp32
    decoder linears' bytes), both prepared by the CPU table with their originals released."""
    fp32 = load_model(bundled_model_path())
    linears = sum(p.nbytes for n, p in fp32.named_parameters() if n.endswith("proj.weight"))
    fp32.prepare(get_op_table("cpu", "cpu"), release=True)
    model = load_model(quantized)
    model.prepare(get_op_table("cpu", "cpu"), release=True)
    return fp32.weight_bytes() - model.weight_bytes(), linears


@pytest.mark.parametrize("path", ["onednn-int8", "int-mm", "avx2-int8", "amx-int8"])
def test_quantized_weights_are_held_at_their_width(checkpoints, monkeypatch, path):
    """int8 decoder linears hold a quarter of fp32's bytes (scales aside), whichever kernel runs them
    (a packed copy replaces the int8 values, not joins them): both prepared by the CPU table,
    whatever it keeps for the (full-precision) lm_head is the same in both."""
    from workers.ops.cpu_quant import has_amx_int8, has_avx2_int8, has_onednn_int8, saturates

    if path == "amx-int8" and not has_amx_int8():
        pytest.skip("this CPU has no AMX-INT8")

    if path == "onednn-int8" and (not has_onednn_int8() or saturates(path)):
        pytest.skip("this torch has no oneDNN int8 inner product, or its sums saturate on this CPU")
    if path == "avx2-int8" and not has_avx2_int8():
        pytest.skip("raylm's CPU kernels were not built with AVX2 here")
    monkeypatch.setenv("RAYLM_CPU_INT8_GEMM", path)
    saved, linears = bytes_saved(checkpoints["compressed-tensors"][0])
    assert saved >= 0.73 * linears


@pytest.mark.parametrize("int4_rows", ["0", "64"])
def test_awq_weights_are_held_at_four_bits(checkpoints, monkeypatch, int4_rows):
    """AWQ linears hold half a byte a weight, plus torch's own int4 packing where its kernel runs
    (with its fp32 scales and zeros, about 0.3 of fp32's bytes in all), never the unpacked values."""
    monkeypatch.setenv("RAYLM_CPU_INT4_ROWS", int4_rows)
    saved, linears = bytes_saved(checkpoints["awq"][0])
    assert saved >= (0.84 if int4_rows == "0" else 0.68) * linears


def test_exported_w8a8_is_the_formats_checkpoint(tmp_path):
    """`raylm quantize` writes what the format's own rules give (the independent writer) for an fp32
    checkpoint, and for a bf16 one int8 values that are the nearest to what the stored scale
    dequantizes; the copy loads as compressed-tensors W8A8."""
    from safetensors.torch import load_file

    from cluster.cli import main as cli
    from workers.loader import load_config
    from workers.quant.export import export_w8a8

    src = bundled_model_path()
    assert cli(["quantize", src, str(tmp_path / "ours")]) == 0
    theirs = load_file(write_compressed_tensors(src, tmp_path / "theirs") / "model.safetensors")
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name
    model = load_model(str(tmp_path / "ours"))
    assert model.quant.describe() == {"method": "compressed-tensors", "scheme": "w8a8-dynamic"}
    assert load_config(str(tmp_path / "ours")) == load_config(src)

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    export_w8a8(tmp_path / "bf16", tmp_path / "bf16-w8a8")
    floats, quant = load_file(tmp_path / "bf16" / "model.safetensors"), \
        load_file(tmp_path / "bf16-w8a8" / "model.safetensors")
    w = floats["model.layers.0.mlp.down_proj.weight"]
    q, scale = quant["model.layers.0.mlp.down_proj.weight"], quant["model.layers.0.mlp.down_proj.weight_scale"]
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (w.shape[0], 1)
    assert torch.equal(q, torch.round(w.float() / scale.float()).clamp(-128, 127).to(torch.int8))
    assert torch.equal(quant["lm_head.weight"] if "lm_head.weight" in quant else quant["model.embed_tokens.weight"],
                       floats["lm_head.weight"] if "lm_head.weight" in floats else floats["model.embed_tokens.weight"])


def test_quantize_refuses_what_it_cannot_write(tmp_path, checkpoints, capsys):
    from cluster.cli import main as cli

    assert cli(["quantize", str(tmp_path / "nothing"), str(tmp_path / "a")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert cli(["quantize", checkpoints["awq"][0], str(tmp_path / "b")]) == 2
    assert "quant_method='awq'" in capsys.readouterr().err
    assert cli(["quantize", bundled_model_path(), checkpoints["awq"][0]]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["engine", "stacked"])
def test_a_moe_checkpoint_exports_its_experts_quantized_and_its_router_in_full_precision(tmp_path, layout):
    """`raylm quantize` on Qwen3-MoE quantizes attention's projections and every expert (under Qwen's
    per-expert names, whether the source stores experts per expert or stacked), leaves the router as
    it was (named in `ignore`), and the copy loads with int8 experts."""
    from safetensors.torch import load_file

    from tests.workers.moe_checkpoints import write_checkpoint
    from workers.quant.export import export_w8a8

    src = write_checkpoint(layout, tmp_path / "moe")
    export_w8a8(src, tmp_path / "w8a8")
    floats, quant = load_file(f"{src}/model.safetensors"), load_file(tmp_path / "w8a8" / "model.safetensors")
    routers = [n for n in floats if n.endswith("mlp.gate.weight")]
    assert routers and all(torch.equal(quant[n], floats[n]) for n in routers)
    assert quant["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    whole = load_model(src)
    model = load_model(str(tmp_path / "w8a8"))
    assert model.quant.describe() == {"method": "compressed-tensors", "scheme": "w8a8-dynamic"}
    for (name, a), (_, b) in zip(whole.named_modules(), model.named_modules()):
        if name.endswith("mlp.experts"):
            for proj in ("gate_up_proj", "down_proj"):
                q, scale, w = getattr(b, proj), getattr(b, proj + "_scale"), getattr(a, proj)
                assert q.dtype == torch.int8 and q.shape == w.shape
                assert (q.float() * scale[..., None] - w.float()).abs().max() <= scale.max() * 0.51
