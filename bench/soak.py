"""`make soak`: a mixed load against the whole stack for a while, then a tally and a leak check.

Poisson arrivals of normal requests, requests the client cancels part-way, and invalid requests,
while the workers are SIGKILLed and restarted in turn. Every request must end as expected: normal
ones complete (or, only if their worker was killed after it had streamed tokens, UNAVAILABLE saying
so); cancelled ones as CANCELLED; invalid ones as INVALID_ARGUMENT naming the field. Afterwards no
worker may hold a request or a KV block, and the router no credit. Writes bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

from tandem.loadgen.live import wait_for_healthy_backends
from tandem.loadgen.results import percentile, write_json
from tandem.launch import ServiceProcess, free_port
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2

RESULTS = Path(__file__).resolve().parent / "results"
LOGS = RESULTS / "soak-logs"
BAD_REQUESTS = [  # (fields, the field the error must name)
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 8, "prompt_token_ids": worker_pb2.TokenIds(ids=[10**9])}, "prompt_token_ids"),
    ({"max_new_tokens": 8, "sampling": common_pb2.SamplingParams(temperature=-1)}, "temperature"),
    ({"max_new_tokens": 8, "policy": "fastest"}, "policy"),
]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Soak:
    def __init__(self, model: str | None, duration_s: float, rate: float, kill_every_s: float, seed: int):
        self.model_args = ["--model", model] if model else []
        self.duration_s, self.rate, self.kill_every_s = duration_s, rate, kill_every_s
        self.rng = random.Random(seed)
        self.restarts = 0
        self.workers = {name: self._start_worker(name, free_port()) for name in ("cpu", "gpu")}
        specs = [arg for name, w in self.workers.items() for arg in ("--worker", f"{name}={name}@{w.address}")]
        self.router = ServiceProcess("router", "router_svc", [*self.model_args, *specs], LOGS / "router.log")
        self.outcomes: Counter = Counter()
        self.unexpected: list[str] = []
        self.ttft_s: list[float] = []
        self.e2e_s: list[float] = []

    def _start_worker(self, name: str, port: int) -> ServiceProcess:
        module = f"{name}_worker"
        device = ["--device", "cpu"] if name == "gpu" else []
        return ServiceProcess(module, module, [*self.model_args, *device, "--threads", "1"],
                              LOGS / f"{module}-{self.restarts}.log", port=port)

    async def one(self, stub, index: int) -> None:
        kind = self.rng.choices(["normal", "cancel", "bad"], [0.8, 0.1, 0.1])[0]
        prompt = [self.rng.randrange(10, 40000) for _ in range(self.rng.randint(8, 120))]
        fields = dict(prompt_token_ids=worker_pb2.TokenIds(ids=prompt), max_new_tokens=self.rng.randint(8, 48),
                      ignore_eos=True, sampling=common_pb2.SamplingParams(temperature=0.0), request_id=f"soak-{index}")
        expected_field = None
        if kind == "bad":
            bad, expected_field = self.rng.choice(BAD_REQUESTS)
            fields.update(bad)
        cancel_after = self.rng.randint(1, 8) if kind == "cancel" else None
        start = time.perf_counter()
        first = None
        tokens = 0
        call = stub.Generate(router_pb2.RouteRequest(**fields), timeout=300)
        try:
            async for response in call:
                if response.token_ids:
                    first = first or time.perf_counter()
                    tokens += len(response.token_ids)
                if cancel_after is not None and tokens >= cancel_after:
                    call.cancel()
                    self.outcomes["cancelled"] += 1
                    return
            if kind != "normal":
                self.unexpected.append(f"{kind} request completed")
            self.outcomes["completed"] += 1
            self.ttft_s.append(first - start)
            self.e2e_s.append(time.perf_counter() - start)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if kind == "bad" and code == grpc.StatusCode.INVALID_ARGUMENT and expected_field in details:
                self.outcomes["rejected_invalid"] += 1
            elif code == grpc.StatusCode.UNAVAILABLE and tokens > 0 and "failed after streaming" in details:
                self.outcomes["unavailable_after_tokens"] += 1
            else:
                self.outcomes[f"unexpected_{code.name}"] += 1
                self.unexpected.append(f"{kind} request {index}: {code.name}: {details} after {tokens} tokens")
        finally:
            call.cancel()

    async def killer(self, stop: asyncio.Event) -> None:
        names = ["cpu", "gpu"]
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.kill_every_s * self.rng.uniform(0.5, 1.5))
                return
            except TimeoutError:
                pass
            name = names[self.restarts % 2]
            victim = self.workers[name]
            victim.process.kill()
            await asyncio.to_thread(victim.close)
            await asyncio.sleep(self.rng.uniform(0.5, 3.0))
            self.restarts += 1
            self.workers[name] = self._start_worker(name, victim.port)
            await asyncio.to_thread(self.workers[name].wait_for_health)
            print(f"  killed and restarted {name} ({self.restarts} restarts)", flush=True)

    async def run(self) -> dict:
        async with grpc.aio.insecure_channel(self.router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            await wait_for_healthy_backends(self.router.address)
            rss_start = rss_kib(self.router.process.pid)
            stop = asyncio.Event()
            killer = asyncio.create_task(self.killer(stop))
            tasks = []
            started = time.monotonic()
            index = 0
            while time.monotonic() - started < self.duration_s:
                tasks.append(asyncio.create_task(self.one(stub, index)))
                index += 1
                await asyncio.sleep(self.rng.expovariate(self.rate))
            stop.set()
            await killer
            await asyncio.gather(*tasks)
            await wait_for_healthy_backends(self.router.address)
            leaks = await self._leaks(stub)
            rss_end = rss_kib(self.router.process.pid)
        return {
            "duration_s": self.duration_s, "rate_per_s": self.rate, "requests": index,
            "outcomes": dict(self.outcomes), "unexpected": self.unexpected[:50], "leaks": leaks,
            "worker_restarts_handled": self.restarts,
            "ttft_p50_s": percentile(self.ttft_s, 50), "ttft_p99_s": percentile(self.ttft_s, 99),
            "e2e_p50_s": percentile(self.e2e_s, 50), "e2e_p99_s": percentile(self.e2e_s, 99),
            "router_rss_kib_start": rss_start, "router_rss_kib_end": rss_end,
        }

    async def _leaks(self, stub, timeout_s: float = 30.0) -> list[str]:
        """What is still held once everything has ended (empty when nothing leaked)."""
        deadline = time.monotonic() + timeout_s
        while True:
            backends = (await stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)).backends
            leaks = [f"{b.name}: {b.state.num_running} running, {b.state.num_waiting} waiting, "
                     f"{b.state.kv_blocks_used} KV blocks, {b.inflight_requests} router credits"
                     for b in backends if (b.state.num_running, b.state.num_waiting, b.state.kv_blocks_used,
                                           b.inflight_requests) != (0, 0, 0, 0)]
            if not leaks or time.monotonic() > deadline:
                return leaks
            await asyncio.sleep(0.5)

    def close(self) -> None:
        for process in (self.router, *self.workers.values()):
            process.terminate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    parser.add_argument("--kill-every-s", type=float, default=120.0, help="mean time between worker kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    soak = Soak(args.model, args.duration_s, args.rate, args.kill_every_s, args.seed)
    try:
        for process in (*soak.workers.values(), soak.router):
            process.wait_for_health()
        report = asyncio.run(soak.run())
    finally:
        soak.close()
    write_json(RESULTS / "soak.json", report)
    print(report)
    return 0 if not report["leaks"] and not report["unexpected"] else 1


if __name__ == "__main__":
    sys.exit(main())
