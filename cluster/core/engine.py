"""Engine: the driver side of raylm. Tokenizes, validates, routes requests to replicas,
detokenizes their tokens, applies stop strings and streams deltas to callers.

Data flows one way: requests go down (`add_request` -> `Replica.add`), outputs come up
(each replica's loop thread calls `_on_updates` with no replica lock held), and what
the engine decides about a running request (an abort, a stop string) goes back down as
a message (`Replica.post_finish`), never as a call into the replica's state.

Threads: callers (add_request, abort, shutdown) and every replica's loop thread meet in
`self._lock`, a plain Lock that guards `_requests` and each request's detokenizer and
stream. Lock order: the engine's before a replica's, never the other way round (a
replica emits with its own lock released).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cluster.config import EngineConfig
from cluster.core.chat_template import encode_prompt, render_chat
from cluster.core.detokenizer import IncrementalDetokenizer
from cluster.core.metrics import EngineMetrics
from cluster.core.placement import cpu_worker_threads, place_replicas, worker_resources
from cluster.core.replica import Replica
from cluster.core.router import Router
from cluster.core.stream import RequestStream, deliver
from cluster.errors import EngineDeadError, EngineOverloadedError, RequestRefused
from cluster.outputs import RequestMetrics, RequestOutput, StreamDelta, TokenLogprob
from scheduler.checks import all_ints_in, is_int
from scheduler.protocol import check_token_ids
from scheduler.request import FinishReason, Request, SamplingParams

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _RequestState:
    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer | _NoText
    stream: RequestStream
    replica: Replica
    logprobs: list[TokenLogprob] | None
    stop_reason: str | int | None = None
    # the tokens delivered so far: the replica's thread may have appended more to
    # request.output_token_ids by the time the engine finalizes (an abort)
    token_ids: list[int] = field(default_factory=list)
    group: str | None = None  # requests of one group run on one replica (the choices of one request)


class LocalEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.replicas: list[Replica] = []
        self._requests: dict[str, _RequestState] = {}
        self.tokenizer = None
        self.model_path: str | None = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.sampling_defaults: dict = {}  # the checkpoint's recommended sampling (generation_config "auto")
        self.max_model_len = 0
        self.vocab_size = 0
        self.device_outputs = True
        self._lock = threading.Lock()  # guards _requests and each state's detok / stream
        self._groups: dict[str, list] = {}  # group -> [its replica, its open requests]
        self.started_at = time.time()
        self.metrics = EngineMetrics(self.stats)
        self._router = Router(prefix_caching=config.enable_prefix_caching,
                              max_num_batched_tokens=config.max_num_batched_tokens)

    # ---- lifecycle ----
    def start(self) -> LocalEngine:
        from workers.loader import (
            bundled_model_path,
            eos_token_ids,
            is_random_spec,
            load_config,
            load_quant_config,
            load_tokenizer,
            parse_random_spec,
            random_spec_config,
            sampling_defaults,
        )
        from workers.parallel import check_shardable
        from workers.stage_layers import stage_layers

        cfg = self.config
        self.model_path = cfg.model or bundled_model_path()
        tp = cfg.tensor_parallel_size
        if is_random_spec(self.model_path):  # random weights, no tokenizer: token-id prompts only
            model_config = random_spec_config(parse_random_spec(self.model_path))
            self.tokenizer, self.eos_token_ids = None, frozenset()
        else:
            model_config = load_config(self.model_path)
            load_quant_config(self.model_path, cfg.quantization)  # a format raylm cannot serve fails here
            self.tokenizer = load_tokenizer(self.model_path)
            self.eos_token_ids = frozenset(eos_token_ids(self.model_path))
            if cfg.generation_config == "auto":
                self.sampling_defaults = sampling_defaults(self.model_path)
        # shapes that cannot split fail here, before any actor starts
        check_shardable(model_config, tp, cfg.enable_expert_parallel)
        stage_layers(model_config.num_hidden_layers, cfg.pipeline_parallel_size, 0, cfg.pp_layer_partition)
        threads, prefill_threads = (cpu_worker_threads(cfg.num_replicas, cfg.ranks_per_replica, cfg.threads_per_worker,
                                                       cfg.reserved_cpus,
                                                       cfg.prefill_threads_per_worker)
                                    if cfg.device == "cpu" else (cfg.threads_per_worker or 1,) * 2)
        resources = worker_resources(cfg.device, threads, cfg.accelerator_resource, fake=cfg.fake_step_s is not None)
        runner_configs = [cfg.runner_config(i, model_path=self.model_path, num_threads=threads,
                                            prefill_threads=prefill_threads)
                          for i in range(cfg.num_replicas)]
        self.device_outputs = runner_configs[0].device_outputs
        groups = place_replicas(resources, cfg.num_replicas, cfg.placement_timeout_s, tp, cfg.pipeline_parallel_size)
        for i, (pg, runner_config) in enumerate(zip(groups, runner_configs)):
            self.replicas.append(Replica(i, cfg, runner_config, resources, pg, self._on_updates))
        try:
            with ThreadPoolExecutor(len(self.replicas)) as pool:
                list(pool.map(Replica.start, self.replicas))
        except BaseException:
            self.shutdown()
            for placement in groups:
                placement.release()
            raise
        info = self.replicas[0].info
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        log.info("raylm engine up: %d replica(s) x TP %d of %s on %s", len(self.replicas), tp, self.model_path,
                 cfg.device)
        if self.sampling_defaults:
            log.info("requests that leave them unset sample with the model's generation_config.json values %s "
                     "(generation_config='none' ignores them)", self.sampling_defaults)
        # What this process holds by now (modules, Ray's client, the tokenizer: a few hundred thousand objects)
        # lives as long as the engine: moved out of the collector's generations, it is not walked again by each
        # full collection that the requests' own objects trigger (gc.freeze)
        gc.collect()
        gc.freeze()
        return self

    def shutdown(self) -> None:
        gc.unfreeze()  # what the engine held may be garbage now: the collector may take it again
        for rep in self.replicas:
            rep.shutdown()
        with self._lock:
            for st in list(self._requests.values()):
                self._finalize(st, FinishReason.ABORT, error="engine shut down")
        self.replicas = []

    # ---- requests ----
    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> str:
        """The prompt text of a conversation (cluster/core/chat_template.py)."""
        self._need_tokenizer("chat messages")
        return render_chat(self.tokenizer, messages, tools, template_kwargs, self.config.trust_request_chat_template)

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            self._need_tokenizer("text prompts")
            return prompt, encode_prompt(self.tokenizer, prompt)
        if isinstance(prompt, (list, tuple)) and all_ints_in(prompt, 0, self.vocab_size):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return None, list(prompt)
        if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}: {prompt!r:.80}")

    def default_sampling_params(self) -> SamplingParams:
        """What a request without params samples with: SamplingParams' defaults, overridden by
        the checkpoint's generation_config.json values (generation_config "auto")."""
        return SamplingParams(**self.sampling_defaults)

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_path!r} has no tokenizer: {what} are not accepted; "
                             "give prompts as lists of token ids")

    def encode_text(self, prompt: str) -> list[int] | None:
        """A text prompt's token ids as add_request would compute them (None: no tokenizer here),
        for callers that tokenize off their event loop and pass `prompt_token_ids`."""
        return encode_prompt(self.tokenizer, prompt) if self.tokenizer is not None else None

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, loop=None, sink=None, group: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> RequestStream:
        """Accept a request; its deltas go to the returned RequestStream (read with `for`,
        or `async for` on `loop`), or to `sink.put(delta)` when a sink is given (a
        frontend's outbox, shared by many requests). Requests naming one `group` (the n
        choices of one request) go to the replica the group's first open one went to, so
        they share the prompt's blocks there."""
        params = params if params is not None else self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if prompt_token_ids and isinstance(prompt, str):  # encode_text's, computed by the caller
            text, ids = prompt, list(prompt_token_ids)
        else:
            text, ids = self.tokenize(prompt)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        request = make_request(request_id, ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                               eos_token_ids=self.eos_token_ids)
        params = request.params
        if request_id in self._requests:  # checked again under the lock below
            raise ValueError(f"request_id {request_id!r} is already in use")
        pinned = self._groups.get(group) if group is not None else None
        try:
            replica = pinned[0] if pinned is not None and not pinned[0].dead else self._router.pick(self.replicas, ids)
        except EngineDeadError as e:  # say when to come back
            raise EngineDeadError(str(e), self._retry_after()) from None
        if params.grammar is not None and not replica.info.get("structured_output"):
            raise ValueError(f"structured output needs xgrammar where the workers run, and replica {replica.index}'s "
                             "worker has none: pip install 'raylm[structured]' on every node")
        if replica.num_waiting() >= self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"too many waiting requests ({self.config.max_waiting_requests} on replica {replica.index}); "
                "retry later")
        if params.stop:
            self._need_tokenizer("stop strings")
        if params.grammar is not None:  # checked here, where input enters: the worker only compiles it
            from workers.sampling.grammar import build_grammar

            self._need_tokenizer("structured output (a grammar)")
            size, limit = len(params.grammar.text.encode()), self.config.max_grammar_bytes
            if size > limit:
                raise ValueError(f"grammar: the schema or grammar is {size} bytes, over the limit of {limit} "
                                 "(max_grammar_bytes)")
            build_grammar(params.grammar)
        stream = sink if sink is not None else RequestStream(request_id, loop)
        detok = _NoText() if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop)
        st = _RequestState(request, text, detok, stream, replica, [] if params.logprobs is not None else None,
                           group=group)
        with self._lock:  # held through replica.add, so an abort cannot slip in between
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._requests[request_id] = st
            try:
                replica.add(request)
            except BaseException:
                del self._requests[request_id]
                raise
            if group is not None:
                entry = self._groups.setdefault(group, [replica, 0])
                entry[0], entry[1] = replica, entry[1] + 1
        return stream

    def abort(self, request_id: str) -> bool:
        """Finish a request now (its stream ends with finish_reason "abort"); its replica
        frees its blocks before planning its next step. False if it is not running."""
        with self._lock:
            st = self._requests.get(request_id)
            if st is None:
                return False
            self._finalize(st, FinishReason.ABORT, finish_time=time.monotonic())
        st.replica.post_finish(request_id, FinishReason.ABORT)
        return True

    # ---- outputs (a replica's loop thread, no replica lock held) ----
    def _on_updates(self, replica: Replica, updates) -> None:
        out: list = []  # (sink, delta): the step's deltas, handed over with one wake-up per event loop
        with self._lock:
            try:
                for u in updates:
                    try:
                        self._on_update(replica, u, out)
                    except Exception as e:  # one request's output failed (its detokenizer, say): fail it alone
                        self._fail_request(replica, u.request.request_id, e, out)
            finally:  # under the lock: an abort's last delta cannot overtake these
                deliver(out)

    def _fail_request(self, replica: Replica, request_id: str, error: Exception, out: list) -> None:
        log.exception("request %s failed while its output was handled", request_id)
        st = self._requests.get(request_id)
        if st is not None:
            self._finalize(st, FinishReason.ERROR, error=f"{type(error).__name__}: {error}",
                           finish_time=time.monotonic(), out=out)
        replica.post_finish(request_id, FinishReason.ERROR)  # the replica frees it before its next plan

    def _on_update(self, replica: Replica, u, out: list) -> None:
        st = self._requests.get(u.request.request_id)
        if st is None:
            return  # aborted meanwhile: the replica drops it when it reads the message
        req = u.request
        logprobs = None
        if st.logprobs is not None and u.new_logprobs:
            logprobs = [self._token_logprob(lp) for lp in u.new_logprobs]
        new_ids = u.new_token_ids
        if len(new_ids) > 1 and st.detok.has_stop_strings:  # a verified run: it ends with the token completing one
            stopped = False
            for i, token in enumerate(new_ids):
                if st.detok.append([token]) is not None:
                    new_ids, stopped = new_ids[:i + 1], True
                    break
        else:
            stopped = bool(new_ids) and st.detok.append(new_ids) is not None  # a stop string
        if logprobs is not None:
            logprobs = logprobs[:len(new_ids)]
            st.logprobs.extend(logprobs)
        st.token_ids += new_ids
        if u.finished:
            self._finalize(st, req.finish_reason or FinishReason.STOP, new_ids=new_ids, logprobs=logprobs,
                           out=out)
            return
        if stopped:
            replica.post_finish(req.request_id, FinishReason.STOP)  # the replica frees it before its next plan
            self._finalize(st, FinishReason.STOP, new_ids=new_ids, logprobs=logprobs,
                           finish_time=time.monotonic(), out=out)
            return
        text = st.detok.take_delta()
        if text or new_ids:
            out.append((st.stream, StreamDelta(req.request_id, text, list(new_ids), logprobs)))

    def _token_logprob(self, lp) -> TokenLogprob:
        text = self._token_text
        return TokenLogprob(lp.token_id, text(lp.token_id), lp.logprob,
                            [(i, text(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)])

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def _finalize(self, st: _RequestState, reason: FinishReason, *, new_ids=(), logprobs=None,
                  error: str | None = None, finish_time: float | None = None, out: list | None = None) -> None:
        """The request's last delta, put in its sink (or appended to `out` as (sink, delta)).
        `finish_time` when the engine ended it (abort, stop string) before its replica did;
        otherwise the scheduler's."""
        req = st.request
        if self._requests.pop(req.request_id, None) is None:
            return
        if st.group is not None:
            entry = self._groups[st.group]
            entry[1] -= 1
            if not entry[1]:
                del self._groups[st.group]
        if req.refused:  # its input cannot be served: the caller gets the error as bad input
            refusal = RequestRefused(req.request_id, req.error)
            if out is None:
                st.stream.put(refusal)
            else:
                out.append((st.stream, refusal))
            return
        if st.detok.stop_reason is not None:
            st.stop_reason = st.detok.stop_reason
        elif st.token_ids and st.token_ids[-1] in req.params.stop_token_ids:
            st.stop_reason = st.token_ids[-1]
        st.detok.flush()
        text = st.detok.take_delta(final=True)
        reason_value = reason.value if isinstance(reason, FinishReason) else str(reason)
        output = RequestOutput(
            request_id=req.request_id,
            prompt=st.prompt,
            prompt_token_ids=req.prompt_token_ids,
            text=st.detok.text,
            token_ids=list(st.token_ids),
            finish_reason=reason_value,
            stop_reason=st.stop_reason,
            logprobs=st.logprobs,
            error=error or req.error,
            metrics=_metrics(req, req.finish_time if finish_time is None else finish_time),
        )
        self.metrics.observe_finished(reason_value, output.metrics.ttft, output.metrics.tpot)
        delta = StreamDelta(req.request_id, text, list(new_ids), logprobs, reason_value, output)
        if out is None:
            st.stream.put(delta)
        else:
            out.append((st.stream, delta))

    def _retry_after(self) -> float | None:
        waits = [r.health_state.cooldown_left() for r in self.replicas if r.health_state.state == "down"]
        return min(waits) if waits else None

    # ---- stats ----
    def health(self) -> dict:
        """Whether requests can be served now: "ok" (every replica up), "degraded" (some
        down) or "unavailable" (none up; `reason` says why, `retry_after_s` when to retry)."""
        reps = [r.health() for r in self.replicas]
        up = [h for h in reps if h["state"] == "up"]
        if not reps:
            return {"status": "unavailable", "reason": "the engine is not running", "replicas": [],
                    "retry_after_s": None}
        if not up:
            waits = [h["retry_in_s"] for h in reps if h.get("retry_in_s") is not None]
            errors = "; ".join(f"replica {h['replica']}: {h['state']}"
                               + (f" ({h['last_error']})" if h.get("last_error") else "") for h in reps)
            return {"status": "unavailable", "reason": f"no replica can serve: {errors}", "replicas": reps,
                    "retry_after_s": min(waits) if waits else None}
        status = "ok" if len(up) == len(reps) else "degraded"
        reason = None if status == "ok" else f"{len(reps) - len(up)} of {len(reps)} replicas down"
        return {"status": status, "reason": reason, "replicas": reps, "retry_after_s": None}

    def metrics_text(self) -> bytes:
        """Prometheus exposition text."""
        return self.metrics.render()

    def worker_stats(self) -> list[dict]:
        """Per replica, its worker: where it runs (pid, node, device) and what it computes
        (dtype, weights fingerprint, KV blocks). One call to each worker."""
        return [{**r.info, **r.worker_stats()} for r in self.replicas]

    def stats(self) -> dict:
        reps = [r.snapshot() for r in self.replicas]
        total = {}
        for snap in reps:
            for k, v in snap.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _PER_REPLICA_ONLY:
                    total[k] = total.get(k, 0) + v
        queried = total.get("prefix_queried_tokens", 0)
        total["prefix_hit_rate"] = total.get("prefix_hit_tokens", 0) / queried if queried else 0.0
        drafted, accepted = total.get("spec_draft_tokens", 0), total.get("spec_accepted_tokens", 0)
        verify_rows = total.get("spec_verify_rows", 0)
        total["spec_acceptance_rate"] = accepted / drafted if drafted else 0.0
        total["spec_mean_accepted_length"] = 1 + accepted / verify_rows if verify_rows else 0.0
        decode_steps = total.get("decode_steps", 0)
        pulled = total.get("decode_bytes_pulled", 0)
        total["bytes_pulled_per_decode_step"] = pulled / decode_steps if decode_steps else 0.0
        total["rows_per_decode_step"] = total.get("decode_rows", 0) / decode_steps if decode_steps else 0.0
        total["open_requests"] = len(self._requests)  # accepted and not finished, as the engine tracks them
        total["num_replicas"] = len(self.replicas)
        total["tensor_parallel_size"] = self.config.tensor_parallel_size
        total["pipeline_parallel_size"] = self.config.pipeline_parallel_size
        total["replicas_alive"] = sum(1 for r in self.replicas if not r.dead)
        total["device_outputs"] = self.device_outputs
        total["pipeline_depth"] = self.config.pipeline_depth_for(self.device_outputs)
        total["model"] = self.model_path
        total["device"] = self.config.device
        total["max_model_len"] = self.max_model_len
        total["replicas"] = reps
        return total


_PER_REPLICA_ONLY = ("replica", "last_error_time", "retry_in_s")  # numbers that make no sense summed


def make_request(request_id: str, ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                 eos_token_ids=frozenset()) -> Request:
    """The Request the engine schedules for prompt `ids`, checked against the model: ValueError
    naming the field when the prompt, max_tokens or a token id does not fit it. max_tokens None
    becomes what fits in max_model_len."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if not ids:
        raise ValueError("prompt must not be empty")
    if not all_ints_in(ids, 0, vocab_size):
        check_token_ids("prompt", ids, vocab_size)
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, but max_model_len is {max_model_len}")
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=max_model_len - len(ids))
    params.check_vocab(vocab_size)
    if len(ids) + params.max_tokens > max_model_len:
        raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                         f"max_model_len={max_model_len}")
    return Request(request_id, ids, params, eos_token_ids=eos_token_ids)


class _NoText:
    """The detokenizer of a model without a tokenizer: outputs are token ids only."""

    text = ""
    stop_reason = None
    has_stop_strings = False  # stop strings need text: a verified run is taken whole

    def append(self, token_ids) -> None:
        return None

    def flush(self) -> None:
        pass

    def take_delta(self, final: bool = False) -> str:
        return ""


def _metrics(req: Request, finish_time: float | None) -> RequestMetrics:
    latency = finish_time - req.arrival_time if finish_time is not None else None
    return RequestMetrics(
        arrival_time=req.arrival_time, first_token_time=req.first_token_time, finish_time=finish_time,
        ttft=req.ttft, tpot=req.tpot, latency=latency,
        num_cached_tokens=req.num_cached_tokens, num_preemptions=req.num_preemptions,
        num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens,
    )
