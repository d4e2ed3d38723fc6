"""Shared fixtures. One local Ray per test session (two CPUs, two faked NPUs), started
lazily by the first test that asks for it and shut down at the end. Every test that uses
it is marked `ray`, so `-m "not ray"` (make test-fast) runs what needs no Ray."""

from __future__ import annotations

import logging

import pytest


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, resources={"NPU": 2}, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()
