"""Prometheus metrics of one engine, in a registry of its own.

Counters and histograms are updated as requests finish; gauges (running, waiting, KV
usage, prefix-cache hit rate, bytes pulled per decode step) are read from the engine's
stats when scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class _StatsCollector:
    def __init__(self, stats_fn):
        self._stats_fn = stats_fn

    def collect(self):
        s = self._stats_fn()
        gauges = [
            ("raylm_requests_running", "Requests being generated", s.get("num_running", 0)),
            ("raylm_requests_waiting", "Requests waiting to be scheduled", s.get("num_waiting", 0)),
            ("raylm_kv_cache_usage_ratio", "Fraction of KV blocks in use",
             s.get("kv_blocks_used", 0) / s["kv_blocks_total"] if s.get("kv_blocks_total") else 0.0),
            ("raylm_kv_blocks_used", "KV blocks in use", s.get("kv_blocks_used", 0)),
            ("raylm_kv_blocks_total", "KV blocks in the pools", s.get("kv_blocks_total", 0)),
            ("raylm_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / queried",
             s.get("prefix_hit_rate", 0.0)),
            ("raylm_bytes_pulled_per_decode_step", "Mean bytes a decode step returns from a worker",
             s.get("bytes_pulled_per_decode_step", 0.0)),
            ("raylm_replicas_alive", "Replicas serving", s.get("replicas_alive", 0)),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        yield from _replica_families(s.get("replicas", []))
        for name, doc, key in [
            ("raylm_prompt_tokens", "Prompt tokens computed", "prompt_tokens"),
            ("raylm_generation_tokens", "Tokens generated", "generated_tokens"),
            ("raylm_preemptions", "Requests preempted for recompute", "num_preemptions"),
            ("raylm_worker_restarts", "Worker actors restarted after a failure", "worker_restarts"),
            ("raylm_step_loop_failures", "Failures of a replica's step loop itself (each repaired as a worker "
             "failure)", "loop_failures"),
            ("raylm_poisoned_requests", "Requests failed as the likely cause of repeated worker failures",
             "poisoned_requests"),
            ("raylm_grammars_refused", "Requests refused because their grammar failed or timed out compiling",
             "grammars_refused"),
            ("raylm_bytes_pulled", "Bytes returned by workers", "bytes_pulled"),
            ("raylm_spec_decode_num_draft_tokens", "Speculative decoding: tokens drafted", "spec_draft_tokens"),
            ("raylm_spec_decode_num_accepted_tokens", "Speculative decoding: drafted tokens accepted",
             "spec_accepted_tokens"),
            ("raylm_spec_decode_num_drafts", "Speculative decoding: decode rows that verified drafts",
             "spec_verify_rows"),
            ("raylm_engine_steps", "Steps the workers returned", "steps_returned"),
            ("raylm_decode_steps", "Steps of decode rows only", "decode_steps"),
            ("raylm_worker_step_seconds", "Seconds workers spent executing steps (busy / wall: their use)",
             "worker_time_s"),
        ]:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(s.get(key, 0)))
            yield c


def _replica_families(replicas: list[dict]):
    """Per replica: up (routable and serving), its state, restarts, give-ups, last error time."""
    up = GaugeMetricFamily("raylm_replica_up", "1 if the replica serves, else 0", labels=["replica"])
    state = GaugeMetricFamily("raylm_replica_state", "1 for the replica's current state", labels=["replica", "state"])
    restarts = CounterMetricFamily("raylm_replica_restarts", "Worker restarts of the replica", labels=["replica"])
    give_ups = CounterMetricFamily("raylm_replica_give_ups", "Times the replica spent its restart budget",
                                   labels=["replica"])
    last_error = GaugeMetricFamily("raylm_replica_last_error_timestamp_seconds",
                                   "Unix time of the replica's last worker failure (0: none)", labels=["replica"])
    for r in replicas:
        i = str(r["replica"])
        up.add_metric([i], 1.0 if r.get("state") == "up" else 0.0)
        state.add_metric([i, str(r.get("state"))], 1.0)
        restarts.add_metric([i], float(r.get("restarts", 0)))
        give_ups.add_metric([i], float(r.get("give_ups", 0)))
        last_error.add_metric([i], float(r.get("last_error_time") or 0.0))
    yield from (up, state, restarts, give_ups, last_error)


class EngineMetrics:
    def __init__(self, stats_fn):
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("raylm_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.ttft = Histogram("raylm_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("raylm_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_StatsCollector(stats_fn))

    def observe_finished(self, finish_reason: str, ttft: float | None, tpot: float | None) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
