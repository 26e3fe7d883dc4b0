"""`tandem up`: the whole stack on this machine — cpu_worker, gpu_worker and the router."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from tandem.launch import ServiceProcess


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop


def run_stack(model: str | None, router_port: int, cpu_port: int, gpu_port: int, log_dir: Path,
              host: str = "127.0.0.1") -> int:
    """Start both workers and the router, wait until all are healthy, and run until Ctrl-C or SIGTERM."""
    import torch

    from tandem.worker.config import default_threads

    cores = default_threads()
    model_args = ["--model", model] if model else []
    if torch.cuda.is_available():
        gpu_args, cpu_threads = [], cores
        print(f"gpu_worker: CUDA device {torch.cuda.get_device_name(0)}")
    else:
        cpu_threads = max(1, cores // 2)
        gpu_args = ["--device", "cpu", "--threads", str(max(1, cores - cpu_threads))]
        print("notice: no CUDA GPU here; gpu_worker runs with --device cpu (its reports say device=cpu), "
              f"and the {cores} cores are split between the two workers")
    signal.signal(signal.SIGTERM, _raise_stop)
    services: list[ServiceProcess] = []
    try:
        services.append(ServiceProcess("cpu_worker", "cpu_worker", [*model_args, "--threads", str(cpu_threads)],
                                       log_dir / "cpu_worker.log", host, cpu_port))
        services.append(ServiceProcess("gpu_worker", "gpu_worker", [*model_args, *gpu_args],
                                       log_dir / "gpu_worker.log", host, gpu_port))
        services.append(ServiceProcess(
            "router", "router_svc",
            [*model_args, "--worker", f"cpu=cpu@{host}:{cpu_port}", "--worker", f"gpu=gpu@{host}:{gpu_port}"],
            log_dir / "router.log", host, router_port,
        ))
        print(f"starting cpu_worker ({host}:{cpu_port}), gpu_worker ({host}:{gpu_port}), router ({host}:{router_port}); "
              f"logs in {log_dir}/ ...", flush=True)
        for service in services:
            service.wait_for_health()
            print(f"  {service.name} is healthy", flush=True)
        print(_instructions(f"{host}:{router_port}"), flush=True)
        while all(service.alive for service in services):
            time.sleep(0.5)
        dead = [s.name for s in services if not s.alive]
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
        for service in reversed(services):
            code = service.terminate()
            print(f"  {service.name} stopped (exit code {code})", flush=True)


def _instructions(router: str) -> str:
    return f"""
Tandem is running. The router listens on {router}.

  .venv/bin/tandem generate "Why is the sky blue?"              # stream an answer
  .venv/bin/tandem generate --explain "Why is the sky blue?"    # ... and show the routing decision
  .venv/bin/tandem backends                                       # the workers' live state
  grpcurl -plaintext -d '{{"prompt_text": "Hello", "max_new_tokens": 16}}' {router} tandem.v1.Router/Generate

Press Ctrl-C to stop everything."""
