"""A checkpoint's generation_config.json sampling values are the defaults of requests that
leave them out (as vLLM applies them), in Python and over the OpenAI API; a field the
request gives, even at raylm's own default value, wins; generation_config="none" ignores
the file."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

import cluster
from cluster import SamplingParams
from cluster.openai import api_models as oa
from workers.loader import bundled_model_path, sampling_defaults

QWEN3_STYLE = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True, "max_new_tokens": 7,
               "frequency_penalty": 0.25, "num_beams": 1, "bos_token_id": 1, "eos_token_id": [2, 3]}


def _model_with(tmp_path, generation: dict):
    d = tmp_path / "model"
    shutil.copytree(bundled_model_path(), d, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    base = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**base, **generation}))
    return d


def test_the_sampling_keys_are_read_and_renamed_as_vllm_reads_them(tmp_path):
    assert sampling_defaults(_model_with(tmp_path, QWEN3_STYLE)) == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "frequency_penalty": 0.25, "max_tokens": 7}
    (tmp_path / "model" / "generation_config.json").unlink()
    assert sampling_defaults(tmp_path / "model") == {}
    assert sampling_defaults(bundled_model_path()) == {}  # eos/bos ids only: nothing to default


def test_a_bad_value_in_the_file_names_the_file_the_field_and_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"generation_config\.json: top_p .*1\.5"):
        sampling_defaults(_model_with(tmp_path, {"top_p": 1.5}))


def _completion(**kw) -> oa.CompletionRequest:
    return oa.CompletionRequest.model_validate({"model": "m", "prompt": "hi", **kw})


def test_fields_a_request_leaves_out_take_the_defaults_and_given_ones_win():
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                "max_tokens": 7}
    p = _completion().sampling_params(16, None, defaults)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            p.max_tokens) == (0.6, 20, 0.95, 1.1, 0.5, 0.0, 7)
    # given at raylm's own default values: still the request's
    p = _completion(temperature=1.0, top_k=-1, max_tokens=3).sampling_params(16, None, defaults)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (1.0, -1, 0.95, 3)
    p = _completion().sampling_params(16, None, {"temperature": 0.0})  # no default max_tokens: the route's
    assert (p.temperature, p.max_tokens) == (0.0, 16)
    assert _completion().sampling_params(16, None, {}) == _completion().sampling_params(16, None)
    chat = oa.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_completion_tokens": 2})
    p = chat.sampling_params(None, None, defaults)
    assert (p.temperature, p.max_tokens) == (0.6, 2)


@pytest.mark.ray
def test_requests_without_sampling_fields_sample_as_the_checkpoint_recommends(ray_session, tmp_path):
    from cluster.openai.app import ServerState, build_app

    model = _model_with(tmp_path, {"temperature": 0.0, "top_k": 20, "max_new_tokens": 5})
    greedy5 = SamplingParams(temperature=0, max_tokens=5)
    with cluster.launch(model=str(model), num_kv_blocks=64, threads_per_worker=1) as llm:
        assert llm.sampling_defaults == {"temperature": 0.0, "top_k": 20, "max_tokens": 5}
        assert llm.default_sampling_params() == SamplingParams(temperature=0.0, top_k=20, max_tokens=5)
        want = llm.generate("Hello", greedy5)
        assert llm.generate("Hello").token_ids == want.token_ids  # no params: the checkpoint's greedy, 5 tokens
        state = ServerState(["m"], api_key=None)
        state.handle = llm

        async def post(body):
            transport = httpx.ASGITransport(app=build_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://raylm", timeout=60) as c:
                return (await c.post("/v1/completions", json={"model": "m", "prompt": "Hello", **body})).json()

        left_out = asyncio.run(post({}))
        assert left_out["choices"][0]["text"] == want.text
        assert left_out["usage"]["completion_tokens"] == len(want.token_ids)
        three = asyncio.run(post({"max_tokens": 3}))
        assert three["usage"]["completion_tokens"] == min(3, len(want.token_ids))
        assert want.text.startswith(three["choices"][0]["text"])
    with cluster.launch(model=str(model), num_kv_blocks=64, threads_per_worker=1, generation_config="none") as llm:
        assert llm.sampling_defaults == {}
        assert llm.default_sampling_params() == SamplingParams()
