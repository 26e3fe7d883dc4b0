"""`make bench-vllm-overhead`: what Tandem adds in front of vLLM — a vLLM-engine worker behind Tandem's router
(OpenAI HTTP API) against ``vllm serve`` (vLLM's own OpenAI server) on the same model, the same engine settings
and the same cores, both driven by ``tandem bench --openai``'s client.

Two loads, each run on both servers in turn (the order alternating, the same token ids on both):
- latency: Poisson arrivals at a light rate, so that TTFT is mostly the path, not the queue;
- throughput: the article's seed-burst of 48 requests.

Reports the median TTFT of each server and the added TTFT (median over the repeats), and the output
throughput of each and the share of vLLM's that Tandem keeps. Writes bench/results/vllm-overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from tandem.loadgen.live import OpenAIServer, run_openai_workload, write_run
from tandem.loadgen.results import write_json
from tandem.loadgen.workloads import poisson, seed_burst
from tandem.launch import ServiceProcess, free_port

RESULTS = Path(__file__).resolve().parent / "results"
SERVERS = ("vllm_serve", "tandem")
MAX_NUM_SEQS = 16
BLOCK_SIZE = 32
KV_CACHE_GIB = 1
TARGETS = {"added_ttft_p50": 0.05, "throughput_kept": 0.98}


def loads(vocab_size: int, seed: int) -> dict:
    return {
        "latency": poisson(24, vocab_size, seed=seed, rate_per_s=0.5, output_tokens_mean=24, max_new_tokens=64),
        "throughput": seed_burst(48, vocab_size, seed=seed),
    }


class VllmServe(ServiceProcess):
    """``vllm serve`` (its OpenAI API server module) as a local process, healthy once GET /health answers."""

    def __init__(self, python: str, model: str, log_path: Path, engine_args: list[str], env: dict[str, str]):
        super().__init__("vllm_serve", None, ["--model", model, *engine_args], log_path,
                         command=[python, "-m", "vllm.entrypoints.openai.api_server"], env=env)
        self.url = f"http://{self.address}/v1"

    def wait_for_health(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"vllm serve exited with code {self.process.returncode}; log:\n{self.log()}")
            try:
                if httpx.get(f"http://{self.address}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve was not healthy within {timeout:.0f} s; log:\n{self.log()}")


async def one_run(url: str, name: str, load: str, seed: int, vocab_size: int, out_dir: Path) -> dict:
    async with OpenAIServer(url) as server:
        model = await server.first_model()
        workload = loads(vocab_size, seed)[load]
        await server.warm(model, workload.warm_prefixes)
        run = await run_openai_workload(server, workload, model, label=name)
    summary = write_run(run, workload, out_dir / f"{load}-{name}-{seed}.json", plot=False)
    assert summary["outcomes"] == {"OK": len(workload.requests)}, f"{name} {load}: {summary['outcomes']}"
    return {key: summary[key] for key in ("makespan_s", "output_tok_s", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s")
            if key in summary}


def summarize(runs: list[dict]) -> dict:
    """Each server's median over the repeats, and Tandem's against vLLM's as the median of the per-repeat ratios
    (a repeat sends the same token ids to both)."""
    def of(load: str, server: str, key: str) -> list[float]:
        return [r[key] for r in sorted(runs, key=lambda r: r["repeat"]) if r["load"] == load and r["server"] == server]

    def ratio(load: str, key: str) -> float:
        return statistics.median(t / v for t, v in zip(of(load, "tandem", key), of(load, "vllm_serve", key)))

    summary = {
        "ttft_p50_s": {name: statistics.median(of("latency", name, "ttft_p50_s")) for name in SERVERS},
        "output_tok_s": {name: statistics.median(of("throughput", name, "output_tok_s")) for name in SERVERS},
        "added_ttft_p50": ratio("latency", "ttft_p50_s") - 1,
        "throughput_kept": ratio("throughput", "output_tok_s"),
        "targets": TARGETS,
    }
    summary["targets_met"] = (summary["added_ttft_p50"] <= TARGETS["added_ttft_p50"]
                              and summary["throughput_kept"] >= TARGETS["throughput_kept"])
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="the Python of vLLM's environment (make setup-vllm)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="cores for vLLM (the last ones of this machine)")
    parser.add_argument("--output", type=Path, default=RESULTS / "vllm-overhead.json")
    args = parser.parse_args()

    from tandem.model_files import resolve_model
    from tandem.engine.config import SchedulerConfig

    model = str(resolve_model(None))
    out_dir = args.output.parent / args.output.stem
    cores = sorted(os.sched_getaffinity(0))[-args.threads:]
    # Both vLLMs run on the same cores with the same engine settings; only one is busy at a time.
    binding = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
    batched_tokens = SchedulerConfig().max_num_batched_tokens
    serve = VllmServe(args.vllm_python, model, out_dir / "vllm-serve.log", [
        "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(batched_tokens), "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(KV_CACHE_GIB << 30)], binding)
    worker = ServiceProcess("gpu_worker", None, [
        "--model", model, "--engine", "vllm", "--device", "cpu", "--threads", str(args.threads),
        "--block-size", str(BLOCK_SIZE), "--max-active", str(MAX_NUM_SEQS),
        "--max-batched-tokens", str(batched_tokens), "--kv-cache-gib", str(KV_CACHE_GIB)],
        out_dir / "gpu_worker.log", command=[args.vllm_python, "-m", "gpu_worker"], env=binding)
    http_port = free_port()
    router = ServiceProcess("router", "router_svc", ["--model", model, "--worker", f"gpu=gpu@{worker.address}"],
                            out_dir / "router.log", env={"TANDEM_HTTP_PORT": str(http_port)})
    urls = {"vllm_serve": serve.url, "tandem": f"http://127.0.0.1:{http_port}/v1"}
    report: dict = {"model": model, "vllm_cores": cores, "max_num_seqs": MAX_NUM_SEQS, "block_size": BLOCK_SIZE,
                    "max_num_batched_tokens": batched_tokens, "repeats": args.repeats, "runs": []}
    try:
        serve.wait_for_health()
        worker.wait_for_health(timeout=600)
        router.wait_for_health()
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(model).vocab_size
        for repeat in range(args.repeats):
            order = SERVERS if repeat % 2 == 0 else SERVERS[::-1]
            for load in ("latency", "throughput"):
                for name in order:
                    result = asyncio.run(one_run(urls[name], name, load, repeat, vocab_size, out_dir))
                    report["runs"].append({"server": name, "load": load, "repeat": repeat, **result})
                    print(f"  {load} #{repeat} {name}: TTFT p50 {result['ttft_p50_s'] * 1000:.1f} ms, "
                          f"{result['output_tok_s']:.1f} tok/s", flush=True)
                    write_json(args.output, report)
    finally:
        router.close()
        worker.close()
        serve.close()

    report["summary"] = summarize(report["runs"])
    summary = report["summary"]
    write_json(args.output, report)
    ttft, throughput = summary["ttft_p50_s"], summary["output_tok_s"]
    print(f"median TTFT: vllm serve {ttft['vllm_serve'] * 1000:.1f} ms, Tandem {ttft['tandem'] * 1000:.1f} ms; "
          f"added {summary['added_ttft_p50']:+.1%}; throughput: vllm serve {throughput['vllm_serve']:.1f} tok/s, "
          f"Tandem {throughput['tandem']:.1f} tok/s; kept {summary['throughput_kept']:.1%} (medians of the repeats' "
          f"ratios); targets met: {summary['targets_met']}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
