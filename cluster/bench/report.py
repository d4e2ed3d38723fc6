"""What `raylm bench` reports: the ratios between contenders and the targets they meet or
miss, the printed table, and the JSON document (rewritten after every run)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.bench.suite import Bench

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
LONG_PROMPT = 512  # prompts this long and longer: the long-prompt workload, whose goal against vLLM is 1.1x


def ratios(bench: Bench) -> dict:
    """Output tokens/s of raylm over each contender (medians over rounds); the targets, met or
    not, go into bench.report beside them."""
    by = {r.name: r.summary() for r in bench.runs if r.rounds}
    out, targets = {}, {}

    def tok(name):
        return by.get(name, {}).get("output_tok_s")

    for bsz in bench.a.batch_size:
        sfx = f" b={bsz}" if len(bench.a.batch_size) > 1 else ""
        ray_tok = tok("raylm" + sfx)
        if ray_tok is None:
            continue
        hf = {r.name: tok(r.name) for r in bench.runs
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
            if bench.a.input_len[0] >= LONG_PROMPT:  # the long-prompt workload's goal (issue 35)
                targets[f"raylm >= 1.1x vLLM, prompts of {LONG_PROMPT}+ tokens{sfx}"] = (v, 1.1)
            else:
                targets[f"raylm >= 1.25x vLLM{sfx}"] = (v, 1.25)
        if tok("bare" + sfx):
            v = ray_tok / tok("bare" + sfx)
            out[f"engine / bare step loop{sfx}"] = v
            targets[f"engine >= 0.9x bare step loop{sfx}"] = (v, 0.9)
    cfgs = bench.replica_configs()
    if len(cfgs) > 1:
        r0, t0 = cfgs[0]
        b0 = bench.a.batch_size[0]
        base = tok("raylm" + (f" b={b0}" if len(bench.a.batch_size) > 1 else ""))
        for r, t in cfgs[1:]:
            v = tok(f"raylm {r}x{t}t")
            if v is None or base is None:
                continue
            out[f"{r} replica{'s' if r > 1 else ''} x {t} threads / {r0} replica x {t0} threads"] = v / base
            same = None if r == 1 else base if (r0, t0) == (1, t) else tok(f"raylm 1x{t}t")
            if same:  # each replica owns what one replica owned: the data-parallel scaling figure
                out[f"{r} replicas x {t} threads / 1 replica x {t} threads"] = v / same
                targets[f"{r} replicas >= 1.6x 1 replica ({t} threads each)"] = (v / same, 1.6)
    bench.report["ratios"] = out
    bench.report["targets"] = {k: {"value": v, "target": t, "met": v >= t} for k, (v, t) in targets.items()}
    return out


def write_json(bench: Bench) -> None:
    """Every figure so far to --json (atomically: a reader never sees half a file)."""
    if not bench.a.json:
        return
    ratios(bench)
    doc = {"command": ["raylm", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else sys.argv,
           "model": bench.model_spec, "dtype": bench.a.dtype, "workload": bench.wl.describe(),
           "config": {k: v for k, v in vars(bench.a).items() if k != "func"},
           "machine": bench.report.get("machine"), "runs": [r.to_dict() for r in bench.runs if r.rounds],
           "serve": [r.to_dict() for r in bench.serve_runs], "ratios": bench.report["ratios"],
           "targets": bench.report["targets"]}
    tmp = bench.a.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, bench.a.json)


def print_report(bench: Bench, out=sys.stdout) -> None:
    """The table of runs, the ratios and the targets."""
    def ms(s, k):
        p50, p99 = s.get(f"{k}_p50_ms"), s.get(f"{k}_p99_ms")
        return "-" if p50 is None else f"{p50:.0f}/{p99:.0f}"

    wl = bench.wl.describe()
    print(f"\n# raylm bench: {bench.model_spec}, {bench.a.dtype} weights; {wl['num_requests']} requests, prompts "
          f"{wl['prompt_len_min']}-{wl['prompt_len_max']} ({wl['prompt_tokens']} tokens), outputs "
          f"{wl['output_len_min']}-{wl['output_len_max']} ({wl['output_tokens']} tokens); "
          f"{bench.a.repeat} round(s), medians", file=out)
    rows = bench.runs + bench.serve_runs
    head = (f"{'run':<22} {'computes':>8} {'batch':>5} {'repl x thr':>10} {'out tok/s':>10} {'total tok/s':>11} "
            f"{'elapsed s':>9} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} "
            f"{'B/decode step':>13}")
    print(head, file=out)
    for r in rows:
        if not r.rounds:
            continue
        s = r.summary()
        bps = s.get("bytes_per_decode_step")
        rep = f"{r.spec.replicas}x{r.spec.threads}" if r.kind in ("raylm", "serve") else f"-x{r.spec.threads}"
        dt = ",".join(sorted({_SHORT.get(f.get("compute_dtype"), "?") for f in r.rounds}))
        print(f"{r.name:<22} {dt:>8} {r.spec.batch_size:>5} {rep:>10} {s['output_tok_s']:>10.2f} "
              f"{s['total_tok_s']:>11.2f} {s['elapsed_s']:>9.1f} {ms(s, 'ttft'):>16} {ms(s, 'tpot'):>16} "
              f"{ms(s, 'itl'):>15} "
              f"{'-' if bps is None else f'{bps:.0f}':>13}", file=out)
    for r in rows:
        spec = [f for f in r.rounds if f.get("spec_acceptance_rate") is not None]
        if spec:
            f = spec[0]
            print(f"{r.name}: speculative decoding {r.spec.speculative_config}: acceptance "
                  f"{f['spec_acceptance_rate']:.2f} ({f['spec_accepted_tokens']} of {f['spec_draft_tokens']} drafted), "
                  f"{f['spec_mean_accepted_length']:.2f} tokens per verifying row (first round)", file=out)
    held = [f["weight_bytes"] for r in bench.runs if r.kind == "raylm" for f in r.rounds if f.get("weight_bytes")]
    if held:
        on_disk = sum(p.stat().st_size for p in Path(bench.model_spec).glob("*.safetensors"))
        print(f"\nweights a raylm worker holds: {max(held) / 2**30:.2f} GiB"
              + (f" (the checkpoint's safetensors: {on_disk / 2**30:.2f} GiB)" if on_disk else ""), file=out)
    table = ratios(bench)
    if table:
        print("\n# ratios (output tokens/s)", file=out)
        for k, v in table.items():
            print(f"{k:<58} {v:6.2f}", file=out)
    for k, t in bench.report["targets"].items():
        print(f"target {k}: {t['value']:.2f} ({'met' if t['met'] else 'MISSED'})", file=out)
    bad = [r.name for r in rows for f in r.rounds if not f.get("lengths_ok", True)
           or f.get("weights_match_driver") is False]
    if bad:
        print(f"WARNING: lengths or weights did not check out in: {sorted(set(bad))}", file=out)
