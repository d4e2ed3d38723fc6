"""`raylm generate | serve | bench`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from cluster.config import DEFAULT_GIL_SWITCH_INTERVAL_MS, GENERATION_CONFIG_MODES, check_gil_switch_interval_ms
from cluster.openai.http_limits import (
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
    DEFAULT_REQUEST_HEADER_TIMEOUT_S,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    HttpLimits,
)
from cluster.openai.serving_config import DEFAULT_MAX_BODY_BYTES, SERVE_INGRESS_MODES, ServingConfig, served_model_name
from workers.runner_config import QUANTIZATIONS

log = logging.getLogger("raylm")


def _engine_args(p: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """The engine's flags, in groups (EngineConfig's own); returns the groups, for a command to add to."""
    m = p.add_argument_group("model and device")
    k = p.add_argument_group("batching and the KV pool")
    t = p.add_argument_group("parallelism")
    r = p.add_argument_group("reliability (docs/reliability.md)")
    a = p.add_argument_group("advanced (performance tuning and placement overrides; the defaults are chosen "
                             "for the device)")
    m.add_argument("--model", default=None, help="checkpoint directory (default: the bundled tiny Qwen3)")
    m.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    m.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: the checkpoint's; bf16/fp16 weights compute in float32 on a CPU "
                        "without half-precision matmul instructions)")
    m.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS,
                   help="int8: quantize an unquantized checkpoint's linears at load (per-channel weights, per-token "
                        "activations); the others name the checkpoint's own format (read from it by default)")
    m.add_argument("--max-model-len", type=int, default=None)
    m.add_argument("--speculative-config", default=None, type=json_object,
                   help='speculative decoding, vLLM\'s keys as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    k.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (CPU)")
    k.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one batch")
    k.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    k.add_argument("--max-waiting-requests", type=int, default=None,
                   help="queue bound per replica; beyond it requests are refused (HTTP 429)")
    t.add_argument("--replicas", type=int, default=1, help="data-parallel replicas")
    t.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices (worker actors) per replica, the model split across them")
    t.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: each of a replica's devices holds whole experts (num_experts / "
                        "tensor_parallel_size of them) instead of a slice of every expert")
    t.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages per replica, each a tensor-parallel group holding a share of the layers; "
                        "stages go on different nodes when no node holds the whole replica")
    t.add_argument("--pp-layer-partition", default=None,
                   help="layers per pipeline stage, e.g. 5,3 (vLLM's VLLM_PP_LAYER_PARTITION; default: balanced)")
    r.add_argument("--max-request-failures", type=int, default=None,
                   help="fail a request that was on the worker at this many worker failures in a row (default 2)")
    r.add_argument("--grammar-compile-timeout-s", type=float, default=None,
                   help="refuse a request whose grammar (response_format, forced tool call) does not compile within "
                        "this many seconds (default 10)")
    r.add_argument("--max-grammar-bytes", type=int, default=None,
                   help="refuse a schema or grammar longer than this (default 65536)")
    a.add_argument("--threads-per-worker", type=int, default=None)
    a.add_argument("--prefill-threads-per-worker", type=int, default=None,
                   help="torch threads of steps of >= 256 tokens (default: with the reserved cores lent back)")
    a.add_argument("--accelerator-resource", default=None,
                   help="Ray resource each worker takes one of (default: NPU for npu, GPU for cuda, none for cpu); "
                        "e.g. NPU with --device cpu places CPU workers as they would be placed on NPUs")
    a.add_argument("--enforce-eager", action="store_true",
                   help="no captured decode graphs on cuda/npu (every step eager)")
    a.add_argument("--graph-sizes", default=None, type=lambda s: [int(x) for x in s.split(",")],
                   help="decode graph batch buckets, e.g. 1,2,4,8 (default: powers of two up to max_num_seqs)")
    a.add_argument("--step-channel", default=None, choices=["auto", "socket", "ray"],
                   help="how steps reach a worker: 'socket', a TCP connection to it (~7x less CPU per step); "
                        "'ray', an actor call per step; 'auto' (the default): socket on cpu, ray on cuda/npu")
    return {"model": m, "batching": k, "parallel": t, "reliability": r, "advanced": a}


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (e.g. --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r:.80}")
    return value


def _engine_kwargs(a: argparse.Namespace) -> dict:
    kw = dict(model=a.model, device=a.device, num_replicas=a.replicas, dtype=a.dtype, quantization=a.quantization,
              num_kv_blocks=a.num_kv_blocks, max_model_len=a.max_model_len, threads_per_worker=a.threads_per_worker,
              prefill_threads_per_worker=a.prefill_threads_per_worker,
              accelerator_resource=a.accelerator_resource, enforce_eager=a.enforce_eager, graph_sizes=a.graph_sizes,
              tensor_parallel_size=a.tensor_parallel_size, enable_expert_parallel=a.enable_expert_parallel,
              pipeline_parallel_size=a.pipeline_parallel_size, speculative_config=a.speculative_config,
              pp_layer_partition=a.pp_layer_partition or os.environ.get("VLLM_PP_LAYER_PARTITION") or None)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "generation_config",
                 "step_channel", "trust_request_chat_template", "max_request_failures", "grammar_compile_timeout_s",
                 "max_grammar_bytes"):  # unset (or not a flag of this command): the default
        if getattr(a, name, None) is not None:
            kw[name] = getattr(a, name)
    return kw


def cmd_generate(a: argparse.Namespace) -> int:
    import cluster

    params = cluster.SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                                    top_k=a.top_k, seed=a.seed, ignore_eos=a.ignore_eos)
    t0 = time.perf_counter()
    with cluster.launch(**_engine_kwargs(a)) as llm:
        t_up = time.perf_counter() - t0
        prompt = llm.apply_chat_template([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
        t1 = time.perf_counter()
        if a.stream:
            print(a.prompt, end="", flush=True)
            for delta in llm.stream(prompt, params):
                print(delta.text, end="", flush=True)
            out = delta.output
            print()
        else:
            out = llm.generate(prompt, params)
            print(a.prompt + out.text)
        elapsed = time.perf_counter() - t1
        stats = llm.stats()
        ops = (llm.worker_stats() or [{}])[0].get("ops") or {}
    n = len(out.token_ids)
    ttft = out.metrics.ttft if out.metrics and out.metrics.ttft is not None else float("nan")
    print(
        f"[raylm] {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s), TTFT {ttft * 1000:.1f} ms, "
        f"finish={out.finish_reason}, bytes pulled per decode step {stats['bytes_pulled_per_decode_step']:.0f}, "
        f"engine start {t_up:.1f}s, ops {'/'.join(str(v) for v in ops.values() if v) or '-'}"
        + (f", speculative acceptance {stats['spec_acceptance_rate']:.2f} "
           f"({stats['spec_mean_accepted_length']:.2f} tokens per verifying row)" if stats.get("spec_draft_tokens")
           else ""),
        file=sys.stderr,
    )
    return 0


def resolve_api_key(flag: str | None, key_file: str | None = None) -> str | None:
    """--api-key-file's first line, else --api-key, else RAYLM_API_KEY, else no key (then
    bind only to trusted interfaces). A key given as --api-key shows in the process list
    (`ps`), so it is taken with a warning; a file that cannot be read or whose first line
    is empty is a ValueError naming the flag and the path."""
    if key_file is not None:
        if flag:
            raise ValueError("give the API key one way: --api-key or --api-key-file, not both")
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or e
            raise ValueError(f"--api-key-file {key_file!r}: cannot read it: {reason}") from None
        if not key:
            raise ValueError(f"--api-key-file {key_file!r}: the first line is empty; it must hold the key")
        return key
    if flag:
        log.warning("--api-key puts the key in the process list (ps); use --api-key-file or RAYLM_API_KEY")
        return flag
    return os.environ.get("RAYLM_API_KEY") or None


def http_limits(a: argparse.Namespace) -> HttpLimits:
    """The HTTP limits `raylm serve`'s flags ask for (--limit-concurrency 0: no limit)."""
    return HttpLimits(timeout_keep_alive=a.timeout_keep_alive, limit_concurrency=a.limit_concurrency or None,
                      max_header_bytes=a.max_header_bytes, request_header_timeout=a.request_header_timeout,
                      request_body_timeout=a.request_body_timeout)


def cmd_serve(a: argparse.Namespace) -> int:
    import cluster

    cfg = cluster.EngineConfig.from_kwargs(**_engine_kwargs(a), reserved_cpus=a.reserved_cpus,
                                           prepare_structured_output=not a.lazy_structured_output)
    check_gil_switch_interval_ms(a.gil_switch_interval_ms)
    serving = ServingConfig(  # bad serving options are an error before anything starts
        model_names=(a.served_model_name or served_model_name(a.model),), host=a.host, port=a.port,
        api_key=resolve_api_key(a.api_key, a.api_key_file), metrics_without_auth=a.metrics_without_auth,
        max_body_bytes=a.max_body_bytes, access_log=not a.disable_access_log, limits=http_limits(a),
        http_process=a.frontend)
    if serving.http_process == "engine" and (a.address or "").startswith("ray://"):
        raise ValueError(f"--frontend engine serves HTTP from the engine actor on this node, which a Ray Client "
                         f"address ({a.address}) does not make part of the cluster; use --frontend process")
    if a.engines is not None and a.serve_proxy == "haproxy":
        if a.address != "local":
            log.warning("--serve-proxy haproxy: a Ray this command joins serves through HAProxy only if it was "
                        "started with RAY_SERVE_ENABLE_HA_PROXY=1 in its environment")
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"  # before Ray starts: its Serve controller reads it
        if a.address == "local":
            os.environ.update(private_haproxy_env(os.environ))
    cluster.ensure_ray(a.address)
    if a.engines is not None:
        return _serve_with_ray_serve(a, cfg, serving)
    if serving.http_process == "process":
        return _serve_from_this_process(a, cfg, serving)
    return _serve_in_engine(a, cfg, serving)


def private_haproxy_env(env) -> dict[str, str]:
    """For a Ray this command starts with Serve's HAProxy: the listeners and files HAProxy otherwise
    takes from fixed defaults (stats and metrics ports 8404 and 9101, the fallback Python proxy's
    8500, its config, admin socket and server state under /tmp/haproxy-serve), made this server's
    own, so a second server on the host neither fails to bind nor overwrites the first's config. A
    variable already set in `env` is kept."""
    import atexit
    import shutil
    import tempfile

    from cluster.ports import free_port

    d = tempfile.mkdtemp(prefix="raylm-haproxy-")
    atexit.register(shutil.rmtree, d, True)
    own = {"RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),  # Serve's Python proxy beside HAProxy
           "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(d, "haproxy.cfg"),
           "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(d, "admin.sock"),
           "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": d,
           "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(d, "server-state")}
    return {k: v for k, v in own.items() if k not in env}


def _serve_in_engine(a, cfg, serving: ServingConfig) -> int:
    """The HTTP server runs in the engine actor's process (cluster/openai/http_server.py); this
    process waits, and stops the engine when interrupted or when the engine dies."""
    import ray

    from cluster.remote.engine_actor import launch_detached

    try:
        actor, started = launch_detached(cfg, a.name, http=serving, gil_switch_interval_ms=a.gil_switch_interval_ms)
    except OSError as e:
        print(f"raylm: error: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log.info("engine %r loading; HTTP on http://%s:%d (in the engine's process; /health is 503 until loaded)",
             a.name, serving.host, serving.port)
    try:
        pending = [started]
        while not stop.is_set():
            if pending:
                done, pending = ray.wait(pending, timeout=0.5)
                if done:
                    try:
                        ray.get(done[0])
                        log.info("engine %r loaded; serving on %s", a.name, serving.url)
                    except ray.exceptions.RayActorError as e:
                        log.error("the engine actor died while loading: %s", e)
                        return 1
                    except Exception as e:  # the server answers 503 "unavailable" with the reason
                        log.error("engine failed to start: %s", getattr(e, "cause", None) or e)
                continue
            try:  # still there? (a dead engine took its HTTP server with it)
                if not ray.get(actor.serves_http.remote(), timeout=30):
                    log.error("the HTTP server inside engine %r stopped (the engine's log says why)", a.name)
                    return 1
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayActorError as e:
                log.error("the engine actor died: %s", e)
                return 1
            stop.wait(2.0)
    finally:
        ray.kill(actor, no_restart=True)  # the engine lives as long as this command
    return 0


def _serve_with_ray_serve(a, cfg, serving: ServingConfig) -> int:
    """`--engines N`: the Ray Serve application (cluster/serve/deployments.py), N engines behind Serve's
    HTTP proxy (from N to --max-engines under Serve's autoscaling); runs until interrupted."""
    import dataclasses

    from ray import serve

    from cluster.core.placement import default_threads
    from cluster.serve.deployments import build_openai_app

    if a.engines < 1:
        raise ValueError(f"--engines must be an integer >= 1, got {a.engines}")
    if cfg.device == "cpu" and cfg.threads_per_worker is None:  # the cores split over every engine there may be
        engines = a.max_engines or a.engines
        cfg = dataclasses.replace(cfg, threads_per_worker=default_threads(
            engines * cfg.num_replicas, cfg.ranks_per_replica, cfg.reserved_cpus))
    autoscaling = None
    if a.max_engines is not None:
        if a.max_engines < a.engines:
            raise ValueError(f"--max-engines must be >= --engines ({a.engines}), got {a.max_engines}")
        autoscaling = {"min_replicas": a.engines, "max_replicas": a.max_engines}
    app = build_openai_app(cfg, num_engines=a.engines, autoscaling_config=autoscaling,
                           served_model_name=serving.model_names[0], api_key=serving.api_key,
                           metrics_without_auth=serving.metrics_without_auth, max_body_bytes=serving.max_body_bytes,
                           access_log=serving.access_log, ingress=a.serve_ingress,
                           gil_switch_interval_ms=a.gil_switch_interval_ms)
    if _serve_running():
        log.warning("Ray Serve already runs on this cluster: its HTTP proxies keep the host and port they have; "
                    "--host %s --port %d do not apply", serving.host, serving.port)
    serve.start(http_options={"host": serving.host, "port": serving.port})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log.info("starting %d engine(s) under Ray Serve; HTTP on %s", a.engines, serving.url)
    try:
        serve.run(app, name=a.name, route_prefix="/", blocking=False)
        log.info("serving on %s", serving.url)
        stop.wait()
    finally:
        serve.delete(a.name)
        if not serve.status().applications:  # Serve started for this app alone: its proxy frees the port
            serve.shutdown()
    return 0


def _serve_running() -> bool:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def _serve_from_this_process(a, cfg, serving: ServingConfig) -> int:
    """The HTTP server in this process, a frontend of the engine actor over the channel."""
    import ray
    import uvicorn

    import cluster
    from cluster.openai.app import ServerState, build_app
    from cluster.openai.http_limits import uvicorn_options
    from cluster.remote.engine_actor import launch_detached
    from cluster.remote.remote_engine import RemoteEngine

    actor, started = launch_detached(cfg, a.name, gil_switch_interval_ms=a.gil_switch_interval_ms)
    state = ServerState(list(serving.model_names), serving.api_key, serving.metrics_without_auth)

    def wait_until_loaded() -> None:
        try:
            ray.get(started)
            state.handle = cluster.LLMHandle(RemoteEngine.attach(a.name))
            log.info("engine %r loaded; serving on %s", a.name, serving.url)
        except Exception as e:  # /health says why
            state.startup_error = f"engine failed to start: {e}"
            log.error(state.startup_error)

    threading.Thread(target=wait_until_loaded, daemon=True).start()
    try:
        uvicorn.run(build_app(state, serving.max_body_bytes, serving.limits.request_body_timeout), host=serving.host,
                    port=serving.port, **uvicorn_options(serving.limits, access_log=serving.access_log))
    finally:
        ray.kill(actor, no_restart=True)  # the engine lives as long as this server
    return 0


def cmd_up(a: argparse.Namespace) -> int:
    from cluster.ray_up import up

    return up(a.config, a.ray_up_args)


def cmd_quantize(a: argparse.Namespace) -> int:
    from workers.quant.export import export_w8a8

    if os.path.exists(os.path.join(a.dst, "config.json")):
        raise ValueError(f"{a.dst} already holds a checkpoint (config.json); choose an empty directory")
    print(export_w8a8(a.src, a.dst))
    return 0


def _http_limit_args(s) -> None:
    s.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S, metavar="S",
                   help="close a keep-alive connection idle for S seconds "
                        f"(default {DEFAULT_TIMEOUT_KEEP_ALIVE_S:g})")
    s.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY, metavar="N",
                   help="open connections plus running requests past which a request gets 503 "
                        f"(default {DEFAULT_LIMIT_CONCURRENCY}; 0: no limit)")
    s.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES, metavar="B",
                   help="largest request line and headers; larger gets 431 and the connection closed "
                        f"(default {DEFAULT_MAX_HEADER_BYTES})")
    s.add_argument("--request-header-timeout", type=float, default=DEFAULT_REQUEST_HEADER_TIMEOUT_S, metavar="S",
                   help="a request's headers must arrive within S seconds of the connection's start (between "
                        "requests: of their first byte), else 408 and the connection closed "
                        f"(default {DEFAULT_REQUEST_HEADER_TIMEOUT_S:g})")
    s.add_argument("--request-body-timeout", type=float, default=DEFAULT_REQUEST_BODY_TIMEOUT_S, metavar="S",
                   help="a request's body must arrive within S seconds of the server starting to read it, else 408 "
                        f"(default {DEFAULT_REQUEST_BODY_TIMEOUT_S:g})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylm", description="Serve Qwen3 from a Ray cluster")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (the default here) is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--stream", action="store_true")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server over a named engine actor")
    groups = _engine_args(s)
    h = s.add_argument_group("serving")
    m, r, a = groups["model"], groups["reliability"], groups["advanced"]
    h.add_argument("--address", default=None,
                   help="Ray address to join ('auto': the local node's cluster; 'local': start a new single-node Ray)")
    h.add_argument("--name", default="raylm", help="engine actor name, for cluster.connect(name)")
    h.add_argument("--served-model-name", default=None, help="model id in the API (default: model dir name)")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (and /metrics with "
                        "--metrics-without-auth); the process list shows it: prefer --api-key-file or the "
                        "RAYLM_API_KEY environment variable")
    h.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from PATH's first line")
    h.add_argument("--metrics-without-auth", action="store_true",
                   help="serve /metrics without the API key (for a Prometheus scraper that has none)")
    h.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body (default: 1 MiB; 413)")
    _http_limit_args(h)
    a.add_argument("--reserved-cpus", type=int, default=1,
                   help="CPU cores left to the HTTP server and engine actor when --threads-per-worker is not given "
                        "(device cpu; default 1: a worker's torch threads stall whenever another process takes "
                        "one of their cores)")
    h.add_argument("--engines", type=int, default=None, metavar="N",
                   help="serve as a Ray Serve application of N engines, each with its own workers, behind Serve's "
                        "HTTP proxy (requests routed by cached prefix, then load); default: one engine, no Serve")
    h.add_argument("--max-engines", type=int, default=None, metavar="M",
                   help="with --engines N: let Serve's autoscaler run N to M engines on ongoing requests")
    h.add_argument("--serve-proxy", choices=("python", "haproxy"), default="python",
                   help="with --engines: Serve's HTTP proxy, its Python one (Serve's default) or HAProxy "
                        "(RAY_SERVE_ENABLE_HA_PROXY=1, set here for the Ray this command starts; a cluster "
                        "started with `ray start` needs it in that environment)")
    h.add_argument("--serve-ingress", choices=SERVE_INGRESS_MODES, default="deployment",
                   help="with --engines: 'deployment' (default), an OpenAI ingress deployment in front of the "
                        "engines, which routes by cached prefix and retries a request an engine lost before its "
                        "first token; 'direct', each engine serves HTTP itself, one hop less, load-balanced by the "
                        "proxy, without either (docs/architecture.md)")
    a.add_argument("--frontend", choices=("engine", "process"), default="engine",
                   help="where the HTTP server runs: 'engine' (the default), inside the engine actor's process, "
                        "no channel between them; 'process', in this process, a frontend of the engine over "
                        "the channel (for hosts with cores to spare, where one GIL for both would limit)")
    a.add_argument("--gil-switch-interval-ms", type=float, default=DEFAULT_GIL_SWITCH_INTERVAL_MS,
                   help="how long a thread of the engine actor's process may hold the GIL while another waits "
                        "(sys.setswitchinterval; Python's default is 5 ms, a whole decode step: the step loop "
                        "then waits behind the HTTP server)")
    h.add_argument("--disable-access-log", action="store_true",
                   help="no log line per HTTP request (as vLLM's --disable-uvicorn-access-log; ~5%% of the "
                        "server's CPU under a burst of short requests)")
    a.add_argument("--lazy-structured-output", action="store_true",
                   help="load the tokenizer and xgrammar into a worker with its first grammar request, not "
                        "while it starts (that request then waits a second or two longer; the others do not)")
    m.add_argument("--generation-config", choices=GENERATION_CONFIG_MODES, default=None,
                   help="'auto' (the default): requests that leave temperature, top_p, top_k, min_p, "
                        "the penalties or max_tokens out get the model's generation_config.json values, "
                        "as vLLM does; 'none': raylm's own defaults (vLLM's --generation-config vllm)")
    r.add_argument("--trust-request-chat-template", action="store_true", default=None,
                   help="let requests bring their own chat template (chat_template, or "
                        "chat_template_kwargs.chat_template), as vLLM's flag of this name; it renders in a bounded "
                        "sandbox. Without it such requests are refused (400)")
    s.set_defaults(func=cmd_serve)

    u = sub.add_parser("up", help="check a cluster YAML (validation, SSH to the head), then run `ray up` on it")
    u.add_argument("config", help="cluster YAML, e.g. deploy/ascend-cluster.yaml")
    u.add_argument("ray_up_args", nargs=argparse.REMAINDER, help="passed on to `ray up` (e.g. -y)")
    u.set_defaults(func=cmd_up)

    q = sub.add_parser("quantize", help="write a float checkpoint's W8A8 copy (compressed-tensors int-quantized: "
                                        "int8 weights per channel, activations per token at run time)")
    q.add_argument("src", help="a float checkpoint directory (config.json, *.safetensors)")
    q.add_argument("dst", help="a new directory for the quantized copy")
    q.set_defaults(func=cmd_quantize)

    from cluster.bench import add_parser as add_bench_parser  # the CLI is the one importer of cluster.bench

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request (the bench polls /health)
    try:
        return a.func(a)
    except (ValueError, ConnectionError) as e:  # bad input, no Ray at the address: say what, no traceback
        print(f"raylm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
