"""Property-based fuzzing of `raylm serve`'s HTTP API from its own OpenAPI schema (schemathesis).

Every route of /openapi.json gets, in order: schemathesis' coverage cases (boundary values,
missing and mistyped fields, methods the route does not have), then requests Hypothesis draws
from the schema (valid bodies) and from its negation (invalid ones); a route with a body then
gets the coverage cases and draws of the same schema narrowed to the engine's documented ranges
(within_engine_ranges), which the engine serves, so the fuzzing reaches sampling, stops,
logprobs, grammars and templates; all with the API key. Last, a few valid requests without it,
which must be 401 (/health: 200).

What must hold for each: no 5xx (schemathesis' not_a_server_error), an answer within
REQUEST_TIMEOUT_S (max_response_time, and the client's own clock for a streamed body), the
connection not dropped, a JSON answer (or each event of a stream) strict JSON: no NaN or
Infinity. A 4xx is an answer: the schema allows values the engine refuses with a clear 400,
which is documented behaviour, so positive-data acceptance is not checked. After each batch a
plain greedy completion must be served; at the end /health must be 200 "ok" and /metrics must
count no worker restart, step-loop failure, poisoned request or request finished with `error`.

The seed and the example counts are fixed, so a run repeats the same requests in the same order
(the digest printed says so) for the same code: Hypothesis also draws literals of the project's
own modules, so a change to them changes some cases. About two minutes of requests on two cores;
RAYLM_FUZZ_SEED=N draws other ones. The suite prints what it did and found: the requests sent
per phase, the statuses per route, 5xx, hangs, dropped connections and replica deaths (for
docs/reliability.md); each failure with its route, body, curl command and the server log's tail.
A failure found here becomes a named regression test in tests/fuzz/test_regressions.py.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import max_response_time, not_a_server_error
from schemathesis.core import NOT_SET
from schemathesis.errors import FailureGroup

import workers.tiny_model
from scheduler.protocol import (
    BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    SEED_RANGE,
)
from scheduler.request import MAX_N
from tests.fuzz.conftest import ERRORED_REQUESTS, FAULT_COUNTERS, MAX_MODEL_LEN

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(900)]

SEED = int(os.environ.get("RAYLM_FUZZ_SEED", "20261203"))  # CI's; another explores other cases
REQUEST_TIMEOUT_S = 20.0  # later is a hang (the longest valid request, 4 prompts x n=16 x 126 tokens, takes ~2 s)
EXAMPLES = {"positive": 100, "negative": 100, "in-range": 500}  # drawn per route
MAX_COVERAGE_CASES = 500  # per route, schemathesis' coverage cases (chat has ~480)
UNAUTHORIZED_EXAMPLES = 3  # per route, valid requests sent without the key
ROUTES = {"GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions",
          "POST /tokenize", "POST /detokenize"}
OPEN_ROUTES = {"GET /health"}  # served without the key


@dataclasses.dataclass
class Failure:
    route: str
    kind: str  # "5xx", "hang", "dropped", "auth", "not json"
    detail: str
    body: str
    curl: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.route}\n  body: {self.body}\n  {self.curl}\n  {self.detail}"


def shown(body) -> str:
    if body is NOT_SET:
        return "(no body)"
    if isinstance(body, (bytes, str)):
        return repr(body)[:1000]
    try:
        return json.dumps(body, ensure_ascii=False)[:1000]
    except (TypeError, ValueError):
        return repr(body)[:1000]


def _refuse_constant(constant: str):
    raise ValueError(f"{constant} is not JSON")


def not_strict_json(response) -> str | None:
    """What in a JSON answer, or in an SSE stream's events, is not JSON as the standard has it
    (NaN and Infinity are not, though Python's json writes and reads them); None if all is."""
    kind = (response.headers.get("content-type") or [""])[0]  # schemathesis' Response: a list per header
    if kind.startswith("text/event-stream"):
        texts = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        texts = [t for t in texts if t != "[DONE]"]
    elif kind.startswith("application/json"):
        texts = [response.text]
    else:
        return None
    for text in texts:
        try:
            json.loads(text, parse_constant=_refuse_constant)
        except ValueError as e:
            return f"{e}: {text[:300]!r}"
    return None


class Fuzzer:
    """Sends cases and keeps score: requests and statuses per route and phase, and failures."""

    def __init__(self, server):
        self.server = server
        self.session = requests.Session()
        self.sent = collections.Counter()  # phase -> requests
        self.seconds = collections.Counter()  # phase -> seconds (drawing the cases, sending them)
        self.statuses = collections.defaultdict(collections.Counter)  # route -> status -> requests
        self.failures: list[Failure] = []
        self.slowest = (0.0, "")
        self.digest = hashlib.sha256()  # of every request sent, in order: two runs sent the same ones if equal

    def fail(self, case, kind: str, detail: str, headers: dict) -> None:
        self.failures.append(Failure(case.operation.label, kind, detail, shown(case.body),
                                     case.as_curl_command(headers=headers)))

    def send(self, case, phase: str, authorized: bool = True):
        """One request; a hang (no answer in time, or a stream cut at the time limit) or a dropped
        connection is a failure; returns the response, or None when there is none."""
        headers = dict(self.server.auth) if authorized else {}
        self.sent[phase] += 1
        self.digest.update(f"{case.method} {case.path} {authorized} {shown(case.body)}\n".encode())
        t0 = time.monotonic()
        try:
            response = case.call(session=self.session, headers=headers, timeout=REQUEST_TIMEOUT_S)
        except requests.Timeout as e:
            self.statuses[case.operation.label]["hang"] += 1
            self.fail(case, "hang", f"no answer within {REQUEST_TIMEOUT_S:g} s: {e}", headers)
            return None
        except requests.RequestException as e:  # reset, refused, cut mid-body: the server dropped it
            self.statuses[case.operation.label]["dropped"] += 1
            self.fail(case, "dropped", f"{type(e).__name__}: {e}", headers)
            return None
        wall = time.monotonic() - t0
        self.slowest = max(self.slowest, (wall, f"{case.operation.label} {shown(case.body)[:200]}"))
        self.statuses[case.operation.label][response.status_code] += 1
        if response.stream_cut_short or wall > REQUEST_TIMEOUT_S:
            self.fail(case, "hang", f"the answer took {wall:.1f} s (stream cut short: {response.stream_cut_short})",
                      headers)
        bad = not_strict_json(response)
        if bad:
            self.fail(case, "not json", f"{response.status_code}: {bad}", headers)
        try:
            case.validate_response(response, checks=[not_a_server_error, max_response_time], headers=headers)
        except FailureGroup as group:
            kind = "5xx" if response.status_code >= 500 else "hang"
            self.fail(case, kind, f"{response.status_code} {response.text[:500]!r}\n  "
                      + "; ".join(f"{f.title}: {f.message}" for f in group.exceptions), headers)
        return response

    def batch(self, route: str, phase: str, cases_of, *args, authorized: bool = True) -> list:
        """Send every case of `cases_of(*args)`; then the server must still serve a normal request.
        Returns the cases."""
        t0 = time.monotonic()
        cases = cases_of(*args)
        for case in cases:
            response = self.send(case, phase, authorized)
            if not authorized and response is not None:
                expected = 200 if route in OPEN_ROUTES else 401
                if response.status_code != expected:
                    self.fail(case, "auth", f"without the key: {response.status_code} (expected {expected}): "
                              f"{response.text[:300]!r}", {})
        self.seconds[phase] += time.monotonic() - t0
        assert self.server.proc.poll() is None, f"raylm serve exited after {route} {phase}\n{self.server.log_tail()}"
        self.server.serves_a_normal_request()
        return cases


VOCAB = json.loads((Path(workers.tiny_model.__file__).parent / "config.json").read_text())["vocab_size"]


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": VOCAB - 1}}
_SAMPLING = {  # the fields both generation routes share, narrowed to what the engine accepts
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "maximum": VOCAB},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -PENALTY_RANGE, "maximum": PENALTY_RANGE},
    "frequency_penalty": {"type": "number", "minimum": -PENALTY_RANGE, "maximum": PENALTY_RANGE},
    "repetition_penalty": {"type": "number", "minimum": REPETITION_PENALTY_RANGE[0],
                           "maximum": REPETITION_PENALTY_RANGE[1]},
    "seed": _nullable({"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]}),
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_MODEL_LEN}),
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 4},
    "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "items": {"type": "string", "minLength": 1}}]}),
    "stop_token_ids": _nullable(_IDS),
    "logit_bias": _nullable({"type": "object", "maxProperties": min(8, MAX_LOGIT_BIAS),
                             "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,2})$"},  # ids below 1000 < VOCAB
                             "additionalProperties": {"type": "number", "minimum": -BIAS_RANGE,
                                                      "maximum": BIAS_RANGE}}),
}
IN_RANGE = {  # component -> property -> its narrowed schema
    "CompletionRequest": {**_SAMPLING,
                          "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                               {**_IDS, "minItems": 1},
                                               {"type": "array", "items": {"type": "string", "minLength": 1},
                                                "minItems": 1, "maxItems": 4},
                                               {"type": "array", "items": {**_IDS, "minItems": 1},
                                                "minItems": 1, "maxItems": 4}]},
                          "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
                          "echo": {"const": False}, "suffix": {"type": "null"}, "best_of": {"type": "null"}},
    "ChatCompletionRequest": {**_SAMPLING,
                              "max_completion_tokens": _nullable({"type": "integer", "minimum": 1,
                                                                  "maximum": MAX_MODEL_LEN}),
                              "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS})},
    "ChatMessage": {"content": {"anyOf": [{"type": "string"},
                                          {"type": "array", "items": {"$ref": "#/components/schemas/TextPart"}}]}},
    "DetokenizeRequest": {"tokens": _IDS},
}
REQUIRED_IN_RANGE = {"ChatMessage": ["role", "content"]}  # a message without content is refused (400)
ONE_OF_IN_RANGE = {"TokenizeRequest": [  # exactly one of prompt and messages
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
    {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]}


def within_engine_ranges(schema: dict) -> dict:
    """The schema with the request fields narrowed to the values the engine accepts (its
    documented ranges: scheduler/protocol.py, the vocab, MAX_MODEL_LEN), so that most requests
    drawn from it are served and the fuzzing reaches sampling, stops, logprobs, grammars and
    templates instead of stopping at a 400. The server's own schema is looser on purpose (the
    engine's checks name field and value); these are drawn in addition to its own cases."""
    narrowed = copy.deepcopy(schema)
    components = narrowed["components"]["schemas"]
    for name, fields in IN_RANGE.items():
        props = components[name]["properties"]
        unknown = sorted(set(fields) - set(props))
        assert not unknown, f"{name} no longer has {unknown}: update IN_RANGE"
        props.update(copy.deepcopy(fields))
    for name, required in REQUIRED_IN_RANGE.items():
        components[name]["required"] = required
    for name, alternatives in ONE_OF_IN_RANGE.items():
        components[name]["oneOf"] = copy.deepcopy(alternatives)
    return narrowed


def integral_floats_as_ints(value):
    """JSON Schema counts 277.0 as an integer, so the generator sends such floats where the schema
    says integer; the server parses integers strictly and refuses them with a 400 naming the field
    (the other phases send them as drawn). The engine-range cases send them as ints, to be served."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: integral_floats_as_ints(v) for k, v in value.items()}
    return value


def in_engine_ranges(narrowed_operation, n: int) -> list:
    """n cases drawn from the narrowed schema, their integral floats sent as ints."""
    cases = drawn(narrowed_operation, GenerationMode.POSITIVE, n)
    for case in cases:
        if isinstance(case.body, (dict, list)):
            case.body = integral_floats_as_ints(case.body)
    return cases


def drawn(operation, mode: GenerationMode, n: int) -> list:
    """Up to n cases Hypothesis draws for the operation, from SEED: the same ones every run of the
    same code. Fewer when the schema has fewer (a GET without parameters has one; its negation none)."""
    cases = []

    @seed(SEED)
    @settings(max_examples=n, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def draw(case):
        cases.append(case)

    try:
        draw()
    except Unsatisfiable:  # nothing to negate
        pass
    return cases


def coverage_cases(schema, operation) -> list:
    """schemathesis' coverage phase for the operation: deterministic boundary and type cases,
    both modes, plus the methods the route does not have."""
    cases = schema.iter_coverage_cases(operation, generation_modes=list(GenerationMode),
                                       generation_config=schema.config.generation_for(operation=operation))
    return [c for _, c in zip(range(MAX_COVERAGE_CASES), cases)]


def test_every_route_survives_schema_driven_fuzzing(fuzz_server):
    """The goals of the hostile-input issue, measured: no 5xx, no hang, no replica death, and a
    normal request served after every batch, over every route of the server's own schema."""
    config = schemathesis.Config.from_dict({
        "seed": SEED,
        "base-url": fuzz_server.base,
        "checks": {"max_response_time": REQUEST_TIMEOUT_S},
        "request-timeout": REQUEST_TIMEOUT_S,
        "max-stream-events": 1_000_000,  # read every stream to its end: only the time limit cuts one
        "output": {"sanitization": {"enabled": False}},  # the failures' curl commands as sent (max_tokens, ...)
    })
    schema = schemathesis.openapi.from_url(fuzz_server.base + "/openapi.json", config=config,
                                           headers=fuzz_server.auth, timeout=30)
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.label for op in operations} == ROUTES, "the schema's routes changed: update ROUTES (and OPEN_ROUTES)"
    in_range = schemathesis.openapi.from_dict(within_engine_ranges(schema.raw_schema), config=config)
    in_range_ops = {r.ok().label: r.ok() for r in in_range.get_all_operations()}

    before = fuzz_server.counters()
    fuzzer = Fuzzer(fuzz_server)
    t0 = time.monotonic()
    for op in operations:
        fuzzer.batch(op.label, "coverage", coverage_cases, schema, op)
        positive = fuzzer.batch(op.label, "positive", drawn, op, GenerationMode.POSITIVE, EXAMPLES["positive"])
        fuzzer.batch(op.label, "negative", drawn, op, GenerationMode.NEGATIVE, EXAMPLES["negative"])
        if op.body:  # a route with a request body: its engine-range cases too
            narrowed = in_range_ops[op.label]
            fuzzer.batch(op.label, "in-range coverage", coverage_cases, in_range, narrowed)
            fuzzer.batch(op.label, "in-range", in_engine_ranges, narrowed, EXAMPLES["in-range"])
        fuzzer.batch(op.label, "unauthorized", list, positive[:UNAUTHORIZED_EXAMPLES], authorized=False)
    elapsed = time.monotonic() - t0

    after = fuzz_server.counters()
    health = httpx.get(fuzz_server.base + "/health", timeout=30)
    deaths = {name: after[name] - before[name] for name in (*FAULT_COUNTERS, ERRORED_REQUESTS)}
    kinds = collections.Counter(f.kind for f in fuzzer.failures)
    print(f"\nfuzz: {sum(fuzzer.sent.values())} requests in {elapsed:.0f} s (seed {SEED}, schemathesis "
          f"{schemathesis.__version__}, digest {fuzzer.digest.hexdigest()[:16]}): "
          + ", ".join(f"{k} {v} ({fuzzer.seconds[k]:.0f} s)" for k, v in fuzzer.sent.items()))
    for route, statuses in fuzzer.statuses.items():
        print(f"fuzz:   {route}: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items(), key=str)))
    print(f"fuzz: 5xx {kinds['5xx']}, hangs (past {REQUEST_TIMEOUT_S:g} s) {kinds['hang']}, dropped connections "
          f"{kinds['dropped']}, not JSON {kinds['not json']}, auth {kinds['auth']}; "
          f"slowest answer {fuzzer.slowest[0]:.1f} s ({fuzzer.slowest[1]})")
    print("fuzz: replica deaths: " + ", ".join(f"{k} +{v:g}" for k, v in deaths.items())
          + f"; /health {health.status_code} {health.json().get('status')}")
    for f in fuzzer.failures:
        print(f"fuzz: FAILURE {f}")
    if fuzzer.failures or any(deaths.values()):
        print(f"fuzz: server log tail:\n{fuzz_server.log_tail()}")

    assert not fuzzer.failures, f"{len(fuzzer.failures)} failures: {dict(kinds)} (printed above)"
    assert not any(deaths.values()), deaths
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
