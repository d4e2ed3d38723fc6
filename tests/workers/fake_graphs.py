"""A graph device for CPU tests: capture keeps the callable, replay re-runs it.

With the torch_npu emulation attached, capture and replay also switch the emulation's
mode, so captured paged-attention tasks keep the host arguments they were captured with
(as on an Ascend device) unless the backend updates them before the replay."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.graphs import GraphDevice


@dataclass
class FakeGraph:
    fn: object = None
    tasks: list = field(default_factory=list)  # the emulation's captured task handles
    replays: int = 0


class FakeGraphDevice(GraphDevice):
    def __init__(self, emu=None) -> None:
        self.emu = emu
        self.warmups = 0

    def new_graph(self) -> FakeGraph:
        return FakeGraph()

    def warmup(self, fn) -> None:
        self.warmups += 1
        fn()

    def capture(self, graph: FakeGraph, fn) -> None:
        graph.fn = fn
        if self.emu is not None:
            self.emu.begin_capture(graph.tasks)
        try:
            fn()  # a real capture records the kernels; running them here is harmless (replay overwrites)
        finally:
            if self.emu is not None:
                self.emu.end_capture()

    def replay(self, graph: FakeGraph) -> None:
        if graph.fn is None:
            raise RuntimeError("replay of a graph that was never captured")
        if self.emu is not None:
            self.emu.begin_replay(graph.tasks)
        graph.fn()
        graph.replays += 1
        if self.emu is not None:
            self.emu.end_replay()
