"""LLMHandle: what users hold. The same methods serve a launched engine (in this
process) and a connected one (a named engine actor elsewhere in the cluster).

SamplingParams(n=k) asks for k choices: the handle submits them as k engine requests
(ids "<request_id>-<i>", params `params.choice(i)`: n=1 and choice i's seed) feeding one
stream, so the engine and the scheduler only ever see single-choice requests. They name
one group, so they run on one replica; arriving together with one prompt, they compute its
full KV blocks once (the scheduler lets the later ones wait for the first's blocks and hit
the prefix cache). `abort(request_id)`
aborts every choice; leaving a stream early, or cancelling, aborts the unfinished ones."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

from cluster.core.interface import Engine
from cluster.core.stream import RequestStream
from cluster.outputs import RequestOutput, StreamDelta
from scheduler.checks import all_ints
from scheduler.request import SamplingParams

Prompt = str | list[int]
OFF_LOOP_TOKENIZE_CHARS = 4096  # async submissions tokenize text at least this long on a thread (~2K tokens)


class LLMHandle:
    def __init__(self, engine: Engine, *, owns_ray: bool = False):
        # the engine behind the handle (cluster.core.interface.Engine): a LocalEngine or a RemoteEngine.
        # Public for tests and debugging (fault injection, its replicas); beyond the protocol, not a stable API.
        self.engine = engine
        self._owns_ray = owns_ray
        self._closed = False
        self._choice_ids: dict[str, list[str]] = {}  # request id -> its choices' engine ids (n > 1), while open

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def sampling_defaults(self) -> dict:
        """The checkpoint's recommended sampling values (its generation_config.json's temperature,
        top_p, top_k, min_p, the repetition, presence and frequency penalties, max_new_tokens as
        max_tokens) that requests without params, and API requests that leave those fields out,
        get; {} when the checkpoint has none or the engine runs with generation_config="none"."""
        return dict(self.engine.sampling_defaults)

    def default_sampling_params(self) -> SamplingParams:
        """What `generate(prompt)` without params samples with (vLLM's
        LLM.get_default_sampling_params): SamplingParams() with `sampling_defaults` applied."""
        return SamplingParams(**self.engine.sampling_defaults)

    # ---- blocking ----
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, request_id: str | None = None, use_tqdm: bool | None = None):
        """A string (or one list of token ids) gives one RequestOutput; a list of prompts
        gives a list of RequestOutputs in input order."""
        if _is_single(prompts) or not isinstance(prompts, (list, tuple)):  # the engine checks its type
            s = self._submit(prompts, params, request_id)
            try:
                return s.result()
            finally:
                self._release(s)
        prompts = list(prompts)
        if request_id is not None:
            raise ValueError("request_id applies to a single prompt; a list gets generated ids")
        per = _per_prompt(params, len(prompts))
        streams = []
        try:
            for p, sp in zip(prompts, per):
                streams.append(self._submit(p, sp))
            bar = _progress(len(streams), use_tqdm)
            outputs = []
            for s in streams:
                outputs.append(s.result())
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
            return outputs
        finally:
            for s in streams:
                self._release(s)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None, **kw):
        """One conversation ([{"role", "content"}, ...]) or a list of them, through the chat template."""
        if messages and isinstance(messages[0], list):
            return self.generate([self.apply_chat_template(m) for m in messages], params, **kw)
        return self.generate(self.apply_chat_template(messages), params, **kw)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """Yields StreamDeltas; the last has finish_reason set and the whole output.
        Leaving the loop early aborts the request."""
        s = self._submit(prompt, params, request_id)
        try:
            yield from s
        finally:
            self._release(s)

    # ---- asyncio ----
    async def agenerate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                        request_id: str | None = None) -> RequestOutput:
        s = await self._asubmit(prompt, params, request_id)
        try:
            return await s.aresult()
        finally:  # cancelled: stop generating for nobody
            self._release(s)

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None, *,
                      request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        s = await self._asubmit(prompt, params, request_id)
        try:
            async for delta in s:
                yield delta
        finally:
            self._release(s)

    async def astream_batches(self, prompt: Prompt, params: SamplingParams | None = None, *,
                              request_id: str | None = None) -> AsyncIterator[list[StreamDelta]]:
        """Like `astream`, but yields every delta that has arrived by the time the caller
        asks, as a list: a consumer that fell behind catches up in one go."""
        s = await self._asubmit(prompt, params, request_id)
        try:
            async for batch in s.batches():
                yield batch
        finally:
            self._release(s)

    def abort(self, request_id: str) -> bool:
        """Stop a request (every choice of it); False if it is not running."""
        ids = self._choice_ids.get(request_id)
        if ids is None:
            return self.engine.abort(request_id)
        return any([self.engine.abort(c) for c in ids])

    async def _asubmit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None) -> RequestStream:
        """_submit from a coroutine: a long text prompt is tokenized on a thread, not on the event
        loop (8K tokens take ~20 ms, every other stream of the loop stalled meanwhile)."""
        loop = asyncio.get_running_loop()
        ids = None
        if isinstance(prompt, str) and len(prompt) >= OFF_LOOP_TOKENIZE_CHARS:
            ids = await loop.run_in_executor(None, self.engine.encode_text, prompt)
        return self._submit(prompt, params, request_id, loop, ids)

    def _submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None = None,
                loop=None, token_ids: list[int] | None = None) -> RequestStream:
        """One request's stream; n > 1 choices go to the engine as n requests feeding it (a text
        prompt tokenized once for all). `token_ids`: the text prompt's, from engine.encode_text."""
        params = _one(params)
        if params is None or params.n == 1:
            return self.engine.add_request(prompt, params, request_id, loop, prompt_token_ids=token_ids)
        if token_ids is None and isinstance(prompt, str) and prompt:
            token_ids = self.engine.encode_text(prompt)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
        if rid in self._choice_ids:
            raise ValueError(f"request_id {rid!r} is already in use")
        ids = [f"{rid}-{i}" for i in range(params.n)]
        stream = RequestStream(rid, loop, ids)
        self._choice_ids[rid] = ids
        try:
            for i, cid in enumerate(ids):
                self.engine.add_request(prompt, params.choice(i), cid, loop, sink=stream, group=rid,
                                         prompt_token_ids=token_ids)
        except BaseException:
            self._release(stream)
            raise
        return stream

    def _release(self, s: RequestStream) -> None:
        """Abort the choices of `s` still running (its reader stopped early) and forget it."""
        for rid in s.unfinished_ids():
            self.engine.abort(rid)
        if len(s.choice_ids) > 1:
            self._choice_ids.pop(s.request_id, None)

    def health(self) -> dict:
        """{"status": "ok" | "degraded" | "unavailable", "reason", "replicas": [...]}."""
        return self.engine.health()

    def stats(self) -> dict:
        return self.engine.stats()

    def worker_stats(self) -> list[dict]:
        """Per replica, its worker: pid, node and device it runs on, compute dtype, weights
        fingerprint, KV blocks. Asks every worker (unlike `stats`, which the driver answers)."""
        return self.engine.worker_stats()

    def metrics_text(self) -> bytes:
        """The engine's Prometheus metrics, in the text exposition format."""
        return self.engine.metrics_text()

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> str:
        """The prompt text the model's chat template makes of a conversation (with the tools
        offered and extra template variables such as {"enable_thinking": False})."""
        return self.engine.apply_chat_template(messages, tools, template_kwargs)

    # ---- lifetime ----
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.engine.shutdown()
        if self._owns_ray:
            import ray

            ray.shutdown()

    def __enter__(self) -> LLMHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _is_single(prompts) -> bool:
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all_ints(prompts)


def _one(params):
    if params is not None and not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


def _per_prompt(params, n: int) -> list:
    if params is None or isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"params has {len(params)} entries for {n} prompts")
    return [_one(p) for p in params]


def _progress(total: int, use_tqdm: bool | None):
    if use_tqdm is False or (use_tqdm is None and not sys.stderr.isatty()) or total < 2:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
