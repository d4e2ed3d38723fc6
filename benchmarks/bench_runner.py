"""ModelRunner decode step vs Hugging Face's own Qwen3 forward with its DynamicCache.

    PYTHONPATH=. python benchmarks/bench_runner.py [--layers 28] [--dtype bfloat16]
        [--batches 1,16,64] [--context 256] [--steps 5] [--device cpu]

A Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128,
intermediate 3072, vocab 151936, tied) gets random weights in memory; HF's
Qwen3ForCausalLM shares the very same tensors. Each batch row has `context` tokens
already in the cache (contents random: decode time does not depend on them), then each
timed step decodes one token per row:
- runner/device: ModelRunner.execute with device sampling (USE_RESIDENT inputs, ids back);
- runner/host:   ModelRunner.execute returning the logits (host-logits baseline);
- hf:            Qwen3ForCausalLM.forward(input_ids [B, 1], cache=DynamicCache).
Prints the median step time of each and the ratios to HF. A script, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cluster.bench.hf_runs import hf_model  # HF's Qwen3ForCausalLM on our very tensors
from scheduler.protocol import USE_RESIDENT, NewRequest, ScheduledRow, StepPlan, WorkerSampling
from workers.device import synchronize, torch_device
from workers.loader import random_qwen3, resolve_dtype
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig


def runner_stepper(model, batch: int, context: int, num_steps: int, device: str, device_outputs: bool):
    """A ModelRunner whose rows already hold `context` tokens, and a function running one decode step."""
    bs = 16
    total = context + num_steps + 2
    per_seq = -(-total // bs)
    runner = ModelRunner(RunnerConfig(device=device, block_size=bs, num_kv_blocks=batch * per_seq,
                                      max_num_seqs=batch, max_num_batched_tokens=max(batch, 256),
                                      max_model_len=max(total, 256), device_outputs=device_outputs,
                                      dtype=str(model.dtype).removeprefix("torch.")), model=model)  # HF's dtype
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    new = [NewRequest(i, torch.randint(0, vocab, (context + 1,), generator=g).tolist(), context,
                      list(range(i * per_seq, (i + 1) * per_seq)), WorkerSampling()) for i in range(batch)]
    # the first step computes token `context` of every row over `context` cached tokens
    runner.execute(StepPlan(0, new_requests=new, rows=[ScheduledRow(i, 1) for i in range(batch)]))
    token = USE_RESIDENT if device_outputs else 1  # host mode: the driver would send its sampled id
    step_id = iter(range(1, 1 << 30))

    def step():
        runner.execute(StepPlan(next(step_id), rows=[ScheduledRow(i, 1, [], token) for i in range(batch)]))
        synchronize(runner.device)

    return runner, step


def hf_stepper(hf, batch: int, context: int):
    """HF's forward over a DynamicCache already holding `context` + 1 tokens per row."""
    from transformers import DynamicCache

    c = hf.config
    device = hf.model.embed_tokens.weight.device
    dtype = hf.model.embed_tokens.weight.dtype
    cache = DynamicCache(config=c)
    g = torch.Generator(device=device).manual_seed(0)
    for layer in range(c.num_hidden_layers):
        shape = (batch, c.num_key_value_heads, context + 1, c.head_dim)
        cache.update(torch.randn(shape, generator=g, device=device).to(dtype),
                     torch.randn(shape, generator=g, device=device).to(dtype), layer)
    ids = torch.ones(batch, 1, dtype=torch.long, device=device)

    def step():
        with torch.inference_mode():
            hf(input_ids=ids, cache=cache, use_cache=True)
        synchronize(device)

    return cache, step


def measure(steppers: dict, steps: int, warmup: int) -> dict[str, float]:
    """Median step time of each stepper; the steppers take turns so that background
    load on a shared machine hits them alike."""
    times = {name: [] for name in steppers}
    for i in range(warmup + steps):
        for name, step in steppers.items():
            t0 = time.perf_counter()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch_device(args.device)
    dtype = resolve_dtype(args.dtype)
    t0 = time.perf_counter()
    model = random_qwen3(dtype=dtype, layers=args.layers, device=device)
    hf = hf_model(model)
    print(f"# Qwen3-0.6B shape, {args.layers} layers, {args.dtype}, context {args.context}, device {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"model built in {time.perf_counter() - t0:.1f}s")
    print(f"{'batch':>5} {'runner/device ms':>17} {'runner/host ms':>15} {'hf ms':>9} "
          f"{'device/hf':>10} {'host/hf':>8}")
    for batch in (int(b) for b in args.batches.split(",")):
        n = args.steps + args.warmup
        dev_runner, dev_step = runner_stepper(model, batch, args.context, n, args.device, device_outputs=True)
        host_runner, host_step = runner_stepper(model, batch, args.context, n, args.device, device_outputs=False)
        cache, hf_step = hf_stepper(hf, batch, args.context)
        t = measure({"device": dev_step, "host": host_step, "hf": hf_step}, args.steps, args.warmup)
        print(f"{batch:>5} {t['device'] * 1e3:>17.1f} {t['host'] * 1e3:>15.1f} {t['hf'] * 1e3:>9.1f} "
              f"{t['device'] / t['hf']:>10.2f} {t['host'] / t['hf']:>8.2f}", flush=True)
        dev_runner.close()
        host_runner.close()
        del cache


if __name__ == "__main__":
    main()
