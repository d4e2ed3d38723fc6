"""raylm as a Ray Serve application: OpenAI routes in front of engines that scale out.

Two deployments (`ingress="deployment"`, the default):

- "RaylmEngine" (cluster/serve/engine_server.py): each Serve replica is one raylm engine with
  its own workers, placed together: `placement_group_bundles` holds a bundle per worker rank
  (its NPU / GPU and CPUs), STRICT_PACK, and the engine's ranks take those bundles. Serve scales
  it (a fixed `num_engines`, or `autoscaling_config` on ongoing requests), health-checks it
  through the engine's own health, and routes each request with PrefixAwareRouter
  (cluster/serve/prefix_router.py).
- "OpenAIIngress": the same HTTP app `raylm serve` runs (cluster/openai/app.py: routes,
  streaming, errors, API key, body limits) over an LLMHandle whose engine is a ServeEngine
  (cluster/serve/serve_engine.py), behind Serve's HTTP proxy.

With `ingress="direct"` there is one: each engine replica is the HTTP ingress itself
(DirectEngineServer: the OpenAI app over its own engine), so a request crosses no ingress replica
and its stream no extra process. What that gives up: Serve's proxy balances the engines by load
alone (under HAProxy, HAProxy's algorithm; the PrefixAwareRouter sees no prompt there), and a
request whose engine dies fails with it instead of being retried elsewhere. Serve's HAProxy
ingress (RAY_SERVE_ENABLE_HA_PROXY=1 where Ray starts; `raylm serve --serve-proxy haproxy`)
serves either form in place of its Python proxy (docs/benchmarks.md measures each).

`build_openai_app(engine_config, ...)` is the Python builder; `build_app(args)` is the same for
`serve run` and Serve config files (deploy/serve.yaml); `raylm serve --engines N` runs it.
"""

from __future__ import annotations

import dataclasses

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.config import DEFAULT_GIL_SWITCH_INTERVAL_MS, EngineConfig, check_gil_switch_interval_ms
from cluster.core.placement import worker_resources
from cluster.openai.serving_config import DEFAULT_MAX_BODY_BYTES, SERVE_INGRESS_MODES
from cluster.openai.serving_config import served_model_name as default_model_name
from cluster.serve.engine_server import (
    DEFAULT_STREAM_INTERVAL_MS,
    DirectEngineServer,
    EngineServer,
    check_stream_interval_ms,
)
from cluster.serve.prefix_router import PrefixAwareRouter

ENGINE_DEPLOYMENT = "RaylmEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"
INGRESS_MAX_ONGOING_REQUESTS = 8192  # the ingress only parses and relays; requests wait at the engines
ENGINE_GRACEFUL_SHUTDOWN_S = 60.0  # a scaled-down engine finishes what it runs (then the rest is retried)


@serve.ingress()
class OpenAIIngress:
    async def __init__(self, engine, model_names: list[str], api_key: str | None = None,
                       metrics_without_auth: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        from cluster.handle import LLMHandle
        from cluster.openai.app import ServerState
        from cluster.serve.serve_engine import ServeEngine

        self.engine = ServeEngine(engine, await engine.info.remote())
        self.state = ServerState(list(model_names), api_key, metrics_without_auth)
        self.state.handle = LLMHandle(self.engine)
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self):
        from cluster.openai.app import build_app

        return build_app(self.state, self.max_body_bytes)


def engine_config_for_serve(config: EngineConfig | dict) -> EngineConfig:
    """The config each engine runs: a CPU worker's threads fixed (1 unless given), since an engine
    cannot split the cluster's cores with engines Serve has not started yet."""
    cfg = config if isinstance(config, EngineConfig) else EngineConfig.from_kwargs(**config)
    if cfg.device == "cpu" and cfg.threads_per_worker is None:
        cfg = dataclasses.replace(cfg, threads_per_worker=1)
    return cfg


def engine_bundles(cfg: EngineConfig) -> list[dict]:
    """One bundle per worker rank of an engine (its replicas x their TP x PP ranks)."""
    threads = cfg.threads_per_worker or 1
    resources = worker_resources(cfg.device, threads, cfg.accelerator_resource, fake=cfg.fake_step_s is not None)
    return [resources.bundle() for _ in range(cfg.num_replicas * cfg.ranks_per_replica)]


def build_openai_app(engine_config: EngineConfig | dict, *, num_engines: int = 1,
                     autoscaling_config: dict | None = None, served_model_name: str | None = None,
                     api_key: str | None = None,
                     metrics_without_auth: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     max_ongoing_requests: int | None = None, imbalanced_threshold: int | None = None,
                     access_log: bool = False, stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS,
                     ingress: str = "deployment",
                     gil_switch_interval_ms: float | None = DEFAULT_GIL_SWITCH_INTERVAL_MS):
    """The Serve application: `num_engines` engines (or `autoscaling_config`, Serve's
    own keys: min_replicas, max_replicas, target_ongoing_requests, ...) behind one ingress.
    `max_ongoing_requests` per engine defaults to twice what its batches hold (the rest wait in
    Serve's queue, for whichever engine frees up or starts first). `access_log`: Serve's log line
    per HTTP request (the engine deployment never logs each call: one per request costs its CPU).
    `stream_interval_ms`: how long an engine holds a stream's deltas to send them as one item
    (cluster/serve/engine_server.py). `ingress`: "deployment" or "direct" (above).
    `gil_switch_interval_ms`: each engine process's sys.setswitchinterval, as `raylm serve`'s (None:
    Python's 5 ms)."""
    cfg = engine_config_for_serve(engine_config)
    if isinstance(num_engines, bool) or not isinstance(num_engines, int) or num_engines < 1:
        raise ValueError(f"num_engines must be an integer >= 1, got {num_engines!r}")
    if autoscaling_config is not None and not isinstance(autoscaling_config, dict):
        raise ValueError(f"autoscaling_config must be a mapping of Serve's autoscaling keys, got "
                         f"{autoscaling_config!r}")
    check_stream_interval_ms(stream_interval_ms)
    check_gil_switch_interval_ms(gil_switch_interval_ms)
    if ingress not in SERVE_INGRESS_MODES:
        raise ValueError(f"ingress must be one of {', '.join(SERVE_INGRESS_MODES)}, got {ingress!r}")
    batch = cfg.max_num_seqs * cfg.num_replicas
    if max_ongoing_requests is None:
        max_ongoing_requests = 2 * batch
    if isinstance(max_ongoing_requests, bool) or not isinstance(max_ongoing_requests, int) \
            or max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests must be an integer >= 1, got {max_ongoing_requests!r}")
    router_kwargs = {"block_size": cfg.block_size or 16}
    if imbalanced_threshold is not None:
        router_kwargs["imbalanced_threshold"] = imbalanced_threshold
    scaling = ({"autoscaling_config": {"target_ongoing_requests": batch, **autoscaling_config}}
               if autoscaling_config is not None else {"num_replicas": num_engines})
    model = served_model_name or default_model_name(cfg.model)
    direct = ingress == "direct"
    engine = serve.deployment(serve.ingress()(DirectEngineServer) if direct else EngineServer).options(
        name=ENGINE_DEPLOYMENT,
        placement_group_bundles=engine_bundles(cfg),
        # pipeline stages may need nodes of their own: packed where they fit, spread where not
        placement_group_strategy="PACK" if cfg.pipeline_parallel_size > 1 else "STRICT_PACK",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max_ongoing_requests,
        graceful_shutdown_timeout_s=ENGINE_GRACEFUL_SHUTDOWN_S,
        health_check_period_s=5,
        health_check_timeout_s=30,
        logging_config={"enable_access_log": direct and bool(access_log)},  # the HTTP ingress's lines only
        **({} if direct else {"request_router_config": RequestRouterConfig(
            request_router_class=PrefixAwareRouter, request_router_kwargs=router_kwargs)}),
        **scaling,
    )
    if direct:
        return engine.bind(cfg.to_dict(), stream_interval_ms, gil_switch_interval_ms, [model], api_key,
                           metrics_without_auth, max_body_bytes)
    front = serve.deployment(OpenAIIngress).options(
        name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS, logging_config={"enable_access_log": bool(access_log)},
    )
    return front.bind(engine.bind(cfg.to_dict(), stream_interval_ms, gil_switch_interval_ms), [model], api_key,
                      metrics_without_auth, max_body_bytes)


_APP_KEYS = ("num_engines", "autoscaling_config", "served_model_name", "api_key", "metrics_without_auth",
             "max_body_bytes", "max_ongoing_requests", "imbalanced_threshold", "access_log", "stream_interval_ms",
             "ingress", "gil_switch_interval_ms")


_TEXT_KEYS = ("model", "served_model_name", "api_key", "ingress")


def _scalar(text: str):
    """'8' -> 8, '0.5' -> 0.5, 'true' -> True, 'null' -> None; other text stays text."""
    import yaml

    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return v if v is None or isinstance(v, (bool, int, float)) else text


def build_app(args: dict):
    """`serve run cluster.serve.deployments:build_app model=... num_engines=2`, or a Serve config file's
    `import_path` with `args`: the serving keys above; every other key is EngineConfig's (or
    `engine_config`, a mapping of them)."""
    args = dict(args or {})
    app_kwargs = {k: args.pop(k) for k in _APP_KEYS if k in args}
    engine = dict(args.pop("engine_config", {}) or {})
    engine.update(args)
    for d in (app_kwargs, engine):  # `serve run key=value` gives every value as a string
        for k, v in d.items():
            if isinstance(v, str) and k not in _TEXT_KEYS:
                d[k] = _scalar(v)
    return build_openai_app(EngineConfig.from_kwargs(**engine), **app_kwargs)
