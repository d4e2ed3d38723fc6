"""The HTTP layer against hostile input, without Ray: the API key on every route but /health,
the key's sources, the connection limits of a real uvicorn server on 127.0.0.1 (raw sockets,
short limits), request bodies the strict parser refuses, and the OpenAPI schema's bodies."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest
from fastapi.testclient import TestClient

from cluster.cli import build_parser, http_limits, main, resolve_api_key
from cluster.openai.app import ServerState, build_app
from cluster.openai.http_limits import HttpLimits
from cluster.openai.http_server import HttpServer
from cluster.openai.serving_config import ServingConfig
from cluster.outputs import RequestOutput
from tests.cluster.conftest import free_port

KEY = "sk-limits"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "m"
# short enough for fast tests, long enough that a loaded 2-core host answers a whole request in time
LIMITS = HttpLimits(timeout_keep_alive=1.0, request_header_timeout=1.0, request_body_timeout=1.0,
                    max_header_bytes=4096, max_headers=20)


class _Tokenizer:
    """One token per byte of UTF-8."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def __len__(self) -> int:
        return 256


class FakeHandle:
    """What the routes call on an LLMHandle. agenerate checks the prompt and max_tokens as the
    engine does (with its messages) and answers "ok" after `delay` seconds."""

    sampling_defaults: dict = {}
    max_model_len = 256
    tokenizer = _Tokenizer()

    def __init__(self, delay: float = 0.0):
        self.delay = delay

    def health(self) -> dict:
        return {"status": "ok", "replicas": []}

    def metrics_text(self) -> str:
        return "raylm_requests_running 0\n"

    def apply_chat_template(self, messages, tools=None, kwargs=None) -> str:
        return "".join(m["content"] for m in messages)

    async def agenerate(self, prompt, params) -> RequestOutput:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                             f"max_model_len={self.max_model_len}")
        await asyncio.sleep(self.delay)
        return RequestOutput("r", None, ids, "ok", [111, 107], "length")


def _client(api_key: str | None = KEY, metrics_without_auth: bool = False, handle=None) -> TestClient:
    state = ServerState([MODEL], api_key, metrics_without_auth)
    state.handle = handle or FakeHandle()
    return TestClient(build_app(state))


def _routes(client: TestClient) -> list[tuple[str, str]]:
    """(method, path) of every route the server's own schema lists."""
    schema = client.get("/openapi.json", headers=AUTH).json()
    return [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]


# ---- the API key ----

def test_every_route_but_health_needs_the_key():
    client = _client()
    routes = _routes(client)
    assert {("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/v1/models")} <= set(routes)
    for method, path in routes + [("GET", "/openapi.json"), ("GET", "/no-such-route")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = client.request(method, path, headers=headers, json={"model": MODEL, "prompt": "hi"})
            if path == "/health":
                assert r.status_code == 200, r.text
            else:
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
        r = client.request(method, path, headers=AUTH, json={"model": MODEL, "prompt": "hi"})
        assert r.status_code != 401, (method, path, r.text)


def test_metrics_open_only_when_the_operator_says_so():
    assert _client().get("/metrics").status_code == 401
    opened = _client(metrics_without_auth=True)
    r = opened.get("/metrics")
    assert r.status_code == 200 and "raylm_requests_running" in r.text
    for method, path in _routes(opened):
        if path not in ("/health", "/metrics"):
            assert opened.request(method, path).status_code == 401, path
    assert build_parser().parse_args(["serve"]).metrics_without_auth is False
    assert build_parser().parse_args(["serve", "--metrics-without-auth"]).metrics_without_auth is True


def test_without_a_key_every_route_is_open():
    client = _client(api_key=None)
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}).json()["tokens"] == [104, 105]


def test_the_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("RAYLM_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY} \nsecond line ignored\n")
    assert resolve_api_key(None, str(key_file)) == KEY
    monkeypatch.setenv("RAYLM_API_KEY", "from-env")
    assert resolve_api_key(None, str(key_file)) == KEY  # the file's, not the environment's
    with caplog.at_level(logging.WARNING, logger="raylm"):
        assert resolve_api_key(None) == "from-env"
        assert not caplog.records
        assert resolve_api_key("on-the-command-line") == "on-the-command-line"
    assert any("process list" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key("k", str(key_file))


@pytest.mark.parametrize("content", [None, "", "\n", "   \nkey on the second line\n"])
def test_a_missing_or_empty_key_file_is_an_error_naming_flag_and_path(tmp_path, capsys, content):
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    assert main(["serve", "--api-key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--api-key-file" in err and str(path) in err


# ---- bodies: strict parsing, errors naming the field ----

def test_an_empty_prompt_list_is_a_400_naming_prompt():
    client = _client()
    for prompt in ([], "", [[]]):
        r = client.post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 400, (prompt, r.text)
        assert r.json()["error"]["param"] == "prompt", r.text
    ok = client.post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": [104, 105], "max_tokens": 2})
    assert ok.status_code == 200 and [c["text"] for c in ok.json()["choices"]] == ["ok"]


@pytest.mark.parametrize("body,param,shown", [
    ({"max_tokens": 10**12}, "max_tokens", "1000000000000"),  # the engine's "max_tokens=... plus the prompt's"
    ({"max_tokens": 4, "min_tokens": 9}, "min_tokens", "max_tokens=4"),
    ({"logit_bias": {"5": 500}}, "logit_bias", "500"),
    ({"max_tokens": "8"}, "max_tokens", '"8"'),
])
def test_bad_fields_name_the_field_as_param(body, param, shown):
    r = _client().post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and shown in r.json()["error"]["message"], r.text


def test_chat_errors_name_the_message_they_are_about():
    r = _client().post("/v1/chat/completions", headers=AUTH,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content", r.text


# ---- the OpenAPI schema ----

def test_the_schema_describes_the_json_body_of_each_post_route():
    schema = _client().get("/openapi.json", headers=AUTH).json()
    components = schema["components"]["schemas"]

    def resolve(node):
        """The node with every $ref replaced by its target (each must exist)."""
        if isinstance(node, dict):
            if "$ref" in node:
                prefix, name = node["$ref"].rsplit("/", 1)
                assert prefix == "#/components/schemas" and name in components, node["$ref"]
                return resolve(components[name])
            return {k: resolve(v) for k, v in node.items()}
        return [resolve(v) for v in node] if isinstance(node, list) else node

    required = {"/v1/completions": {"model", "prompt"}, "/v1/chat/completions": {"model", "messages"},
                "/tokenize": {"model"}, "/detokenize": {"model", "tokens"}}
    for path, fields in required.items():
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        model = resolve(body["content"]["application/json"]["schema"])
        assert model["type"] == "object" and set(model["required"]) == fields, (path, model.get("required"))
        assert model["properties"]["model"]["enum"] == [MODEL]  # another name is a 404
    assert "$defs" not in json.dumps(schema)
    chat = resolve(components["ChatCompletionRequest"])
    assert chat["properties"]["messages"]["items"]["properties"]["role"]["enum"][:2] == ["system", "user"]
    prompt = resolve(components["CompletionRequest"])["properties"]["prompt"]["anyOf"]
    assert all(p.get("minItems") == 1 for p in prompt if p["type"] == "array")


# ---- connection limits, on a real uvicorn server ----

@pytest.fixture(scope="module")
def server():
    """The HTTP server as the engine actor runs it (HttpServer), on 127.0.0.1 with LIMITS;
    its handle answers after 1.5 s, longer than the header and body timeouts."""
    port = free_port()
    http = HttpServer(ServingConfig(model_names=(MODEL,), port=port, api_key=KEY, access_log=False, limits=LIMITS))
    asyncio.run(http.start())
    http.serve(FakeHandle(delay=1.5))
    yield port
    asyncio.run(http.stop())


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout, 10 s,
    fails the test: the connection stayed open)."""
    got = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def _response(s: socket.socket) -> tuple[int, dict, bytes]:
    """One response with a content-length body, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += s.recv(65536)
    return int(lines[0].split()[1]), headers, body


def _status_and_error(raw: bytes) -> tuple[int, dict | None]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"] if body else None


def test_a_connection_that_sends_nothing_is_closed(server):
    with _connect(server) as s:
        assert _until_closed(s) == b""


def test_partial_headers_get_408_and_the_connection_closed(server):
    with _connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: 1")
        status, error = _status_and_error(_until_closed(s))
    assert status == 408 and error["code"] == "request_timeout"


def test_headers_over_the_byte_limit_get_431_and_the_connection_closed(server):
    with _connect(server) as s:  # just under the limit: served
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (LIMITS.max_header_bytes - 200) + b"\r\n\r\n")
        assert _response(s)[0] == 200
    with _connect(server) as s:  # over it, the head not yet complete: refused before the rest arrives
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * LIMITS.max_header_bytes)
        status, error = _status_and_error(_until_closed(s))
    assert status == 431 and error["code"] == "headers_too_large" and str(LIMITS.max_header_bytes) in error["message"]


def test_a_complete_head_over_the_limit_is_refused_too(server):
    with _connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 300) for i in range(15))
                  + b"\r\n")
        status, error = _status_and_error(_until_closed(s))
    assert status == 431 and error["code"] == "headers_too_large"


def test_too_many_headers_get_431_and_the_connection_closed(server):
    def head(n: int) -> bytes:
        return b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(n)) + b"\r\n"

    with _connect(server) as s:
        s.sendall(head(LIMITS.max_headers))
        assert _response(s)[0] == 200
    with _connect(server) as s:
        s.sendall(head(LIMITS.max_headers + 1))
        status, error = _status_and_error(_until_closed(s))
    assert status == 431 and error["code"] == "too_many_headers" and str(LIMITS.max_headers) in error["message"]


def test_a_stalled_body_gets_408_and_the_connection_closed(server):
    with _connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")
        raw = _until_closed(s)
    status, error = _status_and_error(raw)
    assert status == 408 and error["code"] == "request_timeout" and error["param"] == "body", raw


def test_an_idle_keep_alive_connection_is_closed_after_its_response(server):
    with _connect(server) as s:
        for _ in range(2):  # the connection serves requests one after another
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, _ = _response(s)
            assert status == 200 and headers.get("connection") != "close"
        assert _until_closed(s) == b""


def test_a_slow_response_outlives_the_header_timeout(server):
    """The handle takes 1.5 s, past the header timeout; a stray CRLF after the request (as some
    clients send after a body) must not get the connection closed under the response."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    with _connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body + b"\r\n")
        status, _, out = _response(s)
    assert status == 200 and json.loads(out)["choices"][0]["text"] == "ok"


def test_stray_bytes_after_a_response_leave_the_connection_bounded(server):
    """Any byte after a response stops uvicorn's keep-alive timer, a CRLF too (the parser
    skips it: no request begins); the head timer closes the connection instead."""
    with _connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(s)[0] == 200
        s.sendall(b"\r\n")
        status, error = _status_and_error(_until_closed(s))
    assert status == 408 and error["code"] == "request_timeout"


def test_limit_flags_reach_the_limits_with_their_defaults():
    assert http_limits(build_parser().parse_args(["serve"])) == HttpLimits()
    a = build_parser().parse_args(["serve", "--timeout-keep-alive", "2", "--limit-concurrency", "0",
                                   "--max-header-bytes", "8192", "--request-header-timeout", "3",
                                   "--request-body-timeout", "4"])
    assert http_limits(a) == HttpLimits(timeout_keep_alive=2, limit_concurrency=None, max_header_bytes=8192,
                                        request_header_timeout=3, request_body_timeout=4)
    with pytest.raises(ValueError, match="request_header_timeout must be a positive number of seconds, got 0"):
        http_limits(build_parser().parse_args(["serve", "--request-header-timeout", "0"]))
    with pytest.raises(ValueError, match="max_header_bytes must be an integer >= 1, got -1"):
        HttpLimits(max_header_bytes=-1)


def test_the_serving_config_names_a_bad_field_and_value():
    with pytest.raises(ValueError, match="port must be an integer in \\[0, 65535\\], got 70000"):
        ServingConfig(model_names=("m",), port=70000)
    with pytest.raises(ValueError, match="model_names must be a non-empty list of model ids, got 'm'"):
        ServingConfig(model_names="m")
    with pytest.raises(ValueError, match="http_process must be one of \\('engine', 'process'\\), got 'thread'"):
        ServingConfig(model_names=("m",), http_process="thread")
    with pytest.raises(ValueError, match="max_body_bytes must be an integer >= 1, got 0"):
        ServingConfig(model_names=("m",), max_body_bytes=0)
    assert ServingConfig(model_names=["m"], port=8001).url == "http://127.0.0.1:8001"
