"""encode_prompt, the serving path's text-to-ids, on the bundled tokenizer without Ray: the direct
call into the Rust tokenizer gives exactly the ids `tokenizer.encode` gives, and a tokenizer whose
backend truncates keeps the wrapper's answer."""

from __future__ import annotations

import random

import pytest

from cluster.core.chat_template import encode_prompt
from workers.loader import bundled_model_path, load_tokenizer
from workers.tiny_model.corpus import CHINESE, ENGLISH


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(bundled_model_path())


def texts(tok) -> list[str]:
    rng = random.Random(0)
    special = "<|im_start|>user\nhi<|im_end|>\n<think>\n</think><tool_call>{}</tool_call><|endoftext|>"
    decoded = [tok.decode([rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]) for _ in range(60)]
    return [*ENGLISH[:20], *CHINESE[:20], special, " leading  and trailing spaces  ", "tabs\tand\nnewlines\r\n",
            "北京故宫是 hello 龘😀, café €5 ßtraße", "x" * 500, *decoded]


def test_encode_prompt_gives_the_tokenizers_own_ids(tok):
    for text in texts(tok):
        assert encode_prompt(tok, text) == tok.encode(text, add_special_tokens=False), text


def test_a_truncating_backend_keeps_the_wrappers_answer():
    tok = load_tokenizer(bundled_model_path())  # its own: the truncation set here must not leak into others
    text = " ".join(ENGLISH[:4])
    full = load_tokenizer(bundled_model_path()).encode(text, add_special_tokens=False)
    tok.backend_tokenizer.enable_truncation(max_length=5)
    assert len(full) > 5
    assert encode_prompt(tok, text) == full


def test_an_empty_prompt_is_refused(tok):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        encode_prompt(tok, "")
