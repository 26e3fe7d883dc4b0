"""`tandem up`: the whole stack on this machine — cpu_worker, gpu_worker and the router."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.model_files import model_name
from tandem.launch import ServiceProcess, free_port


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop


@dataclass
class Stack:
    """cpu_worker, gpu_worker and the router as local processes."""

    cpu: ServiceProcess
    gpu: ServiceProcess
    router: ServiceProcess
    notice: str
    http_port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.router.host}:{self.http_port}"

    @property
    def services(self) -> list[ServiceProcess]:
        return [self.cpu, self.gpu, self.router]

    def wait_for_health(self, announce=lambda service: None) -> None:
        for service in self.services:
            service.wait_for_health()
            announce(service)

    def stop(self) -> dict[str, int]:
        """SIGTERM each service, router first; their exit codes."""
        return {service.name: service.terminate() for service in reversed(self.services)}


def start_stack(model: str | None, log_dir: Path, host: str = "127.0.0.1", router_port: int | None = None,
                cpu_port: int | None = None, gpu_port: int | None = None, cpu_args: tuple[str, ...] = (),
                gpu_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (), http_port: int | None = None,
                gpu_python: str | None = None) -> Stack:
    """Start both workers and the router (not yet healthy), the router's HTTP API on ``http_port`` (default: a
    free port). Without CUDA, gpu_worker runs with ``--device cpu`` and the cores are split between the two
    workers. ``gpu_python`` runs gpu_worker from another environment (vLLM's, for ``--engine vllm``)."""
    import torch

    from tandem.worker.config import default_threads

    cores = default_threads()
    model_args = ["--model", model] if model else []
    if torch.cuda.is_available():
        device_args, cpu_threads = [], cores
        notice = f"gpu_worker: CUDA device {torch.cuda.get_device_name(0)}"
    else:
        cpu_threads = max(1, cores // 2)
        device_args = ["--device", "cpu", "--threads", str(max(1, cores - cpu_threads))]
        notice = ("notice: no CUDA GPU here; gpu_worker runs with --device cpu (its reports say device=cpu), "
                  f"and the {cores} cores are split between the two workers")
    started: list[ServiceProcess] = []
    try:
        started.append(ServiceProcess("cpu_worker", "cpu_worker",
                                      [*model_args, "--threads", str(cpu_threads), *cpu_args],
                                      log_dir / "cpu_worker.log", host, cpu_port))
        started.append(ServiceProcess("gpu_worker", "gpu_worker", [*model_args, *device_args, *gpu_args],
                                      log_dir / "gpu_worker.log", host, gpu_port,
                                      command=[gpu_python, "-m", "gpu_worker"] if gpu_python else None))
        cpu, gpu = started
        http_port = http_port or free_port()
        # The HTTP port travels in the environment, so that the same command line also starts a router
        # elsewhere (bench-router's comparisons).
        started.append(ServiceProcess(
            "router", "router_svc",
            [*model_args, "--worker", f"cpu=cpu@{cpu.address}", "--worker", f"gpu=gpu@{gpu.address}", *router_args],
            log_dir / "router.log", host, router_port, env={"TANDEM_HTTP_PORT": str(http_port)},
        ))
    except BaseException:
        for service in started:
            service.close()
        raise
    return Stack(*started, notice, http_port)


def run_stack(model: str | None, router_port: int, cpu_port: int, gpu_port: int, log_dir: Path,
              host: str = "127.0.0.1", http_port: int = 8000) -> int:
    """Start both workers and the router, wait until all are healthy, and run until Ctrl-C or SIGTERM."""
    signal.signal(signal.SIGTERM, _raise_stop)
    stack = None
    try:
        stack = start_stack(model, log_dir, host, router_port, cpu_port, gpu_port, http_port=http_port)
        print(stack.notice)
        print(f"starting cpu_worker ({stack.cpu.address}), gpu_worker ({stack.gpu.address}), "
              f"router ({stack.router.address}); logs in {log_dir}/ ...", flush=True)
        stack.wait_for_health(lambda service: print(f"  {service.name} is healthy", flush=True))
        print(_instructions(stack.router.address, stack.http_url, model_name(model)), flush=True)
        while all(service.alive for service in stack.services):
            time.sleep(0.5)
        dead = [s.name for s in stack.services if not s.alive]
        print(f"{', '.join(dead)} exited; stopping the stack. See the logs in {log_dir}/", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Stop):
        print("\nstopping ...", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"the stack failed to start: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if stack is not None:
            for name, code in stack.stop().items():
                print(f"  {name} stopped (exit code {code})", flush=True)


def _instructions(router: str, http_url: str, model: str) -> str:
    return f"""
Tandem is running. The router serves gRPC on {router} and the OpenAI API on {http_url}/v1.

  .venv/bin/tandem generate "Why is the sky blue?"              # stream an answer
  .venv/bin/tandem generate --explain "Why is the sky blue?"    # ... and show the routing decision
  .venv/bin/tandem backends                                       # the workers' live state
  grpcurl -plaintext -d '{{"prompt_text": "Hello", "max_new_tokens": 16}}' {router} tandem.v1.Router/Generate
  curl {http_url}/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 16}}'

Press Ctrl-C to stop everything."""
