"""Multi-node local Rays (ray.cluster_utils.Cluster: several raylets on this machine, each with
its own CPUs and faked accelerators), as Ray's own multi-node tests build them. One per module;
tests/multinode is `make test-multinode`."""

from __future__ import annotations

import logging

import pytest

# each worker node's resources: one "NPU" (so two pipeline stages of one rank each need two
# nodes) and two "NPU_PAIR" (so a stage of two tensor ranks fits a node, the whole 2 x 2 replica none)
WORKER_NODE = {"num_cpus": 2, "resources": {"NPU": 1, "NPU_PAIR": 2}}


def start_cluster(num_worker_nodes: int):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})  # the driver's node: no accelerators
    nodes = [cluster.add_node(**WORKER_NODE) for _ in range(num_worker_nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    return cluster, nodes


def stop_cluster(cluster) -> None:
    import ray

    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def faulty_workers(monkeypatch):
    """Engines launched during the test start tests.cluster.faults.FaultyWorker."""
    from tests.cluster.faults import FAULTY_WORKER
    from workers.actor import WORKER_ACTOR_ENV

    monkeypatch.setenv(WORKER_ACTOR_ENV, FAULTY_WORKER)
