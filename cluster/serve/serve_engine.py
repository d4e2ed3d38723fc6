"""ServeEngine: the Engine (cluster/core/interface.py) the Serve ingress hands to LLMHandle.

Its requests go to the "RaylmEngine" deployment through a Serve DeploymentHandle, one
streaming call per request (so Serve's request router picks the engine, and Serve's autoscaler
counts it as ongoing); the prompt is tokenized here first, so the router can match its token
blocks against what each engine has cached (cluster/serve/prefix_router.py).

Nothing accepted is silently lost when an engine goes away: a request that has not streamed a
token yet is sent again (up to MAX_TRIES calls; Serve routes it to a live engine), and raises
EngineDeadError (HTTP 503) if every try was lost; one that has streamed ends with finish_reason
"error", the error, and the tokens it got (its usage). None hangs.
Input errors (a bad parameter, a full queue) are raised as the engine raised them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

import ray

import cluster.remote.messages as messages
from cluster.core.stream import RequestStream, deliver
from cluster.errors import EngineDeadError
from cluster.outputs import RequestOutput, StreamDelta
from cluster.remote.client import ClientEngine

log = logging.getLogger(__name__)

MAX_TRIES = 3  # calls per request while none of its tokens has streamed
# what a lost engine looks like to a caller: its actor died or is unreachable, or it had no replica
_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, EngineDeadError)


def _cause(e: BaseException) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


class ServeEngine(ClientEngine):
    def __init__(self, handle, info: dict):
        super().__init__(info)
        self._handle = handle
        self._generate = handle.options(stream=True, method_name="generate", _by_reference=False)
        self._calls: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Task]] = {}
        self._lock = threading.Lock()
        self._own_loop: asyncio.AbstractEventLoop | None = None  # for blocking callers' requests
        # the loop this was made on (the ingress replica's), where Serve may run the handle's router:
        # then only a coroutine on it may wait for a call (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0,
        # part of RAY_SERVE_THROUGHPUT_OPTIMIZED), so blocking callers' calls are awaited there
        self._home = _running_loop()
        self.retries = 0  # requests sent again after their engine went away before a token

    # ---- requests ----
    def add_request(self, prompt, params=None, request_id: str | None = None, loop=None,
                    sink: RequestStream | None = None, group: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> RequestStream:
        rid, wire = self.wire_request(prompt, request_id, prompt_token_ids)
        stream = sink if sink is not None else RequestStream(rid, loop)
        request = [rid, wire, None if params is None else dataclasses.asdict(params), group]
        want_logprobs = params is not None and params.logprobs is not None
        run_on = loop if loop is not None else self._blocking_loop()
        with self._lock:
            if rid in self._calls:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._calls[rid] = (run_on, None)
        call = self._call(stream, request, prompt, want_logprobs)
        if _running_loop() is run_on:
            task = run_on.create_task(call)
        else:
            task = asyncio.run_coroutine_threadsafe(call, run_on)
        with self._lock:
            self._calls[rid] = (run_on, task)
        return stream

    def abort(self, request_id: str) -> bool:
        with self._lock:
            entry = self._calls.get(request_id)
        if entry is None or entry[1] is None:
            return False
        loop, task = entry
        loop.call_soon_threadsafe(task.cancel)  # cancelling the call makes Serve cancel it on the engine
        return True

    async def _call(self, stream: RequestStream, request: list, prompt, want_logprobs: bool) -> None:
        rid = request[0]
        text, token_ids = [], []
        try:
            for attempt in range(MAX_TRIES):
                logprobs = [] if want_logprobs else None
                try:
                    async for chunk in self._generate.remote(request):
                        deltas = [messages.entry_delta(e, prompt, logprobs) for e in messages.unpack(chunk)]
                        for d in deltas:
                            text.append(d.text)
                            token_ids += d.token_ids
                        deliver([(stream, d) for d in deltas])
                        if deltas and deltas[-1].finished:
                            return
                    raise EngineDeadError("the engine ended the request's stream before it finished")
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    error = _cause(e)
                    if not isinstance(error, _LOST):  # the engine refused it: bad input, a full queue
                        stream.put(error)
                        return
                    if token_ids or attempt == MAX_TRIES - 1:
                        break
                    self.retries += 1
                    log.warning("request %s: its engine went away before a token (%s); sending it again", rid, error)
            message = f"lost the engine: {type(error).__name__}: {error}"
            if not token_ids:  # never started anywhere: refused as an engine with no replica refuses (503)
                stream.put(EngineDeadError(f"{message} (tried {MAX_TRIES} times)"))
                return
            prompt_ids = request[1] if isinstance(request[1], list) else []
            output = RequestOutput(request_id=rid, prompt=prompt if isinstance(prompt, str) else None,
                                   prompt_token_ids=prompt_ids, text="".join(text), token_ids=token_ids,
                                   finish_reason="error", error=message)
            deliver([(stream, StreamDelta(rid, "", [], None, "error", output))])
        finally:
            with self._lock:
                self._calls.pop(rid, None)

    def _blocking_loop(self) -> asyncio.AbstractEventLoop:
        """An event loop on a thread of its own that carries blocking callers' requests."""
        with self._lock:
            if self._own_loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="raylm-serve-calls", daemon=True).start()
                self._own_loop = loop
            return self._own_loop

    # ---- the rest: one engine answers (Serve picks it) ----
    def _ask(self, method: str, *args):
        """One engine's answer to `method`, for a blocking caller (never on the home loop itself)."""
        async def ask():
            return await getattr(self._handle, method).remote(*args)

        loop = self._home or self._blocking_loop()
        if _running_loop() is loop:
            raise RuntimeError(f"ServeEngine.{method} blocks: call it from a thread, not from its event loop")
        try:
            return asyncio.run_coroutine_threadsafe(ask(), loop).result()
        except Exception as e:
            raise _cause(e) from None

    def apply_chat_template(self, messages_, tools=None, template_kwargs=None) -> str:
        text = self.client_tokenizer.render(messages_, tools, template_kwargs)
        return text if text is not None else self._ask("apply_chat_template", messages_, tools, template_kwargs)

    def health(self) -> dict:
        return self._ask("health")

    def stats(self) -> dict:
        return {**self._ask("stats"), "serve_retries": self.retries}

    def worker_stats(self) -> list[dict]:
        return self._ask("worker_stats")

    def metrics_text(self) -> bytes:
        return self._ask("metrics_text")

    def shutdown(self) -> None:
        """Abort what this client left running (the engines belong to the Serve application)."""
        with self._lock:
            rids = list(self._calls)
        for rid in rids:
            self.abort(rid)
        if self._own_loop is not None:
            self._own_loop.call_soon_threadsafe(self._own_loop.stop)


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
