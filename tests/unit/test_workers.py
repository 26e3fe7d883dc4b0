"""The router's view of a worker: reported state plus in-flight credit, from an estimate or a snapshot."""

from __future__ import annotations

from router_svc.prefix_index import PromptBlocks
from router_svc.workers import Worker, WorkerAddress, WorkerRegistry
from tandem.v1 import common_pb2, worker_pb2


def make_worker() -> Worker:
    registry = WorkerRegistry([WorkerAddress("gpu", "gpu", "127.0.0.1", 1)], reference_fingerprint="f")
    worker = registry.workers["gpu"]
    worker.info = worker_pb2.GetInfoResponse(model_fingerprint="f", max_num_batched_tokens=256)
    worker.connected = True
    return worker


def state(*requests: common_pb2.RequestLoad, seq: int = 1) -> common_pb2.BackendState:
    return common_pb2.BackendState(
        seq=seq,
        serving_state=common_pb2.SERVING_STATE_SERVING,
        num_running=sum(r.running for r in requests),
        num_waiting=sum(not r.running for r in requests),
        pending_prefill_tokens=sum(r.prefill_tokens for r in requests),
        pending_decode_tokens=sum(r.decode_tokens for r in requests),
        max_active_requests=4,
        rates=common_pb2.Rates(prefill_tokens_per_s=2551, decode_tokens_per_s=293),
        requests=list(requests),
    )


async def test_dispatched_requests_count_until_the_worker_reports_them():
    worker = make_worker()
    worker.state = state(common_pb2.RequestLoad(request_id="a", running=True, decode_tokens=100))
    worker.dispatch("b", PromptBlocks([]), prefill_tokens=20, decode_tokens=128)
    worker.dispatch("c", PromptBlocks([]), prefill_tokens=20, decode_tokens=128)

    credited = worker.view(None)
    assert (credited.pending_prefill_tokens, credited.pending_decode_tokens) == (40, 356)
    assert (credited.num_waiting, credited.inflight_requests) == (2, 2)
    assert credited.state_source == "snapshot" and credited.cached_tokens == 0
    assert len(credited.queue) == 3

    fresh = state(common_pb2.RequestLoad(request_id="a", running=True, decode_tokens=99),
                  common_pb2.RequestLoad(request_id="b", running=False, prefill_tokens=20, decode_tokens=128), seq=2)
    fresh.cached_tokens = 496
    view = worker.view(fresh)
    assert (view.pending_prefill_tokens, view.pending_decode_tokens) == (40, 355)  # b reported, c credited
    assert (view.inflight_requests, view.cached_tokens, view.state_source) == (1, 496, "estimate")

    worker.release("c")
    assert worker.view(fresh).inflight_requests == 0
    assert worker.routed_requests == 2


async def test_an_indexed_view_looks_the_prompt_up_in_the_workers_prefix_index_and_adds_credit():
    worker = make_worker()
    worker.state = state(common_pb2.RequestLoad(request_id="a", running=True, decode_tokens=100))
    worker.state.block_size = 4
    prompt = PromptBlocks(list(range(13)))  # three full blocks may hit
    first, second, _ = prompt.hashes(4)
    worker.prefix_index.apply(common_pb2.PrefixCacheChanges(reset=True, held=[first], free=[second]))
    worker.dispatch("b", PromptBlocks([]), prefill_tokens=5, decode_tokens=8)

    view = worker.indexed_view(prompt)
    assert (view.cached_tokens, view.cached_evictable_tokens, view.state_source) == (8, 4, "index")
    assert (view.pending_prefill_tokens, view.pending_decode_tokens, view.inflight_requests) == (5, 108, 1)


async def test_health_needs_connection_serving_state_and_the_reference_model():
    worker = make_worker()
    assert not worker.healthy  # no state yet
    worker.state = state()
    assert worker.healthy and worker.describe() == "serving"
    worker.info = worker_pb2.GetInfoResponse(model_fingerprint="other")
    assert not worker.healthy and "fingerprint" in worker.describe()
    worker.info = worker_pb2.GetInfoResponse(model_fingerprint="f")
    worker.state = common_pb2.BackendState(serving_state=common_pb2.SERVING_STATE_DRAINING)
    assert not worker.healthy and worker.describe() == "draining"
