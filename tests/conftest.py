"""Shared fixtures. One local Ray per test session (two CPUs, two faked NPUs), started
lazily by the first test that asks for it and shut down at the end; under pytest-xdist
(make test) each worker process is its own session with its own Ray. Every test that uses
it is marked `ray`, so `-m "not ray"` (make test-fast) runs what needs no Ray."""

from __future__ import annotations

import logging
import os

import pytest

# Every test process measures its kernel choices afresh, as the tests of those measurements expect:
# nothing a test that fixed a probe's outcome, or an earlier run, kept on this host is taken
# (tests/workers/test_kernel_choices.py turns keeping on where it checks it).
os.environ.setdefault("RAYLM_KERNEL_CHOICES", "off")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    _deselect_opt_in_unless_asked(config, items)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, resources={"NPU": 2}, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


OPT_IN = ("deploy", "serve", "multinode")  # suites run only when a -m expression names them


def _deselect_opt_in_unless_asked(config, items) -> None:
    """Tests marked `deploy` install and start system services (sshd, a two-node Ray
    cluster), tests marked `serve` start a multi-node Ray of their own with Ray Serve and tests
    marked `multinode` one without: they run only when asked for by marker (`make test-deploy`:
    -m deploy, `make test-serve`: -m serve, `make test-multinode`: -m multinode), never as part
    of a plain `pytest` / `make test`, whatever other -m is given."""
    asked = config.getoption("markexpr") or ""
    skipped = [m for m in OPT_IN if m not in asked]
    kept = [item for item in items if not any(item.get_closest_marker(m) for m in skipped)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
