"""The bundled tiny model is trained: in HF transformers (the oracle raylm matches token for
token), greedy, it continues prose with sentences of its corpus, answers chats, thinks when
thinking is on and writes a Qwen3 tool call when a matching tool is offered."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.openai.reasoning import split_reasoning
from cluster.openai.tool_calls import parse_tool_calls
from workers.loader import bundled_model_path, eos_token_ids
from workers.tiny_model.corpus import CHINESE, COUNTRIES, ENGLISH, TOOLS


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = sorted(eos_token_ids(path))

    def greedy(text: str, n: int = 96) -> str:
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def chat(question: str, tools=None, **kw) -> str:
        return greedy(tok.apply_chat_template([{"role": "user", "content": question}], tools=tools, tokenize=False,
                                              add_generation_prompt=True, **kw))
    return greedy, chat


def test_prose_continues_with_a_sentence_of_the_corpus(tiny):
    greedy, _ = tiny
    text = greedy("Once upon a time", 40)
    assert "\ufffd" not in text
    sentences = set(ENGLISH) | {f"The capital of {c} is {k}." for c, k, _, _ in COUNTRIES}
    assert any(("Once upon a time" + text).startswith(s) for s in sentences)
    text = greedy("北京故宫是", 64)  # the README's prompt: one token, then Chinese from the corpus
    assert "\ufffd" not in text
    first = text.split("。")[0] + "。"
    assert len(first) > 5 and any(first in s for s in CHINESE)


def test_chat_thinks_when_thinking_is_on_and_not_when_off(tiny):
    _, chat = tiny
    reasoning, content = split_reasoning(chat("What is the capital of Japan?"))
    assert reasoning and "capital" in reasoning and content.startswith("The capital of ")
    reasoning, content = split_reasoning(chat("What is the capital of Japan?", enable_thinking=False))
    assert reasoning is None and content.startswith("The capital of ") and "<think>" not in content


@pytest.mark.parametrize("tool", ["get_time", "get_weather"])
@pytest.mark.parametrize("thinking", [True, False])
def test_a_matching_tool_gets_a_qwen3_tool_call(tiny, thinking, tool):
    _, chat = tiny
    question = {"get_time": "What time is it in Rome?", "get_weather": "What is the weather in Rome?"}[tool]
    out = chat(question, tools=[TOOLS["get_weather"], TOOLS["get_time"]], enable_thinking=thinking)
    reasoning, content = split_reasoning(out)
    assert bool(reasoning) == thinking
    text, calls = parse_tool_calls(content or "")
    assert text is None and [c.name for c in calls] == [tool]
    assert set(json.loads(calls[0].arguments)) == set(TOOLS[tool]["function"]["parameters"]["required"])
