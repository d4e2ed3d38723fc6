"""ModelRunner: plan -> tensors -> forward -> device sampling -> StepResult.

The runner owns the model, the paged KV cache, the per-slot request state and a device
buffer of each slot's last sampled token (`last_tokens`), so a decode row marked
USE_RESIDENT needs no input token from the driver. Per step, the embedded inputs go into
the resident "next_hidden" buffer and the sampling rows' logits into the resident "logits"
buffer (batch sizes bucketed); only int32 ids (and logprobs when asked) reach the host.
With device outputs off it returns the logits instead, trimmed to the real vocab.

Under tensor parallelism every rank runs the same plan on its shard; logits are gathered
to rank 0, which samples and broadcasts the ids, so every rank keeps the same last_tokens.
Only rank 0's result means anything.

With speculative decoding (config.speculative) a decode row may bring room for k drafts: the
runner drafts them (prompt lookup over the request's own tokens, a draft model, or an EAGLE-3
head from the target's hidden states, which it reads at the end of each step), computes the
input token and the drafts in one pass, samples each position as a row of its own and accepts the
drafts up to the first that differs from its position's sample, all on the device; the row
returns its accepted ids and the one after them, and the rejected positions' K/V is left to be
overwritten.

Under pipeline parallelism (workers/pipeline.py) every stage runs the same plan over its own
layers: the first embeds, the others take the previous stage's output, and the last samples
and sends the ids to the first (only the last stage's tensor rank 0 has a result).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import numpy as np
import torch

from scheduler.protocol import USE_RESIDENT, NewRequest, RowLogprobs, ScheduledRow, StepPlan, StepResult, WorkerSampling
from workers.block_sizes import check_npu_block_size
from workers.device import (
    bind_device,
    compute_dtype,
    default_cpu_blocks,
    keep_host_heap,
    num_kv_blocks,
    set_cpu_threads,
    synchronize,
    torch_device,
)
from workers.draft_model import DraftModel
from workers.eagle3_drafter import Eagle3Drafter
from workers.graphs import DecodeGraphs, check_graph_sizes, default_graph_sizes, graph_device_for
from workers.kv_cache import KVCache
from workers.loader import (
    bundled_model_path,
    cast_model,
    expert_dtype_for,
    is_random_spec,
    load_config,
    load_model,
    random_model,
    resolve_dtype,
    tokenizer_size,
    weights_fingerprint,
)
from workers.models.qwen3 import Qwen3ForCausalLM
from workers.ngram import propose_ngram
from workers.ops import get_op_table
from workers.parallel import SINGLE, TensorParallel
from workers.quant import QuantConfig, quantize_at_load
from workers.resident import ResidentOutputs
from workers.runner_config import RunnerConfig, device_outputs_enabled
from workers.sampling.grammar_masks import GrammarMasks
from workers.sampling.logits_codec import encode_logits
from workers.sampling.sampler import Sampler, SamplerOutput, row_logprobs
from workers.sampling.slot_sampling import SlotSampling
from workers.slot_table import SlotTable
from workers.staging import StepStaging
from workers.step_inputs import Verify, build_step_inputs

log = logging.getLogger(__name__)
# one thread must beat the configured count by this factor to be chosen for decode steps: a close
# call keeps the cores (a batch that grows makes more threads pay)
DECODE_THREADS_MARGIN = 0.9


@functools.lru_cache(maxsize=8)
def _tokenizer_size(path: str) -> int | None:
    try:
        return tokenizer_size(path)
    except (OSError, ValueError, TypeError):  # a checkpoint without a usable tokenizer
        return None


class ModelRunner:
    def __init__(self, config: RunnerConfig, model: Qwen3ForCausalLM | None = None,
                 parallel: TensorParallel = SINGLE) -> None:
        self.config = config
        self.parallel = parallel
        if model is not None and (parallel.enabled or parallel.pipeline.enabled):
            raise ValueError("a given model cannot be split over ranks: each rank loads its own part")
        self.pipeline = parallel.pipeline
        # CPU threads per step: (threads for small steps, for steps of >= prefill_thread_tokens)
        self.cpu_threads: tuple[int, int] | None = None
        self.host_heap = keep_host_heap() if config.device == "cpu" else None
        if config.device == "cpu" and config.num_threads is not None:
            set_cpu_threads(config.num_threads)
            prefill = config.prefill_threads or config.num_threads
            if prefill < config.num_threads:
                raise ValueError(f"prefill_threads must be >= num_threads {config.num_threads}, got {prefill}")
            self.cpu_threads = (config.num_threads, prefill)
        self.device = torch_device(config.device, config.device_index)
        self.weights_fingerprint: float | None = None  # set for random models, to check copies agree
        given = model is not None
        model, tokenizer_size = self._load_model(config, model, parallel)
        self.model = model.eval()
        mc = model.config
        self.vocab_size = min(mc.vocab_size, tokenizer_size or mc.vocab_size)  # the real vocab
        self.ops = get_op_table(self.device, config.ops)
        parallel.share_choices(self.ops)  # a replicated weight (a MoE router) computes alike on every rank
        if self.ops.name == "npu":
            check_npu_block_size(config.block_size)  # the fused kernels refuse other sizes
        with torch.no_grad():
            # weights fused / packed once; one the table copied is not held twice (a caller's model stays whole)
            self.model.prepare(self.ops, logits_rows=self.vocab_size, release=not given)
        # a tied embedding, now that the lm_head holds its own copy: freed where that copy serves its lookups
        self.model.store_embedding(self._narrow_embedding or self.model.model.embed_tokens.weight.dtype)
        self.max_model_len = config.max_model_len or mc.max_model_len
        if self.max_model_len > mc.max_model_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"{'scaled RoPE length' if mc.rope_scaling else 'max_position_embeddings'} "
                             f"{mc.max_model_len}")
        self.speculative = config.speculative
        if self.speculative is not None and not device_outputs_enabled(config.device_outputs):
            raise ValueError("speculative decoding verifies drafts on the worker: device outputs must be on")
        if self.speculative is not None and self.pipeline.enabled:
            raise ValueError("speculative decoding does not run under pipeline parallelism yet")
        # a draft model's or head's weights load before the KV pools are sized, which count its pool
        self.drafter: DraftModel | Eagle3Drafter | None = None
        self.eagle: Eagle3Drafter | None = None  # the head that reads each step's aux hidden states
        # every rank runs the whole drafter: its table takes the group's kernel choices, so all draft alike
        if self.speculative is not None and self.speculative.method in ("draft_model", "eagle3"):
            draft_ops = get_op_table(self.device, config.ops)
            parallel.share_choices(draft_ops)
        if self.speculative is not None and self.speculative.method == "draft_model":
            self.drafter = DraftModel(self.speculative.model, ops=draft_ops, dtype=self.model.dtype, device=self.device,
                                      vocab_size=self.vocab_size, target_vocab=mc.vocab_size)
        elif self.speculative is not None and self.speculative.method == "eagle3":
            self.drafter = self.eagle = Eagle3Drafter(self.speculative.model, target=self.model, ops=draft_ops,
                                                      dtype=self.model.dtype, device=self.device,
                                                      max_slots=config.max_num_seqs)
        graph_device, use_graphs = self._allocate_kv_cache(config, parallel)
        if self.drafter is not None:
            self.drafter.allocate(self.num_kv_blocks, config.block_size)
        self.slots = SlotTable(max_num_seqs=config.max_num_seqs, num_blocks=self.num_kv_blocks,
                               block_size=config.block_size, max_model_len=self.max_model_len,
                               vocab_size=mc.vocab_size, max_num_batched_tokens=config.max_num_batched_tokens,
                               max_lookahead=0 if self.speculative is None else self.speculative.num_speculative_tokens)
        self.num_draft_tokens = self.num_accepted_tokens = self.num_verify_rows = 0
        self.last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)  # [slots]
        self.outputs = ResidentOutputs(self.device)
        self.sampler = Sampler(self.device, seed=config.seed, buffers=self.outputs)  # its scratch is resident too
        # each slot's params (and penalty state), on the device
        self.slot_sampling = SlotSampling(config.max_num_seqs, self.device, self.vocab_size)
        self.staging = StepStaging(self.device)  # the host buffer of each step's one copy, reused
        self.device_outputs = device_outputs_enabled(config.device_outputs)
        checkpoint = None if is_random_spec(config.model) else (config.model or bundled_model_path())
        self.grammars = GrammarMasks(max_num_seqs=config.max_num_seqs, vocab_size=mc.vocab_size,
                                     device=self.device, checkpoint=checkpoint,  # rank 0 samples: only it masks
                                     max_lookahead=self.slots.max_lookahead)
        if config.prepare_structured_output and parallel.samples:  # only the sampling rank masks
            self.grammars.prepare()
        self.num_steps = 0
        self.num_lm_head_argmax_steps = 0  # steps whose ids came from the lm_head fused with the argmax
        self.num_tokens = 0
        self.step_s = 0.0  # host time in execute()
        self.thread_probe: dict | None = None  # set when warmup chose the decode steps' thread count
        self.graphs: DecodeGraphs | None = self._capture_graphs(config, graph_device) if use_graphs else None

    def _load_model(self, config: RunnerConfig, model, parallel: TensorParallel):
        """The model in its compute dtype on this device, and the tokenizer's vocab size (None when
        unknown): a caller's model, random weights for a random spec, or the checkpoint's (this rank's
        shard), cast while loading so no second copy is made."""
        tokenizer_size = None
        requested = resolve_dtype(config.dtype) if config.dtype else None
        stored = None  # the weights' own dtype
        given = model is not None
        if model is None and is_random_spec(config.model):
            model = random_model(config.model, dtype=requested, device=self.device,  # None: the shape's dtype
                                 parallel=parallel)
            self.weights_fingerprint = weights_fingerprint(model)
        elif model is None:
            path = config.model or bundled_model_path()
            stored = resolve_dtype(load_config(path).torch_dtype)
            dtype = compute_dtype(self.device, stored, requested)
            model = load_model(path, dtype=dtype, device=self.device, parallel=parallel,
                               expert_dtype=expert_dtype_for(stored, dtype), quantization=config.quantization)
            tokenizer_size = _tokenizer_size(path)
        self.weights_dtype = stored or model.dtype
        dtype = compute_dtype(self.device, self.weights_dtype, requested)
        if model.dtype != dtype or model.model.embed_tokens.weight.device != self.device:
            model = cast_model(model, dtype, self.device, copy=given,  # a caller's model stays as it was
                               expert_dtype=expert_dtype_for(self.weights_dtype, dtype))
        if config.quantization is not None and model.quant is None:  # random weights, or a caller's model
            if given:
                raise ValueError("quantization applies to the checkpoint or random spec a worker loads, not to a "
                                 "model passed in")
            if config.quantization != "int8":
                raise ValueError(f"quantization={config.quantization!r} names a checkpoint's format; "
                                 f"{config.model} is random weights (quantization='int8' quantizes them)")
            model.quant = QuantConfig("int8", "w8a8-dynamic")
            quantize_at_load(model, model.quant)
        self._narrow_embedding = None  # the dtype the embedding is kept in, when narrower than dtype
        if dtype != self.weights_dtype:
            log.info("%s weights compute in %s on %s", self.weights_dtype, dtype, self.device)
            if stored is not None and stored.itemsize < dtype.itemsize and self.device.type == "cpu":
                self._narrow_embedding = stored
                model.store_embedding(stored)  # the checkpoint's values: exact at its width
        return model, tokenizer_size

    def _allocate_kv_cache(self, config: RunnerConfig, parallel: TensorParallel):
        """The paged KV pool, as many blocks as fit (the same on every rank); returns the graph
        device and whether decode steps replay captured graphs."""
        model, mc = self.model, self.model.config
        kv_heads = model.shape.num_kv_heads  # this rank's KV heads
        num_layers = len(model.stage)  # this pipeline stage's layers
        bytes_per_block = KVCache.bytes_per_block(
            num_layers=num_layers, block_size=config.block_size,
            num_kv_heads=kv_heads, head_dim=mc.head_dim, dtype=model.dtype)
        if self.drafter is not None:  # a block holds the draft's (or head's) K/V of its positions too
            bytes_per_block += self.drafter.bytes_per_block(config.block_size)
        if config.num_kv_blocks is not None and self.device.type != "cpu":
            self.num_kv_blocks = config.num_kv_blocks
        else:
            self.num_kv_blocks = num_kv_blocks(
                self.device, bytes_per_block=bytes_per_block, memory_fraction=config.memory_fraction,
                cpu_blocks=config.num_kv_blocks or default_cpu_blocks(
                    bytes_per_block, max_num_seqs=config.max_num_seqs,
                    blocks_per_seq=-(-self.max_model_len // config.block_size)))
        # one block table serves every rank (stages hold different layers: the min over all of them)
        self.num_kv_blocks = (self.pipeline.min_over_replica(self.num_kv_blocks) if self.pipeline.enabled
                              else parallel.all_reduce_min(self.num_kv_blocks))
        # no captured graphs under TP or PP: collectives and transfers stay outside graph capture
        split = parallel.enabled or self.pipeline.enabled
        graph_device = None if config.enforce_eager or split else graph_device_for(self.device)
        use_graphs = graph_device is not None and getattr(self.ops.attention, "supports_graphs", False)
        # with graphs, one more block than the scheduler knows of: the graphs' padding rows write there
        self.kv_cache = KVCache(num_layers=num_layers, num_blocks=self.num_kv_blocks + use_graphs,
                                block_size=config.block_size, num_kv_heads=kv_heads,
                                head_dim=mc.head_dim, dtype=model.dtype, device=self.device)
        return graph_device, use_graphs

    def _capture_graphs(self, config: RunnerConfig, graph_device) -> DecodeGraphs:
        sizes = (default_graph_sizes(config.max_num_seqs) if config.graph_sizes is None
                 else check_graph_sizes(config.graph_sizes, config.max_num_seqs))
        graphs = DecodeGraphs(
            model=self.model, attention=self.ops.attention, kv_cache=self.kv_cache, outputs=self.outputs,
            sizes=sizes, max_blocks=-(-self.max_model_len // config.block_size), pad_block=self.num_kv_blocks,
            vocab_size=self.vocab_size, graph_device=graph_device)
        graphs.capture()  # logs the capture time and memory
        return graphs

    # -- one step -----------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        if not isinstance(plan, StepPlan):
            raise ValueError(f"execute takes a StepPlan, got {type(plan).__name__}")
        if self.parallel.samples:
            self.grammars.check_new(plan.new_requests)  # compiles before the plan changes anything
        rows = self.slots.apply(plan)
        if self.eagle is not None:
            for req in plan.new_requests:
                self.eagle.release(req.slot)  # a slot's head output was its last request's
        if self.device_outputs:
            for req in plan.new_requests:
                state = self.slots.states[req.slot]
                self.slot_sampling.admit(req.slot, state.sampling, state.token_ids, state.num_prompt)
        result = StepResult(step_id=plan.step_id, logits_shape=(0, 0 if self.device_outputs else self.vocab_size))
        if rows:
            if self.speculative is not None:
                self._draft(rows)
            if self.eagle is not None:  # what each row knew before the step: the head extends from it
                known = {w.slot: len(w.state.token_ids) + len(w.state.generated) for w in rows}
            self._set_step_threads(plan.num_tokens)
            with torch.inference_mode():
                step = self._run(rows, result)
            if self.speculative is not None:
                self._record_speculation(rows, result, step)
            if self.eagle is not None:
                with torch.inference_mode():
                    self.eagle.extend(rows, known)  # the head reads this step's features
            self.num_steps += 1
            self.num_tokens += plan.num_tokens
        result.step_time = time.perf_counter() - t0
        self.step_s += result.step_time
        return result

    def _draft(self, rows) -> None:
        """Drafts for the decode rows that have room for them, from the request's tokens (what the
        worker was sent and what it sampled since): prompt lookup, the draft model, or the EAGLE-3
        head."""
        spec = self.speculative
        eligible = [w for w in rows if w.lookahead
                    # an input token this worker knows in place (else: no drafts)
                    and len(w.state.token_ids) + len(w.state.generated) == w.start + 1]
        if not eligible:
            return
        if self.drafter is not None:
            self.drafter.propose(eligible)
            return
        for w in eligible:
            w.draft = propose_ngram(w.state.known_array(), min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max,
                                    k=w.lookahead) or None

    def _verify(self, v: Verify, batch, hidden: torch.Tensor) -> np.ndarray:
        """Each verifying row's token at each of its positions, sampled on the device as a row of
        its own (the argmax for greedy rows); its accepted drafts are the leading ones equal to
        them. For a draft that is one token (not a distribution) this is speculative sampling:
        the draft is kept with the probability the target gives it, and where it is not, the token
        in its place is drawn from the target's distribution without it. A seeded row's tokens are
        those it samples without speculation (its noise depends on the position alone). Keeps each
        row's last accepted id resident. Returns, on the host, the [R, k + 1] grid of sampled
        tokens followed by the R accepted-draft counts."""
        r, k = len(v.work), v.k
        h = hidden.index_select(0, v.indices)  # [V, hidden]
        fused = batch.argmax_only and not self.grammars.any_grammar(v.work)
        ids = self.model.greedy_ids(h, self.vocab_size) if fused else None  # [V]
        if ids is None:  # sampled rows, or tensor parallel: the logits (gathered to rank 0, which samples)
            logits = self.outputs.get_rows("verify_logits", len(h), (self.vocab_size,), torch.float32)
            logits = self.model.compute_logits(h, out=logits)
            ids = self.outputs.get_rows("verify_ids", len(h), (), torch.int64)
            if logits is not None:
                self.grammars.mask_verified(logits, v.work)  # each position after the drafts before it
                if batch.penalties is not None:  # each position's counts with the drafts before it
                    self.slot_sampling.penalties.count_drafts(batch.penalties, self._draft_counts(v))
                out = self.sampler(logits, batch)
                ids.copy_(out.token_ids)
                v.logprobs = row_logprobs(out, batch)  # every position's that asked, kept or not
            self.parallel.broadcast(ids, src=0)
        grid = self.outputs.get_rows("verify_grid", r * (k + 1), (), torch.int64).fill_(-1)
        grid = grid.index_copy_(0, v.grid_index, ids.to(torch.int64)).view(r, k + 1)
        accepted = (grid[:, :k] == v.drafts.view(r, k)).to(torch.int64).cumprod(1).sum(1)  # [R]
        self.last_tokens.index_copy_(0, v.slots, grid.gather(1, accepted.unsqueeze(1)).squeeze(1))
        counted = [w.state.sampling.counts_tokens for w in v.work]
        if any(counted):  # penalties count the kept tokens in their slots, on the device
            self.slot_sampling.penalties.record_runs(v.slots, grid, accepted,
                                                     torch.tensor(counted, device=self.device))
        return torch.cat([grid.flatten(), accepted]).cpu().numpy()  # the verification's one host copy

    def _draft_counts(self, v: Verify) -> list[int]:
        """For the penalized verified positions (rows of the batch's penalties, in order): each
        draft before the position, as p * V + token (PenaltyState.count_drafts)."""
        entries, p, vocab = [], 0, self.slot_sampling.penalties.vocab_size
        for w in v.work:
            if not w.state.sampling.has_penalties:
                continue
            for j in range(len(w.draft) + 1):
                entries += [p * vocab + t for t in w.draft[:j] if 0 <= t < vocab]
                p += 1
        return entries

    def _record_speculation(self, rows, result: StepResult,
                            step: tuple[tuple[Verify, np.ndarray] | None, np.ndarray | None]) -> None:
        """Every sampling row's ids into its request's tokens for later drafts (on every rank, so
        all draft alike) and, on the sampling rank, into the result in plan order (a verifying row's
        accepted ids and the one after them); a verifying row's accepted drafts join its computed count."""
        verified, sampled = step
        if sampled is None:
            sampled = np.zeros(0, dtype=np.int32)
        if verified is None:
            for w, t in zip([w for w in rows if w.samples], sampled.tolist()):
                w.state.generated.append(t)
            return
        v, host = verified
        r, k = len(v.work), v.k
        grid, accepted = host[:r * (k + 1)].reshape(r, k + 1), host[r * (k + 1):]
        runs = {w.slot: grid[i, :accepted[i] + 1].tolist() for i, w in enumerate(v.work)}
        first = dict(zip((w.slot for w in v.work), np.cumsum([0] + [len(w.draft) + 1 for w in v.work]).tolist()))
        verified_lps = {lp.row: lp for lp in v.logprobs or ()}  # by verified position
        run_lps = []  # RowLogprobs of the accepted runs' tokens, in token order
        ids: list[int] = []
        counts: list[int] = []
        drafted: list[int] = []
        row_of: dict[int, int] = {}  # index among the plain sampling rows -> among all
        plain = iter(sampled.tolist())
        for w in (w for w in rows if w.samples):
            run = runs.get(w.slot)
            if run is None:
                row_of[len(row_of)] = len(counts)
                run, d = [next(plain)], 0
            else:
                d = len(w.draft)
                for j in range(len(run)):
                    lp = verified_lps.get(first[w.slot] + j)
                    if lp is not None:
                        run_lps.append(RowLogprobs(len(counts), lp.sampled, lp.top_ids, lp.top_logprobs))
                w.state.num_computed += len(run) - 1
                if self.parallel.samples:
                    self.grammars.accept_run(w, run)
                if isinstance(self.drafter, DraftModel):
                    self.drafter.accepted(w, len(run) - 1)
                w.state.has_resident = True
                self.num_draft_tokens += d
                self.num_accepted_tokens += len(run) - 1
                self.num_verify_rows += 1
            w.state.generated += run
            ids += run
            counts.append(len(run))
            drafted.append(d)
        if not self.parallel.samples:
            return  # only the sampling rank's result is read
        for lp in result.logprobs:
            lp.row = row_of[lp.row]
        result.logprobs += run_lps
        result.slots = [w.slot for w in rows if w.samples]
        result.token_ids = np.asarray(ids, dtype=np.int32).tobytes()
        result.num_ids = np.asarray(counts, dtype=np.int32).tobytes()
        result.num_drafted = np.asarray(drafted, dtype=np.int32).tobytes()

    def bind_thread(self) -> None:
        """Ready the calling thread to execute steps (the worker's step channel runs them on
        a thread of its own): torch's CPU thread count and current device are per thread."""
        if self.cpu_threads is not None:
            set_cpu_threads(self.cpu_threads[0])
        bind_device(self.device)

    def _set_step_threads(self, num_tokens: int) -> None:
        """CPU: a big step (a prefill chunk) computes with prefill_threads, others with
        num_threads. Big steps stream few tokens per second of compute, so the cores a
        frontend keeps for streaming decode steps' tokens are nearly idle during them."""
        if self.cpu_threads is None or self.cpu_threads[0] == self.cpu_threads[1]:
            return
        want = self.cpu_threads[num_tokens >= self.config.prefill_thread_tokens]
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _run(self, rows, result: StepResult) -> tuple[tuple[Verify, np.ndarray] | None, np.ndarray | None]:
        """Computes the step; returns the verifying rows and their host results (None when nothing
        was drafted), and, when speculating, the other sampling rows' ids on the host (every rank)."""
        mc = self.model.config
        upload = vupload = None
        if self.device_outputs:  # the sampling rows' ints (and new requests' params) join the step's copy
            sampling_rows = [w for w in rows if w.samples and not w.draft]
            upload = self.slot_sampling.prepare([w.state.sampling for w in sampling_rows],
                                                [w.sample_position for w in sampling_rows],
                                                [w.slot for w in sampling_rows])
            verifying = [w for w in rows if w.draft]
            if verifying:  # each verified position samples as a row of its own, at its own position
                vupload = self.slot_sampling.prepare(
                    [w.state.sampling for w in verifying for _ in range(len(w.draft) + 1)],
                    [p for w in verifying for p in range(w.start + 1, w.start + len(w.draft) + 2)],
                    [w.slot for w in verifying for _ in range(len(w.draft) + 1)])
        pipeline = self.pipeline
        if pipeline.enabled and pipeline.is_first and self.device_outputs:
            # the last stage's ids of earlier steps: each row's before it reads its resident token
            pipeline.take_ids(self.last_tokens, {w.slot for w in rows if w.is_decode and w.token == USE_RESIDENT})
        uploads = [u for u in (upload, vupload) if u is not None]
        inputs = build_step_inputs(rows, block_size=self.config.block_size, last_tokens=self.last_tokens,
                                   staging=self.staging,
                                   sampling_ints=[v for u in uploads for v in u.ints.values()],
                                   sampling_floats=[v for u in uploads for v in u.floats.values()])
        batch = vbatch = None
        if upload is not None:
            ni, nf = len(upload.ints), len(upload.floats)
            batch = self.slot_sampling.finish(upload, inputs.sampling_ints[:ni], inputs.sampling_floats[:nf])
            if vupload is not None:
                vbatch = self.slot_sampling.finish(vupload, inputs.sampling_ints[ni:], inputs.sampling_floats[nf:])
        b = len(inputs.slots)
        result.slots = inputs.slots
        verified = None
        logits = greedy = None  # greedy: ids straight from the lm_head, when every row takes the argmax
        attn, t = inputs.attn, inputs.num_tokens
        if (self.graphs is not None and self.eagle is None and attn.num_decode == attn.num_seqs == t == b
                and self.graphs.bucket_for(t) is not None):  # decode only: replay a captured step
            logits = self.graphs.run(inputs.input_ids, inputs.positions, attn)  # [B, V]
            if inputs.logits_indices is not None:
                logits = logits.index_select(0, inputs.logits_indices)
        else:
            hidden_in = self.outputs.get_rows("next_hidden", t, (mc.hidden_size,), self.model.dtype)
            if pipeline.is_first:
                self.model.embed(inputs.input_ids, out=hidden_in)  # [T, hidden]
            else:
                pipeline.recv_hidden(hidden_in)  # [T, hidden]: the previous stage's output
            if self.eagle is not None:
                aux: list[torch.Tensor] = []
                hidden = self.model(hidden_in, inputs.positions, self.kv_cache, attn, self.eagle.aux_layers, aux)
                self.eagle.hold(inputs.row_starts, aux)
            else:
                hidden = self.model(hidden_in, inputs.positions, self.kv_cache, attn)  # [T, hidden]
            if not pipeline.is_last:
                pipeline.send_hidden(hidden)
                if pipeline.is_first and b and self.device_outputs:
                    pipeline.expect_ids(inputs.sample_slots, inputs.slots)
                for w in inputs.work:
                    w.state.has_resident = True
                result.logits_shape = (b, 0)
                return None, None
            if inputs.verify is not None:
                verified = inputs.verify, self._verify(inputs.verify, vbatch, hidden)
            if inputs.logits_indices is not None:
                hidden = hidden.index_select(0, inputs.logits_indices)  # [B, hidden]
            if b == 0:
                return verified, None
            if batch is not None and batch.argmax_only and not self.grammars.any_grammar(inputs.work):
                greedy = self.model.greedy_ids(hidden, self.vocab_size)  # None under TP
            if greedy is None:
                logits = self.outputs.get_rows("logits", b, (self.vocab_size,), torch.float32)
                logits = self.model.compute_logits(hidden, out=logits)  # [B, V]; None on TP ranks > 0
        if logits is not None:
            self.grammars.mask(logits, inputs.work)  # structured output: in place, before any sampling
        if not self.device_outputs:
            if logits is not None:
                result.logits, result.logits_shape, result.logits_dtype = encode_logits(logits, self.vocab_size)
            return None, None
        out = None
        if greedy is not None:
            self.num_lm_head_argmax_steps += 1
            out = SamplerOutput(token_ids=greedy.to(torch.int32))
        elif logits is not None:
            out = self.sampler(logits, batch)
        if out is not None:
            ids = out.token_ids  # [B] int32
        else:
            ids = self.outputs.get_rows("sampled_ids", b, (), torch.int32)  # filled by rank 0's broadcast
        self.parallel.broadcast(ids, src=0)  # every rank keeps the same resident last tokens
        if pipeline.enabled:
            pipeline.send_ids(ids)  # the first stage embeds them
        self.last_tokens.index_copy_(0, inputs.sample_slots, ids.to(torch.int64))
        self.slot_sampling.record(batch, ids)  # penalties' token counts, on the device
        for w in inputs.work:
            w.state.has_resident = True
        result.logits_shape = (b, 0)
        host_ids = None
        if out is not None or self.speculative is not None:  # other ranks keep speculation's token lists
            host_ids = ids.cpu().numpy()  # the step's one host copy
        if out is not None:
            result.token_ids = host_ids.tobytes()
            result.logprobs = row_logprobs(out, batch)
            self.grammars.accept(inputs.work, host_ids)  # a no-op loop unless a row has a grammar
        return verified, host_ids

    # -- lifecycle ----------------------------------------------------------------------

    def warmup(self) -> None:
        """Run one prefill + decode step through the whole path, then forget it."""
        if len(self.slots):
            raise ValueError("warmup must run before any request is admitted")
        bs = self.config.block_size
        n = max(1, min(2 * bs, self.config.max_num_batched_tokens, self.max_model_len - 1,
                       self.num_kv_blocks * bs - 1))
        blocks = list(range((n + bs) // bs))  # room for n prompt tokens and one decode token
        greedy = WorkerSampling()
        with self._forgotten():
            self.execute(StepPlan(step_id=-1, new_requests=[NewRequest(0, [0] * n, 0, blocks, greedy)],
                                  rows=[ScheduledRow(0, n)]))
            token = USE_RESIDENT if self.device_outputs else 0
            self.execute(StepPlan(step_id=-1, rows=[ScheduledRow(0, 1, token=token)]))
            if self.pipeline.enabled:  # the decode step's ids, and every send, done before they are forgotten
                if self.pipeline.is_first and self.device_outputs:
                    self.pipeline.take_ids(self.last_tokens)
                self.pipeline.flush()
            synchronize(self.device)
        if (self.config.choose_decode_threads and self.cpu_threads is not None and self.cpu_threads[0] > 1
                and not self.parallel.enabled and not self.pipeline.enabled):
            self._choose_decode_threads()

    @contextlib.contextmanager
    def _forgotten(self):
        """Steps run inside (warmup's, the thread probe's) leave no request behind and count in
        no stats: those count served steps only."""
        counters = (self.num_steps, self.num_tokens, self.num_lm_head_argmax_steps, self.step_s,
                    self.parallel.collective_s, self.parallel.num_collectives)
        try:
            yield
        finally:
            self.slots.clear()
            self.slot_sampling.clear()
            self.last_tokens.zero_()
            (self.num_steps, self.num_tokens, self.num_lm_head_argmax_steps, self.step_s,
             self.parallel.collective_s, self.parallel.num_collectives) = counters
            self.pipeline.bytes_sent, self.pipeline.recv_wait_s, self.pipeline.ids_wait_s = 0, 0.0, 0.0

    def _choose_decode_threads(self, reps: int = 3, steps_per_rep: int = 2) -> None:
        """Time decode steps of a batch of requests on one thread and on the configured count,
        alternating, and keep the faster (by a clear margin) for steps below prefill_thread_tokens;
        the choice and the timings go into stats()["cpu_threads"]. Leaves no request behind."""
        threads, prefill = self.cpu_threads
        bs = self.config.block_size
        prompt = bs
        per_request = -(-(prompt + reps * 2 * steps_per_rep + 1) // bs)
        rows = max(1, min(self.config.max_num_seqs, 16, self.num_kv_blocks // per_request))
        new = [NewRequest(i, [1 + i] * prompt, 0, list(range(i * per_request, (i + 1) * per_request)),
                          WorkerSampling()) for i in range(rows)]
        token = USE_RESIDENT if self.device_outputs else 0
        decode = StepPlan(step_id=-1, rows=[ScheduledRow(i, 1, token=token) for i in range(rows)])
        times: dict[int, list[float]] = {threads: [], 1: []}
        self.cpu_threads = None  # the probe sets the thread count itself
        with self._forgotten():
            self.execute(StepPlan(step_id=-1, new_requests=new, rows=[ScheduledRow(i, prompt) for i in range(rows)]))
            for _ in range(reps):
                for t in times:
                    torch.set_num_threads(t)
                    t0 = time.perf_counter()
                    for _ in range(steps_per_rep):
                        self.execute(decode)
                    synchronize(self.device)
                    times[t].append((time.perf_counter() - t0) / steps_per_rep)
        median = {t: sorted(v)[len(v) // 2] for t, v in times.items()}
        chosen = 1 if median[1] < DECODE_THREADS_MARGIN * median[threads] else threads
        self.cpu_threads = (chosen, prefill)
        self.thread_probe = {"rows": rows, "step_ms": {str(t): round(1000 * v, 3) for t, v in median.items()}}
        set_cpu_threads(chosen)
        log.info("decode steps of %d rows: %s ms by thread count; computing them on %d thread(s)", rows,
                 self.thread_probe["step_ms"], chosen)

    def stats(self) -> dict:
        return {
            "steps": self.num_steps,
            "tokens": self.num_tokens,
            "step_s": round(self.step_s, 3),  # host time executing steps (waits between stages included)
            "lm_head_argmax_steps": self.num_lm_head_argmax_steps,  # greedy steps that wrote no logits
            "active_slots": len(self.slots),
            "kv_blocks": self.num_kv_blocks,
            "kv_cache_bytes": self.kv_cache.nbytes,
            "resident_buffers": len(self.outputs),
            "resident_bytes": self.outputs.nbytes,
            "resident_allocations": self.outputs.num_allocations,
            "staging_allocations": self.staging.num_allocations,  # host staging buffers allocated (grows only)
            "penalty_state_bytes": self.slot_sampling.penalties.nbytes,  # 0 until a request with penalties
            "device": str(self.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "weights_dtype": str(self.weights_dtype).removeprefix("torch."),
            "weight_bytes": self.model.weight_bytes(),  # this rank's, as held: parameters and prepared copies
            "quantization": None if self.model.quant is None else self.model.quant.describe(),
            "moe": self.moe_report(),
            "device_outputs": self.device_outputs,
            "weights_fingerprint": self.weights_fingerprint,
            "tensor_parallel_rank": self.parallel.rank,
            "tensor_parallel_size": self.parallel.world_size,
            "layers": [self.model.stage.start, self.model.stage.end],  # this rank's: [first, end)
            "pipeline": self.pipeline.describe(),  # None without pipeline parallelism
            "speculative": None if self.speculative is None else {
                **self.speculative.describe(), "draft_tokens": self.num_draft_tokens,
                "drafter": None if self.drafter is None else self.drafter.describe(),
                "accepted_tokens": self.num_accepted_tokens, "verify_rows": self.num_verify_rows},
            "collective_s": self.parallel.collective_s,
            "collectives": self.parallel.num_collectives,
            "ops": self.ops.describe(),
            "grammars": self.grammars.stats(),
            "sampler": "fused-cpp" if self.sampler.kernels is not None else "torch",
            "cpu_threads": self.cpu_thread_report(),
            "host_heap": self.host_heap,
            "decode_graphs": None if self.graphs is None else {
                "sizes": list(self.graphs.sizes), "capture_s": self.graphs.report.seconds,
                "capture_bytes": self.graphs.report.memory_bytes, "replays": self.graphs.num_replays},
        }

    def moe_report(self) -> dict | None:
        """A MoE model's experts as this rank holds them (None for a dense model)."""
        mc, shape = self.model.config, self.model.shape
        if not mc.is_moe:
            return None
        experts = next(m for name, m in self.model.named_modules() if name.endswith("mlp.experts"))
        return {"num_experts": mc.num_experts, "top_k": mc.num_experts_per_tok,
                "local_experts": shape.num_local_experts, "first_expert": shape.first_expert,
                "expert_parallel": self.parallel.expert_parallel,
                "experts_dtype": str(experts.gate_up_proj.dtype).removeprefix("torch."),
                "sparse_layers": sum(mc.is_sparse(i) for i in range(mc.num_hidden_layers))}

    def cpu_thread_report(self) -> dict | None:
        """The CPU threads steps compute with, and the timings they were chosen by (if measured)."""
        if self.cpu_threads is None:
            return None
        return {"step": self.cpu_threads[0], "prefill": self.cpu_threads[1],
                "prefill_min_tokens": self.config.prefill_thread_tokens, "probe": self.thread_probe}

    def close(self) -> None:
        self.graphs = None  # the graphs' memory pool goes with them
        self.slots.clear()
        self.sampler.close()
        self.slot_sampling.penalties.close()
        self.outputs.close()
        self.kv_cache = None  # type: ignore[assignment]
