"""Worker process bootstrap: gRPC server, health, reflection, model loading, SIGTERM drain."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable

from tandem.serving import GrpcService, serve_metrics
from tandem.telemetry import setup_tracing
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.worker import engines
from tandem.worker.config import WorkerConfig
from tandem.worker.servicer import WorkerServicer

logger = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


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
    if config.metrics_port:
        from tandem.worker.metrics import register_engine_state

        register_engine_state(lambda: servicer.engine.state() if servicer.engine is not None else None)
        serve_metrics(config.host, config.metrics_port)
    await service.start()
    logger.info("%s worker listening on %s; loading the model", config.kind, service.address)

    def on_failure(reason: str) -> None:
        def mark() -> None:
            servicer.mark_failed()
            asyncio.ensure_future(service.set_health(False))

        loop.call_soon_threadsafe(mark)

    start = await _run_in_daemon_thread(lambda: engines.load(config, on_failure), stop)
    if start is None:
        await service.server.stop(grace=0)
        return 0
    opened = await start()
    servicer.attach(opened.engine, opened.identity, opened.tokenizer)
    await service.set_health(True)
    identity = opened.identity
    logger.info("ready on %s: %s on %s (%s, %s engine %s), %s", service.address, identity.model_id, config.device,
                identity.dtype, identity.engine, identity.engine_version, opened.rates_line)

    await stop.wait()
    logger.info("draining: refusing new requests, waiting up to %.0f s for in-flight streams", config.drain_grace_s)
    servicer.drain()
    await service.set_health(False)
    if not await servicer.wait_idle(config.drain_grace_s):
        logger.warning("grace period over; cancelling the streams still in flight")
    await service.server.stop(grace=1.0)
    await opened.engine.close()
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
