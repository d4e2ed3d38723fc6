"""YaRN through the whole model: logits equal HF's at positions past
original_max_position_embeddings (dense and MoE), and the served length is the scaled one."""

from __future__ import annotations

import pytest
import torch

from tests.workers.moe_checkpoints import SHAPES
from tests.workers.test_model import BS, hf_logits, make_cache, run
from workers.loader import bundled_model_path, load_model
from workers.ops.metadata import SequenceRows, build_metadata
from workers.runner import ModelRunner
from workers.runner_config import RunnerConfig

ORIGINAL = 32
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0}


def _save(tmp_path, moe: bool) -> str:
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPES["top2"], max_position_embeddings=ORIGINAL,
                                                   rope_parameters=dict(YARN), initializer_range=0.2))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=131, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             max_position_embeddings=ORIGINAL, rope_parameters=dict(YARN),
                                             initializer_range=0.2))
    d = tmp_path / ("moe" if moe else "dense")
    model.to(torch.float32).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{bundled_model_path()}/{name}", d / name)
    return str(d)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_yarn_logits_equal_hfs_past_the_original_length(tmp_path, moe):
    from transformers import AutoModelForCausalLM

    path = _save(tmp_path, moe)
    model = load_model(path)
    assert model.config.max_model_len == ORIGINAL * 4
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [int(i) for i in torch.randint(0, 131, (110,), generator=torch.Generator().manual_seed(1))]
    cache = make_cache(model, num_blocks=40)
    attn = build_metadata([SequenceRows(0, len(prompt), list(range(3, 3 + -(-len(prompt) // BS))))],
                          num_decode=0, block_size=BS)
    ours = run(model, cache, prompt, range(len(prompt)), attn)
    want = hf_logits(hf, prompt)
    torch.testing.assert_close(ours[ORIGINAL:], want[ORIGINAL:], atol=1e-4, rtol=1e-4)  # past the original length
    plain = dict(model.named_parameters())
    assert all(torch.equal(p, plain[n]) for n, p in load_model(path).named_parameters())


def test_the_runner_serves_the_scaled_length_and_refuses_more(tmp_path):
    path = _save(tmp_path, moe=False)
    runner = ModelRunner(RunnerConfig(model=path, block_size=BS, num_kv_blocks=64, max_num_seqs=2))
    assert runner.max_model_len == ORIGINAL * 4
    with pytest.raises(ValueError, match=rf"max_model_len {ORIGINAL * 4 + 1} exceeds the model's scaled RoPE "
                                         rf"length {ORIGINAL * 4}"):
        ModelRunner(RunnerConfig(model=path, block_size=BS, num_kv_blocks=64, max_num_seqs=2,
                                 max_model_len=ORIGINAL * 4 + 1))
