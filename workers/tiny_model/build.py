"""Build the bundled tiny Qwen3 checkpoint, deterministically.

    python -m workers.tiny_model.build [OUT_DIR]

rewrites config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and chat_template.jinja byte for byte (default OUT_DIR: this
package). The tokenizer is a byte-level BPE trained with `tokenizers` on the inline
corpus below, with Qwen's pre-tokenizer and special tokens; the weights come from
Python's own seeded Mersenne Twister (stable across platforms and torch versions),
std 0.5 so that even a random model produces varied tokens.
"""

from __future__ import annotations

import json
import random
import sys
from array import array
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 2048
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 (Qwen's regex)
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)
INITIALIZER_RANGE = 0.5
SEED = 20250601

ENGLISH = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Ray schedules tasks and actors across a cluster of machines. Each worker owns one accelerator.
The scheduler batches prefill chunks and decode rows into one step, and the worker runs the model.
Paged attention stores keys and values in fixed-size blocks; a block table maps positions to blocks.
Hello, world! How are you today? I am fine, thank you. What time is it? It is half past seven.
Once upon a time there was a small model that wanted to write poems about the sea and the stars.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2025 3.14159 -7 1e6. Dates like 2024-05-01 and times like 12:30.
Python, Rust, C++ and Go are programming languages. def main(): print("hello") return 0
The capital of France is Paris. The capital of Japan is Tokyo. The capital of China is Beijing.
Large language models predict the next token given the previous tokens in the sequence.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
To be, or not to be, that is the question. All that glitters is not gold.
Water boils at one hundred degrees Celsius at sea level. Ice melts at zero degrees.
Spring brings flowers, summer brings heat, autumn brings falling leaves and winter brings snow.
The library opens at nine in the morning and closes at six in the evening, except on holidays.
Mathematics studies numbers, shapes, patterns and structures; physics studies matter and energy.
Please remember to water the plants, feed the cat, lock the door and turn off the lights.
Mountains, rivers, forests, deserts, oceans and islands cover the surface of our planet.
Engineers measure latency, throughput, memory bandwidth and utilization before optimizing anything.
Breakfast was bread with butter, scrambled eggs, orange juice and a cup of strong black coffee.
The orchestra played a symphony by Beethoven, followed by a concerto for violin and piano.
Children learn to read, write, count, draw, sing and play together in the village school.
Doctors recommend sleeping eight hours, exercising regularly and eating fresh vegetables.
Yesterday we visited the museum, walked along the river, and watched the sunset from the bridge.
Artificial intelligence, machine learning, neural networks, transformers, attention, embeddings.
"""
CHINESE = """\
北京故宫是中国明清两代的皇家宫殿，旧称紫禁城，位于北京中轴线的中心。
长城是古代中国为抵御外敌而修筑的军事工程，绵延数千公里。
今天天气很好，我们一起去公园散步吧。你好，世界！你今天过得怎么样？
人工智能正在改变我们的生活和工作方式。大语言模型可以回答问题、写文章和翻译。
春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。床前明月光，疑是地上霜。
上海是中国最大的城市之一，也是重要的经济和金融中心。杭州西湖风景优美。
学而时习之，不亦说乎？有朋自远方来，不亦乐乎？
黄河是中华民族的母亲河，长江是中国第一大河，两条河流孕育了悠久的文明。
我喜欢读书、听音乐、看电影，周末常常和朋友一起爬山或者去海边游泳。
计算机科学包括算法、数据结构、操作系统、编译原理、网络和数据库等课程。
秋天到了，树叶变黄了，一片一片地从树上落下来，像一只只蝴蝶在空中飞舞。
熊猫生活在四川的竹林里，它们每天要吃很多竹子，是中国的国宝。
请问去火车站怎么走？一直往前走，到第二个路口向左转就到了。
中秋节的时候，家人团聚在一起吃月饼、赏月亮，表达对美好生活的祝愿。
"""


def corpus() -> list[str]:
    lines = [line for line in (ENGLISH + CHINESE).splitlines() if line]
    rng = random.Random(SEED)
    mixed = []
    for i in range(200):  # deterministic recombinations so the BPE has pairs to merge
        a, b = rng.choice(lines), rng.choice(lines)
        mixed.append(f"{a} {i} {b}")
    chat = [f"<|im_start|>user\n{line}<|im_end|>\n<|im_start|>assistant\n{line}<|im_end|>" for line in lines]
    return lines * 4 + mixed + chat


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)  # ids follow the learned vocab, as in Qwen
    return tok


def _gauss(rng: random.Random, shape: tuple[int, ...], std: float):
    import torch

    n = 1
    for s in shape:
        n *= s
    values = array("f", (rng.gauss(0.0, std) for _ in range(n)))
    return torch.frombuffer(bytearray(values.tobytes()), dtype=torch.float32).view(shape)


def build_weights(vocab_size: int) -> dict:
    import torch

    rng = random.Random(SEED)
    h, i, d = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["head_dim"]
    q, kv = SHAPE["num_attention_heads"] * d, SHAPE["num_key_value_heads"] * d
    w = {"model.embed_tokens.weight": _gauss(rng, (vocab_size, h), INITIALIZER_RANGE)}
    for layer in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
                            ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)), ("mlp.down_proj", (h, i))):
            w[p + name + ".weight"] = _gauss(rng, shape, INITIALIZER_RANGE)
        for name, dim in (("input_layernorm", h), ("post_attention_layernorm", h),
                          ("self_attn.q_norm", d), ("self_attn.k_norm", d)):
            w[p + name + ".weight"] = torch.ones(dim)
    w["model.norm.weight"] = torch.ones(h)
    return w


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build(out_dir) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    _write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n", encoding="utf-8")
    _write_json(out / "config.json", {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": endoftext,
        "eos_token_id": im_end,
        "hidden_act": "silu",
        "initializer_range": INITIALIZER_RANGE,
        "max_position_embeddings": 4096,
        "max_window_layers": SHAPE["num_hidden_layers"],
        "model_type": "qwen3",
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
        **SHAPE,
    })
    _write_json(out / "generation_config.json", {
        "bos_token_id": endoftext,
        "eos_token_id": [im_end, endoftext],
        "pad_token_id": endoftext,
    })
    save_file(build_weights(vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    target = build(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent)
    print(f"wrote the tiny Qwen3 checkpoint to {target}")
