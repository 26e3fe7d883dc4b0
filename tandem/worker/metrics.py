"""Prometheus metrics of a worker: request latencies and outcomes, plus live engine state at scrape time."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.engine.engine import EngineState, RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1)

TTFT = Histogram("tandem_worker_time_to_first_token_seconds", "Time from arrival to the first token", buckets=_LATENCY_BUCKETS)
TPOT = Histogram("tandem_worker_time_per_output_token_seconds", "Mean time between output tokens of a request",
                 buckets=_TOKEN_BUCKETS)
E2E = Histogram("tandem_worker_e2e_request_latency_seconds", "Time from arrival to the last token", buckets=_LATENCY_BUCKETS)
QUEUE = Histogram("tandem_worker_queue_time_seconds", "Time from arrival to the first scheduled step", buckets=_LATENCY_BUCKETS)
PROMPT_TOKENS = Histogram("tandem_worker_prompt_tokens", "Prompt length of finished requests",
                          buckets=(16, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
OUTPUT_TOKENS = Histogram("tandem_worker_output_tokens", "Output length of finished requests",
                          buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
STEP_BATCH_SIZE = Histogram("tandem_worker_step_batch_size", "Requests computed per engine step (prefill and decode)",
                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
FINISHED = Counter("tandem_worker_requests_finished_total", "Finished requests by finish reason", ["finish_reason"])
PREEMPTIONS = Counter("tandem_worker_preemptions_total", "Times a request was preempted and recomputed")
RPCS = Counter("tandem_worker_rpcs_total", "RPCs by method and final gRPC status code (errors included)", ["method", "code"])
ESTIMATES = Counter("tandem_worker_estimates_total", "Estimate probes answered (Estimate calls and EstimateStream messages)")


def record_finished(output: RequestOutput) -> None:
    stats = output.stats
    FINISHED.labels(output.finish_reason.value).inc()
    QUEUE.observe(stats.queue_time_s)
    E2E.observe(stats.total_time_s)
    PROMPT_TOKENS.observe(stats.num_prompt_tokens)
    OUTPUT_TOKENS.observe(stats.num_output_tokens)
    PREEMPTIONS.inc(stats.num_preemptions)
    if stats.ttft_s is not None:
        TTFT.observe(stats.ttft_s)
        if stats.num_output_tokens > 1:
            TPOT.observe((stats.total_time_s - stats.ttft_s) / (stats.num_output_tokens - 1))


def record_step(batch_size: int) -> None:
    """Observe an executed engine step of ``batch_size`` requests (either engine calls this once per step)."""
    STEP_BATCH_SIZE.observe(batch_size)


def rpc_status_recorder(method: str) -> Callable[[grpc.StatusCode], None]:
    return lambda code: RPCS.labels(method, code.name).inc()


class EngineStateCollector:
    """Gauges read from the engine's state snapshot when Prometheus scrapes."""

    def __init__(self, state: Callable[[], EngineState | None]):
        self._state = state

    def collect(self):
        state = self._state()
        if state is None:
            return
        load = state.load

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, documentation, value=value)

        yield gauge("tandem_worker_requests_running", "Requests in the running batch", load.num_running)
        yield gauge("tandem_worker_requests_waiting", "Requests in the waiting queue", load.num_waiting)
        yield gauge("tandem_worker_pending_prefill_tokens", "Uncomputed prompt tokens, running and waiting",
                    state.pending_prefill_tokens)
        yield gauge("tandem_worker_pending_decode_tokens", "Remaining decode budget, running and waiting",
                    state.pending_decode_budget)
        blocks = GaugeMetricFamily("tandem_worker_kv_blocks", "KV cache blocks by state", labels=["state"])
        free = load.num_kv_blocks - load.num_used_blocks - load.num_cached_free_blocks
        for name, value in (("used", load.num_used_blocks), ("cached", load.num_cached_free_blocks), ("free", free)):
            blocks.add_metric([name], value)
        yield blocks
        yield gauge("tandem_worker_kv_usage_ratio", "Fraction of KV blocks held by requests",
                    load.num_used_blocks / load.num_kv_blocks)
        yield CounterMetricFamily("tandem_worker_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=load.prefix_queried_tokens)
        yield CounterMetricFamily("tandem_worker_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=load.prefix_hit_tokens)
        yield gauge("tandem_worker_prefix_cache_hit_ratio", "Hit tokens over queried tokens since start",
                    load.prefix_hit_tokens / load.prefix_queried_tokens if load.prefix_queried_tokens else 0.0)
        if state.rates is not None:
            yield gauge("tandem_worker_prefill_tokens_per_second", "Prefill rate of a full chunk", state.rates.prefill_tok_s)
            yield gauge("tandem_worker_decode_tokens_per_second", "Aggregate decode rate of a full batch",
                        state.rates.decode_tok_s)


def register_engine_state(state: Callable[[], EngineState | None]) -> None:
    REGISTRY.register(EngineStateCollector(state))
