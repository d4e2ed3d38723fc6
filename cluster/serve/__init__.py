"""raylm as a Ray Serve application (cluster/serve/deployments.py has the shape of it).

    from ray import serve
    from cluster.serve import build_openai_app, connect_app

    serve.run(build_openai_app({"model": "/data/Qwen3-8B", "device": "npu"}, num_engines=2), name="raylm")
    llm = connect_app("raylm")  # an LLMHandle whose requests Serve routes to the engines
    llm.generate("Hello")

Imports ray.serve: only the CLI's `--engines`, Serve itself and users import this package.
"""

from __future__ import annotations

from cluster.serve.deployments import ENGINE_DEPLOYMENT, build_app, build_openai_app


def connect_app(app_name: str = "raylm"):
    """An LLMHandle over a running raylm Serve application's engines (generate, stream, chat)."""
    from ray import serve

    from cluster.handle import LLMHandle
    from cluster.serve.serve_engine import ServeEngine

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app_name)
    return LLMHandle(ServeEngine(handle, handle.info.remote().result()))


__all__ = ["build_app", "build_openai_app", "connect_app"]
