"""Shared fixtures. One local Ray per test session (two CPUs, two faked NPUs), started
lazily by the first test that asks for it and shut down at the end."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, resources={"NPU": 2}, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()
