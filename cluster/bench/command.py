"""`raylm bench`: throughput and latency on seeded random requests, side by side with peers.

    raylm bench [--layers 4] [--num-requests 64] [--input-len 32:256] [--output-len 32:128]
                [--compare hf,bare] [--ab device-outputs] [--replicas 1,2] [--repeat 2]
                [--serve --rate 0.5,1,inf] [--json out.json] [--plot out.png]

Offline runs (vLLM's and nano-vllm's throughput benchmarks): every request arrives at
once; prompts are random token ids, their lengths and the output lengths uniform in the
given ranges, `ignore_eos`, greedy. Output tokens/s counts the tokens the requests asked
for; total tokens/s adds their prompts. Every raylm run launches a fresh engine (so no
run hits another's prefix cache); the contenders take turns, reversed on every other
round of `--repeat`, and the figures printed are the medians over rounds.

- `--compare hf`: the same requests through HF transformers on the same weights:
  `hf-cb`, the continuous-batching manager behind `generate_batch` (explicit cache
  config, each request's own max_new_tokens); `hf-generate`, plain `generate` on one
  left-padded batch (per `--batch-size` requests) run to the batch's longest output;
  `hf-generate_batch` (opt-in, `--hf-modes`): `generate_batch` itself, every request run
  to the longest output. Only the tokens each request asked for count.
- `--compare bare`: the same requests through ModelRunner driven directly by the real
  Scheduler in this process (no Ray, no detokenizing, no pipelining).
- `--compare vllm`: the same requests through vLLM's CPU build (`make peers`; its venv by
  `--peers-venv`) in a subprocess that lives through all rounds (prefix cache reset before
  each), on the same checkpoint: a random model is first saved as one (bf16 weights,
  `save_pretrained`, a word-level tokenizer of exactly the vocab) and every contender loads it.
  vLLM computes in `--vllm-dtype` (auto: float32 on a CPU without AVX512-BF16/AMX, as raylm).
- `--ab device-outputs`: device outputs (ids back) against host logits (logits back,
  sampled on the driver).
- `--replicas 1,2`: each replica count with cores // replicas threads per worker (or
  `--threads-per-worker`), plus one replica at the smallest of those thread counts; the
  scaling target compares N replicas with one replica of the same threads (on a CPU a
  replica's threads stand for its device).
- `--driver-capacity`: the engine alone, with fake workers that load no model
  (cluster/bench/driver_capacity.py): its CPU per replica-step at `--rows` running rows, and
  how many replicas it drives at a `--fake-step-ms` device step before it, not the workers,
  limits throughput.
- `--serve --rate R[,R...]`: requests arrive as a Poisson process at R per second
  ("inf": all at once); TTFT, TPOT, ITL and end-to-end latency as vLLM's serving
  benchmark reports them.

Dtypes: `--dtype` is the weights' (bfloat16 by default). raylm computes as it serves
(`--compute-dtype auto`): in the weights' dtype, except half-precision weights on a CPU
without bf16/fp16 matmul instructions (no AVX512-BF16 or AMX), which it upcasts to float32
once at load. HF computes in the weights' dtype, as `from_pretrained` loads them;
`--hf-dtypes bfloat16,float32` adds HF on upcast weights as further contenders, so the
engine's share of a speedup can be told from the dtype's. The report names each run's
compute dtype.

The default model is `random:qwen3-0.6b` (Qwen3-0.6B's shape, random bf16 weights,
built in memory by each worker and by this process for the peers; their fingerprints are
checked equal). `--layers N` cuts its depth; `--model PATH` takes a checkpoint instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform

from cluster.bench.hf_runs import HF_MODES
from cluster.bench.plot import plot
from cluster.bench.report import print_report, write_json
from cluster.bench.suite import Bench
from cluster.bench.workload import make_workload

DEFAULT_MODEL = "random:qwen3-0.6b"
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def parse_range(text: str) -> tuple[int, int]:
    """`LO:HI` (or `N`, meaning N:N) as an argparse type: a range of lengths, 1 <= LO <= HI."""
    lo, sep, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (or N), got {text!r}") from None
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def add_kernels_workload_args(ap: argparse.ArgumentParser) -> None:
    """The options of the scripts that time raylm's step loop against vLLM on one checkpoint
    (benchmarks/bench_vllm_bare.py, bench_quant.py), defaulting to the kernels workload."""
    ap.add_argument("--checkpoint", required=True, help="a checkpoint directory (written from --model if empty)")
    ap.add_argument("--model", default="random:qwen3-0.6b?layers=8&seed=0")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=parse_range, default=(42, 251))
    ap.add_argument("--output-len", type=parse_range, default=(34, 128))
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers-venv", default=None)
    ap.add_argument("--seed", type=int, default=0)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _rates(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates (req/s, or inf), got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return values


def _names(allowed: tuple[str, ...], what: str):
    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{what} must be among {', '.join(allowed)}, got {text!r}")
        return values
    return parse


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark raylm (and peers) on seeded random requests",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a checkpoint directory or a random model spec (default {DEFAULT_MODEL})")
    b.add_argument("--layers", type=int, default=None, help="cut the random model to N layers")
    b.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES,
                   help="the weights' dtype: the random model is built in it, every contender gets these weights")
    b.add_argument("--compute-dtype", default="auto", choices=("auto",) + DTYPE_NAMES,
                   help="raylm's (and the bare loop's) compute dtype; auto: as raylm serves, the weights' own "
                        "except half weights on a CPU without half matmuls, which compute in float32")
    b.add_argument("--hf-dtypes", type=_names(DTYPE_NAMES, "--hf-dtypes"), default=None,
                   help="HF's compute dtypes, each a contender (default: the weights' dtype, as HF loads them)")
    b.add_argument("--seed", type=int, default=0, help="seeds the weights (random model) and the workload")
    b.add_argument("--num-requests", type=int, default=64)
    b.add_argument("--input-len", type=parse_range, default=(32, 256), help="prompt lengths LO:HI (uniform)")
    b.add_argument("--output-len", type=parse_range, default=(32, 128), help="output lengths LO:HI (uniform)")
    b.add_argument("--batch-size", type=_int_list, default=[64],
                   help="max sequences per step (raylm max_num_seqs, HF's batch); a list sweeps")
    b.add_argument("--max-num-batched-tokens", type=int, default=2048)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--speculative-config", type=json.loads, default=None,
                   help="raylm runs speculate (vLLM's keys as JSON); their acceptance is reported")
    b.add_argument("--compare", type=_names(("hf", "bare", "vllm"), "--compare"), default=[],
                   help="hf: the same requests through HF transformers; bare: through ModelRunner + Scheduler "
                        "in this process")
    b.add_argument("--vllm-dtype", default="auto", choices=("auto",) + DTYPE_NAMES,
                   help="vLLM's compute dtype (auto: float32 unless the CPU has AVX512-BF16 or AMX)")
    b.add_argument("--peers-venv", default=None,
                   help="the venv holding vLLM for --compare vllm (default RAYLM_PEERS_VENV or .venv-peers)")
    b.add_argument("--checkpoint-dir", default=None,
                   help="where --compare vllm saves a random model as a checkpoint "
                        "(default ~/.cache/raylm/checkpoints/<spec>)")
    b.add_argument("--hf-modes", type=_names(HF_MODES, "--hf-modes"), default=["cb", "generate"],
                   help="HF contenders (default cb,generate; generate_batch runs every request to the longest)")
    b.add_argument("--ab", choices=["device-outputs"], default=None,
                   help="device-outputs: sampled ids back (on) against full logits back (off)")
    b.add_argument("--replicas", type=_int_list, default=None,
                   help="replica counts to run (scaling; default 1, with --driver-capacity 1,2,4,8,16)")
    b.add_argument("--threads-per-worker", type=int, default=None,
                   help="torch threads per worker (default: cores // replicas)")
    b.add_argument("--serve", action="store_true", help="serving load: Poisson arrivals at --rate")
    b.add_argument("--rate", type=_rates, default=[1.0], help="requests per second (list; inf: all at once)")
    b.add_argument("--serve-http", action="store_true",
                   help="drive a real `raylm serve` over HTTP with concurrent streaming clients (vLLM's bench serve "
                        "figures); the bundled tiny model unless --model names a checkpoint; first of --input-len, "
                        "--output-len, --rate and --batch-size (max_num_seqs)")
    b.add_argument("--max-waiting-requests", type=int, default=None,
                   help="with --serve-http: the server's queue bound (a flood beyond it gets 429)")
    b.add_argument("--through-serve", action="store_true",
                   help="with --serve-http: also serve as the Ray Serve application of one engine (raylm serve "
                        "--engines 1) and print its throughput against raylm serve's")
    b.add_argument("--in-process", action="store_true",
                   help="with --serve-http: the same requests through cluster.launch() too, for the ratio")
    b.add_argument("--repeat", type=int, default=1,
                   help="rounds of the offline runs, or of --serve-http (--in-process: the median ratio); order "
                        "reversed every other")
    b.add_argument("--address", default=None, help="Ray address to join (default: this process's or a local one)")
    b.add_argument("--driver-capacity", action="store_true",
                   help="the engine's own cost per step with fake workers (no model): --rows, --replicas, "
                        "--fake-step-ms")
    b.add_argument("--engines", type=_int_list, default=None,
                   help="with --driver-capacity: instead, N engines under Ray Serve (e.g. 1,2), steps a second of "
                        "all against the first count's")
    b.add_argument("--rows", type=_int_list, default=[1, 16, 64, 256],
                   help="with --driver-capacity: running rows of one replica (its largest but one: each replica's "
                        "in the replicas sweep)")
    b.add_argument("--fake-step-ms", type=float, default=30.0,
                   help="with --driver-capacity: each fake worker step's time in the replicas sweep (a device's)")
    b.add_argument("--json", default=None, metavar="PATH", help="write every figure here (updated after each run)")
    b.add_argument("--plot", default=None, metavar="PATH", help="PNG of throughput against batch size or rate")
    b.add_argument("--profile", default=None, metavar="DIR",
                   help="py-spy record (raw stacks) the workers and the driver during raylm runs")
    b.set_defaults(func=run)


def _model_spec(a) -> str:
    from workers.loader import is_random_spec, parse_random_spec

    if is_random_spec(a.model):
        s = parse_random_spec(a.model)
        layers = a.layers if a.layers is not None else s.layers
        return str(type(s)(s.name, layers, s.seed if "seed=" in a.model else a.seed))
    if a.layers is not None:
        raise ValueError("--layers applies to a random model, not to a checkpoint directory")
    return os.path.expanduser(a.model)


def _as_checkpoint(model_spec: str, directory: str | None) -> str:
    """A random spec saved as a checkpoint directory (once; reused), so vLLM loads the same weights."""
    from cluster.bench.vllm_peer import save_checkpoint
    from workers.loader import is_random_spec

    if not is_random_spec(model_spec):
        return model_spec
    slug = model_spec.split(":", 1)[1].replace("?", "-").replace("&", "-").replace("=", "")
    directory = directory or os.path.join(os.path.expanduser("~/.cache/raylm/checkpoints"), slug)
    save_checkpoint(model_spec, directory)
    return directory


def _vocab_size(model_spec: str) -> int:
    from workers.loader import is_random_spec, load_config, load_tokenizer, parse_random_spec
    from workers.models.qwen3 import Qwen3Config

    if is_random_spec(model_spec):
        parse_random_spec(model_spec)
        return Qwen3Config().vocab_size
    return min(load_config(model_spec).vocab_size, len(load_tokenizer(model_spec)))


def _machine() -> dict:
    import ray
    import torch
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ray_cpus": ray.cluster_resources().get("CPU"),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "ray": ray.__version__, "platform": platform.platform(), "load_avg_at_start": os.getloadavg()}


def run(a: argparse.Namespace) -> int:
    import cluster

    if a.driver_capacity:
        import cluster.bench.driver_capacity as driver_capacity

        a.replicas = a.replicas or [1, 2, 4, 8, 16]
        return driver_capacity.run(a)
    a.replicas = a.replicas or [1]
    if a.serve_http:
        import cluster.bench.serve_http as serve_http

        return serve_http.run(a)

    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'raylm[plot]'") from None
    if a.serve and (a.compare or a.ab or len(a.replicas) > 1 or a.repeat != 1):
        raise ValueError("--serve runs alone: drop --compare, --ab, --repeat and multiple --replicas")
    for name in ("num_requests", "repeat", "max_num_batched_tokens", "block_size"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.threads_per_worker is not None and a.threads_per_worker < 1:
        raise ValueError(f"--threads-per-worker must be >= 1, got {a.threads_per_worker}")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)  # HF's per-run INFO chatter
    model_spec = _model_spec(a)
    if "vllm" in a.compare:
        model_spec = _as_checkpoint(model_spec, a.checkpoint_dir)
    vocab = _vocab_size(model_spec)
    wl = make_workload(a.num_requests, a.input_len, a.output_len, vocab, a.seed)
    owns_ray = cluster.ensure_ray(a.address)
    try:
        import ray

        cores = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        bench = Bench(a, model_spec, wl, vocab, cores)
        bench.report["machine"] = _machine()
        try:
            if a.serve:
                bench.execute_serve()
            else:
                bench.plan()
                bench.execute()
        finally:
            bench.close()
        print_report(bench)
        write_json(bench)
        if a.plot:
            plot(bench, a.plot)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    return 0
