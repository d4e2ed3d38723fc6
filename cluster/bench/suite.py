"""The runs of one `raylm bench` invocation: which contenders in which configurations
(the plan), taking turns round after round (execute), or one engine under Poisson load
(execute_serve)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field

from cluster.bench.contenders import EngineSpec, run_bare, run_raylm, run_serve
from cluster.bench.figures import agreement
from cluster.bench.hf_runs import HF_RUNNERS, hf_model
from cluster.bench.report import write_json
from cluster.bench.workload import Workload, blocks_needed, kv_blocks_for, make_workload

log = logging.getLogger("raylm.bench")


@dataclass
class Run:
    name: str
    kind: str  # raylm | bare | vllm | hf-cb | hf-generate | hf-generate_batch | serve
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


def driver_model(model_spec: str, dtype: str):
    """This process's copy of the model, for the contenders that run here (bare loop, HF)."""
    from workers.loader import is_random_spec, load_model, random_model

    return random_model(model_spec, dtype) if is_random_spec(model_spec) else load_model(model_spec, dtype)


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
                          kv_blocks_for(self.wl, a.block_size), a.max_num_batched_tokens, a.seed,
                          getattr(a, "speculative_config", None))

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
            spec = self.spec(replicas=r, threads=t, batch_size=a.batch_size[0])
            self.runs.append(Run(f"raylm {r}x{t}t", "raylm", spec))

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
            model = driver_model(self.model_spec, a.dtype)
            log.info("driver copy of the model built in %.1fs", time.perf_counter() - t)
        hfs = {dt: hf_model(model if dt == a.dtype else cast_model(model, resolve_dtype(dt), copy=True))
               for dt in self.hf_dtypes()} if any(r.kind.startswith("hf-") for r in self.runs) else {}
        mine = weights_fingerprint(model) if model is not None and is_random_spec(self.model_spec) else None
        for run in self.runs:  # vLLM starts (and compiles) first: a failure shows before any long run
            if run.kind == "vllm":
                self.peer(run)
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
                write_json(self)

    def run_vllm(self, run: Run) -> tuple[dict, list[list[int]]]:
        """vLLM on the same checkpoint and requests; one engine per batch size, kept for all rounds."""
        from cluster.bench.figures import throughput_figures

        peer = self.peer(run)
        elapsed, outs = peer.run(self.wl.prompts, self.wl.output_lens)
        fig = throughput_figures(self.wl, elapsed, sum(map(len, outs)), [], [])
        fig.update(launch_s=peer.launch_s, vllm_version=peer.version, compute_dtype=peer.dtype)
        return fig, outs

    def peer_kv_gib(self, dtype: str) -> int:
        """vLLM's KV cache space (GiB): the workload's every request at once, twice over, 1 to 4 GiB (a
        fixed 4 GiB beside a big MoE model's weights ran this machine out of memory)."""
        from workers.loader import load_config

        c = load_config(self.model_spec)
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * (4 if dtype == "float32" else 2)
        need = 2 * per_token * blocks_needed(self.wl.prompts, self.wl.output_lens, 1)
        return max(1, min(4, -(-need // 2**30)))

    def longest_request(self) -> int:
        """The workload's longest prompt + output: vLLM's max_model_len, which it refuses to start
        without KV space for (the model's own, 40,960 for Qwen3, needs more than peer_kv_gib)."""
        return max(len(p) + n for p, n in zip(self.wl.prompts, self.wl.output_lens, strict=True))

    def peer(self, run: Run):
        """The vLLM engine of this run's batch size, started on first use and kept for all rounds."""
        from cluster.bench.vllm_peer import VLLMPeer, peer_dtype

        a = self.a
        peer = self.peers.get(run.spec.batch_size)
        if peer is None:
            log_path = os.path.join(os.path.dirname(a.json or "") or ".", "vllm-peer.log")
            dtype = peer_dtype(a.vllm_dtype)
            peer = VLLMPeer(self.model_spec, dtype=dtype, max_num_seqs=run.spec.batch_size,
                            max_num_batched_tokens=a.max_num_batched_tokens, block_size=None,
                            threads=run.spec.threads, kv_space_gib=self.peer_kv_gib(dtype), venv=a.peers_venv,
                            max_model_len=self.longest_request(), log_path=log_path)
            log.info("vLLM %s (%s) up in %.1fs; its log: %s", peer.version, peer.dtype, peer.launch_s, log_path)
            self.peers[run.spec.batch_size] = peer
        return peer

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
        write_json(self)
