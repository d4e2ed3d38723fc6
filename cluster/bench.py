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
import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

from cluster.bench_runs import (HF_MODES, HF_RUNNERS, EngineSpec, Workload, agreement, hf_model, kv_blocks_for,
                                make_workload, run_bare, run_raylm, run_serve)

log = logging.getLogger("raylm.bench")

DEFAULT_MODEL = "random:qwen3-0.6b"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# ---- the plan, the report ----------------------------------------------------------------

@dataclass
class Run:
    name: str
    kind: str  # raylm | bare | hf-cb | hf-generate | hf-generate_batch | serve
    spec: EngineSpec
    reference: bool = False  # its first round's outputs are what the others' agreement is measured against
    rounds: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        """Per figure, the median over rounds (numbers only)."""
        keys = [k for k, v in self.rounds[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out = {}
        for k in keys:
            vals = [r[k] for r in self.rounds if r.get(k) is not None]
            out[k] = statistics.median(vals) if vals else None
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "params": self.spec.params(), "summary": self.summary(),
                "rounds": self.rounds}


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (or N), got {text!r}") from None
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


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
    b.add_argument("--input-len", type=_range, default=(32, 256), help="prompt lengths LO:HI (uniform)")
    b.add_argument("--output-len", type=_range, default=(32, 128), help="output lengths LO:HI (uniform)")
    b.add_argument("--batch-size", type=_int_list, default=[64],
                   help="max sequences per step (raylm max_num_seqs, HF's batch); a list sweeps")
    b.add_argument("--max-num-batched-tokens", type=int, default=2048)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--compare", type=_names(("hf", "bare", "vllm"), "--compare"), default=[],
                   help="hf: the same requests through HF transformers; bare: through ModelRunner + Scheduler "
                        "in this process; vllm: through vLLM's CPU build in a subprocess (make peers)")
    b.add_argument("--vllm-dtype", default="auto", choices=("auto",) + DTYPE_NAMES,
                   help="vLLM's compute dtype (auto: float32 unless the CPU has AVX512-BF16 or AMX)")
    b.add_argument("--peers-venv", default=None,
                   help="the venv holding vLLM (default RAYLM_PEERS_VENV or .venv-peers)")
    b.add_argument("--checkpoint-dir", default=None,
                   help="where --compare vllm saves a random model as a checkpoint "
                        "(default ~/.cache/raylm/checkpoints/<spec>)")
    b.add_argument("--hf-modes", type=_names(HF_MODES, "--hf-modes"), default=["cb", "generate"],
                   help="HF contenders (default cb,generate; generate_batch runs every request to the longest)")
    b.add_argument("--ab", choices=["device-outputs"], default=None,
                   help="device-outputs: sampled ids back (on) against full logits back (off)")
    b.add_argument("--replicas", type=_int_list, default=[1], help="replica counts to run (scaling)")
    b.add_argument("--threads-per-worker", type=int, default=None,
                   help="torch threads per worker (default: cores // replicas)")
    b.add_argument("--serve", action="store_true", help="serving load: Poisson arrivals at --rate")
    b.add_argument("--rate", type=_rates, default=[1.0], help="requests per second (list; inf: all at once)")
    b.add_argument("--repeat", type=int, default=1, help="rounds of the offline runs (order reversed every other)")
    b.add_argument("--address", default=None, help="Ray address to join (default: this process's or a local one)")
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
    from cluster.vllm_peer import save_checkpoint
    from workers.loader import is_random_spec

    if not is_random_spec(model_spec):
        return model_spec
    slug = model_spec.split(":", 1)[1].replace("?", "-").replace("&", "-").replace("=", "")
    directory = directory or os.path.join(os.path.expanduser("~/.cache/raylm/checkpoints"), slug)
    t = time.perf_counter()
    save_checkpoint(model_spec, directory)
    log.info("%s as a checkpoint in %s (%.1fs)", model_spec, directory, time.perf_counter() - t)
    return directory


def _driver_model(model_spec: str, dtype: str):
    from workers.loader import is_random_spec, load_model, random_model

    return random_model(model_spec, dtype) if is_random_spec(model_spec) else load_model(model_spec, dtype)


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


class Bench:
    def __init__(self, a, model_spec: str, wl: Workload, vocab_size: int, cores: int):
        self.a, self.model_spec, self.wl, self.vocab_size, self.cores = a, model_spec, wl, vocab_size, cores
        self.runs: list[Run] = []
        self.serve_runs: list[Run] = []
        self.reference_outputs: dict[int, list[list[int]]] = {}  # batch size -> the base raylm run's ids
        self.peers: dict = {}  # batch size -> a VLLMPeer kept through the rounds
        self.report: dict = {}

    def spec(self, *, replicas: int, threads: int, device_outputs: bool = True, batch_size: int) -> EngineSpec:
        a = self.a
        dtype = None if a.compute_dtype == "auto" else a.compute_dtype
        return EngineSpec(self.model_spec, dtype, replicas, threads, device_outputs, batch_size, a.block_size,
                          kv_blocks_for(self.wl, a.block_size), a.max_num_batched_tokens, a.seed)

    def replica_configs(self) -> list[tuple[int, int]]:
        t = self.a.threads_per_worker
        cfgs = [(r, t or max(1, self.cores // r)) for r in self.a.replicas]
        if t is None and len(cfgs) > 1:
            least = min(th for _, th in cfgs)
            if (1, least) not in cfgs:
                cfgs.append((1, least))  # one replica with the threads each replica gets when split
        return cfgs

    def plan(self) -> None:
        a = self.a
        (r0, t0), *others = self.replica_configs()
        for bsz in a.batch_size:
            sfx = f" b={bsz}" if len(a.batch_size) > 1 else ""
            self.runs.append(Run("raylm" + sfx, "raylm", self.spec(replicas=r0, threads=t0, batch_size=bsz),
                                 reference=True))
            if a.ab:
                self.runs.append(Run("raylm host-logits" + sfx, "raylm",
                                     self.spec(replicas=r0, threads=t0, device_outputs=False, batch_size=bsz)))
            in_process = self.spec(replicas=1, threads=t0, batch_size=bsz)
            if "bare" in a.compare:
                self.runs.append(Run("bare" + sfx, "bare", in_process))
            if "vllm" in a.compare:
                self.runs.append(Run("vllm" + sfx, "vllm", in_process))
            if "hf" in a.compare:
                for m in a.hf_modes:
                    for dt in self.hf_dtypes():
                        name = f"hf-{m}" + ("" if dt == a.dtype else f" {dt}") + sfx
                        self.runs.append(Run(name, f"hf-{m}", dataclasses.replace(in_process, dtype=dt)))
        for r, t in others:
            self.runs.append(Run(f"raylm {r}x{t}t", "raylm", self.spec(replicas=r, threads=t, batch_size=a.batch_size[0])))

    def hf_dtypes(self) -> list[str]:
        return self.a.hf_dtypes or [self.a.dtype]

    # ---- running ----
    def execute(self) -> None:
        from workers.device import set_cpu_threads
        from workers.loader import cast_model, is_random_spec, resolve_dtype, weights_fingerprint

        a = self.a
        model = None
        if any(r.kind not in ("raylm", "vllm") for r in self.runs):
            t = time.perf_counter()
            model = _driver_model(self.model_spec, a.dtype)
            log.info("driver copy of the model built in %.1fs", time.perf_counter() - t)
        hfs = {dt: hf_model(model if dt == a.dtype else cast_model(model, resolve_dtype(dt), copy=True))
               for dt in self.hf_dtypes()} if any(r.kind.startswith("hf-") for r in self.runs) else {}
        mine = weights_fingerprint(model) if model is not None and is_random_spec(self.model_spec) else None
        for rnd in range(a.repeat):
            order = self.runs if rnd % 2 == 0 else self.runs[::-1]
            for run in order:
                log.info("round %d/%d: %s ...", rnd + 1, a.repeat, run.name)
                if run.kind == "raylm":
                    tag = f"{run.name.replace(' ', '_')}-r{rnd}"
                    fig, outs = run_raylm(run.spec, self.wl, self.vocab_size, a.profile, tag)
                elif run.kind == "vllm":
                    fig, outs = self.run_vllm(run)
                else:
                    set_cpu_threads(run.spec.threads)
                    if run.kind == "bare":
                        fig, outs = run_bare(model, run.spec, self.wl)
                    else:
                        fig, outs = HF_RUNNERS[run.kind[3:]](hfs[run.spec.dtype], self.wl, run.spec)
                        fig["compute_dtype"] = run.spec.dtype
                fig["round"] = rnd
                fig["lengths_ok"] = [len(o) for o in outs] == self.wl.output_lens
                if run.kind == "raylm" and mine is not None:  # the workers built the weights the peers use
                    fig["weights_match_driver"] = all(
                        f is not None and math.isclose(f, mine, rel_tol=1e-9) for f in fig["weights_fingerprints"])
                if run.reference:
                    self.reference_outputs.setdefault(run.spec.batch_size, outs)
                else:  # greedy on the same weights: how often each system made raylm's tokens
                    fig.update(agreement(outs, self.reference_outputs.get(run.spec.batch_size)))
                run.rounds.append(fig)
                log.info("%s: %.2f output tok/s (%.1fs)", run.name, fig["output_tok_s"], fig["elapsed_s"])
                self.write_json()

    def run_vllm(self, run: Run) -> tuple[dict, list[list[int]]]:
        from cluster.bench_runs import _figures
        from cluster.vllm_peer import VLLMPeer
        from workers.ops.cpu_features import cpu_class

        a = self.a
        peer = self.peers.get(run.spec.batch_size)
        if peer is None:
            dtype = a.vllm_dtype
            if dtype == "auto":
                dtype = "bfloat16" if cpu_class() in ("amx_bf16", "avx512_bf16") else "float32"
            log_path = os.path.join(os.path.dirname(a.json or "") or ".", "vllm-peer.log")
            t = time.perf_counter()
            peer = VLLMPeer(self.model_spec, dtype=dtype, max_num_seqs=run.spec.batch_size,
                            max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
                            threads=run.spec.threads, venv=a.peers_venv, log_path=log_path)
            peer.dtype = dtype
            log.info("vLLM %s up in %.1fs (log %s)", peer.version, time.perf_counter() - t, log_path)
            self.peers[run.spec.batch_size] = peer
        elapsed, outs = peer.run(self.wl.prompts, self.wl.output_lens)
        fig = _figures(self.wl, elapsed, sum(map(len, outs)), [], [])
        fig.update(launch_s=peer.launch_s, vllm_version=peer.version, compute_dtype=peer.dtype)
        return fig, outs

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()

    def execute_serve(self) -> None:
        a = self.a
        r0, t0 = self.replica_configs()[0]
        spec = self.spec(replicas=r0, threads=t0, batch_size=a.batch_size[0])
        workloads = []
        for i, rate in enumerate(a.rate):  # fresh prompts per rate: no prefix-cache hits across rates
            wl = self.wl if i == 0 else make_workload(a.num_requests, a.input_len, a.output_len, self.vocab_size,
                                                      a.seed + i)
            workloads.append((rate, wl))
        spec.num_kv_blocks = max(kv_blocks_for(wl, a.block_size) for _, wl in workloads)
        for (rate, _), fig in zip(workloads, run_serve(spec, workloads, self.vocab_size, a.seed)):
            run = Run(f"serve rate={rate:g}", "serve", spec, rounds=[fig])
            self.serve_runs.append(run)
        self.write_json()

    # ---- reporting ----
    def ratios(self) -> dict:
        by = {r.name: r.summary() for r in self.runs if r.rounds}
        out, targets = {}, {}

        def tok(name):
            return by.get(name, {}).get("output_tok_s")

        for bsz in self.a.batch_size:
            sfx = f" b={bsz}" if len(self.a.batch_size) > 1 else ""
            ray_tok = tok("raylm" + sfx)
            if ray_tok is None:
                continue
            hf = {r.name: tok(r.name) for r in self.runs
                  if r.kind.startswith("hf-") and r.spec.batch_size == bsz and tok(r.name)}
            for name, v in hf.items():
                out[f"raylm / {name}"] = ray_tok / v
            if hf:
                best = max(hf, key=hf.get)
                out[f"raylm / best hf ({best})"] = ray_tok / hf[best]
                targets[f"raylm >= 2x best HF{sfx}"] = (ray_tok / hf[best], 2.0)
            if tok("raylm host-logits" + sfx):
                v = ray_tok / tok("raylm host-logits" + sfx)
                out[f"device outputs / host logits{sfx}"] = v
                targets[f"device outputs >= 1.15x host logits{sfx}"] = (v, 1.15)
            if tok("vllm" + sfx):
                v = ray_tok / tok("vllm" + sfx)
                out[f"raylm / vllm{sfx}"] = v
                targets[f"raylm >= 1.25x vLLM{sfx}"] = (v, 1.25)
            if tok("bare" + sfx):
                v = ray_tok / tok("bare" + sfx)
                out[f"engine / bare step loop{sfx}"] = v
                targets[f"engine >= 0.9x bare step loop{sfx}"] = (v, 0.9)
        cfgs = self.replica_configs()
        if len(cfgs) > 1:
            r0, t0 = cfgs[0]
            b0 = self.a.batch_size[0]
            base = tok("raylm" + (f" b={b0}" if len(self.a.batch_size) > 1 else ""))
            for r, t in cfgs[1:]:
                v = tok(f"raylm {r}x{t}t")
                if v is None or base is None:
                    continue
                out[f"{r} replica{'s' if r > 1 else ''} x {t} threads / {r0} replica x {t0} threads"] = v / base
                same = None if r == 1 else base if (r0, t0) == (1, t) else tok(f"raylm 1x{t}t")
                if same:  # each replica owns what one replica owned: the data-parallel scaling figure
                    out[f"{r} replicas x {t} threads / 1 replica x {t} threads"] = v / same
                    targets[f"{r} replicas >= 1.6x 1 replica ({t} threads each)"] = (v / same, 1.6)
        self.report["ratios"] = out
        self.report["targets"] = {k: {"value": v, "target": t, "met": v >= t} for k, (v, t) in targets.items()}
        return out

    def write_json(self) -> None:
        if not self.a.json:
            return
        self.ratios()
        doc = {"command": ["raylm", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else sys.argv,
               "model": self.model_spec, "dtype": self.a.dtype, "workload": self.wl.describe(),
               "config": {k: v for k, v in vars(self.a).items() if k != "func"},
               "machine": self.report.get("machine"), "runs": [r.to_dict() for r in self.runs if r.rounds],
               "serve": [r.to_dict() for r in self.serve_runs], "ratios": self.report["ratios"],
               "targets": self.report["targets"]}
        tmp = self.a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, self.a.json)

    def print_report(self, out=sys.stdout) -> None:
        def ms(s, k):
            p50, p99 = s.get(f"{k}_p50_ms"), s.get(f"{k}_p99_ms")
            return "-" if p50 is None else f"{p50:.0f}/{p99:.0f}"

        wl = self.wl.describe()
        print(f"\n# raylm bench: {self.model_spec}, {self.a.dtype} weights; {wl['num_requests']} requests, prompts "
              f"{wl['prompt_len_min']}-{wl['prompt_len_max']} ({wl['prompt_tokens']} tokens), outputs "
              f"{wl['output_len_min']}-{wl['output_len_max']} ({wl['output_tokens']} tokens); "
              f"{self.a.repeat} round(s), medians", file=out)
        rows = self.runs + self.serve_runs
        head = (f"{'run':<22} {'computes':>8} {'batch':>5} {'repl x thr':>10} {'out tok/s':>10} {'total tok/s':>11} "
                f"{'elapsed s':>9} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'B/decode step':>13}")
        print(head, file=out)
        for r in rows:
            if not r.rounds:
                continue
            s = r.summary()
            bps = s.get("bytes_per_decode_step")
            rep = f"{r.spec.replicas}x{r.spec.threads}" if r.kind in ("raylm", "serve") else f"-x{r.spec.threads}"
            dt = ",".join(sorted({_SHORT.get(f.get("compute_dtype"), "?") for f in r.rounds}))
            print(f"{r.name:<22} {dt:>8} {r.spec.batch_size:>5} {rep:>10} {s['output_tok_s']:>10.2f} "
                  f"{s['total_tok_s']:>11.2f} {s['elapsed_s']:>9.1f} {ms(s, 'ttft'):>16} {ms(s, 'tpot'):>16} {ms(s, 'itl'):>15} "
                  f"{'-' if bps is None else f'{bps:.0f}':>13}", file=out)
        ratios = self.ratios()
        if ratios:
            print("\n# ratios (output tokens/s)", file=out)
            for k, v in ratios.items():
                print(f"{k:<58} {v:6.2f}", file=out)
        for k, t in self.report["targets"].items():
            print(f"target {k}: {t['value']:.2f} ({'met' if t['met'] else 'MISSED'})", file=out)
        bad = [r.name for r in rows for f in r.rounds if not f.get("lengths_ok", True)
               or f.get("weights_match_driver") is False]
        if bad:
            print(f"WARNING: lengths or weights did not check out in: {sorted(set(bad))}", file=out)

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        title = f"{self.model_spec}, {self.a.dtype} weights, {self.wl.num_requests} requests"
        if self.serve_runs:
            fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
            rates = [r.rounds[0]["rate"] for r in self.serve_runs]
            finite = [x for x in rates if math.isfinite(x)]
            inf_x = 2 * max(finite) if finite else 1.0
            xs = [x if math.isfinite(x) else inf_x for x in rates]
            ax.plot(xs, [r.rounds[0]["output_tok_s"] for r in self.serve_runs], "o-", label="raylm")
            for k, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("tpot_p50_ms", "s-"), ("itl_p99_ms", "s--")):
                ax2.plot(xs, [r.rounds[0][k] for r in self.serve_runs], style, label=k.replace("_ms", " (ms)"))
            for a_ in (ax, ax2):
                a_.set_xticks(xs, [f"{x:g}" for x in rates])
                a_.set_xlabel("request rate (req/s)")
            ax.set_ylabel("output tokens/s")
            ax2.set_ylabel("ms")
            ax2.set_yscale("log")
            ax2.legend(fontsize=7)
        else:
            fig, ax = plt.subplots(figsize=(7, 4))
            groups: dict[str, list] = {}
            for r in self.runs:
                if r.rounds:
                    base = r.name.split(" b=")[0]
                    groups.setdefault(base, []).append((r.spec.batch_size, r.summary()["output_tok_s"]))
            if len(self.a.batch_size) > 1:
                for name, pts in groups.items():
                    pts.sort()
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("batch size (max sequences per step)")
                ax.legend(fontsize=8)
            else:
                names = list(groups)
                bars = ax.bar(names, [groups[n][0][1] for n in names])
                ax.bar_label(bars, fmt="%.1f", fontsize=8)
                ax.set_xlabel(f"batch size {self.a.batch_size[0]}")
                ax.tick_params(axis="x", labelrotation=20, labelsize=8)
            ax.set_ylabel("output tokens/s (tokens asked for)")
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)


def run(a: argparse.Namespace) -> int:
    import cluster

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
        bench.print_report()
        bench.write_json()
        if a.plot:
            bench.plot(a.plot)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`raylm bench ...` in this process (joins an initialized Ray)."""
    from cluster.cli import main as cli_main

    return cli_main(["bench", *(argv or [])])
