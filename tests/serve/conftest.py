"""A two-node local Ray (ray.cluster_utils.Cluster: two raylets, each with its own CPUs and one
faked NPU) running Ray Serve with its HTTP proxy on the head node only (both nodes are this
machine: two proxies cannot share a port). One per module; tests/serve is `make test-serve`."""

from __future__ import annotations

import logging
import socket

import pytest

NODE_CPUS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_cluster():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS, "resources": {"NPU": 1}})
    cluster.add_node(num_cpus=NODE_CPUS, resources={"NPU": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    yield cluster, f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
