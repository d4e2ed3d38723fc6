"""IncrementalDetokenizer on the bundled tokenizer, without Ray: streamed deltas join to the
tokenizer's own decoding, never split a UTF-8 character, and stop strings cut the text."""

from __future__ import annotations

import pytest

from cluster.core.detokenizer import REPLACEMENT, IncrementalDetokenizer
from workers.loader import bundled_model_path, load_tokenizer

TEXT = "北京故宫是 hello 龘😀, café €5 ßtraße"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(bundled_model_path())


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    deltas = []
    for i in range(0, len(ids), step):
        detok.append(ids[i:i + step])
        deltas.append(detok.take_delta())
    detok.flush()
    deltas.append(detok.take_delta(final=True))
    return deltas


def test_multibyte_characters_split_over_tokens_are_never_split_in_a_delta(tok):
    prompt, out = encode(tok, "Q: "), encode(tok, TEXT)
    assert any(REPLACEMENT in tok.decode([i]) for i in out)  # some tokens really are partial characters
    for step in (1, 2, 3):
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = stream(detok, out, step)
        assert "".join(deltas) == detok.text == tok.decode(out)
        assert not any(REPLACEMENT in d for d in deltas)


def test_text_continues_the_prompt_as_the_tokenizer_decodes_them_together(tok):
    prompt, out = encode(tok, "北京故宫"), encode(tok, "是 hello world")
    detok = IncrementalDetokenizer(tok, prompt)
    stream(detok, out)
    whole, head = tok.decode(prompt + out), tok.decode(prompt)
    assert whole.startswith(head) and detok.text == whole[len(head):]


def test_flush_releases_an_incomplete_character_at_finish(tok):
    partial = encode(tok, "a龘")[:-1]  # "a" and the first bytes of a three-byte character
    detok = IncrementalDetokenizer(tok, [])
    for token in partial:
        detok.append([token])
    assert detok.take_delta() == "a"  # the partial character is held: it may still complete
    detok.flush()
    assert "a" + detok.take_delta(final=True) == detok.text == tok.decode(partial)


def test_a_stop_string_cuts_the_text_and_is_never_half_shown(tok):
    out = encode(tok, "one two three four")
    detok = IncrementalDetokenizer(tok, [], stop=("three", "xyz"))
    shown, reason = "", None
    for i in out:
        reason = detok.append([i])
        shown += detok.take_delta()
        assert "thr" not in shown  # the stop string's beginning is held back while streaming
        if reason:
            break
    assert reason == "three"
    assert shown + detok.take_delta(final=True) == detok.text == "one two "
    assert detok.append(encode(tok, " more")) == "three"  # after the stop nothing grows
    assert detok.text == "one two "


def test_the_earliest_stop_string_wins(tok):
    detok = IncrementalDetokenizer(tok, [], stop=("world", "hello"))
    detok.append(encode(tok, "say hello world"))
    assert detok.stop_reason == "hello" and detok.text == "say "


def test_without_stop_strings_nothing_is_held_back(tok):
    detok = IncrementalDetokenizer(tok, [])
    detok.append(encode(tok, "hello world"))
    assert detok.take_delta() == "hello world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_when_asked(tok, skip):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    out = encode(tok, "hi") + [eos]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    text = "".join(stream(detok, out))
    assert text == tok.decode(out, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip


class _PythonOnly:
    """The tokenizer without its Rust backend: the detokenizer's Python windows, what a slow tokenizer gets."""

    def __init__(self, tok) -> None:
        self.decode = tok.decode


def test_rust_stream_and_python_windows_release_the_same_deltas(tok):
    import random

    rng = random.Random(0)
    vocab = len(tok)
    texts = [TEXT, "  two  spaces\n\nand tabs\t", "<|im_end|> x 😀😀"]
    for trial in range(300):
        if trial % 2:
            out = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]  # partial characters anywhere
        else:
            out = encode(tok, rng.choice(texts))
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]  # some cut inside a character
        skip = trial % 3 != 0
        deltas = [stream(IncrementalDetokenizer(t, prompt, skip_special_tokens=skip), out)
                  for t in (tok, _PythonOnly(tok))]
        assert deltas[0] == deltas[1], (prompt, out)
