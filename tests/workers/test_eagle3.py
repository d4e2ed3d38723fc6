"""The EAGLE-3 head's pieces against plain references: its config (published and speculators
formats), its checkpoint names, the target's aux hidden states against HF's hidden_states, and
the head's op-table forward over a paged KV against its plain-torch forward over whole sequences.
(Outputs with a head equal those without: tests/workers/test_spec_decode.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from scheduler.protocol import WorkerSampling
from workers.eagle3_drafter import Eagle3Drafter, load_head, random_head
from workers.kv_cache import KVCache
from workers.loader import bundled_eagle3_path, bundled_model_path, load_model
from workers.models.eagle3 import Eagle3Config, default_aux_layers
from workers.ops import get_op_table
from workers.ops.metadata import SequenceRows, build_metadata
from workers.slot_table import RowWork, SlotState
from workers.spec_config import SpeculativeConfig

PUBLISHED = {  # the shape of a published Qwen3-8B head's config.json
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "num_hidden_layers": 1, "vocab_size": 151936, "draft_vocab_size": 32000, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "rope_scaling": None, "tie_word_embeddings": False}


def test_config_reads_published_and_speculators_formats():
    c = Eagle3Config.from_dict(PUBLISHED)
    assert (c.hidden_size, c.draft_vocab_size, c.target_hidden_size, c.num_key_value_heads) == (4096, 32000, 4096, 8)
    assert c.layers_for(36) == default_aux_layers(36) == (2, 18, 33)
    speculators = {"architectures": ["Eagle3Speculator"], "draft_vocab_size": 32000, "target_hidden_size": 4096,
                   "eagle_aux_hidden_state_layer_ids": [1, 46, 90], "norm_before_residual": True,
                   "transformer_layer_config": {k: v for k, v in PUBLISHED.items() if k != "draft_vocab_size"}}
    s = Eagle3Config.from_dict(speculators)
    assert (s.layers_for(94), s.norm_before_residual, s.hidden_size) == ((1, 46, 90), True, 4096)
    assert Eagle3Config.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Qwen3ForCausalLM"]}, "'Qwen3ForCausalLM' is not an EAGLE-3 head"),
    ({"num_hidden_layers": 2}, "num_hidden_layers 2: an EAGLE-3 head has one layer"),
    ({"draft_vocab_size": 200000}, "draft_vocab_size 200000 exceeds vocab_size 151936"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, "must be three layer numbers"),
    ({"hidden_size": None}, "hidden_size must be a positive integer"),
])
def test_bad_head_configs_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        Eagle3Config.from_dict({**PUBLISHED, **change})
    with pytest.raises(ValueError, match=r"layers \[40\] outside the target's 0..35"):
        Eagle3Config.from_dict({**PUBLISHED, "eagle_aux_hidden_state_layer_ids": [2, 18, 40]}).layers_for(36)


def test_speculative_config_takes_eagle3():
    spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": "random:eagle3", "num_speculative_tokens": 3})
    assert (spec.method, spec.model) == ("eagle3", "random:eagle3")
    inferred = SpeculativeConfig.from_dict({"model": "AngelSlim/Qwen3-8B_eagle3", "num_speculative_tokens": 3})
    assert inferred.method == "eagle3"  # from the name, as vLLM does
    with pytest.raises(ValueError, match="method 'eagle3' needs model, an EAGLE-3 head's directory"):
        SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def target():
    return load_model(bundled_model_path(), dtype=torch.float32)


def test_aux_hidden_states_are_hfs_layer_inputs(target):
    """Layer i's input (0: the embedding) is HF's hidden_states[i]."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 100, 200, 5, 100, 200, 9, 31, 7]])
    want = hf(ids, output_hidden_states=True).hidden_states
    kv = KVCache(num_layers=4, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                 device="cpu")
    attn = build_metadata([SequenceRows(0, ids.shape[1], [0, 1, 2])], num_decode=0, block_size=4)
    hidden = torch.empty(ids.shape[1], 128)
    aux: list[torch.Tensor] = []
    with torch.no_grad():
        target.embed(ids[0], out=hidden)
        target(hidden, torch.arange(ids.shape[1]), kv, attn, (3, 0, 2), aux)
    assert len(aux) == 3
    for got, layer in zip(aux, (3, 0, 2)):
        torch.testing.assert_close(got, want[layer][0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ops", ["reference", "cpu"])
def test_the_heads_paged_forward_equals_its_plain_forward(target, ops):
    """Two prefill chunks, then a decode pass, through the op table and a paged KV (blocks out of
    order) against one causal pass over the whole sequence; the greedy ids through d2t too."""
    head = random_head("random:eagle3?seed=3&draft_vocab=700", target, torch.float32, "cpu")
    head.prepare(get_op_table("cpu", ops))
    c = head.config
    n = 11
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(n, c.hidden_size, generator=gen)
    features = torch.randn(n, 3 * c.target_hidden_size, generator=gen)
    with torch.no_grad():
        want, logits = head.reference(embeds[None], features[None], torch.arange(n))
        kv = KVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                     dtype=torch.float32, device="cpu")
        table = [5, 2, 7]
        got = []
        for start, count in ((0, 6), (6, 4), (10, 1)):
            attn = build_metadata([SequenceRows(start, count, table)], num_decode=int(count == 1), block_size=4)
            hidden = head.combine(features[start:start + count])
            got.append(head(embeds[start:start + count], hidden, torch.arange(start, start + count), kv, attn))
        got = torch.cat(got)
        torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-4)
        ids = head.greedy_ids(got)
    assert torch.equal(ids, logits[0].argmax(-1) + head.d2t[logits[0].argmax(-1)])
    assert ids.max() < target.config.vocab_size


def save_head(head, path, *, speculators: bool = False, drop: str | None = None) -> str:
    path.mkdir()
    config = head.config.to_dict()
    weights = {k: v for k, v in head.state_dict().items() if k != "embed_tokens.weight"}
    if speculators:
        weights = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}
        config = {"architectures": ["Eagle3Speculator"], "draft_vocab_size": config.pop("draft_vocab_size"),
                  "transformer_layer_config": config}
    weights["t2d"] = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    weights.pop(drop, None)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_saved_head_loads_under_either_naming(target, tmp_path):
    head = random_head("random:eagle3?seed=5&draft_vocab=300", target, torch.float32, "cpu")
    x = torch.randn(2, 5, head.config.hidden_size), torch.randn(2, 5, 3 * head.config.hidden_size)
    with torch.no_grad():
        want = head.reference(*x, torch.arange(5))[1]
        for name, kw in (("published", {}), ("speculators", {"speculators": True})):
            loaded = load_head(save_head(head, tmp_path / name, **kw), torch.float32, "cpu")
            assert torch.equal(loaded.d2t, head.d2t)
            torch.testing.assert_close(loaded.reference(*x, torch.arange(5))[1], want)
    with pytest.raises(ValueError, match=r"missing weights \['fc.weight'\]"):
        load_head(save_head(head, tmp_path / "no-fc", drop="fc.weight"), torch.float32, "cpu")
    with pytest.raises(ValueError, match="draft_vocab_size 300 but no d2t"):
        load_head(save_head(head, tmp_path / "no-d2t", drop="d2t"), torch.float32, "cpu")


def test_the_bundled_head_is_in_the_published_format():
    config = json.loads(open(f"{bundled_eagle3_path()}/config.json").read())
    c = Eagle3Config.from_dict(config)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c.draft_vocab_size < c.vocab_size  # a draft vocab mapped through d2t
    head = load_head(bundled_eagle3_path(), torch.float32, "cpu")
    assert int((head.d2t + torch.arange(c.draft_vocab_size)).max()) < c.vocab_size


@pytest.mark.parametrize("layers, want", [(1, (0, 0, 0)), (3, (0, 1, 2)), (8, (2, 4, 5))])
def test_a_random_head_reads_layers_the_target_has(layers, want):
    from workers.loader import random_qwen3

    small = random_qwen3(layers=layers, vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, dtype=torch.float32)
    head = random_head("random:eagle3?seed=1&draft_vocab=100", small, torch.float32, "cpu")
    assert head.config.layers_for(layers) == want
    assert int((head.d2t + torch.arange(100)).max()) < 256


@pytest.mark.parametrize("ops", ["reference", "cpu"])
def test_the_drafters_drafts_are_the_heads_unrolled_greedy_chain(target, ops):
    """A prompt's step (the head extended over it) and the next step's drafts through
    Eagle3Drafter, against the head's plain-torch unrolled passes as training runs them: the chain
    from the last position, pass j at position n - 1 + j reading the draft before it."""
    n, k = 9, 4
    drafter = Eagle3Drafter("random:eagle3?seed=4&draft_vocab=700", target=target, ops=get_op_table("cpu", ops),
                            dtype=torch.float32, device=torch.device("cpu"), max_slots=2)
    drafter.allocate(num_blocks=12, block_size=4)
    mc = target.config
    prompt = torch.randint(0, mc.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    table = [7, 2, 9, 4]  # out of order, room for n + k
    kv = KVCache(num_layers=mc.num_hidden_layers, num_blocks=12, block_size=4, num_kv_heads=mc.num_key_value_heads,
                 head_dim=mc.head_dim, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        hidden = torch.empty(n, mc.hidden_size)
        target.embed(torch.tensor(prompt), out=hidden)
        aux: list[torch.Tensor] = []
        out = target(hidden, torch.arange(n), kv, build_metadata([SequenceRows(0, n, table)], num_decode=0,
                                                                  block_size=4),
                     aux_layers=drafter.aux_layers, aux_out=aux)
        token = int(target.greedy_ids(out[-1:], mc.vocab_size)[0])  # the prompt step's sampled token
        state = SlotState(list(prompt), n, table, WorkerSampling(), n, generated=[token])
        drafter.hold({1: 0}, aux)
        drafter.extend([RowWork(1, state, 0, n, None, True)], known_before={1: n})
        row = RowWork(1, state, n, 1 + k, token, True)  # the next step: input `token`, k drafts
        drafter.propose([row])

        head = drafter.head
        embed = target.model.embed_tokens.weight
        tokens = torch.tensor(prompt[1:] + [token])[None]  # pass 0: position p reads token p + 1
        hidden, kvs, want = head.fc(torch.cat(aux, -1))[None], [], []
        for j in range(k):
            hidden, logits = head.reference_step(embed[tokens], hidden, torch.arange(n) + j, kvs)
            ids = logits.argmax(-1)
            tokens = ids + head.d2t[ids]  # each chain's draft: the next pass's input
            want.append(int(tokens[0, -1]))  # the chain from the last position
    assert row.draft == want
