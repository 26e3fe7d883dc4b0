"""Worker process bootstrap: gRPC server, health, reflection, model loading, SIGTERM drain."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from tandem.engine.async_engine import AsyncEngine
from tandem.engine.engine import LLMEngine
from tandem.serving import GrpcService, serve_metrics
from tandem.telemetry import setup_tracing
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.worker import metrics
from tandem.worker.config import WorkerConfig, default_threads
from tandem.worker.servicer import WorkerIdentity, WorkerServicer

logger = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def load_engine(config: WorkerConfig) -> tuple[LLMEngine, WorkerIdentity, Path]:
    """Load the model and calibrate the engine (slow; runs off the event loop)."""
    import torch

    from tandem.engine.model.factory import build_engine
    from tandem.engine.model.loader import DEFAULT_MODEL_NAME, model_fingerprint, resolve_model

    torch.set_num_threads(config.threads or default_threads())
    model_dir = resolve_model(config.model)
    engine = build_engine(str(model_dir), config.device, config.dtype, config.scheduler, config.cache,
                          decode_weights=config.decode_weights, cuda_graphs=config.cuda_graphs)
    runner = engine.executor
    identity = WorkerIdentity(
        kind=config.kind,
        model_id=config.model or DEFAULT_MODEL_NAME,
        model_fingerprint=model_fingerprint(model_dir),
        dtype=str(runner.dtype).removeprefix("torch."),
        max_waiting_requests=config.scheduler.max_waiting_requests,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        context_length=runner.max_model_len,
        vocab_size=runner.vocab_size,
        eos_token_ids=tuple(sorted(runner.eos_token_ids)),
        version=version("tandem"),
    )
    return engine, identity, model_dir


async def serve(config: WorkerConfig, stop: asyncio.Event | None = None) -> int:
    """Run a worker until ``stop`` is set or SIGTERM/SIGINT arrives; then drain and return 0.

    Health is NOT_SERVING until the model is loaded and calibrated, SERVING while running, and
    NOT_SERVING again while draining or after an engine failure.
    """
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    service = GrpcService(WORKER_SERVICE, config.host, config.port, options=[
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ], tls=config.tls)
    servicer = WorkerServicer(config.kind)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, service.server)
    await service.set_health(False)
    if config.metrics_port:
        from tandem.worker.metrics import register_engine_state

        register_engine_state(lambda: servicer.engine.state() if servicer.engine is not None else None)
        serve_metrics(config.host, config.metrics_port)
    await service.server.start()
    logger.info("%s worker listening on %s; loading the model", config.kind, service.address)

    loaded = await _run_in_daemon_thread(lambda: load_engine(config), stop)
    if loaded is None:
        await service.server.stop(grace=0)
        return 0
    engine, identity, model_dir = loaded

    def on_failure(reason: str) -> None:
        def mark() -> None:
            servicer.mark_failed()
            asyncio.ensure_future(service.set_health(False))

        loop.call_soon_threadsafe(mark)

    from tandem.engine.model.factory import load_tokenizer

    async_engine = AsyncEngine(engine, on_failure=on_failure, on_step=metrics.record_step,
                               priority=config.engine_priority)
    async_engine.start()
    servicer.attach(async_engine, identity, load_tokenizer(model_dir))
    await service.set_health(True)
    rates = engine.rates.rates()
    logger.info(
        "ready on %s: %s on %s (%s), prefill %.0f tok/s, decode %.0f tok/s",
        service.address, identity.model_id, engine.executor.device, identity.dtype, rates.prefill_tok_s, rates.decode_tok_s,
    )

    await stop.wait()
    logger.info("draining: refusing new requests, waiting up to %.0f s for in-flight streams", config.drain_grace_s)
    servicer.drain()
    await service.set_health(False)
    if not await servicer.wait_idle(config.drain_grace_s):
        logger.warning("grace period over; cancelling the streams still in flight")
    await service.server.stop(grace=1.0)
    async_engine.stop()
    logger.info("stopped")
    return 0


async def _run_in_daemon_thread(work: Callable, stop: asyncio.Event):
    """Run ``work`` on a daemon thread; None if ``stop`` is set first (the process may then exit at once)."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future = loop.create_future()

    def settle(outcome: BaseException | object, failed: bool) -> None:
        if not result.done():
            result.set_exception(outcome) if failed else result.set_result(outcome)

    def target() -> None:
        try:
            value = work()
        except BaseException as exc:  # delivered to the awaiting coroutine
            loop.call_soon_threadsafe(settle, exc, True)
        else:
            loop.call_soon_threadsafe(settle, value, False)

    threading.Thread(target=target, name="tandem-load", daemon=True).start()
    stopped = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({result, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if result in done:
        stopped.cancel()
        return result.result()
    return None


def main(kind: str, default_port: int, resolve_device: Callable[[str | None], str], argv: list[str] | None = None) -> int:
    """Entry point shared by ``python -m cpu_worker`` and ``python -m gpu_worker``."""
    import dataclasses

    from tandem.worker.config import parse_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_config(kind, default_port, argv)
    config = dataclasses.replace(config, device=resolve_device(config.device))
    if kind == "gpu" and config.device == "cpu":
        logger.warning("gpu_worker is running on the CPU; every state report says device=cpu")
    provider = setup_tracing(f"{kind}-worker")
    try:
        return asyncio.run(serve(config))
    finally:
        if provider is not None:
            provider.shutdown()
