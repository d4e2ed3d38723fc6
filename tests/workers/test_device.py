"""device.py: kinds, lazy torch_npu, memory and KV sizing, collective and Ray names."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from workers import device as dev

HAS_CUDA = torch.cuda.is_available()
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None  # found, never imported here


def test_cpu_device_and_unknown_kinds():
    assert dev.torch_device("cpu") == torch.device("cpu")
    assert dev.torch_device("cpu", 3) == torch.device("cpu")
    for bad in ("tpu", "CUDA", "", "gpu"):
        with pytest.raises(ValueError, match=repr(bad)):
            dev.torch_device(bad)
        for fn in (dev.dist_backend, dev.ray_resource_key, dev.visible_devices_env):
            with pytest.raises(ValueError, match=repr(bad)):
                fn(bad)
    with pytest.raises(ValueError, match="index"):
        dev.torch_device("cpu", -1)


def test_names_per_kind():
    assert [dev.dist_backend(k) for k in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    assert [dev.ray_resource_key(k) for k in ("cpu", "cuda", "npu")] == [None, "GPU", "NPU"]
    assert [dev.visible_devices_env(k) for k in ("cpu", "cuda", "npu")] == [
        None, "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"]


def test_cuda_absent_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(dev.DeviceUnavailableError, match="CUDA is not available"):
        dev.torch_device("cuda")


def test_cpu_paths_never_import_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # any import of it now raises ImportError
    cpu = dev.torch_device("cpu")
    dev.synchronize(cpu)
    dev.memory_info(cpu)
    dev.num_kv_blocks(cpu, bytes_per_block=1024, memory_fraction=0.9, cpu_blocks=4)
    for kind in dev.KINDS:
        dev.dist_backend(kind), dev.ray_resource_key(kind), dev.visible_devices_env(kind)
    with pytest.raises(dev.DeviceUnavailableError, match="torch-npu"):
        dev.torch_device("npu")


def test_cpu_memory_info_is_sane():
    free, total = dev.memory_info(torch.device("cpu"))
    assert 0 < free <= total


def test_kv_blocks_on_the_cpu_come_from_the_block_count():
    cpu = torch.device("cpu")
    assert dev.num_kv_blocks(cpu, bytes_per_block=4096, memory_fraction=0.5, cpu_blocks=37) == 37
    for bad in (None, 0, -3, 2.5):
        with pytest.raises(ValueError, match="cpu_blocks"):
            dev.num_kv_blocks(cpu, bytes_per_block=4096, memory_fraction=0.5, cpu_blocks=bad)
    free, _ = dev.memory_info(cpu)
    with pytest.raises(ValueError, match="available"):
        dev.num_kv_blocks(cpu, bytes_per_block=free, memory_fraction=0.5, cpu_blocks=2)
    with pytest.raises(ValueError, match="bytes_per_block"):
        dev.num_kv_blocks(cpu, bytes_per_block=0, memory_fraction=0.5, cpu_blocks=2)


def test_the_default_cpu_pool_fits_every_slot_at_full_length_within_its_budget():
    per_seq = 256  # 4,096 tokens in blocks of 16
    small = 32 * 1024  # bytes per block of a tiny model: every slot fits
    assert dev.default_cpu_blocks(small, max_num_seqs=64, blocks_per_seq=per_seq) == 64 * per_seq
    big = 4 << 20  # a block of a large model: the byte budget caps it, the floor holds
    assert dev.default_cpu_blocks(big, max_num_seqs=64, blocks_per_seq=per_seq) == dev.CPU_MIN_BLOCKS
    mid = dev.CPU_KV_BYTES // 1000
    assert dev.default_cpu_blocks(mid, max_num_seqs=64, blocks_per_seq=per_seq) == dev.CPU_KV_BYTES // mid
    assert dev.default_cpu_blocks(small, max_num_seqs=1, blocks_per_seq=1) == 2  # never below two


def test_kv_blocks_on_an_accelerator_come_from_the_memory_fraction(monkeypatch):
    total, free, per_block = 80 * 2**30, 60 * 2**30, 2**20
    monkeypatch.setattr(dev, "memory_info", lambda device: (free, total))
    cuda = torch.device("cuda", 0)  # only the device's type matters here; nothing runs on it
    for fraction in (0.9, 0.5, 1.0):
        budget = int(total * fraction) - (total - free)
        assert dev.num_kv_blocks(cuda, bytes_per_block=per_block, memory_fraction=fraction,
                                 cpu_blocks=7) == budget // per_block
    with pytest.raises(ValueError, match="no memory left"):
        dev.num_kv_blocks(cuda, bytes_per_block=per_block, memory_fraction=0.2, cpu_blocks=None)
    for bad in (0, 1.5, -0.1, None):
        with pytest.raises(ValueError, match="memory_fraction"):
            dev.num_kv_blocks(cuda, bytes_per_block=per_block, memory_fraction=bad, cpu_blocks=None)


def test_set_cpu_threads():
    before = torch.get_num_threads()
    try:
        dev.set_cpu_threads(1)
        assert torch.get_num_threads() == 1
        dev.set_cpu_threads(None)
        assert torch.get_num_threads() >= 1
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="threads"):
                dev.set_cpu_threads(bad)
    finally:
        torch.set_num_threads(before)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_device_sync_and_memory():
    cuda = dev.torch_device("cuda")
    assert cuda == torch.device("cuda", 0)
    torch.ones(4, device=cuda).sum()
    dev.synchronize(cuda)
    free, total = dev.memory_info(cuda)
    assert 0 < free <= total
    with pytest.raises(ValueError, match="out of range"):
        dev.torch_device("cuda", torch.cuda.device_count())


@pytest.mark.npu
@pytest.mark.skipif(not HAS_TORCH_NPU, reason="torch-npu is not installed")
def test_npu_device_sync_and_memory():
    npu = dev.torch_device("npu")
    assert npu.type == "npu" and npu.index == 0
    dev.synchronize(npu)
    free, total = dev.memory_info(npu)
    assert 0 < free <= total


def test_compute_dtype_upcasts_half_weights_only_on_a_cpu_without_half_matmuls():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert dev.compute_dtype(cpu, bf16, native_half=False) == fp32
    assert dev.compute_dtype(cpu, fp16, native_half=False) == fp32
    assert dev.compute_dtype(cpu, bf16, native_half=True) == bf16
    assert dev.compute_dtype(cpu, fp32, native_half=False) == fp32
    assert dev.compute_dtype(cuda, bf16) == bf16  # accelerators compute in the weights' dtype
    assert dev.compute_dtype(cpu, bf16, requested=bf16, native_half=False) == bf16  # asked for: honored
    assert dev.compute_dtype(cpu, fp32, requested=fp16) == fp16


def test_native_half_matmul_follows_the_cpu_features(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not dev.native_half_matmul(torch.device("cpu"))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert dev.native_half_matmul(torch.device("cpu"))
    assert dev.native_half_matmul(torch.device("cuda"))


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 1 << 20)], ids=["small", "huge-pages"])
def test_host_zeros_are_zeros_of_the_shape_and_dtype_asked(shape):
    t = dev.host_zeros(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert not t.any()
    t.fill_(1.5)  # the pages are the tensor's to write
    assert t.float().sum() == 1.5 * t.numel()
