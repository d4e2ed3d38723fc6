"""Requests and their sampling parameters. Pure Python: no torch, no ray."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import time
from dataclasses import dataclass, field

from scheduler.checks import all_ints_in, check_bool, check_int, is_int
from scheduler.grammar_spec import GrammarSpec
from scheduler.protocol import (
    WorkerSampling,
    check_sampling,
    check_token_ids,
    normalize_logit_bias,
)

MAX_N = 16  # choices one request may ask for (SamplingParams.n)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice `index` of a request seeded with `seed` samples with: `seed` itself
    for choice 0 (so n=1 and the first of n choices agree), else the top 63 bits of
    blake2b("raylm-choice:{seed}:{index}"), stable across processes and runs. No seed
    stays no seed: unseeded choices are independent random draws."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"raylm-choice:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# generation_config.json keys a checkpoint may recommend request defaults with (as vLLM reads
# them), and the SamplingParams fields they set (workers/loader.py sampling_defaults)
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                            "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Every field is checked on construction; a bad value raises ValueError naming the
    field and the value, e.g. "top_p must be in (0, 1], got 1.5".
    temperature 0 means greedy. top_k -1 (or 0) and top_p 1 disable those filters.
    logprobs None asks for none; k in 0..20 returns the sampled token's logprob plus the
    k most likely tokens (computed from the model's raw distribution, before filters
    and penalties).
    Penalties, as OpenAI and vLLM define them: presence_penalty and frequency_penalty in
    [-2, 2] lower a token's logit by frequency * count + presence * (count > 0), counting
    the tokens generated so far; repetition_penalty > 0 (1 disables) divides the positive
    and multiplies the negative logits of every token seen in the prompt or the output;
    logit_bias {token id: bias in [-100, 100]} (at most MAX_LOGIT_BIAS entries; keys may
    be decimal strings, as JSON sends them) is added to the logits first. Greedy rows get
    them too.
    n (1..MAX_N) independent choices are sampled from the one prompt, which they share in
    the prefix cache; with a seed, choice i samples with choice_seed(seed, i).
    grammar (structured output) constrains every output token to the GrammarSpec; the
    worker masks the logits before sampling (logprobs then see the masked distribution).
    """

    max_tokens: int | None = 16  # None: as many as fit in max_model_len
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    n: int = 1
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, 1, optional=True)
        cap = self.max_tokens if self.max_tokens is not None else float("inf")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= cap:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        check_sampling(self)
        self.logit_bias = normalize_logit_bias(self.logit_bias)
        self.stop = self._normalize_stop(self.stop)
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        check_token_ids("stop_token_ids", self.stop_token_ids)
        self.stop_token_ids = tuple(self.stop_token_ids)
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        check_int("n", self.n, 1, MAX_N)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec or None, got {self.grammar!r:.80}")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the field when a token id it names is outside a model's vocab (the engine
        checks this where it knows the vocab; the worker would have to refuse the request)."""
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        check_token_ids("logit_bias token id", list(self.logit_bias or ()), vocab_size)

    def choice(self, index: int) -> SamplingParams:
        """The params of choice `index` alone: n=1 and that choice's seed."""
        if self.n == 1 and index == 0:
            return self
        return dataclasses.replace(self, n=1, seed=choice_seed(self.seed, index))

    @staticmethod
    def _normalize_stop(stop) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        return tuple(stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"


@dataclass
class SampleLogprobs:
    """Logprobs of one generated token: its own, and the top-n tokens' (n = params.logprobs).

    Values are natural-log probabilities from the model's raw distribution. One type per
    layer: the wire carries RowLogprobs (scheduler/protocol.py), the scheduler keeps these
    (ids only), callers get cluster.TokenLogprob (ids with their text).
    """

    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler tracks it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    # parallel to output_token_ids when params.logprobs is not None, else empty
    output_logprobs: list[SampleLogprobs] = field(default_factory=list)
    # tokens whose K/V is computed or being computed by a dispatched step (this admission)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, last admission
    # failures of its replica's worker while it was on the worker, since a token of it was last sampled:
    # a request at max_request_failures is failed as the likely cause (a poison pill)
    num_failures: int = 0
    # finished with ERROR because its own input cannot be served (e.g. its grammar does not compile):
    # callers get the error as bad input (ValueError, HTTP 400), not as a failed generation
    refused: bool = False

    # timings (time.monotonic): TTFT = first_token_time - arrival_time
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    # Scheduler bookkeeping: owned by the Scheduler, read-only for everyone else.
    slot: int | None = field(default=None, repr=False)  # wire id while on the worker
    block_ids: list[int] = field(default_factory=list, repr=False)  # KV block table
    # memo of the prefix-cache hash chain over the full blocks of all_token_ids
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_published_blocks: int = field(default=0, repr=False)  # leading blocks offered to the cache
    num_claimed_blocks: int = field(default=0, repr=False)  # leading full blocks it computes, this admission
    num_sent_tokens: int = field(default=0, repr=False)  # len(NewRequest.token_ids), this admission
    num_inflight_samples: int = field(default=0, repr=False)  # sampled by dispatched steps, not yet returned
    num_inflight_drafting: int = field(default=0, repr=False)  # of those, rows that verify drafts
    last_sample_step: int = field(default=-1, repr=False)  # the newest step id with a row that samples it
    num_draft_tokens: int = field(default=0, repr=False)  # tokens drafted for it (speculative decoding)
    num_accepted_tokens: int = field(default=0, repr=False)  # of those, accepted
    arrival_seq: int = field(default=-1, repr=False)  # order of add_request()
    admission: int = field(default=0, repr=False)  # bumped at every (re-)admission
    worker_sampling: WorkerSampling | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"prompt must not be empty (request {self.request_id!r})")
        self.prompt_token_ids = list(self.prompt_token_ids)
        # ids travel as packed int32 on the wire
        if not all_ints_in(self.prompt_token_ids, 0, 2**31):
            bad = next(t for t in self.prompt_token_ids if not (is_int(t) and 0 <= t < 2**31))
            raise ValueError(
                f"prompt_token_ids must be integers in [0, 2**31) (request {self.request_id!r}), got {bad!r}"
            )
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams (request {self.request_id!r}), got {self.params!r}")
        if self.params.n != 1:
            raise ValueError(f"params.n must be 1 for one scheduled request (request {self.request_id!r}), got "
                             f"{self.params.n}; LLMHandle runs n choices as n requests (SamplingParams.choice)")
        if self.params.max_tokens is None:
            raise ValueError(f"params.max_tokens must be set before scheduling (request {self.request_id!r}); "
                             "the engine resolves None to what fits in max_model_len")
        self.eos_token_ids = frozenset(self.eos_token_ids)

    def fail(self, message: str, now: float) -> None:
        """Finish a request the scheduler never ran, with ERROR and `message`."""
        self.status, self.finish_reason, self.error, self.finish_time = RequestStatus.FINISHED, FinishReason.ERROR, \
            message, now

    def refuse(self, message: str, now: float) -> None:
        """fail(), because its own input cannot be served: callers get it as bad input."""
        self.fail(message, now)
        self.refused = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token: int, logprobs: list[SampleLogprobs], now: float,
                      max_total_tokens: int) -> FinishReason | None:
        """Append one generated token (and its logprobs, [] or [one]); returns why the
        request stops after it, or None. Cheap when the token cannot stop it."""
        outputs, p = self.output_token_ids, self.params
        outputs.append(token)
        if logprobs:
            self.output_logprobs += logprobs
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        if (token in self.eos_token_ids or token in p.stop_token_ids or len(outputs) >= p.max_tokens
                or len(self.prompt_token_ids) + len(outputs) >= max_total_tokens):
            return self.stop_reason(token, max_total_tokens)
        return None

    def stop_reason(self, token: int, max_total_tokens: int) -> FinishReason | None:
        """Why the request stops after `token` was appended to its outputs, or None.

        EOS (unless ignore_eos) and stop_token_ids count only past min_tokens (the worker
        bans them before); max_tokens and max_total_tokens (prompt + outputs) always count.
        """
        n_out = len(self.output_token_ids)
        p = self.params
        if n_out > p.min_tokens and (
            (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        ):
            return FinishReason.STOP
        if n_out >= p.max_tokens or self.num_tokens >= max_total_tokens:
            return FinishReason.LENGTH
        return None

    def num_outstanding_tokens(self, max_total_tokens: int) -> int:
        """Tokens still to compute: the rest of the prefill plus what it may still generate."""
        gen_cap = min(self.params.max_tokens, max_total_tokens - self.num_prompt_tokens)
        return max(0, self.num_prompt_tokens + gen_cap - self.num_computed_tokens)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        n = len(self.output_token_ids)
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)


@dataclass
class RequestUpdate:
    """What one Scheduler.update() did to one request: the scheduler's output."""

    request: Request
    new_token_ids: list[int]  # appended by this update
    new_logprobs: list[SampleLogprobs] = field(default_factory=list)  # parallel, when asked for
    finished: bool = False
