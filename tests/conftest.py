"""Shared fixtures. One local Ray per test session (two CPUs, two faked NPUs), started
lazily by the first test that asks for it and shut down at the end; under pytest-xdist
(make test) each worker process is its own session with its own Ray. Every test that uses
it is marked `ray`, so `-m "not ray"` (make test-fast) runs what needs no Ray."""

from __future__ import annotations

import logging

import pytest


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    _deselect_deploy_unless_asked(config, items)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, resources={"NPU": 2}, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


def _deselect_deploy_unless_asked(config, items) -> None:
    """Tests marked `deploy` install and start system services (sshd, a two-node Ray
    cluster): they run only when asked for by marker (`make test-deploy`: -m deploy),
    never as part of a plain `pytest` / `make test`, whatever other -m is given."""
    if "deploy" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("deploy") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
