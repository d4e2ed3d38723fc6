"""Fixtures of the cluster tests."""

from __future__ import annotations

import pytest

from workers.actor import WORKER_ACTOR_ENV


@pytest.fixture
def faulty_workers(monkeypatch):
    """Engines launched during the test start tests.cluster.faults.FaultyWorker, whose
    `arm_fault` makes a later step exit, hang or raise."""
    from tests.cluster.faults import FAULTY_WORKER

    monkeypatch.setenv(WORKER_ACTOR_ENV, FAULTY_WORKER)
