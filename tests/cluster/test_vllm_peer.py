"""The vLLM contender's subprocess protocol, against a stand-in `vllm` package in a fake peers
venv (the real one is too big for tests): requests go over, the prefix cache is reset before
every run, outputs come back per request in order; a missing venv or a failing engine is an
error that names it."""

from __future__ import annotations

import os
import stat
import sys
import textwrap

import pytest

from cluster.bench.op_profile import BETWEEN, category, summarize
from cluster.bench.vllm_peer import VLLMPeer, peers_python

FAKE_VLLM = '''
__version__ = "0.0-fake"
RESETS = []


class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos, detokenize=True):
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, ids):
        self.token_ids = ids


class _Output:
    def __init__(self, ids):
        self.outputs = [_Completion(ids)]


class _Config:
    def get_vocab_size(self):
        return 1000


class _Engine:
    model_config = _Config()


class LLM:
    def __init__(self, model, **kw):
        if model == "broken":
            raise RuntimeError("no such checkpoint")
        self.llm_engine = _Engine()
        self.resets = 0

    def reset_prefix_cache(self):
        self.resets += 1

    def generate(self, prompts, params, use_tqdm=False):
        if not isinstance(params, list):
            params = [params] * len(prompts)
        import torch  # some op work a profiled run sees (the fake runs on raylm's own python)
        torch.mm(torch.ones(4, 8), torch.ones(8, 1000))
        # each output: the prompt's first id, its length, then the run number, to max_tokens
        return [_Output(([p["prompt_token_ids"][0], len(p["prompt_token_ids"])] + [self.resets] * s.max_tokens)
                        [: s.max_tokens]) for p, s in zip(prompts, params)]
'''


@pytest.fixture
def fake_venv(tmp_path):
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM + "\nfrom vllm import inputs\n")
    (pkg / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    python = bindir / "python"
    python.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        PYTHONPATH={tmp_path / 'site'} exec {sys.executable} "$@"
        """))
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path / "venv")


def peer(venv, model="ckpt", **kw):
    return VLLMPeer(model, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                    threads=1, venv=venv, **kw)


def test_requests_go_over_and_outputs_come_back_in_order_with_the_cache_reset_each_run(fake_venv):
    with peer(fake_venv) as p:
        assert p.version == "0.0-fake" and p.dtype == "float32"
        elapsed, outs = p.run([[7, 8, 9], [5]], [4, 2])
        assert elapsed >= 0
        assert outs == [[7, 3, 1, 1], [5, 1]]  # reset once before the first run
        _, outs = p.run([[7, 8, 9]], [3])
        assert outs == [[7, 3, 2]]  # and again before the second
    assert p.proc.poll() is not None  # closed: the subprocess is gone


def test_an_engine_that_fails_to_start_raises_its_reason(fake_venv):
    with pytest.raises(RuntimeError, match="no such checkpoint"):
        peer(fake_venv, model="broken")


def test_a_missing_peers_venv_is_named(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"peers venv '{missing}' has no bin/python"):
        peers_python(missing)
    assert os.path.exists(peers_python(os.path.dirname(os.path.dirname(sys.executable))))


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]  # R, S, T (stopped), ...


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_the_peer_is_stopped_between_runs_so_it_takes_no_cpu_from_the_next_system(fake_venv):
    with peer(fake_venv) as p:
        assert _state(p.proc.pid) == "T"  # up, and stopped until its first run
        _, outs = p.run([[7, 8, 9]], [2])
        assert outs == [[7, 3]]
        assert _state(p.proc.pid) == "T"  # stopped again once its run is back
    assert p.proc.poll() is not None  # a stopped peer still closes


def test_a_profiled_peer_sends_its_op_rows_and_they_sort_into_categories(fake_venv):
    with peer(fake_venv, profile=True) as p:
        elapsed, outs = p.run([[7, 8, 9]], [2])
        rows = p.last_profile
    assert outs == [[7, 3]]
    mm = [r for r in rows if r["op"] == "aten::mm"]
    assert len(mm) == 1 and mm[0]["calls"] == 1 and "1000" in mm[0]["shapes"]
    spent = summarize(rows, elapsed, vocab_size=1000)
    assert spent["GEMM, lm_head"] == pytest.approx(mm[0]["self_us"] / 1e6)  # its shape holds the vocab
    assert spent[BETWEEN] >= 0 and sum(spent.values()) == pytest.approx(max(elapsed, sum(
        r["self_us"] for r in rows) / 1e6))
    with peer(fake_venv) as p:
        p.run([[7]], [1])
        assert p.last_profile is None  # not profiled unless asked


def test_op_categories():
    assert category("raylm::narrow_linear", "[[64, 6144], [64, 1024]]", 151936) == "GEMM, layers"
    for op in ("onednn::qlinear_pointwise", "raylm::quant_rows_int8", "_C::int8_scaled_mm_with_quant"):
        assert category(op, "[[64, 1024]]", 151936).startswith("GEMM, quantized layers"), op
    assert category("_C::onednn_mm", "[[64, 151936], [64, 1024]]", 151936) == "GEMM, lm_head"
    assert category("raylm::narrow_linear_argmax", "[[64, 1024], [9496, 1024, 16], []]", 151936) == "GEMM, lm_head"
    assert category("_C::cpu_attention_with_kv_cache", "[]", 151936) == "attention"
    assert category("raylm::silu_and_mul", "[]", 151936) == "norms, RoPE, SwiGLU"
    assert category("aten::argmax", "[]", 151936) == "sampling over the vocab"
    assert category("## Call CompiledFxGraph None ##", "[]", 151936) == "compiled elementwise (inductor)"
    assert category("aten::index_select", "[]", 151936) == "copies, indexing, cache writes"
    # the packed bf16 linear: logits into y [64, vocab] are the lm_head; rows read back are the embedding's lookups
    assert category("raylm::packed_bf16_linear", "[[64, 151936], [64, 1024], [9496, 512, 32], []]", 151936) \
        == "GEMM, lm_head"
    assert category("raylm::packed_bf16_linear", "[[64, 6144], [64, 1024], [384, 512, 32], []]", 151936) \
        == "GEMM, layers"
    assert category("raylm::packed_bf16_rows", "[[64, 1024], [9496, 512, 32], [64]]", 151936) \
        == "copies, indexing, cache writes"
    assert category("aten::something_new", "[]", 151936) == "other ops"
