"""One decode step on a CUDA GPU: raylm eager, raylm with a captured CUDA graph, HF's forward.

    PYTHONPATH=. python benchmarks/bench_decode_cuda.py [--layers 28] [--batches 1,16,64]
        [--context 512] [--steps 20] [--warmup 5]
    PYTHONPATH=. python benchmarks/bench_decode_cuda.py --dry-run   # CPU, tiny sizes: plumbing only

A Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128,
vocab 151936) with random bf16 weights; HF's Qwen3ForCausalLM shares the very tensors.
Every row has `context` tokens in the cache (random contents: decode time does not depend
on them) and each timed step decodes one token per row:
- raylm/eager: embed -> Qwen3 forward over the CUDA op table (FlashInfer) -> logits, eager;
- raylm/graph: the same step replayed from a CUDA graph (workers/graphs.py);
- hf:          Qwen3ForCausalLM.forward(input_ids [B, 1], cache=DynamicCache).
Sampling is left out of all three (it is the same few kernels in each). Prints the median
step time of each and the goals' ratios (graph vs HF at batch 64 >= 3x, graph vs eager at
batch 1 >= 1.5x). --dry-run runs on the CPU with tiny sizes through the FlashInfer
emulation and a fake graph device (tests/workers): it checks the script, measures nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_runner import hf_stepper, measure  # noqa: E402
from cluster.bench.hf_runs import hf_model  # noqa: E402
from workers.device import synchronize  # noqa: E402
from workers.graphs import DecodeGraphs, graph_device_for  # noqa: E402
from workers.kv_cache import KVCache  # noqa: E402
from workers.loader import random_qwen3  # noqa: E402
from workers.ops.base import AttentionMetadata  # noqa: E402
from workers.ops.cuda import CudaOpTable  # noqa: E402
from workers.resident import ResidentOutputs  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            vocab_size=512)


def decode_meta(batch: int, context: int, block_size: int, per_seq: int, device) -> AttentionMetadata:
    """Row i decodes position `context` over blocks i * per_seq ... (context + 1 keys)."""
    tables = [[i * per_seq + j for j in range(per_seq)] for i in range(batch)]
    slots = [t[context // block_size] * block_size + context % block_size for t in tables]
    as_dev = lambda xs, dt: torch.tensor(xs, dtype=dt, device=device)  # noqa: E731
    return AttentionMetadata(
        num_tokens=batch, num_decode=batch, block_size=block_size, slot_mapping=as_dev(slots, torch.int64),
        query_start_loc=as_dev(list(range(batch + 1)), torch.int32),
        seq_lens=as_dev([context + 1] * batch, torch.int32), block_tables=as_dev(tables, torch.int32),
        query_lens_host=[1] * batch, seq_lens_host=[context + 1] * batch)


def raylm_steppers(model, ops, batch: int, context: int, block_size: int, graph_device):
    c, device = model.config, model.model.embed_tokens.weight.device
    per_seq = -(-(context + 1) // block_size)
    pad_block = batch * per_seq
    cache = KVCache(num_layers=c.num_hidden_layers, num_blocks=pad_block + 1, block_size=block_size,
                    num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=model.dtype, device=device)
    cache.data.normal_()
    outputs = ResidentOutputs(device)
    ids = torch.ones(batch, dtype=torch.int64, device=device)
    positions = torch.full((batch,), context, dtype=torch.int64, device=device)
    hidden = outputs.get_rows("next_hidden", batch, (c.hidden_size,), model.dtype)
    logits = outputs.get_rows("logits", batch, (c.vocab_size,), torch.float32)

    def eager():
        with torch.inference_mode():
            model.embed(ids, out=hidden)
            h = model(hidden, positions, cache, decode_meta(batch, context, block_size, per_seq, device))
            model.compute_logits(h, out=logits)
        synchronize(device)

    graphs = DecodeGraphs(model=model, attention=ops.attention, kv_cache=cache, outputs=outputs, sizes=(batch,),
                          max_blocks=per_seq, pad_block=pad_block, vocab_size=c.vocab_size, graph_device=graph_device)
    report = graphs.capture()

    def graph():
        with torch.inference_mode():
            graphs.run(ids, positions, decode_meta(batch, context, block_size, per_seq, device))
        synchronize(device)

    def max_diff() -> float:
        """|graph logits - eager logits| on the same inputs (both rewrite the same cache slot)."""
        eager()
        want = logits.clone()
        graph()
        return float((logits - want).abs().max())

    return {"eager": eager, "graph": graph}, report, max_diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, emulated FlashInfer, fake graphs")
    args = ap.parse_args()
    shape = {}
    if args.dry_run:
        from tests.workers import flashinfer_emulation
        from tests.workers.fake_graphs import FakeGraphDevice

        class _Patch:  # what flashinfer_emulation.install needs of pytest's monkeypatch
            def setitem(self, mapping, key, value):
                mapping[key] = value

        flashinfer_emulation.install(_Patch())
        device, graph_device, shape = torch.device("cpu"), FakeGraphDevice(), TINY
        args.layers, args.context, args.steps, args.warmup = min(args.layers, 2), min(args.context, 40), 2, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --dry-run on the CPU (which measures nothing)")
        device = torch.device("cuda")
        graph_device = graph_device_for(device)
    t0 = time.perf_counter()
    model = random_qwen3(dtype=torch.bfloat16, layers=args.layers, device=device, **shape)
    ops = CudaOpTable()
    if hasattr(model, "prepare"):
        with torch.no_grad():
            model.prepare(ops)
    hf = hf_model(model)
    flashinfer_on = ops.attention.supports_graphs
    print(f"# {'DRY RUN (CPU, tiny, emulated: not a measurement)' if args.dry_run else 'CUDA'}: "
          f"{args.layers} layers, bf16, context {args.context}, block {args.block_size}, torch {torch.__version__}, "
          f"FlashInfer {'on' if flashinfer_on else 'missing'}; built in {time.perf_counter() - t0:.1f}s")
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'hf ms':>8} {'hf/graph':>9} {'eager/graph':>12} "
          f"{'capture':>20} {'|graph-eager|':>14}")
    for batch in (int(b) for b in args.batches.split(",")):
        steppers, report, max_diff = raylm_steppers(model, ops, batch, args.context, args.block_size, graph_device)
        cache, steppers["hf"] = hf_stepper(hf, batch, args.context)
        t = measure(steppers, args.steps, args.warmup)
        print(f"{batch:>5} {t['eager'] * 1e3:>9.2f} {t['graph'] * 1e3:>9.2f} {t['hf'] * 1e3:>8.2f} "
              f"{t['hf'] / t['graph']:>9.2f} {t['eager'] / t['graph']:>12.2f} "
              f"{report.seconds:>7.2f}s {report.memory_bytes / 2**20:>8.1f} MiB {max_diff():>14.2e}", flush=True)
        del cache, steppers


if __name__ == "__main__":
    main()
