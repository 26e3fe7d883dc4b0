"""python -m router_svc: the Tandem router."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

from router_svc import discovery
from router_svc.admission import Admission
from router_svc.config import RouterConfig, parse_config
from router_svc.frontends.grpc import RouterServicer
from router_svc.frontends.openai import OpenAIFrontEnd, ServedModel, http_server
from router_svc.frontends.preparation import Preparation
from router_svc.request_path import Router
from router_svc.workers import WorkerRegistry
from tandem.security import BearerTokenAuth
from tandem.serving import GrpcService, serve_metrics
from tandem.telemetry import setup_tracing
from tandem.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger("router_svc")

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
HEALTH_POLL_S = 0.25
GRACE_S = 5.0


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> int:
    """Serve until ``stop`` is set or SIGTERM/SIGINT arrives. Health is SERVING while any worker is healthy."""
    from tandem.model_files import model_fingerprint, model_name, resolve_model
    from tandem.tokenizer import load_prompt_tokenizer as load_tokenizer

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    model_dir = await asyncio.to_thread(resolve_model, config.model)
    tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
    fingerprint = await asyncio.to_thread(model_fingerprint, model_dir)
    registry = WorkerRegistry(list(config.workers), fingerprint, config.worker_tls, config.worker_keepalive_s)
    auth = [BearerTokenAuth(config.auth_tokens)] if config.auth_tokens else []
    service = GrpcService(ROUTER_SERVICE, config.host, config.port, tls=config.tls, interceptors=auth, options=[
        ("grpc.max_receive_message_length", config.max_message_bytes),
    ])
    router = Router(registry, Admission(config.max_inflight, config.max_queued, config.queue_timeout_s),
                    config.probe_deadline_ms / 1000, config.replace_interval_s)
    preparation = Preparation(config.policy, registry.model_limits)
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router, tokenizer, preparation), service.server)
    serve_metrics(config.host, config.metrics_port)
    registry.start([discovery.build(spec, config.discovery) for spec in config.discover])
    await service.start()
    http = None
    if config.http_port:
        front_end = OpenAIFrontEnd(router, tokenizer, ServedModel(model_name(config.model), config.served_model_names,
                                                                  int(time.time())),
                                   preparation, BearerTokenAuth(config.auth_tokens) if config.auth_tokens else None)
        http = http_server(front_end, config.host, config.http_port, config.tls, GRACE_S)
        http_task = asyncio.create_task(http.serve(), name="http")
        while not http.started:  # a port it cannot bind ends the process, as uvicorn does
            await asyncio.sleep(0.01)
        logger.info("OpenAI-compatible HTTP API on %s://%s:%d/v1 (model %s)", "https" if config.tls else "http",
                    config.host, config.http_port, ", ".join(front_end.model.names))
    logger.info("router listening on %s (%s%s), policy %s, model fingerprint %s, workers (%s): %s", service.address,
                "TLS" if config.tls else "plaintext", ", bearer tokens" if config.auth_tokens else "", config.policy,
                fingerprint[:12], "TLS" if config.worker_tls else "plaintext",
                ", ".join([*(f"{w.name}={w.kind}@{w.address}" for w in config.workers), *config.discover]))

    serving = None
    while not stop.is_set():
        now_serving = bool(registry.healthy())
        if now_serving != serving:
            await service.set_health(now_serving)
            serving = now_serving
        try:
            await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)
        except TimeoutError:
            pass

    logger.info("stopping: in-flight streams get %g s to finish", GRACE_S)
    await service.health.enter_graceful_shutdown()
    if http is not None:
        http.should_exit = True
    await asyncio.gather(service.server.stop(grace=GRACE_S), *([http_task] if http is not None else []))
    await registry.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_config(argv)
    provider = setup_tracing("router")
    try:
        return asyncio.run(serve(config))
    finally:
        if provider is not None:
            provider.shutdown()


if __name__ == "__main__":
    sys.exit(main())
