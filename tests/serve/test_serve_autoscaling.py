"""Serve's autoscaler over raylm engines: one engine, a second under load, back to one when idle
(a two-node local Ray with an NPU each; `make test-serve`)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.serve.test_serve_app import ENGINE, engines_running, wait_for

pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]


def test_autoscaling_adds_an_engine_under_load_and_removes_it_after(serve_cluster):
    from ray import serve

    from cluster import SamplingParams
    from cluster.serve import build_openai_app, connect_app

    app = "raylm-autoscaled"
    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0,
               "downscale_delay_s": 2, "metrics_interval_s": 0.5, "look_back_period_s": 1}
    serve.run(build_openai_app(ENGINE, autoscaling_config=scaling), name=app, route_prefix="/autoscaled")
    try:
        assert engines_running(app) == 1
        llm = connect_app(app)
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        stop = threading.Event()

        def load():
            async def keep_busy():
                while not stop.is_set():
                    await asyncio.gather(*[llm.agenerate(f"load {i}", params) for i in range(24)])
            asyncio.run(keep_busy())

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        wait_for(lambda: engines_running(app) == 2, 180, "a second engine under load")
        stop.set()
        loader.join(timeout=120)
        assert not loader.is_alive()
        wait_for(lambda: engines_running(app) == 1, 180, "back to one engine when idle")
    finally:
        serve.delete(app)
