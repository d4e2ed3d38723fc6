"""vLLM's CPU build as a bench contender: the same checkpoint, the same requests, in a subprocess.

raylm never imports vLLM. The driver side (`VLLMPeer`) starts this very file as a script with
the peers venv's python (`make peers`, default .venv-peers, or RAYLM_PEERS_VENV / --peers-venv),
sends it the workload as JSON lines on stdin and reads results as JSON lines on stdout. The
script side (`serve_requests`, run under `__main__`) imports nothing of raylm: it builds
`vllm.LLM` once (inductor compiles on the first start), warms it up, and for each request
resets the prefix cache (so no round hits another's cached prompts), generates greedily with
ignore_eos, and reports the wall time and every output's token ids.

`save_checkpoint` writes a random model spec as a real checkpoint directory (HF
`save_pretrained`, bf16 weights as raylm's random spec builds them, and a word-level tokenizer
with exactly the vocab's ids, so neither side trims the vocab) that both engines load.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

READY = "ready"


# ---- driver side (raylm's venv) ----------------------------------------------------------

def peers_python(venv: str | None = None) -> str:
    venv = venv or os.environ.get("RAYLM_PEERS_VENV") or ".venv-peers"
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        raise ValueError(f"peers venv {venv!r} has no bin/python: run `make peers PEERS_VENV={venv}`")
    return python


def save_checkpoint(model_spec: str, directory: str) -> str:
    """The random model `model_spec` names, saved as an HF checkpoint with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from cluster.bench.hf_runs import hf_model
    from workers.loader import random_model

    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    os.makedirs(directory, exist_ok=True)
    model = random_model(model_spec)  # the spec's own dtype (bf16), as each raylm worker builds it
    hf = hf_model(model)
    hf.config.torch_dtype = model.dtype
    hf.config.eos_token_id = None
    hf.save_pretrained(directory, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(directory)
    del hf, model
    return directory


def peer_dtype(requested: str = "auto") -> str:
    """auto: float32 on a CPU without AVX512-BF16/AMX (no fast bf16 matmul there; raylm computes
    fp32 too, so both run the same arithmetic), else bfloat16."""
    if requested != "auto":
        return requested
    from workers.ops.cpu_features import cpu_class

    return "bfloat16" if cpu_class() in ("amx_bf16", "avx512_bf16") else "float32"


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until /proc says pid is stopped (or gone, or timeout_s passed; no /proc: return at once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.001)


class VLLMPeer:
    """One vLLM engine in a subprocess for the life of the object; `run` may be called repeatedly.

    Between runs its processes (the script, vLLM's engine core and worker: one process group)
    are stopped (SIGSTOP), so an idle vLLM takes no CPU from the system measured next: measured
    here, raylm's engine made 42.7 tok/s beside an idle vLLM and 49.6 alone."""

    def __init__(self, checkpoint: str, *, dtype: str, max_num_seqs: int, max_num_batched_tokens: int,
                 block_size: int | None, threads: int, kv_space_gib: int = 4, venv: str | None = None,
                 max_model_len: int | None = None, log_path: str | None = None, profile: bool = False,
                 speculative_config: dict | None = None) -> None:
        env = dict(os.environ)
        if profile:  # the engine core in the script's own process, where torch.profiler sees its ops
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0", OMP_NUM_THREADS=str(threads),
                   # a loaded machine can take more than vLLM's default 10 minutes to compile and warm up
                   VLLM_ENGINE_READY_TIMEOUT_S="3600", VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="3600")
        env.pop("PYTHONPATH", None)  # nothing of raylm's venv leaks into vLLM's
        if log_path:
            os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen([peers_python(venv), os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        t0 = time.perf_counter()
        self._send({"model": checkpoint, "dtype": dtype, "max_num_seqs": max_num_seqs,
                    "max_num_batched_tokens": max_num_batched_tokens, "block_size": block_size,
                    "max_model_len": max_model_len, "profile": profile,
                    "speculative_config": speculative_config})
        ready = self._receive()
        self.launch_s = time.perf_counter() - t0
        self.version = ready.get("version")
        self.dtype = dtype
        self.last_profile = None
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        """sig to the peer's whole process group (vLLM's own processes included). A stop returns
        once the script is seen stopped: a signal is delivered asynchronously, and the system
        measured next must not start while the peer still runs."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            if sig == signal.SIGSTOP:
                _wait_stopped(self.proc.pid)

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                msg = json.loads(line)
                if "error" in msg:
                    raise RuntimeError(f"vLLM peer failed: {msg['error']}")
                return msg
        raise RuntimeError(f"vLLM peer exited with code {self.proc.wait()} (see its log)")

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> tuple[float, list[list[int]]]:
        """Wall seconds for the whole batch, and each request's output ids. A peer started with
        profile=True keeps the run's op rows (`op_rows`) in `last_profile`."""
        self._signal(signal.SIGCONT)
        try:
            self._send({"prompts": prompts, "output_lens": output_lens})
            msg = self._receive()
        finally:
            self._signal(signal.SIGSTOP)
        self.last_profile = msg.get("profile")
        return msg["elapsed"], msg["outputs"]

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self.proc.poll() is None:
            try:
                self._send({"quit": True})
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._signal(signal.SIGKILL)  # the script and vLLM's processes with it
        self.log.close()

    def __enter__(self) -> VLLMPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- both sides -----------------------------------------------------------------------------

def op_rows(prof) -> list[dict]:
    """A finished torch.profiler run as plain rows (op name, input shapes, self CPU microseconds,
    calls), for `cluster.bench.op_profile` to sort into categories. Needs record_shapes=True."""
    return [{"op": e.key, "shapes": str(e.input_shapes), "self_us": e.self_cpu_time_total, "calls": e.count}
            for e in prof.key_averages(group_by_input_shape=True) if e.self_cpu_time_total > 0]


# ---- script side (the peers venv; imports nothing of raylm) --------------------------------

_PROTOCOL = None  # the pipe to the driver; vLLM's own logging (to stdout) goes to stderr instead


def _reply(message: dict) -> None:
    _PROTOCOL.write(json.dumps(message) + "\n")
    _PROTOCOL.flush()


def serve_requests() -> None:
    import random

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = json.loads(sys.stdin.readline())
    kwargs = {}
    if config.get("max_model_len"):
        kwargs["max_model_len"] = config["max_model_len"]
    if config.get("block_size"):  # None: vLLM's own (its CPU attention takes multiples of 32 here)
        kwargs["block_size"] = config["block_size"]
    if config.get("speculative_config"):
        kwargs["speculative_config"] = config["speculative_config"]
    llm = LLM(model=config["model"], dtype=config["dtype"], max_num_seqs=config["max_num_seqs"],
              max_num_batched_tokens=config["max_num_batched_tokens"], enable_prefix_caching=True, seed=0, **kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(12345)
    warm = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(24)]) for _ in range(2)]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    _reply({READY: True, "version": vllm.__version__})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            break
        llm.reset_prefix_cache()
        prompts = [TokensPrompt(prompt_token_ids=p) for p in msg["prompts"]]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
                  for n in msg["output_lens"]]
        reply = {}
        with contextlib.ExitStack() as stack:
            if config.get("profile"):
                from torch.profiler import ProfilerActivity, profile
                prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU], record_shapes=True))
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            reply["elapsed"] = time.perf_counter() - t0
        if config.get("profile"):
            reply["profile"] = op_rows(prof)
        reply["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        _reply(reply)


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its sibling modules must not shadow vLLM's imports
    _PROTOCOL = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # fd 1 (and every process vLLM spawns) now writes to the log
    try:
        serve_requests()
    except Exception as e:  # the driver reads the reason instead of a bare exit code
        _reply({"error": f"{type(e).__name__}: {e}"})
        raise
