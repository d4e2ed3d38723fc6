"""The engine <-> frontend channel's messages: msgpack of plain lists, in batches.

A frontend (the HTTP server, a `cluster.connect()` handle) talks to an EngineActor with
two calls, each carrying many requests at once:

- `push(connection_id, ops)`: submissions `[SUBMIT, request_id, prompt, params, group]` (group:
  None, or the id that keeps one request's choices on one replica) and aborts
  `[ABORT, request_id]`; the reply lists the submissions refused (`[request_id, kind,
  message, retry_after_s]`, kind one of REFUSALS).
- `pull(connection_id, wait_s)`: every delta of this frontend's requests produced since the
  last pull, one entry per delta:
  `[request_id, text, token_ids, finish_reason, logprobs, final]`, where logprobs is None
  or `[[token_id, token, logprob, [[id, token, logprob], ...]], ...]` and final (on the
  last delta only) is `[prompt_token_ids, text, token_ids, stop_reason, error, metrics]`;
  or, for a request refused after it was accepted (its grammar did not compile), a refusal
  as `push` answers them: `[request_id, kind, message, retry_after_s]`.

Nothing here is pickled: both directions decode with msgpack alone.
"""

from __future__ import annotations

import dataclasses

import msgpack

from cluster.errors import EngineDeadError, EngineOverloadedError
from cluster.outputs import RequestMetrics, RequestOutput, StreamDelta, TokenLogprob
from scheduler.grammar_spec import GrammarSpec
from scheduler.request import SamplingParams

SUBMIT, ABORT = 0, 1
# How a refused submission is raised on the frontend: ValueError is bad input (HTTP 400).
REFUSALS = {"value": ValueError, "overloaded": EngineOverloadedError, "dead": EngineDeadError,
            "error": RuntimeError}
_METRIC_FIELDS = [f.name for f in dataclasses.fields(RequestMetrics)]


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---- frontend -> engine ----
def submit_op(request_id: str, prompt, params: SamplingParams | None, group: str | None = None) -> list:
    return [SUBMIT, request_id, prompt, None if params is None else dataclasses.asdict(params), group]


def abort_op(request_id: str) -> list:
    return [ABORT, request_id]


def params_from(d: dict | None) -> SamplingParams | None:
    """SamplingParams from a submission (validated again here, at the engine's boundary)."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ValueError(f"params must be a mapping of SamplingParams fields, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}")
    grammar = d.get("grammar")
    if isinstance(grammar, dict):  # asdict() made the nested GrammarSpec a mapping
        try:
            d = {**d, "grammar": GrammarSpec(**grammar)}
        except TypeError as e:
            raise ValueError(f"grammar must be a mapping of GrammarSpec fields, got {grammar!r:.80}: {e}") from None
    return SamplingParams(**d)


def refusal(request_id: str, error: BaseException) -> list:
    kind = next((k for k, cls in REFUSALS.items() if isinstance(error, cls) and k != "error"), "error")
    message = str(error) if kind != "error" else f"{type(error).__name__}: {error}"
    return [request_id, kind, message, getattr(error, "retry_after_s", None)]


def refusal_error(kind: str, message: str, retry_after_s: float | None = None) -> BaseException:
    if kind == "dead":
        return EngineDeadError(message, retry_after_s)
    return REFUSALS.get(kind, RuntimeError)(message)


# ---- engine -> frontend ----
def delta_entry(d: StreamDelta) -> list:
    lps = None if d.logprobs is None else [[lp.token_id, lp.token, lp.logprob, [list(t) for t in lp.top]]
                                            for lp in d.logprobs]
    final = None
    if d.output is not None:
        o = d.output
        m = None if o.metrics is None else [getattr(o.metrics, f) for f in _METRIC_FIELDS]
        final = [o.prompt_token_ids, o.text, o.token_ids, o.stop_reason, o.error, m]
    return [d.request_id, d.text, d.token_ids, d.finish_reason, lps, final]


def entry_logprobs(lps) -> list[TokenLogprob] | None:
    if lps is None:
        return None
    return [TokenLogprob(tid, tok, lp, [tuple(t) for t in top]) for tid, tok, lp, top in lps]


def entry_delta(entry: list, prompt, logprobs: list[TokenLogprob] | None) -> StreamDelta:
    """The StreamDelta of a delta entry; `logprobs` gathers the request's logprobs so far (None:
    it asked for none) and goes into the final output; `prompt` is what the output names."""
    rid, text, token_ids, reason, lps, final = entry
    step_logprobs = entry_logprobs(lps)
    if step_logprobs and logprobs is not None:
        logprobs.extend(step_logprobs)
    output = entry_output(rid, prompt, reason, final, logprobs) if reason is not None else None
    return StreamDelta(rid, text, token_ids, step_logprobs, reason, output)


def entry_output(request_id: str, prompt, finish_reason: str, final: list,
                 logprobs: list[TokenLogprob] | None) -> RequestOutput:
    prompt_ids, text, token_ids, stop_reason, error, m = final
    metrics = None if m is None else RequestMetrics(**dict(zip(_METRIC_FIELDS, m)))
    return RequestOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                         prompt_token_ids=prompt_ids, text=text, token_ids=token_ids, finish_reason=finish_reason,
                         stop_reason=stop_reason, logprobs=logprobs, error=error, metrics=metrics)
