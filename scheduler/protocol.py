"""All that crosses the driver <-> worker boundary: StepPlan and StepResult.

Encoded with msgpack as positional arrays; nothing is pickled, and decoding never runs
code. Pure Python (no torch, no ray, no numpy): token arrays travel as packed int32
bytes built with the standard `array` module.

Requests are named on the wire by their *slot*: a small integer in [0, max_num_seqs)
that the scheduler assigns when it sends a request to the worker and frees when the
request finishes or is preempted. Slots keep messages small (one msgpack byte each for
slots < 128) and index the worker's device-resident buffer of last sampled tokens.

A plan carries diffs, not state:
- a request new to the worker (first admission, or re-admission after preemption) is
  sent whole once as a NewRequest: every known token, how many of them are already in
  the KV cache (prefix-cache hits), its block table and its sampling parameters;
- every scheduled row then carries only slot, number of tokens scheduled, newly
  appended block ids and, for decode rows, the input token: an id, or USE_RESIDENT
  when the driver does not know it yet (pipelining) and the worker takes the token it
  sampled last for that slot from its device buffer;
- finished and preempted slots, so the worker drops their state (applied before the
  plan's new requests, so a freed slot may be reused in the same plan).

A row samples exactly when, after it, the worker has computed every known token of its
request (a final prefill chunk, or a decode row). The sampled token's position in the
sequence is the request's computed-token count after the row; seeded sampling depends
on (seed, position) only.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field

import msgpack

from scheduler.checks import check_int, is_int, is_number
from scheduler.grammar_spec import GrammarSpec

USE_RESIDENT = -1
PROTOCOL_VERSION = 3
MAX_LOGPROBS = 20  # top-n logprobs a request may ask for (SamplingParams.logprobs)
MAX_LOGIT_BIAS = 300  # entries one request's logit_bias may hold (OpenAI's own limit)
PENALTY_RANGE = 2.0  # presence_penalty and frequency_penalty lie in [-PENALTY_RANGE, PENALTY_RANGE]
BIAS_RANGE = 100.0  # a logit_bias value lies in [-BIAS_RANGE, BIAS_RANGE]
# What the wire and the device carry. Seeds are 64-bit signed, as OpenAI and vLLM take them (msgpack
# refuses anything wider, and the row seed mixes 64 bits); token ids and top_k travel as int32.
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
TOKEN_ID_LIMIT = 1 << 31  # token ids lie in [0, TOKEN_ID_LIMIT); the engine narrows that to the vocab
FLOAT32_MAX = 3.4028234663852886e38  # temperature is staged as float32: anything larger would become inf
# repetition_penalty divides positive logits and multiplies negative ones in float32: outside this
# range a logit overflows to inf (or the factor to 0), and the row's distribution turns into NaN
REPETITION_PENALTY_RANGE = (1e-3, 1e3)

if array("i").itemsize != 4 or sys.byteorder != "little":  # pragma: no cover
    raise ImportError("raylm's protocol assumes a little-endian platform with 32-bit C ints")


class ProtocolError(ValueError):
    """A message that does not decode into a well-formed StepPlan or StepResult."""


def pack_int32(values) -> bytes:
    return array("i", values).tobytes()


def check_sampling(p) -> None:
    """ValueError naming the field of a sampling parameter out of its range. `p` is a
    SamplingParams (checked when the user builds it) or a WorkerSampling (checked when a
    worker admits the request it arrives with); both name these fields alike. The ranges are
    what the wire and the sampler's float32 arithmetic carry, so an accepted value always
    encodes, decodes on the worker and samples."""
    if not is_number(p.temperature) or not 0 <= p.temperature <= FLOAT32_MAX:
        raise ValueError(f"temperature must be a finite number in [0, {FLOAT32_MAX:.4g}], got {p.temperature!r}")
    if not is_int(p.top_k) or not -1 <= p.top_k < TOKEN_ID_LIMIT:
        raise ValueError(f"top_k must be an integer in [-1, {TOKEN_ID_LIMIT - 1}] (-1 or 0 disables), got {p.top_k!r}")
    if not is_number(p.top_p) or not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p!r}")
    if not is_number(p.min_p) or not 0 <= p.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p!r}")
    if p.seed is not None and (not is_int(p.seed) or not SEED_RANGE[0] <= p.seed <= SEED_RANGE[1]):
        raise ValueError(f"seed must be a 64-bit integer (in [-2**63, 2**63 - 1]) or None, got {p.seed!r}")
    check_int("logprobs", p.logprobs, 0, MAX_LOGPROBS, optional=True)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not is_number(value) or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
            raise ValueError(f"{name} must be a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value!r}")
    low, high = REPETITION_PENALTY_RANGE
    if not is_number(p.repetition_penalty) or not low <= p.repetition_penalty <= high:
        raise ValueError(f"repetition_penalty must be a number in [{low:g}, {high:g}] (1 disables), "
                         f"got {p.repetition_penalty!r}")


def check_token_ids(name: str, ids, limit: int = TOKEN_ID_LIMIT) -> None:
    """ValueError unless `ids` are integers in [0, limit), naming the field and the first bad id."""
    if not all(is_int(t) and 0 <= t < limit for t in ids):
        bad = next(t for t in ids if not (is_int(t) and 0 <= t < limit))
        raise ValueError(f"{name} must be token ids in [0, {limit}), got {bad!r} in {list(ids)!r:.100}")


def normalize_logit_bias(value) -> dict[int, float] | None:
    """{token id: bias} from a mapping whose keys are ids, as ints or as decimal strings (JSON
    object keys are strings); None when empty. ValueError naming logit_bias and the bad entry.
    Ids are checked against the vocab where it is known (the engine, the worker)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {value!r:.80}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12 else key
        if not is_int(token) or not 0 <= token < TOKEN_ID_LIMIT:
            raise ValueError(f"logit_bias keys must be token ids (integers in [0, {TOKEN_ID_LIMIT})), got {key!r:.40}")
        if not is_number(bias) or not -BIAS_RANGE <= bias <= BIAS_RANGE:
            raise ValueError(f"logit_bias values must be numbers in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}], "
                             f"got {bias!r} for token {token}")
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(bias)
    return out or None


def unpack_int32(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ProtocolError(f"packed int32 array has {len(data)} bytes, not a multiple of 4")
    a = array("i")
    a.frombytes(data)
    return a.tolist()


@dataclass
class WorkerSampling:
    """The part of SamplingParams the worker needs to sample one request's rows.

    min_tokens is expressed by position: while the sampled token's position is below
    `ban_until`, the ids in `banned_ids` (EOS and stop ids) cannot be sampled.
    Penalties (workers/sampling/penalties.py) count the request's output tokens, and for
    repetition_penalty its prompt tokens too; logit_bias is (token id, bias) pairs, by id.
    A `grammar` constrains the tokens from position `grammar_start` (the first output) on;
    after a preemption or a worker restart the worker replays the known tokens from there.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    ban_until: int = 0
    banned_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None
    grammar_start: int = 0
    # whether anything of workers/sampling/penalties.py applies to its rows: read per row per step, so
    # computed once here (the params of a request never change after it is built)
    has_penalties: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.has_penalties = self.counts_tokens or bool(self.logit_bias)

    @classmethod
    def from_params(cls, params, num_prompt_tokens: int, eos_token_ids=()) -> WorkerSampling:
        banned: tuple[int, ...] = ()
        ban_until = 0
        if params.min_tokens > 0:
            ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                ids |= set(eos_token_ids)
            banned = tuple(sorted(ids))
            ban_until = num_prompt_tokens + params.min_tokens if banned else 0
        return cls(
            temperature=float(params.temperature),
            top_k=params.top_k,
            top_p=float(params.top_p),
            min_p=float(params.min_p),
            seed=params.seed,
            logprobs=params.logprobs,
            ban_until=ban_until,
            banned_ids=banned,
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            repetition_penalty=float(params.repetition_penalty),
            logit_bias=tuple(sorted((params.logit_bias or {}).items())),
            grammar=params.grammar,
            grammar_start=num_prompt_tokens if params.grammar is not None else 0,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def counts_tokens(self) -> bool:
        """Whether its penalties read the request's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


    def check(self) -> None:
        """ValueError naming the field that is out of range (the worker admits nothing else)."""
        check_sampling(self)
        check_int("ban_until", self.ban_until, 0, TOKEN_ID_LIMIT)
        check_token_ids("banned_ids", self.banned_ids)
        if not all(isinstance(e, tuple) and len(e) == 2 for e in self.logit_bias):
            raise ValueError(f"logit_bias must be (token id, bias) pairs, got {self.logit_bias!r:.80}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise ValueError(f"logit_bias names a token twice: {sorted(ids)!r:.80}")
        normalize_logit_bias(dict(self.logit_bias))
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec or None, got {self.grammar!r:.80}")
        check_int("grammar_start", self.grammar_start, 0, TOKEN_ID_LIMIT)

    def _encode(self) -> list:
        g = self.grammar
        return [self.temperature, self.top_k, self.top_p, self.min_p, self.seed,
                self.logprobs, self.ban_until, list(self.banned_ids), self.presence_penalty,
                self.frequency_penalty, self.repetition_penalty, [t for t, _ in self.logit_bias],
                [b for _, b in self.logit_bias], None if g is None else [g.kind, g.text, self.grammar_start]]

    @classmethod
    def _decode(cls, a) -> WorkerSampling:
        t, k, p, m, seed, lp, until, banned, presence, frequency, repetition, bias_ids, biases, g = a
        if len(bias_ids) != len(biases):
            raise ProtocolError(f"logit_bias has {len(bias_ids)} ids but {len(biases)} biases")
        grammar, start = (None, 0) if g is None else (GrammarSpec(g[0], g[1]), g[2])
        return cls(t, k, p, m, seed, lp, until, tuple(banned), presence, frequency, repetition,
                   tuple(zip(bias_ids, biases)), grammar, start)


@dataclass
class NewRequest:
    slot: int
    token_ids: list[int]  # every known token: prompt, plus outputs when recomputing
    num_computed: int  # tokens already in the KV cache (prefix-cache hit), a block multiple
    block_table: list[int]  # blocks allocated up to and including this plan's rows
    sampling: WorkerSampling
    num_prompt: int | None = None  # the leading token_ids that are the prompt (None: all of them)


@dataclass
class ScheduledRow:
    slot: int
    num_tokens: int
    new_blocks: list[int] = field(default_factory=list)  # appended to the block table first
    # None: a prefill chunk (tokens come from the request's known tokens);
    # an id >= 0: a decode row's input token; USE_RESIDENT: the worker's last sampled id.
    token: int | None = None


@dataclass
class StepPlan:
    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    rows: list[ScheduledRow] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # slots to drop: finished or aborted
    preempted: list[int] = field(default_factory=list)  # slots to drop: recomputed later

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            [
                PROTOCOL_VERSION,
                self.step_id,
                [[n.slot, pack_int32(n.token_ids), n.num_computed, n.block_table, n.sampling._encode(),
                  n.num_prompt] for n in self.new_requests],
                [[r.slot, r.num_tokens, r.new_blocks, r.token] for r in self.rows],
                self.finished,
                self.preempted,
            ],
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> StepPlan:
        try:
            version, step_id, new, rows, finished, preempted = msgpack.unpackb(data, raw=False)
            _check_version(version)
            return cls(
                step_id=step_id,
                new_requests=[
                    NewRequest(slot, unpack_int32(toks), nc, list(bt), WorkerSampling._decode(s), n_prompt)
                    for slot, toks, nc, bt, s, n_prompt in new
                ],
                rows=[ScheduledRow(slot, n, list(nb), tok) for slot, n, nb, tok in rows],
                finished=list(finished),
                preempted=list(preempted),
            )
        except ProtocolError:
            raise
        except Exception as e:  # msgpack errors, wrong arity, wrong types
            raise ProtocolError(f"malformed StepPlan: {e}") from e


@dataclass
class RowLogprobs:
    """Logprobs for one sampled row: the sampled token's, and the top-n tokens'."""

    row: int  # index into StepResult.slots
    sampled: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class StepResult:
    """What a worker returns for one StepPlan.

    `slots` lists the rows that sampled, in plan order, and `token_ids` their sampled ids
    as packed int32 (empty in host-logits mode, where the driver samples). In host-logits
    mode `logits` holds the sampling rows' logits as raw bytes, `logits_shape` is
    (rows, real vocab) and `logits_dtype` names the dtype; with device sampling
    `logits` is b"" and `logits_shape` is (rows, 0).

    With speculative decoding a row may return several ids: `num_ids` then holds each sampling
    row's count (packed int32, 1 to k + 1: its accepted drafts and the token after them) and
    `token_ids` their ids row after row; `num_drafted` each row's drafted count. Both are b""
    when every row returned one id and nothing was drafted.
    """

    step_id: int
    slots: list[int] = field(default_factory=list)
    token_ids: bytes = b""
    logprobs: list[RowLogprobs] = field(default_factory=list)
    logits: bytes = b""
    logits_shape: tuple[int, int] = (0, 0)
    logits_dtype: str = "float32"
    step_time: float = 0.0  # seconds the worker spent executing the plan
    num_ids: bytes = b""
    num_drafted: bytes = b""

    def sampled_ids(self) -> list[int]:
        return unpack_int32(self.token_ids)

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            [
                PROTOCOL_VERSION,
                self.step_id,
                self.slots,
                self.token_ids,
                [[lp.row, lp.sampled, lp.top_ids, lp.top_logprobs] for lp in self.logprobs],
                self.logits,
                list(self.logits_shape),
                self.logits_dtype,
                self.step_time,
                self.num_ids,
                self.num_drafted,
            ],
            use_bin_type=True,
            use_single_float=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> StepResult:
        try:
            (version, step_id, slots, ids, lps, logits, shape, dtype, step_time, num_ids,
             num_drafted) = msgpack.unpackb(data, raw=False)
            _check_version(version)
            if not all(isinstance(b, bytes) for b in (ids, logits, num_ids, num_drafted)):
                raise ProtocolError("token_ids, logits, num_ids and num_drafted must be bytes")
            return cls(
                step_id=step_id,
                slots=list(slots),
                token_ids=ids,
                logprobs=[RowLogprobs(r, s, list(i), list(v)) for r, s, i, v in lps],
                logits=logits,
                logits_shape=(int(shape[0]), int(shape[1])),
                logits_dtype=dtype,
                step_time=float(step_time),
                num_ids=num_ids,
                num_drafted=num_drafted,
            )
        except ProtocolError:
            raise
        except Exception as e:
            raise ProtocolError(f"malformed StepResult: {e}") from e


def sampled_on_device(result: StepResult) -> bool:
    """The one place that decides where a result's rows are sampled.

    True when the worker sampled (ids are in the result); False in host-logits mode,
    where the driver must sample from `result.logits`.
    """
    return result.logits_shape[1] == 0


def _check_version(version) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not {PROTOCOL_VERSION}")
