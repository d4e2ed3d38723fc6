"""Replica: its worker actor(s), its Scheduler, and the driver loop between them.

Under tensor and pipeline parallelism the replica is a group of `tensor_parallel_size` x
`pipeline_parallel_size` actors (stage by stage, tensor rank 0 first); every rank gets the same
plan bytes each step, only the sampling rank's result is pulled (tensor rank 0 of the last
stage), and a rank that dies, raises or hangs takes the whole group down: it is rebuilt, and
its requests recomputed, exactly as a single worker is.

Steps travel over each rank's step channel (workers/step_channel.py: one TCP frame each
way, no Ray call) where the worker reported one at start, else as `execute` actor calls;
either way a dead, failing or hung rank surfaces from `_collect`, never from `_dispatch`.

The loop runs on its own thread. It keeps up to `pipeline_depth` steps in flight: plan
N+1 is sent before result N is back, its decode rows taking the worker's resident
tokens, so the worker never waits on the driver. An idle replica blocks on an Event (no
polling). A worker that dies, raises or hangs past the step timeout is replaced and every
unfinished request is recomputed from its prompt and the tokens it already has.

Healing (cluster/core/health.py, cluster/core/health.py): restarts are a rate, at
most `max_worker_restarts` within `restart_window_s`, spaced by a doubling backoff.
Beyond the budget the replica gives up: its requests finish with an error and the router
skips it. After `replica_cooldown_s` the loop starts a worker again; once it answers,
the replica is routable again with an empty cache and a fresh budget.

Data flows one way. Requests come in through `add` (which raises at once on a request the
scheduler refuses). Outputs go out through `emit(replica, updates)`, called on the loop
thread with no lock held; it must not call back into the replica except to post a message.
Aborts and stop-string finishes come back as messages (`post_finish`), drained by the loop
before it plans the next step (and by any reader of the scheduler's state before it reads).
`self._lock` (a plain Lock) only keeps the scheduler consistent between the loop and the
callers of add / load / snapshot.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.config import EngineConfig
from cluster.core.health import ReplicaHealth
from cluster.errors import EngineDeadError
from scheduler.grammar_spec import GrammarSpec
from scheduler.protocol import StepResult, pack_int32, sampled_on_device
from scheduler.request import FinishReason, Request, RequestUpdate
from scheduler.scheduler import Scheduler
from workers.actor import remote_worker
from workers.runner_config import RunnerConfig
from workers.sampling.grammar import CACHE_SIZE as GRAMMAR_CACHE_SIZE
from workers.sampling.grammar import REFUSED_CACHE_SIZE
from workers.step_channel import StepChannelError, StepClient, StepTimeout, WorkerStepError, collect

log = logging.getLogger(__name__)

_INLINE_PLAN_BYTES = 64 * 1024  # TP: larger plans go to the object store once for all ranks
# what a failed step raises from _collect: the worker died, raised, or hung past the step timeout
STEP_FAILURES = (RayActorError, RayTaskError, GetTimeoutError, StepChannelError, StepTimeout, WorkerStepError)


@dataclass
class ReplicaStats:
    steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    bytes_pulled: int = 0
    decode_bytes_pulled: int = 0
    worker_time_s: float = 0.0
    restarts: int = 0
    loop_iterations: int = 0  # passes of the driver loop; flat while idle (it blocks, never polls)
    loop_failures: int = 0  # exceptions of the loop itself, each handled as a failure of the replica
    grammars_refused: int = 0  # requests refused because their grammar failed or ran out of time compiling


@dataclass(eq=False)
class _GrammarCompile:
    """A grammar the workers are compiling, and the requests that wait for it (none scheduled yet)."""

    deadline: float  # monotonic: past it, the waiting requests are refused
    generation: int  # the worker generation asked; answers from an older one are stale
    requests: list = field(default_factory=list)
    pending: int = 0  # ranks that have not answered
    error: str | None = None  # the first rank's refusal


class Replica:
    def __init__(self, index: int, config: EngineConfig, runner_config: RunnerConfig, resources, placement, emit):
        self.index = index
        self.config = config
        self._runner_config = runner_config
        self._resources = resources
        self._placement = placement  # a ReplicaPlacement: the bundles its ranks take
        self._emit = emit  # emit(replica, [RequestUpdate]): the loop thread's outputs, no lock held
        self._host_sampler = None  # host-logits mode: this replica's own Sampler (start() makes it)
        self._depth = config.pipeline_depth_for(runner_config.device_outputs)
        # the rank that samples and returns each step's result: tensor rank 0 of the last pipeline stage
        self._result_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self._lock = threading.Lock()  # guards the scheduler
        # grammars this worker generation compiled, newest last: as many as a worker keeps compiled
        self._compiled: OrderedDict[GrammarSpec, None] = OrderedDict()
        self._compiling: dict[GrammarSpec, _GrammarCompile] = {}  # asked of the workers, not answered yet
        # grammars refused (invalid, or over the compile time), newest last: the same spec is refused at once
        self._refused: OrderedDict[GrammarSpec, str] = OrderedDict()
        self._generation = 0  # bumped at every worker (re)start
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (request_id, FinishReason) to finish
        self._compiled_inbox: queue.SimpleQueue = queue.SimpleQueue()  # (spec, generation, error) from workers
        self._refusals: list[RequestUpdate] = []  # refused while waiting for a grammar; emitted by the loop
        self._wakeup = threading.Event()
        self._stopping = False
        self._stopped = threading.Event()  # interrupts backoff and cool-down waits
        self.health_state = ReplicaHealth(index, config)
        self.workers: list = []  # rank 0 first; empty while (re)starting
        self.channels: list[StepClient] = []  # one per rank when the workers serve a step channel
        self.info: dict = {}
        self.scheduler: Scheduler | None = None
        self.stats = ReplicaStats()
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----
    def start(self) -> None:
        if not self._runner_config.device_outputs:
            import torch  # the driver samples: it needs torch's CPU sampler

            from workers.sampling.sampler import Sampler

            # one per replica: a Sampler's generators must not be shared across loop threads
            self._host_sampler = Sampler(torch.device("cpu"), seed=self._runner_config.seed)
        self.info = self._start_worker()
        self.scheduler = Scheduler(self.config.scheduler_config(
            num_blocks=self.info["num_kv_blocks"], max_model_len=self.info["max_model_len"]))
        self.health_state.on_up()
        self._thread = threading.Thread(target=self._run, name=f"raylm-replica-{self.index}", daemon=True)
        self._thread.start()

    @property
    def dead(self) -> bool:
        """Not routable: it gave up (cooling down before a retry), was shut down, or its loop ended."""
        return not self.health_state.routable or self.loop_stopped

    @property
    def worker(self):
        """The sampling rank's actor (the only one without TP or PP); None while the group (re)starts."""
        return self.workers[self._result_rank] if self.workers else None

    def _start_worker(self) -> dict:
        cfg = self.config
        ranks = cfg.ranks_per_replica  # stage by stage, tensor rank 0 first
        workers = [remote_worker().options(
            num_cpus=self._resources.num_cpus,
            resources={self._resources.accelerator: 1} if self._resources.accelerator else None,
            scheduling_strategy=self._placement.strategy(rank),
        ).remote() for rank in range(ranks)]
        parallel = [None]
        if ranks > 1:  # rank 0 hosts the rendezvous; the group's collectives time out after the driver's checks
            timeout = max(cfg.step_timeout_s, cfg.start_timeout_s)
            address, port = ray.get(workers[0].rendezvous.remote(ranks, timeout), timeout=cfg.start_timeout_s)
            partition = None if cfg.pp_layer_partition is None else tuple(cfg.pp_layer_partition)
            parallel = [dict(rank=r, world_size=ranks, master_addr=address, master_port=port, timeout_s=timeout,
                             expert_parallel=cfg.enable_expert_parallel,
                             pipeline_parallel_size=cfg.pipeline_parallel_size, pp_layer_partition=partition)
                        for r in range(ranks)]
        self.workers = workers  # set before start: a failed start is killed by _kill_worker
        config = dataclasses.asdict(self._runner_config)  # a plain dict crosses to the actor
        infos = ray.get([w.start.remote(config, p) for w, p in zip(workers, parallel)], timeout=cfg.start_timeout_s)
        channels = [i.pop("step_channel", None) for i in infos]  # its token stays out of stats
        if all(channels):  # appended one by one: a failed connect leaves the others for _kill_worker
            for c in channels:
                self.channels.append(StepClient(c["host"], c["port"], c["token"], timeout=cfg.start_timeout_s))
        with self._lock:  # new workers have compiled nothing: ask them for what is waiting or running
            self._generation += 1
            self._compiled.clear()
            for spec, c in self._compiling.items():
                c.generation, c.pending, c.error = self._generation, 0, None
                self._send_compile(spec, c)
            if self.scheduler is not None:  # recomputed requests: compiled before their steps where time allows
                for spec in {r.params.grammar for r in self.scheduler.requests() if r.params.grammar is not None}:
                    self._compiled[spec] = None
                    for w in workers:
                        w.prefetch_grammar.remote(spec)
        info = dict(infos[self._result_rank])  # the sampling rank's: the vocab and what it decides
        info["step_channel"] = "socket" if self.channels else "ray"
        info["ranks"] = [{k: i[k] for k in ("pid", "node_id", "visible_devices", "pipeline_stage")} for i in infos]
        self.info = info  # where the ranks run now (a rebuilt group may sit on other nodes)
        if len(infos) > 1:
            log.info("replica %d: ranks (pipeline stage, node): %s", self.index,
                     [(i["pipeline_stage"], i["node_id"][:12]) for i in infos])
        return info

    def shutdown(self) -> None:
        self._stopping = True
        self._stopped.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._kill_worker()
        self.health_state.state = "stopped"
        self._placement.release()

    def _kill_worker(self) -> None:
        channels, self.channels = self.channels, []
        for c in channels:
            c.close()
        workers, self.workers = self.workers, []
        for w in workers:  # every rank: the survivors may be waiting in a collective
            try:
                ray.kill(w, no_restart=True)
            except Exception as e:  # already dead
                log.debug("killing worker failed: %s", e)

    # ---- requests (any thread) ----
    def add(self, request: Request) -> None:
        """Queue `request`; raises (ValueError, EngineDeadError) when it cannot be served here.
        A request whose grammar this worker generation has not compiled waits outside the
        scheduler until the workers have compiled it (off their step path), and is refused if
        they cannot within `grammar_compile_timeout_s`: only it waits, never a step."""
        with self._lock:
            if self.dead:
                raise EngineDeadError(f"replica {self.index} is down: its worker failed beyond the restart budget "
                                      f"(retry in {self.health_state.cooldown_left():.0f} s)")
            grammar = request.params.grammar
            if grammar is None or grammar in self._compiled:
                self.scheduler.add_request(request)
                if grammar is not None:
                    self._compiled.move_to_end(grammar)
            else:
                refused = self._refused.get(grammar)
                if refused is not None:
                    self.stats.grammars_refused += 1
                    raise ValueError(refused)
                self.scheduler.check_request(request)
                compile_ = self._compiling.get(grammar)
                if compile_ is None:
                    deadline = time.monotonic() + self.config.grammar_compile_timeout_s
                    compile_ = self._compiling[grammar] = _GrammarCompile(deadline, self._generation)
                    self._send_compile(grammar, compile_)
                compile_.requests.append(request)
        self._wakeup.set()

    def _send_compile(self, spec: GrammarSpec, compile_: _GrammarCompile) -> None:
        """Ask every rank to compile `spec` (lock held); their answers arrive in _compiled_inbox."""
        generation = compile_.generation
        compile_.pending = len(self.workers)
        deadline = time.time() + compile_.deadline - time.monotonic()  # wall clock: the worker may be elsewhere
        for w in self.workers:
            ref = w.prefetch_grammar.remote(spec, deadline)
            ref.future().add_done_callback(lambda f, spec=spec: self._on_compiled(spec, generation, f))

    def _on_compiled(self, spec: GrammarSpec, generation: int, future) -> None:
        """A rank answered (any thread): post it to the loop."""
        try:
            error = future.result()
        except Exception as e:  # the worker died: its replacement is asked again
            error = e
        self._compiled_inbox.put((spec, generation, error))
        self._wakeup.set()

    def post_finish(self, request_id: str, reason: FinishReason) -> None:
        """Ask the loop to finish a request (an abort, a stop string): a message, applied
        before the next plan; its blocks are freed then. Never blocks, takes no lock."""
        self._inbox.put((request_id, reason))
        self._wakeup.set()

    def load(self) -> int:
        with self._lock:
            self._drain_inbox()
            return self.scheduler.outstanding_tokens()

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        with self._lock:
            self._drain_inbox()
            return self.scheduler.cached_prefix_tokens(token_ids)

    def num_waiting(self) -> int:
        """Requests waiting to be scheduled, those waiting for their grammar included."""
        with self._lock:
            self._drain_inbox()
            return self.scheduler.num_waiting + sum(len(c.requests) for c in self._compiling.values())

    # ---- the loop (its own thread) ----
    def _run(self) -> None:
        """The loop thread. An exception of the loop itself is a failure of the replica, not the
        silent end of its thread: it is logged, counted (stats, health, /metrics) and repaired
        as a failed worker is (a new worker; the unfinished requests recomputed)."""
        while not self._stopping:
            try:
                self._loop()
            except Exception as e:
                log.exception("replica %d: the step loop failed; restarting its worker", self.index)
                self.stats.loop_failures += 1
                try:
                    self._recover(e)
                except Exception:  # the repair itself failed: try again after a pause
                    log.exception("replica %d: recovering from a loop failure failed", self.index)
                    self._stopped.wait(self.config.restart_backoff_s)

    def _loop(self) -> None:
        inflight: deque = deque()  # (plan, ObjectRef)
        while not self._stopping:
            self.stats.loop_iterations += 1
            if self.health_state.state == "down":
                self._rejoin_after_cooldown()
                continue
            planned = []
            with self._lock:
                self._drain_inbox()
                while len(inflight) + len(planned) < self._depth and not self.dead:
                    plan = self.scheduler.schedule()
                    if plan is None:
                        break
                    planned.append(plan)
                refusals, self._refusals = self._refusals, []
            if refusals:
                self._emit(self, refusals)
            for plan in planned:  # unlocked: a plan bigger than the socket's buffer waits for the worker to read it
                inflight.append((plan, self._dispatch(plan.to_bytes())))
            if not inflight:
                self._wakeup.wait(self._next_grammar_deadline())
                self._wakeup.clear()
                continue
            plan, refs = inflight.popleft()
            try:
                data = self._collect(refs)
            except STEP_FAILURES as e:
                inflight.clear()
                self._recover(e)
                continue
            self.health_state.budget.on_step_served()
            updates = self._apply(plan, data)
            if updates:
                self._emit(self, updates)  # no lock held: the engine may post_finish right back

    def _dispatch(self, data: bytes):
        """Send one plan's bytes (serialized once) to every rank: the channels, or one ref per
        rank. A send that fails returns its error, for _collect to raise in step order."""
        if self.channels:
            try:
                for c in self.channels:
                    c.send(data, self.config.step_timeout_s)
            except (StepChannelError, StepTimeout) as e:
                return e
            return self.channels
        if len(self.workers) > 1 and len(data) > _INLINE_PLAN_BYTES:
            data = ray.put(data)  # a large plan enters the object store once, not once per rank
        return [w.execute.remote(data) for w in self.workers]

    def _collect(self, refs) -> bytes:
        """The sampling rank's result once every rank finished the step; a rank that failed raises, one
        that is still running past the step timeout raises GetTimeoutError (StepTimeout)."""
        timeout = self.config.step_timeout_s
        if isinstance(refs, BaseException):
            raise refs
        if refs is self.channels:
            return collect(refs, timeout, self._result_rank)
        if len(refs) == 1:
            return ray.get(refs[0], timeout=timeout)
        deadline = time.monotonic() + timeout
        pending, data = list(refs), b""
        while pending:  # whichever rank finishes (or fails) first is checked first
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()),
                                      fetch_local=False)
            if not ready:
                raise GetTimeoutError(f"{len(pending)} of {len(refs)} ranks did not finish within {timeout}s")
            value = ray.get(ready[0])  # raises the rank's error; other ranks return b"" (nothing to pull)
            if ready[0] == refs[self._result_rank]:
                data = value
        return data

    def _drain_inbox(self) -> None:
        """Finish what the engine asked to (under the lock). The loop drains before it plans;
        every reader of the scheduler drains first too, so what it sees reflects every
        message posted before it looked (an aborted request's blocks are free by then)."""
        while True:
            try:
                request_id, reason = self._inbox.get_nowait()
            except queue.Empty:
                break
            if self.scheduler.finish(request_id, reason) is None and self._compiling:
                self._drop_held(request_id)
        if self._compiling:
            self._drain_compiled()

    def _drop_held(self, request_id: str) -> None:
        """Forget a request that waits for its grammar (it was aborted)."""
        for c in self._compiling.values():
            c.requests = [r for r in c.requests if r.request_id != request_id]

    def _drain_compiled(self) -> None:
        """Schedule the requests whose grammar every rank compiled; refuse those whose grammar
        a rank refused or that waited past the compile deadline (lock held)."""
        while True:
            try:
                spec, generation, error = self._compiled_inbox.get_nowait()
            except queue.Empty:
                break
            c = self._compiling.get(spec)
            if c is None or generation != c.generation or isinstance(error, BaseException):
                continue  # stale, or a dead worker's: its replacement was asked again
            c.pending -= 1
            c.error = c.error or error
            if c.pending == 0:
                del self._compiling[spec]
                if c.error is None:
                    self._compiled[spec] = None
                    self._forget_oldest(self._compiled, GRAMMAR_CACHE_SIZE)
                    for req in c.requests:
                        self.scheduler.add_request(req)
                else:
                    self._refuse(spec, c, f"grammar: {c.error}")
        now = time.monotonic()
        for spec, c in list(self._compiling.items()):
            if now >= c.deadline:
                del self._compiling[spec]
                self._refuse(spec, c, f"grammar: not compiled within grammar_compile_timeout_s="
                                      f"{self.config.grammar_compile_timeout_s:g} s; simplify the schema or grammar")

    def _refuse(self, spec: GrammarSpec, c: _GrammarCompile, message: str) -> None:
        self._refused[spec] = message
        self._forget_oldest(self._refused, REFUSED_CACHE_SIZE)
        now = time.monotonic()
        for req in c.requests:
            req.refuse(message, now)
        self.stats.grammars_refused += len(c.requests)
        self._refusals.extend(RequestUpdate(r, [], [], True) for r in c.requests)
        self._wakeup.set()

    @staticmethod
    def _forget_oldest(cache: OrderedDict, size: int) -> None:
        while len(cache) > size:
            cache.popitem(last=False)

    def _next_grammar_deadline(self) -> float | None:
        """Seconds until the nearest compile deadline; None when nothing compiles."""
        with self._lock:
            if not self._compiling:
                return None
            return max(0.0, min(c.deadline for c in self._compiling.values()) - time.monotonic())

    def _apply(self, plan, data: bytes) -> list[RequestUpdate]:
        result = StepResult.from_bytes(data)
        s = self.stats
        s.steps += 1
        s.bytes_pulled += len(data)
        s.worker_time_s += result.step_time
        if plan.rows and all(r.token is not None for r in plan.rows):
            s.decode_steps += 1
            s.decode_rows += len(plan.rows)
            s.decode_bytes_pulled += len(data)
        with self._lock:
            if not sampled_on_device(result):
                self._sample_on_driver(result)
            return self.scheduler.update(result)

    def _sample_on_driver(self, result: StepResult) -> None:
        from workers.sampling.sampler import sample_host

        rows = self.scheduler.sampling_rows(result.step_id)
        histories = self.scheduler.sampling_histories(result.step_id) if any(
            ws.has_penalties for ws, _ in rows) else None
        ids, logprobs = sample_host(result, rows, self._host_sampler, histories)
        result.token_ids = pack_int32(ids)
        result.logprobs = logprobs

    def _recover(self, error: BaseException) -> None:
        """The worker is dead, raised, or hung: replace it and recompute, within the budget."""
        log.warning("replica %d: worker failed (%s: %s); restarting", self.index, type(error).__name__, error)
        while not self._stopping:
            self._kill_worker()
            decision = self.health_state.on_failure(error)
            self.stats.restarts = self.health_state.budget.total_restarts
            if decision.give_up:
                self._give_up(f"worker failed {self.health_state.budget.max_restarts + 1} times within "
                              f"{self.config.restart_window_s:.0f} s; last error: {self.health_state.last_error}")
                return
            if decision.delay_s and self._stopped.wait(decision.delay_s):
                return
            try:
                self._start_worker()
            except Exception as e:  # the replacement failed to start: try again
                error = e
                log.warning("replica %d: restart failed: %s", self.index, e)
                continue
            with self._lock:
                self._drain_inbox()
                poisoned = self.scheduler.recover(self.config.max_request_failures)
            self.health_state.on_up()
            if poisoned:
                log.error("replica %d: failed %s: on the worker at %d worker failures in a row", self.index,
                          [r.request_id for r in poisoned], self.config.max_request_failures)
                self._emit(self, [RequestUpdate(r, [], [], True) for r in poisoned])
            return

    def _give_up(self, message: str) -> None:
        log.error("replica %d: giving up for %.0f s: %s", self.index, self.config.replica_cooldown_s, message)
        with self._lock:  # the health state says "down" already: add() refuses from here on
            failed = self.scheduler.fail_all(message)
            held = [r for c in self._compiling.values() for r in c.requests]  # waiting for a grammar
            self._compiling.clear()
        now = time.monotonic()
        for r in held:
            r.fail(message, now)
        self._emit(self, [RequestUpdate(r, [], [], True) for r in failed + held])

    def _rejoin_after_cooldown(self) -> None:
        """Down: wait out the cool-down, then start a worker; routable again once it is up."""
        if self._stopped.wait(self.health_state.cooldown_left()):
            return
        self.health_state.on_cooldown_over()
        log.info("replica %d: cool-down over; starting a worker", self.index)
        try:
            self._start_worker()
        except Exception as e:  # stays down; the budget decides when to try next
            log.warning("replica %d: retry after cool-down failed: %s", self.index, e)
            self._kill_worker()
            self.health_state.on_failure(e)
            self.stats.restarts = self.health_state.budget.total_restarts
            return
        with self._lock:
            self._drain_inbox()
            self.scheduler.recover()  # an empty pool and cache: the new worker has neither
        self.health_state.on_up()
        log.info("replica %d: serving again", self.index)
        self._wakeup.set()

    def worker_stats(self) -> dict:
        try:
            return ray.get(self.worker.stats.remote(), timeout=10) if self.worker is not None else {}
        except Exception as e:
            return {"error": str(e)}

    def health(self) -> dict:
        h = self.health_state.describe()
        if self.loop_stopped:  # not even the loop's own handler ran: nothing will serve or repair it
            h.update(state="failed", last_error=h["last_error"] or "the replica's step loop is not running")
        return h

    @property
    def loop_stopped(self) -> bool:
        """The loop thread ended although the replica was not shut down."""
        return self._thread is not None and not self._thread.is_alive() and not self._stopping

    def snapshot(self) -> dict:
        with self._lock:
            self._drain_inbox()
            sched = self.scheduler.stats()
        s = self.stats
        return {
            **self.health(),
            "alive": not self.dead,
            **sched,
            "steps_returned": s.steps,
            "decode_steps": s.decode_steps,
            "bytes_pulled": s.bytes_pulled,
            "decode_bytes_pulled": s.decode_bytes_pulled,
            "decode_rows": s.decode_rows,
            "worker_time_s": s.worker_time_s,
            "worker_restarts": s.restarts,
            "loop_iterations": s.loop_iterations,
            "loop_failures": s.loop_failures,
            "grammars_refused": s.grammars_refused,
            "info": self.info,
        }
