"""OpenAI-compatible HTTP in front of an LLMHandle (FastAPI + uvicorn).

/v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health and
/metrics (Prometheus), /tokenize and /detokenize. Errors are OpenAI's error JSON: 400 bad
input (naming the field and value), 401 bad or missing API key, 404 unknown model or route,
408 body not received in time, 413 body over the limit, 429 queue full, 503 not ready or no
replica (with Retry-After). With an API key every route but /health needs it (/metrics too,
unless opened); cluster/openai/http_limits.py bounds connections and request heads.

/openapi.json describes the JSON bodies of the POST routes from their pydantic models, which
the routes parse themselves (strictly, with the errors above) from the raw body.

/health is 200 `{"status": "ok"}` when every replica serves, 200 `"degraded"` when some
are down, and 503 `"loading"` / `"unavailable"` with the reason and each replica's state
when none can serve. A client that disconnects, streaming or not, aborts its request.
The list prompts of one /v1/completions request run at once; choices keep their order.
With `n`, each prompt's n choices run at once too (sharing the prompt's KV blocks); a
disconnect aborts all of them, and a stream interleaves their deltas, each chunk naming its
choice's index; the usage chunk comes once, after the last choice finished.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import cluster.openai.api_models as oa
import cluster.openai.tokenize_api as tk
from cluster.errors import EngineDeadError, EngineOverloadedError
from cluster.openai.chat_output import ChatOutput
from cluster.openai.http_limits import DEFAULT_REQUEST_BODY_TIMEOUT_S
from cluster.openai.serving_config import DEFAULT_MAX_BODY_BYTES

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs until the context is full
RETRY_AFTER_S = 5  # what a 503 tells clients when the engine gives no better estimate


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        if retry_after is None and status == 503:
            retry_after = RETRY_AFTER_S
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else {}
        if self.status in (408, 413):  # the body's unread rest may still be on its way: end the connection
            headers["Connection"] = "close"
        return JSONResponse(oa.error_body(str(self), self.kind, self.param, self.code), status_code=self.status,
                            headers=headers)


# what a request's body may name: the fields of the API's own request models
_REQUEST_FIELDS = frozenset(oa.CompletionRequest.model_fields) | frozenset(oa.ChatCompletionRequest.model_fields)


def _from_exception(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, EngineOverloadedError):
        return ApiError(429, str(e), "rate_limit_error")
    if isinstance(e, EngineDeadError):
        return ApiError(503, str(e), "service_unavailable", retry_after=e.retry_after_s)
    if isinstance(e, ValueError):  # the engine's own checks name the field first: it is the error's param
        return ApiError(400, str(e), param=_leading_field(str(e)))
    return ApiError(500, f"{type(e).__name__}: {e}", "internal_error")


_LEADING_PATH = re.compile(r"([A-Za-z_]\w*)(?:\[\d+\]|\.[A-Za-z_]\w*)*")  # a field, then [i] or .name


def _leading_field(message: str) -> str | None:
    """The request field a validation message starts with, if any, as the path it names:
    "logit_bias token id 99999 is ..." -> logit_bias, "max_tokens=4096 plus the prompt's ..." ->
    max_tokens, "messages[2].content must ..." -> messages[2].content."""
    m = _LEADING_PATH.match(message)
    return m.group() if m is not None and m.group(1) in _REQUEST_FIELDS else None


class BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes, by header and by count (413), and
    bodies not complete within `timeout` seconds of the handler's first read (408). Past
    the body's last part, `receive` (the disconnect watch) passes straight through."""

    def __init__(self, app, limit: int, timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                return await ApiError(413, f"request body is larger than the limit of {self.limit} bytes",
                                      param="body", code="body_too_large").response()(scope, receive, send)
        seen, deadline, done = 0, None, False

        async def counted():
            nonlocal seen, deadline, done
            if done:
                return await receive()
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.timeout
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise ApiError(408, f"request body not complete within the {self.timeout:g} s limit (received "
                               f"{seen} bytes)", param="body", code="request_timeout") from None
            done = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise ApiError(413, f"request body is larger than the limit of {self.limit} bytes",
                               param="body", code="body_too_large")
            return message

        try:
            await self.app(scope, counted, send)
        except ApiError as e:
            await e.response()(scope, receive, send)


class ApiKeyAuth:
    """ASGI middleware: with a key, every route but /health (a load balancer's probe), and
    /metrics when the operator opened it, needs `Authorization: Bearer <key>`; unknown paths
    too, so a client without the key learns nothing of the routes (plain ASGI, so streamed
    responses pass straight through)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        self.open_paths = {"/health", "/metrics"} if state.metrics_without_auth else {"/health"}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.state.api_key and scope["path"] not in self.open_paths:
            given = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
            expected = f"Bearer {self.state.api_key}".encode()
            if not hmac.compare_digest(given, expected):
                return await ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key").response()(scope, receive, send)
        return await self.app(scope, receive, send)


class ServerState:
    """What the routes serve from; `handle` is None until the engine is loaded."""

    def __init__(self, model_names: list[str], api_key: str | None, metrics_without_auth: bool = False):
        self.handle = None
        self.model_names = model_names
        self.api_key = api_key
        self.metrics_without_auth = metrics_without_auth
        self.startup_error: str | None = None


def build_app(state: ServerState, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S) -> FastAPI:
    app = FastAPI(title="raylm", docs_url=None, redoc_url=None)
    app.state.raylm = state
    _describe_bodies(app, {"/v1/completions": oa.CompletionRequest, "/v1/chat/completions": oa.ChatCompletionRequest,
                           "/tokenize": tk.TokenizeRequest, "/detokenize": tk.DetokenizeRequest}, state.model_names)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(ApiError)
    async def _api_error(_req, exc: ApiError):
        return exc.response()

    _add_probe_routes(app, state)
    _add_generation_routes(app, state)
    return BodyLimit(ApiKeyAuth(app, state), max_body_bytes, body_timeout)


def _add_probe_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /metrics and /v1/models."""

    @app.get("/health")
    async def health():
        if state.handle is None:
            body = {"status": "unavailable" if state.startup_error else "loading",
                    "reason": state.startup_error or "the model is loading", "replicas": []}
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            h = await run_in_threadpool(state.handle.health)
        except Exception as e:  # the engine itself is gone
            h = {"status": "unavailable", "reason": f"the engine does not answer: {type(e).__name__}: {e}",
                 "replicas": [], "retry_after_s": None}
        if h["status"] != "unavailable":
            return JSONResponse(h)
        wait = h.get("retry_after_s") or RETRY_AFTER_S
        return JSONResponse(h, status_code=503, headers={"Retry-After": str(max(1, round(wait)))})

    @app.get("/metrics")
    async def metrics():
        if state.handle is None:
            return Response(b"", media_type="text/plain; version=0.0.4")
        return Response(await run_in_threadpool(state.handle.metrics_text), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "raylm"}
                                           for n in state.model_names]}


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/completions, /v1/chat/completions, /tokenize and /detokenize."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, oa.CompletionRequest, state)
        handle = _ready(state)
        params = await _params(handle, body, COMPLETIONS_MAX_TOKENS, body.logprobs)
        prompts = body.prompts()
        rid = oa.new_id("cmpl")
        if body.stream:
            if len(prompts) != 1:
                raise ApiError(400, f"streaming takes one prompt, got {len(prompts)}", param="prompt")
            return await _stream(handle.astream_batches(prompts[0], params), _CompletionEvents(rid, body))
        outs = await _unless_disconnected(request, _generate_all(handle, prompts, params))
        if outs is None:
            return Response(status_code=499)  # nobody reads it
        _raise_if_failed(outs)
        return oa.completion_response(rid, body.model, outs)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _parse(request, oa.ChatCompletionRequest, state)
        handle = _ready(state)
        try:
            params = await _params(handle, body, None, body.logprobs_n())  # None: until the context is full
            prefix = body.forced_prefix()  # "required" or a named function: the call starts in the prompt
            prompt = await run_in_threadpool(handle.apply_chat_template, body.chat_messages(), body.template_tools(),
                                             body.template_kwargs()) + prefix
        except Exception as e:
            raise _from_exception(e) from e
        rid = oa.new_id("chatcmpl")
        parsers = [ChatOutput(prompt, parse_tools=body.effective_tool_choice() != "none", forced_prefix=prefix)
                   for _ in range(body.n)]  # one per choice: a stream's parser keeps state
        if body.stream:
            return await _stream(handle.astream_batches(prompt, params), _ChatEvents(rid, body, parsers))
        outs = await _unless_disconnected(request, _generate_all(handle, [prompt], params))
        if outs is None:
            return Response(status_code=499)
        out = outs[0]
        _raise_if_failed([out])
        return oa.chat_response(rid, body.model, out, parsers)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _parse(request, tk.TokenizeRequest, state)
        return await _run_checked(tk.tokenize, _ready(state), body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _parse(request, tk.DetokenizeRequest, state)
        return await _run_checked(tk.detokenize, _ready(state), body)


def _describe_bodies(app: FastAPI, bodies: dict, model_names: list[str]) -> None:
    """/openapi.json with each POST route's JSON body: `bodies` maps a path to its request
    model; each model's schema, and those it refers to, go to components.schemas. `model`
    is one of the names served (any other is a 404)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                body["properties"]["model"]["enum"] = list(model_names)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


async def _run_checked(fn, *args):
    """fn(*args) off the event loop; its ValueErrors become 400s."""
    try:
        return await run_in_threadpool(fn, *args)
    except Exception as e:
        raise _from_exception(e) from e


async def _parse(request: Request, model, state: ServerState):
    raw = await request.body()
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise ApiError(400, f"body is not valid JSON: {err['msg']}", param="body") from None
        field = ".".join(str(x) for x in err["loc"]) or "body"
        value = err.get("input")
        shown = json.dumps(value)[:200] if not isinstance(value, dict) else "(object)"
        raise ApiError(400, f"{field}: {err['msg']}, got {shown}", param=field) from None
    if body.model not in state.model_names:
        raise ApiError(404, f"model {body.model!r} does not exist; this server serves {state.model_names}",
                       param="model", code="model_not_found")
    bad = body.unsupported()
    if bad is not None:
        raise ApiError(400, f"{bad[0]}={bad[1]!r} is not supported by raylm", param=bad[0])
    return body


def _ready(state: ServerState):
    if state.handle is None:
        raise ApiError(503, state.startup_error or "model is loading; retry shortly", "service_unavailable")
    return state.handle


async def _params(handle, body, max_tokens_default: int | None, logprobs):
    """The body's SamplingParams. One that asks for a grammar (response_format, tools) is built
    off the event loop: compiling it takes xgrammar, whose first import alone takes seconds."""
    def build():
        return body.sampling_params(max_tokens_default, logprobs, handle.sampling_defaults)

    try:
        if body.response_format is not None or getattr(body, "tools", None):
            return await run_in_threadpool(build)
        return build()
    except ValueError as e:
        raise ApiError(400, str(e), param=_leading_field(str(e))) from None


async def _generate_all(handle, prompts: list, params) -> list:
    """Every prompt at once; outputs in input order. One failing cancels (aborts) the rest."""
    tasks = [asyncio.ensure_future(handle.agenerate(p, params)) for p in prompts]
    try:
        return await asyncio.gather(*tasks)
    except BaseException as e:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(e, Exception):
            raise _from_exception(e) from e
        raise


async def _unless_disconnected(request: Request, work):
    """Await `work`, unless the client disconnects first: then cancel it (which aborts
    its requests) and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled itself
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read already, so the next
    message uvicorn hands over is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _raise_if_failed(outs) -> None:
    for o in outs:
        if o.finish_reason == "error":
            raise ApiError(503, f"generation failed: {o.error}", "service_unavailable")


async def _stream(batches, render):
    """Start the request (so bad input is a plain 400), then stream its SSE events."""
    try:
        first = await batches.__anext__()
    except Exception as e:
        raise _from_exception(e) from e
    return _EventStream(first, batches, render)


def _sse(chunks: list) -> bytes:
    """SSE events for chunks, each a dict or its JSON text already."""
    return "".join(f"data: {c if isinstance(c, str) else json.dumps(c, ensure_ascii=False)}\n\n"
                   for c in chunks).encode()


class _EventStream(Response):
    """An SSE response written straight to the ASGI `send`: one write per batch of deltas
    (a client that fell behind gets them joined), rendered by `render(batch) -> (chunks,
    last)`. Written for the per-token path: no generator stack or task group per chunk
    (StreamingResponse's), one watcher task per stream for the client's disconnect, which
    closes `batches` (aborting the request), as does a send that fails."""

    media_type = "text/event-stream"

    def __init__(self, first, batches, render):  # as StreamingResponse: no body, so no content-length
        self.status_code, self.background = 200, None
        self.init_headers()
        self.first, self.batches, self.render = first, batches, render

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not pump.done():  # the client went away (or this handler was cancelled)
                pump.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
        if pump.cancelled() or isinstance(pump.exception(), OSError):  # the client is gone
            return
        if pump.exception() is not None:  # mid-stream: the server's error log and a cut connection tell it
            raise pump.exception()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send) -> None:
        try:
            batch, render = self.first, self.render
            while batch is not None:
                chunks, last = render(batch)
                if last:
                    chunks.append("[DONE]")
                await send({"type": "http.response.body", "body": _sse(chunks), "more_body": True})
                if last:
                    return
                batch = await anext(self.batches, None)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        finally:  # done, failed or cancelled: closing the batches aborts an unfinished request
            await self.batches.aclose()


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _failed(d) -> dict:
    return oa.error_body(f"generation failed: {d.output.error}", "service_unavailable")


class _StreamUsage:
    """Counts a stream's finished choices; after the last one, the usage chunk if asked for
    (the prompt once, completion tokens summed over the choices)."""

    def __init__(self, rid: str, obj: str, body, created: int):
        self.rid, self.obj, self.body, self.created = rid, obj, body, created
        self.left, self.generated = body.n, 0

    def count(self, d) -> list[dict]:
        if not d.finished:
            return []
        self.left, self.generated = self.left - 1, self.generated + len(d.output.token_ids)
        if self.left or not self.body.include_usage:
            return []
        return [oa.usage_chunk(self.rid, self.obj, self.body.model, self.created, d.output.num_prompt_tokens,
                               self.generated)]


class _CompletionEvents:
    """A /v1/completions stream's chunks, batch by batch: (chunks, whether the stream ends)."""

    def __init__(self, rid: str, body):
        created = int(time.time())
        self.rid, self.body, self.created, self.offsets = rid, body, created, [0] * body.n
        self.usage = _StreamUsage(rid, "text_completion", body, created)
        self.fast = oa.CompletionChunkText(rid, body.model, created)

    def __call__(self, batch) -> tuple[list, bool]:
        chunks = []
        for d in batch:
            if d.finish_reason == "error":
                return chunks + [_failed(d)], True
            if d.logprobs is None:
                chunks.append(self.fast(d))
            else:
                chunks.append(oa.completion_chunk(self.rid, self.body.model, self.created, d, self.offsets[d.index]))
            self.offsets[d.index] += len(d.text)
            chunks += self.usage.count(d)
        return chunks, False


class _ChatEvents:
    """A /v1/chat/completions stream's chunks, batch by batch; the first batch's come after
    each choice's role chunk."""

    def __init__(self, rid: str, body, parsers: list[ChatOutput]):
        created = int(time.time())
        self.rid, self.body, self.created, self.parsers = rid, body, created, parsers
        self.usage = _StreamUsage(rid, "chat.completion.chunk", body, created)
        self.pending = [oa.chat_chunk(rid, body.model, created, {"role": "assistant", "content": ""}, index=i)
                        for i in range(body.n)]

    def __call__(self, batch) -> tuple[list, bool]:
        chunks, self.pending = self.pending, []
        for d in batch:
            if d.finish_reason == "error":
                return chunks + [_failed(d)], True
            parsed = self.parsers[d.index]
            fields = parsed.feed_last(d.text) if d.finished else parsed.feed(d.text)
            chunks.append(oa.chat_chunk(self.rid, self.body.model, self.created, fields, d.logprobs,
                                        parsed.finish_reason(d.finish_reason) if d.finished else None,
                                        index=d.index))
            chunks += self.usage.count(d)
        return chunks, False
