"""A plain-torch emulation of the two FlashInfer wrappers raylm's CUDA table uses.

From FlashInfer's documented semantics: "NHD" paged caches [pages, page_size, KVH, D], a
CSR page table (kv_indptr [B + 1], page indices, last_page_len in [1, page_size], all
int32), qo_indptr for prefill, causal masks aligned bottom right, fp16/bf16 only. With
use_cuda_graph the wrapper owns fixed buffers: plan() copies into them, the batch size
cannot change, and run() reads the buffers (so a missing re-plan shows). `install` puts
it in sys.modules["flashinfer"] for one test.
"""

from __future__ import annotations

import sys
import types

import torch

HALF = (torch.float16, torch.bfloat16)


class EmulationError(RuntimeError):
    pass


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise EmulationError(message)


def _i32(t, name, n=None):
    _need(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1, f"{name} must be 1-D int32")
    if n is not None:
        _need(t.shape[0] == n, f"{name} must have {n} entries, got {t.shape[0]}")


class _Wrapper:
    decode = True

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None):
        _need(kv_layout == "NHD", f"only the NHD layout is emulated, got {kv_layout!r}")
        _need(workspace.dtype == torch.uint8, "the float workspace is a uint8 buffer")
        self.graph = use_cuda_graph
        self.bufs = (paged_kv_indptr_buffer if paged_kv_indptr_buffer is not None else paged_kv_indptr_buf,
                     paged_kv_indices_buffer if paged_kv_indices_buffer is not None else paged_kv_indices_buf,
                     paged_kv_last_page_len_buffer if paged_kv_last_page_len_buffer is not None
                     else paged_kv_last_page_len_buf)
        if use_cuda_graph:
            _need(all(b is not None for b in self.bufs),
                  "use_cuda_graph needs the indptr/indices/last_page_len buffers")
        self.plan_args = None
        self.plans = 0

    def _plan(self, qo_indptr, indptr, indices, last, heads, kv_heads, dim, page_size, causal, sm_scale,
              q_data_type, kv_data_type):
        b = last.shape[0] if isinstance(last, torch.Tensor) else -1
        _i32(indptr, "kv_indptr", b + 1)
        _i32(last, "last_page_len", b)
        _i32(indices, "kv_indices", int(indptr[-1]))
        _need(bool((last >= 1).all() and (last <= page_size).all()), "last_page_len must be in [1, page_size]")
        _need(heads % kv_heads == 0, "num_qo_heads must be a multiple of num_kv_heads")
        _need(q_data_type in HALF, f"q_data_type must be float16/bfloat16, got {q_data_type}")
        if qo_indptr is not None:
            _i32(qo_indptr, "qo_indptr", b + 1)
        if self.graph:
            ip, ix, lp = self.bufs
            _need(ip.shape[0] == b + 1, f"a CUDA-graph wrapper's batch size is fixed at {ip.shape[0] - 1}, got {b}")
            _need(ix.shape[0] >= indices.shape[0], "more page indices than the indices buffer holds")
            ip.copy_(indptr)
            ix[:indices.shape[0]].copy_(indices)
            lp.copy_(last)
            indptr, indices, last = ip, ix, lp  # run() reads the buffers
        self.plan_args = dict(qo=qo_indptr, indptr=indptr, indices=indices, last=last, heads=heads,
                              kv_heads=kv_heads, dim=dim, page_size=page_size, causal=causal,
                              scale=dim ** -0.5 if sm_scale is None else sm_scale, q_dtype=q_data_type,
                              kv_dtype=kv_data_type or q_data_type)
        self.plans += 1

    def run(self, q, paged_kv_cache, out=None):
        p = self.plan_args
        _need(p is not None, "run() before plan()")
        k_cache, v_cache = paged_kv_cache
        _need(q.dtype == p["q_dtype"] and k_cache.dtype == p["kv_dtype"], "dtypes differ from the plan's")
        _need(q.dim() == 3 and q.shape[1:] == (p["heads"], p["dim"]), f"q must be [T, {p['heads']}, {p['dim']}]")
        _need(k_cache.dim() == 4 and k_cache.shape[1:] == (p["page_size"], p["kv_heads"], p["dim"]),
              f"NHD cache must be [pages, {p['page_size']}, {p['kv_heads']}, {p['dim']}], got {tuple(k_cache.shape)}")
        indptr, indices, last = p["indptr"].tolist(), p["indices"], p["last"].tolist()
        b = len(last)
        qo = list(range(b + 1)) if p["qo"] is None else p["qo"].tolist()
        _need(qo[-1] == q.shape[0], f"the plan covers {qo[-1]} query rows, q has {q.shape[0]}")
        o = torch.empty_like(q)
        group = p["heads"] // p["kv_heads"]
        for i in range(b):
            pages = indices[indptr[i]:indptr[i + 1]].long()
            kv_len = (len(pages) - 1) * p["page_size"] + last[i]
            keys = k_cache[pages].flatten(0, 1)[:kv_len].float().repeat_interleave(group, 1)
            vals = v_cache[pages].flatten(0, 1)[:kv_len].float().repeat_interleave(group, 1)
            qs = q[qo[i]:qo[i + 1]].float()
            n = qs.shape[0]
            s = torch.einsum("qhd,khd->hqk", qs, keys) * p["scale"]
            if p["causal"] or self.decode:
                allowed = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
                s = s.masked_fill(~allowed[None], float("-inf"))
            o[qo[i]:qo[i + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vals).to(q.dtype)
        if out is not None:
            out.copy_(o)
            return out
        return o


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", q_data_type="float16", kv_data_type=None, sm_scale=None, **rest):
        _need(not rest, f"unemulated plan arguments {sorted(rest)}")
        _need(pos_encoding_mode == "NONE", "only pos_encoding_mode NONE is emulated")
        self._plan(None, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                   False, sm_scale, q_data_type, kv_data_type)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    decode = False

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None, **rest):
        _need(not rest, f"unemulated plan arguments {sorted(rest)}")
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                   num_kv_heads, head_dim_qk, page_size, causal, sm_scale, q_data_type, kv_data_type)


def install(monkeypatch) -> types.ModuleType:
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    mod.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    return mod


def uninstall(monkeypatch) -> None:
    """Make `import flashinfer` fail, as where the extra is not installed."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)
