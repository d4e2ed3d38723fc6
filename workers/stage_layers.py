"""Which layers each pipeline stage holds (workers/pipeline.py). No torch: the driver's
config checks a partition with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageLayers:
    """The layers stage `stage` of `num_stages` holds: [start, end)."""

    stage: int
    num_stages: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def indices(self) -> range:
        return range(self.start, self.end)

    def __len__(self) -> int:
        return self.end - self.start


def check_partition(partition, num_stages: int, num_layers: int | None = None) -> tuple[int, ...] | None:
    """`partition` (layers per stage, e.g. [5, 3] or "5,3") as a tuple; ValueError naming it
    when it is not num_stages positive counts (summing to num_layers, when that is known)."""
    if partition is None:
        return None
    if isinstance(partition, str):
        try:
            partition = [int(p) for p in partition.split(",")]
        except ValueError:
            raise ValueError(f"pp_layer_partition must be layer counts separated by commas, "
                             f"got {partition!r}") from None
    if (not isinstance(partition, (list, tuple)) or len(partition) != num_stages
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in partition)):
        raise ValueError(f"pp_layer_partition must be {num_stages} positive layer counts (one per pipeline stage), "
                         f"got {partition!r}")
    if num_layers is not None and sum(partition) != num_layers:
        raise ValueError(f"pp_layer_partition {list(partition)} must sum to the model's {num_layers} layers, "
                         f"got {sum(partition)}")
    return tuple(partition)


def stage_layers(num_layers: int, num_stages: int, stage: int, partition=None) -> StageLayers:
    """Stage `stage`'s layers: `partition`'s counts when given, else balanced by layer count
    (the first stages take one more where they do not divide evenly)."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers")
    counts = check_partition(partition, num_stages, num_layers) or tuple(
        num_layers // num_stages + (s < num_layers % num_stages) for s in range(num_stages))
    start = sum(counts[:stage])
    return StageLayers(stage, num_stages, start, start + counts[stage])
