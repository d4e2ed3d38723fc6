"""Train the bundled tiny Qwen3 checkpoint, deterministically.

    python -m workers.tiny_model.train [OUT_DIR] [--steps N]
    python -m workers.tiny_model.train --draft [OUT_DIR]
    python -m workers.tiny_model.train --eagle3 [OUT_DIR]

The second trains its draft model for speculative decoding (default OUT_DIR: this package's
draft/): one layer of the same width, the same tokenizer and corpus, config.json and
model.safetensors only. The third trains an EAGLE-3 head for it (default OUT_DIR: eagle3/), in
the published format, on the bundled model's own greedy continuations of corpus prompts: its
aux hidden states (the inputs of layers 1, 2 and 3) as features, its greedy tokens as labels,
three drafts unrolled per position (training-time test), a draft vocab of its 1024 most
generated tokens (d2t).

writes config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
chat_template.jinja and model.safetensors (default OUT_DIR: this package). The corpus is
synthetic (corpus.py, from a fixed seed); the tokenizer is a byte-level BPE trained on it
with Qwen's pre-tokenizer, special tokens (<|endoftext|>, <|im_start|>, <|im_end|>) and
added tokens (<think>, </think>, <tool_call>, </tool_call>, <tool_response>,
</tool_response>); the model is HF's Qwen3ForCausalLM in fp32, trained with AdamW on one
thread, seeded, with deterministic algorithms, in two phases: `train` from the seeded
initialization on `documents`, then `anneal` on `anneal_documents` (more Chinese prose, copy
chats), where prose is also cut as a prompt would be. The same machine reproduces the weights
bit for bit; another CPU (other kernels) or thread count may differ in the last bits.
At 2 idle cores it takes about 10 minutes; on a loaded machine much longer.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

from workers.tiny_model.corpus import Chat, anneal_documents, documents

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
VOCAB_SIZE = 2048
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)
DRAFT_SHAPE = dict(SHAPE, num_hidden_layers=1)
SEED = 20250601
NUM_DOCS = 10000
BPE_DOCS = 3000  # the tokenizer learns from the first documents
STEPS = 450
BATCH = 24
MAX_LEN = 448
LR, WARMUP, THREADS = 3e-3, 40, 1
# the second phase (annealing): a few steps on a mix that fixes what the first leaves weak
ANNEAL_DOCS, ANNEAL_STEPS, ANNEAL_BATCH, ANNEAL_LR = 2000, 60, 16, 7e-4


def chat_template() -> str:
    return (HERE / "chat_template.jinja").read_text(encoding="utf-8")


def render(doc: str | Chat) -> tuple[str, str]:
    """(context, target): the loss covers the target only; prose is all target."""
    if isinstance(doc, str):
        return "", doc + "<|endoftext|>"
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = dict(tools=doc.tools, chat_template=chat_template(), enable_thinking=doc.enable_thinking)
    prompt = render_jinja_template([doc.messages], add_generation_prompt=True, **kwargs)[0][0]
    turn = {"role": "assistant", "content": doc.content, "reasoning_content": doc.reasoning,
            "tool_calls": [{"type": "function", "function": c} for c in doc.tool_calls]}
    full = render_jinja_template([doc.messages + [turn]], **kwargs)[0][0]
    if not full.startswith(prompt):
        raise RuntimeError(f"the template's generation prompt is not a prefix of the turn:\n{prompt!r}\n{full!r}")
    return prompt, full[len(prompt):].removesuffix("\n")  # the target ends with <|im_end|>


def build_tokenizer(texts: list[str]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    reserved = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - reserved, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    marks = SPECIAL_TOKENS + ADDED_TOKENS
    plain = []
    for t in texts:  # markup tokens are whole tokens, never BPE material
        for m in marks:
            t = t.replace(m, "\n")
        plain.append(t)
    tok.train_from_iterator(plain, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)  # ids follow the learned vocab, as in Qwen
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED_TOKENS])
    return tok


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(tok, out: Path) -> dict:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja; returns the ids of the markers."""
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": t in SPECIAL_TOKENS} for t in ids}
    _write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": added, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 4096, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    })
    if out.resolve() != HERE:
        (out / "chat_template.jinja").write_text(chat_template(), encoding="utf-8")
    return ids


def model_config(vocab_size: int, ids: dict) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 4096, "max_window_layers": SHAPE["num_hidden_layers"],
        "model_type": "qwen3", "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "float32", "use_cache": True,
        "use_sliding_window": False, "vocab_size": vocab_size, **SHAPE,
    }


def encode(tok, rendered, cut: random.Random | None = None) -> list[tuple[list[int], list[int]]]:
    """Per rendered document: token ids and the loss labels (-100 outside the target).

    With `cut`, half the prose is cut after its first few characters and the two pieces
    encoded apart, as a prompt and its continuation are: BPE merges across the cut otherwise
    (a run of Chinese characters is one pre-token), so the model would never see a prompt
    such as 北京故宫是 followed by the rest of its sentence."""
    rows = []
    for context, target in rendered:
        c = tok.encode(context, add_special_tokens=False).ids if context else []
        if cut is not None and not context and cut.random() < 0.5:
            at = cut.randint(1, min(8, len(target) - 1))
            t = tok.encode(target[:at], add_special_tokens=False).ids + tok.encode(
                target[at:], add_special_tokens=False).ids
        else:
            t = tok.encode(target, add_special_tokens=False).ids
        ids = (c + t)[:MAX_LEN]
        rows.append((ids, ([-100] * len(c) + t)[:MAX_LEN]))
    return rows


def batches(rows, steps: int, rng: random.Random, size: int = BATCH):
    """`steps` batches of `size` rows of similar length (shuffled, then sorted in windows)."""
    if len(rows) < size:
        raise ValueError(f"{len(rows)} documents cannot fill a batch of {size}")
    order: list[int] = []
    while len(order) < steps * size:
        epoch = list(range(len(rows)))
        rng.shuffle(epoch)
        for w in range(0, len(epoch), size * 8):
            window = sorted(epoch[w:w + size * 8], key=lambda i: len(rows[i][0]))
            chunks = [window[j:j + size] for j in range(0, len(window), size) if len(window[j:j + size]) == size]
            rng.shuffle(chunks)
            for c in chunks:
                order.extend(c)
    for s in range(steps):
        yield [rows[i] for i in order[s * size:(s + 1) * size]]


def new_model(config: dict):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    cfg = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "rope_scaling")},
                      rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]})
    return Qwen3ForCausalLM(cfg).float()


def fit(model, rows, pad: int, steps: int, size: int, peak_lr: float, warmup: int, rng: random.Random, log=print):
    """AdamW, linear warmup then cosine to a tenth of the peak; the loss covers the targets only."""
    import torch

    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)
    t0 = time.perf_counter()
    for step, batch in enumerate(batches(rows, steps, rng, size)):
        lr = peak_lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        width = max(len(r[0]) for r in batch)
        x = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in batch])
        y = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in batch])
        hidden = model.model(input_ids=x).last_hidden_state  # [batch, width, hidden]; right padding is never attended
        keep = y[:, 1:] != -100  # logits only where there is a loss: the LM head is a large part of the step
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[:, :-1][keep]), y[:, 1:][keep])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            log(f"step {step:4d}/{steps} loss {loss.item():.3f} lr {lr:.2e} {time.perf_counter() - t0:.0f}s")
    return model.eval()


def train(tok, rendered, ids: dict, config: dict, steps: int, log=print):
    """The first phase, from the seeded initialization."""
    model = new_model(config)
    return fit(model, encode(tok, rendered), ids["<|endoftext|>"], steps, BATCH, LR, WARMUP, random.Random(SEED + 1),
               log)


def anneal(model, tok, ids: dict, steps: int = ANNEAL_STEPS, num_docs: int = ANNEAL_DOCS, log=print):
    """The second phase, on anneal_documents, with prose cut as prompts are."""
    rendered = [render(d) for d in anneal_documents(SEED + 7, num_docs)]
    rows = encode(tok, rendered, cut=random.Random(SEED + 2))
    return fit(model, rows, ids["<|endoftext|>"], steps, ANNEAL_BATCH, ANNEAL_LR, 10, random.Random(SEED + 3), log)


def write_metadata(out: Path, rendered):
    """The tokenizer (trained on `rendered`), its files and the model's config files."""
    tok = build_tokenizer([c + t for c, t in rendered])
    ids = write_tokenizer_files(tok, out)
    config = model_config(tok.get_vocab_size(with_added_tokens=True), ids)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"]})
    return tok, ids, config


def build(out_dir, steps: int = STEPS, num_docs: int = NUM_DOCS, log=print, anneal_steps: int = ANNEAL_STEPS) -> Path:
    """Write the whole checkpoint to out_dir: tokenizer and config files, then trained weights."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rendered = [render(d) for d in documents(SEED, num_docs)]
    tok, ids, config = write_metadata(out, rendered[:BPE_DOCS])
    return _train_and_save(out, tok, rendered, ids, config, steps, num_docs, anneal_steps, log)


def _train_and_save(out: Path, tok, rendered, ids: dict, config: dict, steps: int, num_docs: int,
                    anneal_steps: int, log) -> Path:
    """Both phases from the seeded initialization, then the weights (the tied lm_head left out)."""
    from safetensors.torch import save_file

    model = train(tok, rendered, ids, config, steps, log)
    if anneal_steps:
        model = anneal(model, tok, ids, anneal_steps, max(num_docs // 5, ANNEAL_BATCH), log)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_draft(out_dir, steps: int = STEPS, num_docs: int = NUM_DOCS, log=print,
                anneal_steps: int = ANNEAL_STEPS) -> Path:
    """The draft model beside the bundled checkpoint: the bundled tokenizer, a one-layer config, trained weights."""
    from tokenizers import Tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(HERE / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}
    config = {**model_config(tok.get_vocab_size(with_added_tokens=True), ids), **DRAFT_SHAPE,
              "max_window_layers": DRAFT_SHAPE["num_hidden_layers"]}
    _write_json(out / "config.json", config)
    rendered = [render(d) for d in documents(SEED, num_docs)]
    return _train_and_save(out, tok, rendered, ids, config, steps, num_docs, anneal_steps, log)


EAGLE_AUX_LAYERS = (1, 2, 3)
EAGLE_DRAFT_VOCAB = 1024
EAGLE_PROMPTS, EAGLE_PROMPT_LEN, EAGLE_NEW_TOKENS = 4096, 32, 96
EAGLE_STEPS, EAGLE_BATCH, EAGLE_LR, EAGLE_UNROLL = 1500, 16, 3e-3, 3


def eagle_data(num_prompts: int = EAGLE_PROMPTS, log=print):
    """The bundled model's greedy continuations of corpus prompts (the last EAGLE_PROMPT_LEN
    tokens of a chat's prompt, or the first of a prose document), with the model's aux hidden
    states over each whole sequence: (ids [N, L], features [N, L, 3 x hidden])."""
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    tok = Tokenizer.from_file(str(HERE / "tokenizer.json"))
    model = Qwen3ForCausalLM.from_pretrained(str(HERE), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # greedy past EOS, as a request with ignore_eos runs
    prompts = []
    for context, target in (render(d) for d in documents(SEED + 11, num_prompts * 2)):
        ids = tok.encode(context or target, add_special_tokens=False).ids
        if len(ids) >= EAGLE_PROMPT_LEN:
            prompts.append(ids[-EAGLE_PROMPT_LEN:] if context else ids[:EAGLE_PROMPT_LEN])
        if len(prompts) == num_prompts:
            break
    seqs, feats = [], []
    t0 = time.perf_counter()
    with torch.no_grad():
        for b in range(0, len(prompts), 64):
            x = torch.tensor(prompts[b:b + 64])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=EAGLE_NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            if out.shape[1] != EAGLE_PROMPT_LEN + EAGLE_NEW_TOKENS:
                raise RuntimeError(f"generation stopped early: {out.shape[1] - EAGLE_PROMPT_LEN} tokens")
            hs = model(out, output_hidden_states=True).hidden_states  # [i]: the input of layer i
            seqs.append(out)
            feats.append(torch.cat([hs[i] for i in EAGLE_AUX_LAYERS], dim=-1))
            log(f"eagle3 data {b + len(x)}/{len(prompts)} {time.perf_counter() - t0:.0f}s")
    return torch.cat(seqs), torch.cat(feats), model.model.embed_tokens.weight.detach()


def build_eagle3(out_dir, steps: int = EAGLE_STEPS, num_prompts: int = EAGLE_PROMPTS, log=print) -> Path:
    """The EAGLE-3 head beside the bundled checkpoint: config.json and model.safetensors."""
    import torch
    from safetensors.torch import save_file

    from workers.models.eagle3 import Eagle3Config, Eagle3Head

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids, feats, embedding = eagle_data(num_prompts, log)
    torch.manual_seed(SEED + 12)
    torch.use_deterministic_algorithms(True)
    mc = json.loads((HERE / "config.json").read_text(encoding="utf-8"))
    generated = ids[:, EAGLE_PROMPT_LEN:].reshape(-1)
    counts = torch.bincount(generated, minlength=mc["vocab_size"])
    vocab = torch.sort(torch.argsort(counts, descending=True, stable=True)[:EAGLE_DRAFT_VOCAB]).values
    to_draft = torch.full((mc["vocab_size"],), -100, dtype=torch.int64)
    to_draft[vocab] = torch.arange(EAGLE_DRAFT_VOCAB)
    config = Eagle3Config(hidden_size=SHAPE["hidden_size"], intermediate_size=SHAPE["intermediate_size"],
                          num_attention_heads=SHAPE["num_attention_heads"],
                          num_key_value_heads=SHAPE["num_key_value_heads"], head_dim=SHAPE["head_dim"],
                          vocab_size=mc["vocab_size"], draft_vocab_size=EAGLE_DRAFT_VOCAB,
                          target_hidden_size=SHAPE["hidden_size"], aux_layer_ids=EAGLE_AUX_LAYERS,
                          rope_theta=mc["rope_theta"], rms_norm_eps=mc["rms_norm_eps"])
    head = Eagle3Head(config)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2 and p.numel():
                torch.nn.init.normal_(p, std=0.02)
        head.d2t.copy_(vocab - torch.arange(EAGLE_DRAFT_VOCAB))
    params = [p for p in head.parameters() if p.requires_grad and p.numel()]
    opt = torch.optim.AdamW(params, lr=EAGLE_LR, betas=(0.9, 0.95), weight_decay=0.0)
    n, length = ids.shape
    s = length - EAGLE_UNROLL - 1  # chains: each drafts EAGLE_UNROLL tokens after its position
    labels_ok = torch.arange(length) >= EAGLE_PROMPT_LEN  # the model's own tokens are the labels
    rng = torch.Generator().manual_seed(SEED + 13)
    t0 = time.perf_counter()
    head.train()
    for step in range(steps):
        lr = EAGLE_LR * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        rows = torch.randint(0, n, (EAGLE_BATCH,), generator=rng)
        x, f = ids[rows], feats[rows]
        hidden, kv, loss = head.fc(f[:, :s]), [], 0.0
        for j in range(EAGLE_UNROLL):  # pass j: chain i's draft j + 1, at position i + j, from token i + j + 1
            tokens, label_at = x[:, j + 1:j + 1 + s], torch.arange(s) + j + 2
            hidden, logits = head.reference_step(embedding[tokens], hidden, torch.arange(s) + j, kv)
            y = to_draft[x[:, label_at]].masked_fill(~labels_ok[label_at], -100)
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, EAGLE_DRAFT_VOCAB), y.reshape(-1),
                                                            ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"eagle3 step {step:4d}/{steps} loss {loss.item() / EAGLE_UNROLL:.3f} {time.perf_counter() - t0:.0f}s")
    weights = {k: v.detach().contiguous() for k, v in head.state_dict().items() if k != "embed_tokens.weight"}
    weights["t2d"] = to_draft >= 0
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config.to_dict())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", nargs="?", default=None, help="default: this package (its draft/ with --draft)")
    p.add_argument("--draft", action="store_true", help="train the draft model for speculative decoding")
    p.add_argument("--eagle3", action="store_true", help="train the EAGLE-3 head for speculative decoding")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--docs", type=int, default=NUM_DOCS)
    p.add_argument("--anneal-steps", type=int, default=ANNEAL_STEPS)
    a = p.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if a.eagle3:
        target = build_eagle3(a.out_dir or HERE / "eagle3", log=log)
        print(f"wrote the tiny Qwen3's EAGLE-3 head to {target}")
        return 0
    if a.draft:
        target = build_draft(a.out_dir or HERE / "draft", a.steps, a.docs, anneal_steps=a.anneal_steps, log=log)
        print(f"wrote the tiny Qwen3's draft model to {target}")
        return 0
    target = build(a.out_dir or str(HERE), a.steps, a.docs, anneal_steps=a.anneal_steps, log=log)
    print(f"wrote the tiny Qwen3 checkpoint to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
