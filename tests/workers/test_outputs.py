"""ResidentOutputs, the RAYLM_DEVICE_OUTPUTS switch, and host-mode logits on the wire."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from scheduler.protocol import StepResult, sampled_on_device
from workers.resident import ResidentOutputs, bucket
from workers.runner_config import ENV_DEVICE_OUTPUTS, device_outputs_enabled
from workers.sampling.logits_codec import encode_logits, logits_tensor

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device")]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_same_key_returns_the_same_buffer_allocated_once(device):
    out = ResidentOutputs(torch.device(device))
    logits = out.get("logits", (8, 100), torch.float32)
    assert logits.device.type == torch.device(device).type
    assert logits.shape == (8, 100) and logits.dtype == torch.float32
    for _ in range(5):
        assert out.get("logits", (8, 100), torch.float32) is logits
        assert out.get("logits", torch.Size([8, 100]), torch.float32) is logits
    assert out.num_allocations == 1
    others = [out.get("logits", (16, 100), torch.float32), out.get("logits", (8, 100), torch.bfloat16),
              out.get("next_hidden", (8, 100), torch.float32)]
    assert all(o is not logits for o in others)
    assert out.num_allocations == 4 and len(out) == 4
    assert out.nbytes == sum(t.numel() * t.element_size() for t in [logits, *others])


@pytest.mark.parametrize("device", DEVICES)
def test_get_rows_shares_one_bucketed_buffer_across_batch_sizes(device):
    out = ResidentOutputs(torch.device(device))
    views = {n: out.get_rows("next_hidden", n, (32,), torch.float32) for n in range(1, bucket(1) + 1)}
    assert out.num_allocations == 1
    assert {v.data_ptr() for v in views.values()} == {views[1].data_ptr()}
    assert all(v.shape == (n, 32) for n, v in views.items())
    out.get_rows("next_hidden", 3 * bucket(1), (32,), torch.float32)
    assert out.num_allocations == 2


def test_bucket_is_the_next_power_of_two_at_least_eight():
    sizes = list(range(0, 300)) + [1000, 4096, 4097]
    for n in sizes:
        b = bucket(n)
        assert b >= max(n, 8) and b & (b - 1) == 0
        assert b == 8 or b < 2 * n  # the smallest such power
    assert len({bucket(n) for n in range(1, 257)}) == 6  # 8, 16, ..., 256: the cache stays small
    for bad in (-1, 2.0, None, True):
        with pytest.raises(ValueError, match="batch size"):
            bucket(bad)


@pytest.mark.parametrize("device", DEVICES)
def test_close_frees_every_buffer(device):
    out = ResidentOutputs(torch.device(device))
    refs = [weakref.ref(out.get(name, (4, 4), torch.float32)) for name in ("logits", "next_hidden")]
    out.close()
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(out) == 0 and out.nbytes == 0
    again = out.get("logits", (4, 4), torch.float32)  # still usable: allocates afresh
    assert out.num_allocations == 3 and again.shape == (4, 4)
    with ResidentOutputs(torch.device(device)) as scoped:
        ref = weakref.ref(scoped.get("logits", (2, 2), torch.float32))
    gc.collect()
    assert ref() is None


def test_bad_keys_raise_value_errors():
    out = ResidentOutputs(torch.device("cpu"))
    for name, shape, dtype, match in [("", (1,), torch.float32, "name"), ("x", (-1, 2), torch.float32, "shape"),
                                      ("x", (2.0,), torch.float32, "shape"), ("x", 3, torch.float32, "shape"),
                                      ("x", (2,), "float32", "dtype")]:
        with pytest.raises(ValueError, match=match):
            out.get(name, shape, dtype)
    assert out.num_allocations == 0


def test_device_outputs_flag_and_environment(monkeypatch):
    monkeypatch.delenv(ENV_DEVICE_OUTPUTS, raising=False)
    assert device_outputs_enabled() is True
    for value, expected in [("1", True), ("0", False), ("true", True), ("false", False), ("FALSE", False)]:
        monkeypatch.setenv(ENV_DEVICE_OUTPUTS, value)
        assert device_outputs_enabled() is expected
    monkeypatch.setenv(ENV_DEVICE_OUTPUTS, "0")
    assert device_outputs_enabled(True) is True  # an explicit flag wins
    monkeypatch.setenv(ENV_DEVICE_OUTPUTS, "1")
    assert device_outputs_enabled(False) is False
    for bad in ("maybe", "", "2"):
        monkeypatch.setenv(ENV_DEVICE_OUTPUTS, bad)
        with pytest.raises(ValueError, match=f"{ENV_DEVICE_OUTPUTS}.*{bad!r}"):
            device_outputs_enabled()
    with pytest.raises(ValueError, match="device_outputs"):
        device_outputs_enabled("yes")


def test_device_sampled_result_gives_an_empty_cpu_placeholder():
    result = StepResult(step_id=3, slots=[0, 4, 5], token_ids=b"\0" * 12, logits_shape=(3, 0))
    for r in (result, StepResult.from_bytes(result.to_bytes())):
        assert sampled_on_device(r)
        placeholder = logits_tensor(r)
        assert placeholder.device == torch.device("cpu")
        assert placeholder.shape == (3, 0) and placeholder.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_mode_logits_decode_to_the_real_vocab(device, dtype):
    vocab, padded = 50, 64
    logits = torch.randn(5, padded, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    data, shape, name = encode_logits(logits, vocab_size=vocab)
    result = StepResult.from_bytes(StepResult(step_id=1, slots=list(range(5)), logits=data,
                                              logits_shape=shape, logits_dtype=name).to_bytes())
    assert not sampled_on_device(result)
    decoded = logits_tensor(result)
    assert decoded.shape == (5, vocab) and decoded.dtype == torch.float32 and decoded.device.type == "cpu"
    assert torch.equal(decoded, logits[:, :vocab].float().cpu())


def test_host_mode_errors_and_empty_rows():
    with pytest.raises(ValueError, match="2-D"):
        encode_logits(torch.zeros(3))
    with pytest.raises(ValueError, match="vocab_size"):
        encode_logits(torch.zeros(2, 4), vocab_size=5)
    with pytest.raises(ValueError, match="dtype"):
        encode_logits(torch.zeros(2, 4, dtype=torch.float64))
    data, shape, name = encode_logits(torch.zeros(0, 7))
    assert logits_tensor(StepResult(step_id=0, logits=data, logits_shape=shape, logits_dtype=name)).shape == (0, 7)
    with pytest.raises(ValueError, match="bytes"):
        logits_tensor(StepResult(step_id=0, logits=b"\0" * 8, logits_shape=(1, 3)))
    with pytest.raises(ValueError, match="logits_dtype"):
        logits_tensor(StepResult(step_id=0, logits=b"\0" * 8, logits_shape=(1, 1), logits_dtype="int8"))
