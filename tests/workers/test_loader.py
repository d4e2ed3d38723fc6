"""Checkpoints as HF writes them load and match HF's logits; bad ones name their problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.loader import (
    CheckpointError,
    bundled_model_path,
    eos_token_ids,
    load_config,
    load_model,
    load_tokenizer,
    random_qwen3,
)
from workers.tiny_model.corpus import TOOLS, documents
from workers.tiny_model.train import BPE_DOCS, SEED, build, render, write_metadata

IDS = [[3, 17, 42, 99, 7, 120, 64, 5, 1]]


def save_hf(path: Path, *, tied: bool = True, **save_kwargs) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.5, tie_word_embeddings=tied, rope_parameters={
                             "rope_theta": 10000.0, "rope_type": "default"})
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path, **save_kwargs)
    return model


def our_logits(model, ids):
    from workers.kv_cache import KVCache
    from workers.ops.metadata import SequenceRows, build_metadata

    c, n = model.config, len(ids)
    cache = KVCache(num_layers=c.num_hidden_layers, num_blocks=4, block_size=16,
                    num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=model.dtype)
    attn = build_metadata([SequenceRows(0, n, list(range((n + 15) // 16)))], num_decode=0, block_size=16)
    with torch.inference_mode():
        hidden = model.embed(torch.tensor(ids), out=torch.empty(n, c.hidden_size, dtype=model.dtype))
        out = model(hidden, torch.arange(n), cache, attn)
        return model.compute_logits(out, out=torch.empty(n, c.vocab_size))


@pytest.mark.parametrize("kind", ["single", "sharded", "untied"])
def test_hf_checkpoints_load_and_match_hf_logits(tmp_path, kind):
    kwargs = {"max_shard_size": "20KB"} if kind == "sharded" else {}
    hf = save_hf(tmp_path, tied=kind != "untied", **kwargs)
    if kind == "sharded":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    if kind == "untied":
        assert "lm_head.weight" in load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path, dtype="float32")
    assert model.config.tie_word_embeddings == (kind != "untied")
    with torch.inference_mode():
        expected = hf(torch.tensor(IDS)).logits[0]
    torch.testing.assert_close(our_logits(model, IDS[0]), expected, atol=1e-4, rtol=1e-4)


def test_dtype_comes_from_the_config_or_the_override(tmp_path):
    save_hf(tmp_path)
    assert load_model(tmp_path).dtype == torch.float32
    model = load_model(tmp_path, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight
    assert load_model(tmp_path, dtype=torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match="int8"):
        load_model(tmp_path, dtype="int8")


def test_old_style_top_level_rope_theta(tmp_path):
    save_hf(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"] * 3
    cfg["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_config(tmp_path).rope_theta == theta


def _edit_weights(path: Path, edit) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


BAD = {
    "missing weight": (lambda p: _edit_weights(p, lambda w: w.pop("model.layers.1.mlp.up_proj.weight")),
                       "missing weight 'model.layers.1.mlp.up_proj.weight'"),
    "unexpected weight": (lambda p: _edit_weights(p, lambda w: w.update({"model.extra.weight": torch.ones(2)})),
                          "unexpected weight 'model.extra.weight'"),
    "shape mismatch": (lambda p: _edit_weights(p, lambda w: w.update(
        {"model.norm.weight": torch.ones(31)})), r"model.norm.weight.*\(31,\).*\(32,\)"),
    "architecture": (lambda p: _edit_config(p, architectures=["LlamaForCausalLM"], model_type="llama"),
                     "LlamaForCausalLM"),
    "no weights": (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    "no config": (lambda p: (p / "config.json").unlink(), "config.json"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_name_their_problem(tmp_path, case):
    save_hf(tmp_path)
    damage, message = BAD[case]
    damage(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path)


def test_missing_shard_and_missing_directory(tmp_path):
    save_hf(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nowhere")


def test_bundled_model_loads_in_hf_and_here():
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.convert_tokens_to_ids(special) in tok.all_special_ids or special in tok.get_vocab()
    text = "北京故宫是 Hello, world!"
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>user\nhi<|im_end|>") and chat.endswith("<|im_start|>assistant\n")
    assert eos_token_ids(path) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    assert len(load_tokenizer(path)) == load_config(path).vocab_size
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(text).input_ids
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(our_logits(load_model(path), ids), expected, atol=1e-4, rtol=1e-4)
    assert sum(f.stat().st_size for f in Path(path).iterdir()) < 4 * 2**20


def test_the_bundled_tokenizer_and_config_files_rebuild_byte_identical(tmp_path):
    write_metadata(tmp_path, [render(d) for d in documents(SEED, BPE_DOCS)])
    shipped = Path(bundled_model_path())
    built = sorted(p.name for p in tmp_path.iterdir())
    assert built == sorted(p.name for p in shipped.iterdir() if p.suffix in (".json", ".jinja"))
    for name in built:
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name


@pytest.mark.slow
def test_training_is_deterministic(tmp_path):
    """The recipe that made the shipped weights, cut to two steps of each phase on a few documents, twice."""
    a, b = (build(tmp_path / d, steps=2, num_docs=60, anneal_steps=2, log=lambda _: None) for d in "ab")
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in a.iterdir():
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name
    fresh, trained = load_file(a / "model.safetensors"), load_file(Path(bundled_model_path()) / "model.safetensors")
    assert fresh.keys() == trained.keys()


def test_bundled_chat_template_renders_qwen3_turns():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    tool = TOOLS["get_weather"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},  # noqa: E501
                {"role": "tool", "content": '{"condition": "sunny"}'}]
    text = tok.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions")
    assert "<tools>\n" + json.dumps(tool, ensure_ascii=False) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n') in text
    assert text.endswith('<|im_start|>user\n<tool_response>\n{"condition": "sunny"}\n</tool_response><|im_end|>\n'
                         "<|im_start|>assistant\n")
    off = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "# Tools" not in off
    # the markup is one token each and survives skip_special_tokens, so parsers see it
    for mark in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        ids = tok.encode(mark, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == mark


def test_random_qwen3_has_the_requested_shape():
    model = random_qwen3(layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=300, dtype="float32")
    assert len(model.model.layers) == 2 and model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)
    assert torch.isfinite(model.model.embed_tokens.weight).all()
    again = random_qwen3(layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=300, dtype="float32")
    assert torch.equal(again.model.layers[1].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight)


def test_copy_of_bundled_model_loads_from_elsewhere(tmp_path):
    shutil.copytree(bundled_model_path(), tmp_path / "m", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    assert load_config(tmp_path / "m") == load_config(bundled_model_path())


def test_tokenizer_size_is_the_tokenizers_length_without_transformers(tmp_path):
    from workers.loader import load_tokenizer, tokenizer_size

    path = bundled_model_path()
    assert tokenizer_size(path) == len(load_tokenizer(path))
    # an added token tokenizer_config.json declares past tokenizer.json's vocabulary counts too
    shutil.copytree(path, tmp_path / "ckpt", ignore=shutil.ignore_patterns("*.safetensors", "*.py"))
    cfg_path = tmp_path / "ckpt" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("added_tokens_decoder", {})["4000"] = {"content": "<extra>", "special": True}
    cfg_path.write_text(json.dumps(cfg))
    assert tokenizer_size(tmp_path / "ckpt") == 4001
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable tokenizer.json"):
        tokenizer_size(tmp_path / "ckpt")
