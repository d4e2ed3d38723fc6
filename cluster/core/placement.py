"""Placement groups and device resources for worker actors.

Each replica's workers live in one placement group: one bundle per rank (pipeline stage by
stage, tensor rank 0 first), packed onto one node (STRICT_PACK: the ranks' collectives stay
inside a node). A pipeline-parallel replica that no node can hold whole gets one STRICT_PACK
group per stage instead, so each stage's tensor-parallel ranks share a node and the stages
spread over as many nodes as they need (only activations and ids cross between them). A
worker asks for one unit of its accelerator resource ("NPU" or "GPU"; Ray then sets
ASCEND_RT_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES for it) plus CPUs for its threads.
Where the cluster has several nodes that can hold a replica, replicas are pinned
round-robin to different nodes.

An engine that itself runs inside a placement group (a Ray Serve replica whose deployment
asks for `placement_group_bundles`, cluster/serve/) makes no groups of its own: its ranks take
that group's bundles in order, replica by replica, as vLLM's Ray executor takes the group it
starts in. Whoever made the group removes it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.device import ray_resource_key

log = logging.getLogger(__name__)


@dataclass
class WorkerResources:
    num_cpus: float
    accelerator: str | None  # Ray resource name, one unit per worker

    def bundle(self) -> dict[str, float]:
        b = {"CPU": float(self.num_cpus)} if self.num_cpus else {}
        if self.accelerator:
            b[self.accelerator] = 1.0
        return b


FAKE_WORKER_CPUS = 0.01  # a fake worker (EngineConfig.fake_step_s) computes nothing


def worker_resources(device: str, threads: int, accelerator_resource: str | None,
                     fake: bool = False) -> WorkerResources:
    accelerator = accelerator_resource or ray_resource_key(device)
    # CPU workers reserve a core per thread; accelerator workers need one host core.
    num_cpus = FAKE_WORKER_CPUS if fake else threads if device == "cpu" else 1
    return WorkerResources(num_cpus=num_cpus, accelerator=accelerator)


def cpu_worker_threads(num_replicas: int, ranks: int, threads_per_worker: int | None,
                       reserved_cpus: int, prefill_threads_per_worker: int | None) -> tuple[int, int]:
    """(torch threads of a CPU worker's steps, of its big prefill steps): the given ones, else
    the cluster's CPUs split over the ranks, less reserved_cpus for steps and with them for
    prefill (the reserved cores are lent back during big steps); prefill never below steps."""
    threads = threads_per_worker or default_threads(num_replicas, ranks, reserved_cpus)
    prefill = prefill_threads_per_worker or (
        threads if threads_per_worker else default_threads(num_replicas, ranks, 0))
    return threads, max(threads, prefill)


def default_threads(num_replicas: int, ranks: int = 1, reserved_cpus: int = 0) -> int:
    """Torch threads per CPU worker so that replicas and their `ranks` each don't fight over
    cores (nor over the reserved_cpus left to the frontend); at least 1."""
    cpus = int(ray.cluster_resources().get("CPU", 1)) - reserved_cpus
    return max(1, cpus // (num_replicas * ranks))


def _fitting_nodes(resources: WorkerResources, ranks: int) -> list[str]:
    """The addresses of live nodes whose resources can hold `ranks` workers together."""
    bundle = resources.bundle()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return [n["NodeManagerAddress"] for n in nodes
            if all(n.get("Resources", {}).get(k, 0) >= v * ranks for k, v in bundle.items())]


def _spread_nodes(resources: WorkerResources, num_replicas: int, ranks: int) -> list[str | None]:
    """A node address per replica, round-robin over nodes that fit all its ranks; None: let Ray pick."""
    fitting = _fitting_nodes(resources, ranks)
    if len(fitting) < 2:
        return [None] * num_replicas
    return [fitting[i % len(fitting)] for i in range(num_replicas)]


@dataclass(frozen=True)
class ReplicaPlacement:
    """A replica's ranks: bundles `first_bundle`, `first_bundle + 1`, ... of `groups[0]`, or,
    with `ranks_per_group`, rank r in bundle r % ranks_per_group of groups[r // ranks_per_group]
    (one group per pipeline stage); `owned`: made for this replica (released with it), not
    borrowed from the group the engine runs in."""
    groups: tuple
    first_bundle: int = 0
    owned: bool = True
    ranks_per_group: int | None = None

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        group, index = divmod(rank, self.ranks_per_group) if self.ranks_per_group else (0, rank)
        return PlacementGroupSchedulingStrategy(placement_group=self.groups[group],
                                                placement_group_bundle_index=self.first_bundle + index)

    def release(self) -> None:
        if self.owned:
            for pg in self.groups:
                release(pg)


def place_replicas(resources: WorkerResources, num_replicas: int, timeout_s: float,
                   tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> list[ReplicaPlacement]:
    """Where each replica's ranks go: the bundles of the placement group this process runs in,
    if it runs in one, else groups of its own per replica (create_replica_groups)."""
    current = get_current_placement_group()
    ranks = tensor_parallel_size * pipeline_parallel_size
    if current is None:
        return create_replica_groups(resources, num_replicas, timeout_s, tensor_parallel_size, pipeline_parallel_size)
    return borrowed_bundles(current.bundle_specs, resources, num_replicas, ranks, current)


def borrowed_bundles(specs: list[dict], resources: WorkerResources, num_replicas: int, ranks: int,
                     pg=None) -> list[ReplicaPlacement]:
    """Replica r's rank k in bundle r * ranks + k of the caller's group (whose bundle `specs` are
    given; `ranks` per replica: tensor x pipeline parallel size); a ValueError naming the bundles
    when they cannot hold the ranks."""
    need = num_replicas * ranks
    ask = resources.bundle()
    short = [i for i, b in enumerate(specs[:need]) if any(b.get(k, 0) < v for k, v in ask.items())]
    if len(specs) < need or short:
        raise ValueError(f"this engine runs in a placement group with bundles {specs}: its {num_replicas} "
                         f"replica(s) x {ranks} rank(s) (tensor x pipeline parallel size) need {need} bundle(s), "
                         f"each holding at least {ask}" + (f" (bundle(s) {short} do not)" if short else ""))
    return [ReplicaPlacement((pg,), r * ranks, owned=False) for r in range(num_replicas)]


PLACEMENT_REPORT_S = 5.0  # a replica not placed by then is reported (what it asked, what is free), then waited for


def create_replica_groups(resources: WorkerResources, num_replicas: int, timeout_s: float,
                          tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> list[ReplicaPlacement]:
    """Ready placement groups for each replica: one (a bundle per rank, on one node), or, for a
    pipeline-parallel replica no node can hold whole, one per stage; or a clear error.
    A replica not placed within PLACEMENT_REPORT_S is reported as a warning; one not placed
    within `timeout_s` fails the start, naming what it asked for and what the cluster has."""
    tp, ranks = tensor_parallel_size, tensor_parallel_size * pipeline_parallel_size
    placements = []
    if pipeline_parallel_size > 1 and not _fitting_nodes(resources, ranks):  # stages on nodes of their own
        for _ in range(num_replicas):
            stages = tuple(placement_group([resources.bundle() for _ in range(tp)], strategy="STRICT_PACK")
                           for _ in range(pipeline_parallel_size))
            placements.append(ReplicaPlacement(stages, ranks_per_group=tp))
    else:
        for node_ip in _spread_nodes(resources, num_replicas, ranks):
            bundle = resources.bundle()
            if node_ip is not None:
                bundle[f"node:{node_ip}"] = 0.001
            placements.append(ReplicaPlacement((placement_group([dict(bundle) for _ in range(ranks)],
                                                                strategy="STRICT_PACK"),)))
    deadline = time.monotonic() + timeout_s
    groups = [(i, pg) for i, p in enumerate(placements) for pg in p.groups]
    for i, pg in groups:
        ready, _ = ray.wait([pg.ready()], timeout=max(0.0, min(PLACEMENT_REPORT_S, deadline - time.monotonic())))
        if not ready:
            log.warning("raylm: waiting up to %.0f s to place replica %d: %s", timeout_s,
                        i, _placement_shortfall(resources, len(pg.bundle_specs)))
            ready, _ = ray.wait([pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            for _, g in groups:
                remove_placement_group(g)
            raise RuntimeError(f"could not place replica {i} within {timeout_s:g} s: "
                               f"{_placement_shortfall(resources, len(pg.bundle_specs))}; lower num_replicas, "
                               "tensor_parallel_size or threads_per_worker, add nodes, or, if this Ray is someone "
                               "else's, use a private one (address='local', raylm serve --address local)")
    return placements


def _placement_shortfall(resources: WorkerResources, ranks: int) -> str:
    """What one placement group of `ranks` workers asks for against what the cluster has and has free."""
    ask = {k: v * ranks for k, v in resources.bundle().items()}
    free = ray.available_resources()
    total = ray.cluster_resources()
    shown = ", ".join(f"{k}: asks {v:g}, free {free.get(k, 0):g} of {total.get(k, 0):g}" for k, v in ask.items())
    return f"its {ranks} worker(s) must fit on one node ({shown}) in the Ray at " \
           f"{ray.get_runtime_context().gcs_address}"


def release(pg) -> None:
    try:
        remove_placement_group(pg)
    except Exception as e:  # already gone with the cluster
        log.debug("removing placement group failed: %s", e)

