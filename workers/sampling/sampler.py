"""Sampling on the worker's device, for a batch that mixes policies row by row.

Penalties and logit_bias (workers/sampling/penalties.py) change a row's logits first, greedy rows'
too, then min_tokens bans. Rows are greedy (temperature 0) or random: temperature, then top-k, top-p and min-p (in
that order; top-p sees the top-k-renormalized distribution, min-p compares each token's
probability with the row's most likely one). Filters are value thresholds: ties at the
cut are kept. Random rows sample by an exponential race, argmax(probs / E) with
E ~ Exp(1) per token, computed as argmax(logits / T - log E) so no softmax is needed.
Only a row with top-p sorts, and on the CPU only when its nucleus is not within the top
TOP_P_CANDIDATES tokens; top-k uses topk.

On the CPU (fp32), where raylm's kernels are built, the draw itself is one pass per row
instead (`raylm::sample_rows`: inverse CDF of the softmax from one uniform per row, one exp
per token against the race's uniform and two logs); RAYLM_CPU_SAMPLER=torch keeps the race.

Randomness: unseeded rows share one batched draw from the Sampler's generator. A seeded
row draws its own noise from a generator seeded by a stable mix of (seed, position), so
its tokens do not depend on its batch companions, its row index, or preemption (the CPU
kernel takes the same mix as the row's key; unseeded rows' keys come from the generator).

Logprobs come from the model's raw distribution, log_softmax of the unmodified logits
(no penalties, temperature, filters or min_tokens ban). Nothing here copies to the host except
`row_logprobs` and `sample_host`; on accelerators `__call__` never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.protocol import RowLogprobs, StepResult, WorkerSampling
from workers.resident import ResidentOutputs
from workers.sampling.logits_codec import logits_tensor
from workers.sampling.penalties import apply_penalties
from workers.sampling.sampling_batch import SamplingBatch

TOP_P_CANDIDATES = 1024  # CPU: top-p first looks for the nucleus among this many tokens
SAMPLER_ENV = "RAYLM_CPU_SAMPLER"  # "fused" (default where the kernels build) or "torch"
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int32, on the logits' device
    sampled_logprobs: torch.Tensor | None = None  # [B] float32 (NaN in rows that did not ask)
    top_ids: torch.Tensor | None = None  # [B, n_max] int32 (-1 in rows that did not ask)
    top_logprobs: torch.Tensor | None = None  # [B, n_max] float32 (NaN in rows that did not ask)


def _fold(thr: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """thr[rows] = max(thr[rows], values); rows None means every row."""
    if rows is None:
        return torch.maximum(thr, values)
    return thr.index_copy(0, rows, torch.maximum(thr.index_select(0, rows), values))


def _subset(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def _nucleus_cut(vals: torch.Tensor, peak: torch.Tensor, total: torch.Tensor, top_p: torch.Tensor):
    """vals [P, n] a prefix of each row's scores sorted descending; peak [P, 1] the rows'
    max, total [P, 1] their sum of exp(score - peak) -> (cut [P], complete [P] bool: the
    prefix holds the whole nucleus). Only `total`'s rounding may vary with the batch (the
    reduction order), which can move the cut only where a prefix sum ties top_p to ~1e-7."""
    probs = (vals - peak).exp_().div_(total)
    cum = probs.cumsum(dim=-1)
    before = cum - probs  # mass of the strictly more likely tokens
    n_keep = (before < top_p[:, None]).sum(dim=-1).clamp(min=1)  # [P]
    return vals.gather(1, (n_keep - 1)[:, None]).squeeze(1), cum[:, -1] >= top_p


def cpu_sampling_kernels():
    """torch.ops.raylm when the CPU sampler draws with raylm's kernel (the default where it
    builds; RAYLM_CPU_SAMPLER=torch: the exponential race in torch ops), else None."""
    from workers.ops import cpu_kernels

    return cpu_kernels.load_unless(SAMPLER_ENV, "torch")


class Sampler:
    """Samples token ids on `device`; owns the generator for unseeded random rows.

    Its [rows, V] scratch (scaled scores, noise, banned logits; names "sampler_*") comes
    from `buffers` (bucketed, reused every step; a private ResidentOutputs when not given),
    so the per-step loop allocates only small tensors.
    """

    def __init__(self, device: torch.device, seed: int = 0, buffers: ResidentOutputs | None = None):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._row_generator = torch.Generator(device=self.device)  # reseeded for each seeded row
        self._owns_buffers = buffers is None
        self.buffers = ResidentOutputs(self.device) if buffers is None else buffers
        self._neg_inf = torch.full((), float("-inf"), device=self.device)
        # top-p candidates tried before a full sort; 0 always sorts (accelerators: sort is cheap
        # there, and the fallback's decision would sync the host)
        self.top_p_candidates = TOP_P_CANDIDATES if self.device.type == "cpu" else 0
        self.kernels = cpu_sampling_kernels() if self.device.type == "cpu" else None

    def _scratch(self, name: str, rows: int, vocab: int) -> torch.Tensor:
        return self.buffers.get_rows(f"sampler_{name}", rows, (vocab,), torch.float32)  # [rows, V]

    @torch.inference_mode()  # scratch is always created and updated the same way
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] (float32; not modified). Returns ids [B] int32 on logits.device."""
        if logits.dim() != 2 or logits.shape[0] != batch.size:
            raise ValueError(f"logits must be [{batch.size}, vocab], got shape {tuple(logits.shape)}")
        B, V = logits.shape
        if V == 0:
            raise ValueError("logits have an empty vocab dimension")
        if batch.max_banned_id >= V:
            raise ValueError(f"banned id {batch.max_banned_id} is outside the vocab of {V}")
        x = logits if logits.dtype == torch.float32 else logits.float()
        if batch.penalties is not None or batch.ban_rows is not None:  # on a copy: the caller's logits stay
            x = self._scratch("banned", B, V).copy_(x)
            if batch.penalties is not None:
                apply_penalties(x, batch.penalties)
            if batch.ban_rows is not None:
                x.index_put_((batch.ban_rows, batch.ban_ids), self._neg_inf)
        if batch.all_greedy:
            ids = x.argmax(dim=-1)  # [B]
        elif batch.num_random == B:
            ids = self._sample_random(x, None, batch)
        else:  # argmax over every row is one cheap pass; random rows then overwrite theirs
            ids = x.argmax(dim=-1).index_copy_(0, batch.random_idx, self._sample_random(x, batch.random_idx, batch))
        out = SamplerOutput(token_ids=ids.to(torch.int32))
        if batch.logprob_rows:
            self._logprobs(logits, ids, batch, out)
        return out

    def _sample_random(self, x: torch.Tensor, rows: torch.Tensor | None, b: SamplingBatch) -> torch.Tensor:
        """x [B, V] (not modified), rows [R] the random rows (None: all) -> ids [R] int64."""
        R, V = b.num_random, x.shape[1]
        scores = self._scratch("scores", R, V)  # [R, V]
        if rows is None:
            torch.div(x, b.temperature[:, None], out=scores)
        else:
            torch.index_select(x, 0, rows, out=scores).div_(b.temperature[:, None])
        thr = torch.full((R,), float("-inf"), device=x.device)  # [R] tokens below are filtered out
        if b.top_k is not None:
            k_max = min(b.top_k_max, V)
            top = _subset(scores, b.top_k_rows).topk(k_max, dim=-1).values  # [K, k_max], descending
            kth = top.gather(1, b.top_k.clamp(max=k_max)[:, None] - 1)  # [K, 1]
            thr = _fold(thr, b.top_k_rows, kth.squeeze(1))
        if b.top_p is not None:  # top-p sees the distribution after top-k
            if b.top_p_within_k:  # the top-k candidates hold each nucleus: no pass over V
                cand = _subset(top, b.top_p_k_idx)  # [P, k_max]
                cand = torch.where(cand >= _subset(kth, b.top_p_k_idx), cand, self._neg_inf)
                total = (cand - cand[:, :1]).exp().sum(dim=-1, keepdim=True)
                cut = _nucleus_cut(cand, cand[:, :1], total, b.top_p)[0]
            else:
                if b.top_k is not None:
                    self._filter(scores, thr)
                cut = self._top_p_cut(_subset(scores, b.top_p_rows), b.top_p)
            thr = _fold(thr, b.top_p_rows, cut)
        if b.log_min_p is not None:  # p >= min_p * p_max  <=>  score >= max score + log(min_p)
            thr = _fold(thr, b.min_p_rows, _subset(scores, b.min_p_rows).amax(dim=-1) + b.log_min_p)
        if b.top_k is not None or b.top_p is not None or b.log_min_p is not None:
            self._filter(scores, thr)
        if self.kernels is not None:  # fp32 CPU: one pass per row, no noise tensor
            keys = (torch.randint(-(1 << 63), (1 << 63) - 1, (R,), generator=self.generator, dtype=torch.int64)
                    if b.any_unseeded else torch.empty(R, dtype=torch.int64))
            for j, seed in b.seeded:
                keys[j] = seed
            return self.kernels.sample_rows(scores, keys)
        # Exponential race: E = -log(U), U ~ U[0, 1); argmax(p / E) = argmax(scores - log E).
        # (uniform_ + log is ~3x faster than exponential_ on the CPU and the same elsewhere.)
        noise = self._scratch("noise", R, V)  # [R, V]
        if b.any_unseeded:
            noise.uniform_(generator=self.generator)
        for j, seed in b.seeded:
            self._row_generator.manual_seed(seed)
            noise[j].uniform_(generator=self._row_generator)
        noise.log_().neg_().clamp_min_(_TINY).log_()  # E = 0 must not turn a masked -inf into NaN
        return scores.sub_(noise).argmax(dim=-1)

    def _filter(self, scores: torch.Tensor, thr: torch.Tensor) -> None:
        """scores [R, V] in place: -inf below each row's threshold thr [R]."""
        torch.where(scores >= thr[:, None], scores, self._neg_inf, out=scores)  # faster than masked_fill_

    def close(self) -> None:
        """Free the scratch buffers, if private (a shared `buffers` is its owner's to close)."""
        if self._owns_buffers:
            self.buffers.close()

    def _top_p_cut(self, scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """scores [P, V] (top-k applied), top_p [P] -> [P] the lowest score in each nucleus.

        On the CPU, rows whose nucleus lies in the top `top_p_candidates` skip the full
        sort (deciding that syncs, which only the CPU gets for free). Every way computes
        the same cut from the same prefix sums.
        """
        peak = scores.amax(dim=-1, keepdim=True)  # [P, 1]
        total = (scores - peak).exp_().sum(dim=-1, keepdim=True)  # [P, 1]
        n = self.top_p_candidates
        if not 0 < n < scores.shape[1]:
            return _nucleus_cut(scores.sort(dim=-1, descending=True).values, peak, total, top_p)[0]
        cut, done = _nucleus_cut(scores.topk(n, dim=-1).values, peak, total, top_p)
        if bool(done.all()):
            return cut
        rest = (~done).nonzero().squeeze(1)
        vals = scores.index_select(0, rest).sort(dim=-1, descending=True).values
        return cut.index_copy(0, rest, _nucleus_cut(vals, peak[rest], total[rest], top_p[rest])[0])

    @staticmethod
    def _logprobs(logits: torch.Tensor, ids: torch.Tensor, b: SamplingBatch, out: SamplerOutput) -> None:
        """Raw-distribution logprobs for the rows that asked, scattered into [B] / [B, n_max]."""
        lp = torch.log_softmax(_subset(logits, b.logprob_idx).float(), dim=-1)  # [L, V]
        sampled = lp.gather(1, _subset(ids, b.logprob_idx)[:, None]).squeeze(1)  # [L]
        n = min(b.max_logprobs, lp.shape[1])
        top_lp, top_ids = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
        top_ids = top_ids.to(torch.int32)
        if b.logprob_idx is not None:
            B, dev = b.size, logits.device
            sampled = torch.full((B,), float("nan"), device=dev).index_copy_(0, b.logprob_idx, sampled)
            top_lp = torch.full((B, n), float("nan"), device=dev).index_copy_(0, b.logprob_idx, top_lp)
            top_ids = torch.full((B, n), -1, dtype=torch.int32, device=dev).index_copy_(0, b.logprob_idx, top_ids)
        out.sampled_logprobs, out.top_ids, out.top_logprobs = sampled, top_ids, top_lp


def row_logprobs(out: SamplerOutput, batch: SamplingBatch) -> list[RowLogprobs]:
    """Host copy of the logprobs of the rows that asked (RowLogprobs.row = batch row)."""
    if not batch.logprob_rows:
        return []
    idx = batch.logprob_idx
    sampled = _subset(out.sampled_logprobs, idx).cpu().tolist()
    top_ids = _subset(out.top_ids, idx).cpu().tolist()
    top_lp = _subset(out.top_logprobs, idx).cpu().tolist()
    return [
        RowLogprobs(row=row, sampled=s, top_ids=ti[:n], top_logprobs=tl[:n])
        for row, n, s, ti, tl in zip(batch.logprob_rows, batch.logprob_n, sampled, top_ids, top_lp)
    ]


def sample_host(
    result: StepResult, rows: list[tuple[WorkerSampling, int]], sampler: Sampler,
    histories: list[tuple[list[int], list[int]] | None] | None = None,
) -> tuple[list[int], list[RowLogprobs]]:
    """The driver's path in host-logits mode: sample `result`'s logits on the CPU.

    rows[i] = (sampling params, sampled position) of the result's row i; histories[i] =
    (prompt ids, output ids so far) where row i has penalties (Scheduler.sampling_histories).
    """
    logits = logits_tensor(result)  # [rows, vocab] float32 on the CPU
    if logits.shape[1] == 0:
        raise ValueError("result was sampled on the device; it carries no logits to sample")
    if len(rows) != logits.shape[0]:
        raise ValueError(f"result has {logits.shape[0]} logits rows but {len(rows)} rows were given")
    if sampler.device.type != "cpu":
        raise ValueError(f"sample_host needs a CPU sampler, got one on {sampler.device}")
    batch = SamplingBatch.build([p for p, _ in rows], [pos for _, pos in rows], sampler.device, histories,
                                logits.shape[1])
    out = sampler(logits, batch)
    return out.token_ids.tolist(), row_logprobs(out, batch)
