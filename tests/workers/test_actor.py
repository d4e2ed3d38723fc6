"""Which actor class replicas start: WorkerActor, or the subclass RAYLM_WORKER_ACTOR names
(how tests inject faults). Imports ray but starts nothing."""

from __future__ import annotations

import pytest

from workers.actor import WORKER_ACTOR_ENV, WorkerActor, remote_worker


def test_the_production_actor_has_no_fault_hooks_and_is_the_default(monkeypatch):
    monkeypatch.delenv(WORKER_ACTOR_ENV, raising=False)
    assert remote_worker() is remote_worker()  # one Ray actor class, made once
    assert not any("fault" in name for name in dir(WorkerActor))


def test_the_variable_selects_a_worker_actor_subclass(monkeypatch):
    from tests.cluster.faults import FAULTY_WORKER

    monkeypatch.delenv(WORKER_ACTOR_ENV, raising=False)
    default = remote_worker()
    monkeypatch.setenv(WORKER_ACTOR_ENV, FAULTY_WORKER)
    chosen = remote_worker()
    assert chosen is not default and hasattr(chosen, "arm_fault") and not hasattr(default, "arm_fault")


@pytest.mark.parametrize("value", ["tests.cluster.faults", "tests.cluster.faults:Nope", "no.such.module:X",
                                   "workers.runner:ModelRunner"])
def test_anything_but_a_worker_actor_subclass_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(WORKER_ACTOR_ENV, value)
    with pytest.raises(ValueError, match=f"{WORKER_ACTOR_ENV}.*{value}"):
        remote_worker()
