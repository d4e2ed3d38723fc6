"""HF transformers as a contender in `raylm bench`, on the very weight tensors raylm runs:
its continuous batching manager, generate_batch, and plain batched generate."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from cluster.bench.figures import throughput_figures, time_per_output_token
from cluster.bench.workload import Workload, blocks_needed

if TYPE_CHECKING:
    from cluster.bench.contenders import EngineSpec

HF_MODES = ("cb", "generate", "generate_batch")


def hf_model(model):
    """HF transformers' Qwen3ForCausalLM (Qwen3MoeForCausalLM for a MoE model) on the very same
    weight tensors as our `model` (a scaled RoPE is not carried over)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    c = model.config
    shape = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                 num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                 num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                 max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
                 rms_norm_eps=c.rms_norm_eps, attention_bias=c.attention_bias,
                 rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"})
    if c.is_moe:
        config = Qwen3MoeConfig(**shape, num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                                moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                                decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers))
        cls = Qwen3MoeForCausalLM
    else:
        config, cls = Qwen3Config(**shape), Qwen3ForCausalLM
    with torch.device("meta"):
        hf = cls(config)
    state = dict(model.state_dict())
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, assign=True, strict=False)  # share the tensors: no second copy
    hf.model.rotary_emb.inv_freq = model.inv_freq.clone()
    hf.model.rotary_emb.original_inv_freq = model.inv_freq.clone()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.to(model.model.embed_tokens.weight.device).eval()  # buffers HF made itself follow the weights


def _gen_config(max_new_tokens: int):
    from transformers import GenerationConfig

    # eos -1: HF's continuous batching reads it as "no EOS" (ignore_eos); plain generate gets None
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0)


def _cb_config(wl: Workload, spec: EngineSpec, output_lens: list[int]):
    """A cache that holds every request at once (no request waits for pages), as raylm's."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = ContinuousBatchingConfig.page_size  # HF's default page (256 tokens)
    pages = blocks_needed(wl.prompts, output_lens, page) + 2
    return ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=spec.max_num_batched_tokens,
                                    max_requests_per_batch=spec.batch_size, allow_block_sharing=True)


def run_hf_cb(hf, wl: Workload, spec: EngineSpec) -> tuple[dict, list[list[int]]]:
    """The manager behind generate_batch, each request with its own max_new_tokens."""
    import torch

    with torch.inference_mode():
        mgr = hf.init_continuous_batching(generation_config=_gen_config(max(wl.output_lens)),
                                          continuous_batching_config=_cb_config(wl, spec, wl.output_lens))
        mgr.start()
        try:
            t0 = time.perf_counter()
            for i, (p, o) in enumerate(zip(wl.prompts, wl.output_lens)):
                mgr.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1, record_timestamps=True)
            results = _hf_results(mgr, wl.num_requests)
            elapsed = time.perf_counter() - t0
        finally:
            mgr.stop(block=True)
            mgr.destroy()
    return _hf_figures(wl, results, t0, elapsed, cfg=str(mgr.continuous_batching_config))


def run_hf_generate_batch(hf, wl: Workload, spec: EngineSpec) -> tuple[dict, list[list[int]]]:
    """generate_batch itself: one max_new_tokens (the longest asked) for every request."""
    import torch

    longest = max(wl.output_lens)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate_batch(wl.prompts, generation_config=_gen_config(longest),
                                continuous_batching_config=_cb_config(wl, spec, [longest] * wl.num_requests),
                                record_timestamps=True, warmup=False)
        elapsed = time.perf_counter() - t0
    results = {f"r{i}": r for i, r in enumerate(out.values())}  # generate_batch returns them in input order
    return _hf_figures(wl, results, t0, elapsed)


def _hf_results(mgr, n: int) -> dict:
    results = {}
    while len(results) < n:
        r = mgr.get_result(timeout=1)
        if r is not None and r.is_finished():
            if r.error is not None:
                raise RuntimeError(f"HF request {r.request_id} failed: {r.error}")
            results[r.request_id] = r
        elif r is None and not mgr.is_running():
            raise RuntimeError("HF's continuous batching loop stopped before every request finished")
    return results


def _hf_figures(wl: Workload, results: dict, t0: float, elapsed: float,
                **extra) -> tuple[dict, list[list[int]]]:
    outs, ttft, tpot, generated = [], [], [], 0
    for i, want in enumerate(wl.output_lens):
        r = results[f"r{i}"]
        generated += len(r.generated_tokens)
        if len(r.generated_tokens) < want:
            raise RuntimeError(f"HF request r{i} made {len(r.generated_tokens)} tokens, {want} were asked")
        outs.append(list(r.generated_tokens[:want]))
        ts = r.timestamps or []
        ttft.append(ts[0] - t0 if ts else None)
        tpot.append(time_per_output_token(ts[0], ts[want - 1], want) if len(ts) >= want else None)
    fig = throughput_figures(wl, elapsed, generated, ttft, tpot)
    fig.update(extra)
    return fig, outs


class _StepClock:
    """A generate() streamer that only notes when each step's tokens come out."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf_generate(hf, wl: Workload, spec: EngineSpec) -> tuple[dict, list[list[int]]]:
    """Plain batched generate: left-padded batches of `batch_size` requests, each run to
    its longest output."""
    import torch

    outs, ttft, tpot, generated = [], [], [], 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, wl.num_requests, spec.batch_size):
            prompts = wl.prompts[lo:lo + spec.batch_size]
            want = wl.output_lens[lo:lo + spec.batch_size]
            width = max(map(len, prompts))
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for k, p in enumerate(prompts):
                ids[k, width - len(p):] = torch.tensor(p)
                mask[k, width - len(p):] = 1
            clock = _StepClock()
            gc = _gen_config(max(want))
            gc.eos_token_id = None
            y = hf.generate(input_ids=ids, attention_mask=mask, generation_config=gc, streamer=clock)
            new = y[:, width:]
            generated += new.numel()
            for k, o in enumerate(want):
                outs.append(new[k, :o].tolist())
                ttft.append(clock.times[0] - t0)
                tpot.append(time_per_output_token(clock.times[0], clock.times[o - 1], o))
    elapsed = time.perf_counter() - t0
    fig = throughput_figures(wl, elapsed, generated, ttft, tpot)
    fig["padded_prompt_tokens"] = sum(max(map(len, wl.prompts[lo:lo + spec.batch_size])) * len(
        wl.prompts[lo:lo + spec.batch_size]) for lo in range(0, wl.num_requests, spec.batch_size))
    return fig, outs


HF_RUNNERS = {"cb": run_hf_cb, "generate": run_hf_generate, "generate_batch": run_hf_generate_batch}
