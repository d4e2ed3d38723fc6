"""Pipeline parallelism inside one replica: which layers a stage holds, and what crosses
between stages.

A replica of P stages x T tensor-parallel ranks is P * T processes in one torch.distributed
group; global rank g is stage g // T, tensor rank g % T (each stage a TP group of its own).
Stage s holds layers [start, end) (balanced by layer count, or a given partition, as vLLM's
VLLM_PP_LAYER_PARTITION); the first stage holds the embedding, the last the final norm,
the lm_head and sampling.

Per step, every rank gets the same plan. Stage s > 0 receives one [tokens, hidden] tensor
from the rank of stage s - 1 with the same tensor rank (the residual stream after that
stage's last layer: `x + residual`, which the next layer normalises exactly as the first
layer does the embedding), and sends its own to stage s + 1: hidden x dtype bytes a row,
nothing more. The last stage samples and sends the ids to the first stage, whose resident
last tokens feed the next decode rows. Sends are non-blocking so a stage goes on to the
next step while its successor still computes: the replica keeps 2 x P steps in flight, P
batches of disjoint requests in turn, each batch's next step planned before its last is back
(its rows' inputs USE_RESIDENT). The first stage takes the ids of exactly the steps whose
rows a step reads, waiting for them if the last stage has not sent them yet, and any others
that have arrived.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from workers.device import torch_device
from workers.stage_layers import StageLayers, stage_layers


class Pipeline:
    """One rank's place in its replica's pipeline and the transfers between stages. The
    single-stage pipeline (`NO_PIPELINE`) transfers nothing."""

    def __init__(self, stage: int = 0, num_stages: int = 1, tp_rank: int = 0, tp_size: int = 1,
                 partition: tuple[int, ...] | None = None, group=None) -> None:
        self.stage, self.num_stages = stage, num_stages
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.partition = partition
        self.group = group  # the replica's whole group (global ranks)
        self._sends: deque = deque()  # (work, tensor) of non-blocking sends not yet known complete
        # first stage, per step not applied: (slots [B], the same on the host, ids buffer, work)
        self._pending_ids: deque = deque()
        self.bytes_sent = 0  # activations and ids this rank sent
        self.recv_wait_s = 0.0  # host time blocked receiving activations (a stage waiting for its predecessor)
        self.ids_wait_s = 0.0  # first stage: host time blocked for the last stage's ids (waiting for its successors)

    @property
    def enabled(self) -> bool:
        return self.num_stages > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def layers(self, num_layers: int) -> StageLayers:
        return stage_layers(num_layers, self.num_stages, self.stage, self.partition)

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def _send(self, x: torch.Tensor, stage: int) -> None:
        """Send x (kept alive until the send completes) to the same tensor rank of `stage`."""
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()
        work = torch.distributed.isend(x, self._peer(stage), group=self.group)
        self._sends.append((work, x))
        self.bytes_sent += x.numel() * x.element_size()

    # -- activations, stage to stage ---------------------------------------------------------

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """This stage's output [T, hidden] to the next stage."""
        self._send(hidden.contiguous(), self.stage + 1)

    def recv_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """The previous stage's output into `out` [T, hidden]."""
        t0 = time.perf_counter()
        torch.distributed.recv(out, self._peer(self.stage - 1), group=self.group)
        self.recv_wait_s += time.perf_counter() - t0
        return out

    # -- sampled ids, last stage to first ----------------------------------------------------

    def send_ids(self, ids: torch.Tensor) -> None:
        """The last stage's sampled ids [B] (int64) to the first stage."""
        self._send(ids.to(torch.int64).contiguous(), 0)

    def expect_ids(self, slots: torch.Tensor, host_slots) -> None:
        """First stage: this step samples into `slots` [B] (`host_slots` on the host); its ids
        arrive from the last stage."""
        ids = torch.empty(len(slots), dtype=torch.int64, device=slots.device)
        work = torch.distributed.irecv(ids, self._peer(self.num_stages - 1), group=self.group)
        # slots: a view of the step's reused staging
        self._pending_ids.append((slots.clone(), frozenset(host_slots), ids, work))

    def take_ids(self, last_tokens: torch.Tensor, needed=None) -> None:
        """First stage: write the last stage's ids of earlier steps into `last_tokens`, oldest
        first: those of every step up to the newest that samples a slot in `needed` (all steps
        when None), waiting for them, then those that have arrived. A step whose rows do not read
        a resident token waits for none: the last stage may still be computing earlier steps."""
        pending = self._pending_ids
        through = len(pending) if needed is None else \
            max((i + 1 for i, entry in enumerate(pending) if not needed.isdisjoint(entry[1])), default=0)
        taken = 0
        while pending and (taken < through or pending[0][3].is_completed()):
            slots, _, ids, work = pending.popleft()
            taken += 1
            t0 = time.perf_counter()
            work.wait()
            self.ids_wait_s += time.perf_counter() - t0
            last_tokens.index_copy_(0, slots, ids.to(last_tokens.device))

    def min_over_replica(self, value: int) -> int:
        """The smallest of every rank's `value` (stages hold different layers: the KV blocks
        that fit on every one)."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        backend = torch.distributed.get_backend(self.group)
        if backend != "gloo":  # nccl and hccl reduce device tensors
            t = t.to(torch_device("cuda" if backend == "nccl" else "npu"))
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def flush(self) -> None:
        """Wait for every send of this rank to complete (before the step's buffers are reused
        outside the step loop, e.g. after warmup)."""
        while self._sends:
            self._sends.popleft()[0].wait()

    def describe(self) -> dict | None:
        if not self.enabled:
            return None
        return {"stage": self.stage, "stages": self.num_stages, "bytes_sent": self.bytes_sent,
                "recv_wait_s": round(self.recv_wait_s, 3), "ids_wait_s": round(self.ids_wait_s, 3)}


NO_PIPELINE = Pipeline()
