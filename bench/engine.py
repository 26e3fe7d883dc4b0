"""Engine benchmark on the article's workload, against transformers' own generation paths.

8 requests share a 496-token prefix plus 20 distinct tokens each (516 tokens), generate exactly 128
tokens (EOS ignored) and are submitted together. Tandem runs with max_active 8 after one earlier
request warmed the prefix; each repeat uses fresh suffixes, so only the prefix is ever cached.
Every peer runs the same prompts with the same model, device and dtype in this process, one after
another (``--device cuda`` puts all of them on the GPU, in its natural dtype unless ``--dtype`` says).

TTFT is reported two ways: for one request alone on an idle engine (``cold_*``: nothing cached;
``warm_*``: the prefix cached), which isolates what the prefix cache saves, and for the whole burst
(``burst_cold_*``, ``burst_warm_*``), which adds queueing behind the other requests of the burst.
Writes bench/results/engine.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from tandem.loadgen.results import percentile
from tandem.engine.config import CUDA_GRAPHS, DEFAULT_ENGINE_PRIORITY, ENGINE_PRIORITIES, SchedulerConfig
from tandem.engine.async_engine import AsyncEngine
from tandem.engine.model.factory import build_engine
from tandem.model_files import resolve_model
from tandem.engine.model.runner import DTYPES, resolve_dtype
from tandem.engine.request import Request
from tandem.sampling import SamplingParams
from tandem.structured import StructuredOutput

RESULTS = Path(__file__).resolve().parent / "results"
GREEDY = SamplingParams(temperature=0)
# --structured: an array of records too long to end within the output budget, so every token is masked
STRUCTURED = {"type": "array", "minItems": 40, "items": {
    "type": "object", "required": ["name", "age", "tags"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}}}}
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}


class Prompts:
    """One shared prefix; every batch of prompts appends fresh distinct suffixes to it."""

    def __init__(self, vocab_size: int, prefix_len: int, suffix_len: int, seed: int = 0):
        self._rng = random.Random(seed)
        self._vocab_size = vocab_size
        self._suffix_len = suffix_len
        self.prefix = self._tokens(prefix_len)

    def batch(self, num_requests: int) -> list[list[int]]:
        return [self.prefix + self._tokens(self._suffix_len) for _ in range(num_requests)]

    def unrelated(self, num_requests: int, length: int) -> list[list[int]]:
        return [self._tokens(length) for _ in range(num_requests)]

    def _tokens(self, count: int) -> list[int]:
        return [self._rng.randrange(3, self._vocab_size) for _ in range(count)]


async def tandem_burst(engine: AsyncEngine, prompts, max_new_tokens: int, tag: str,
                       sampling: SamplingParams = GREEDY) -> dict:
    """Submit all prompts at once; measure makespan and client-side TTFT."""
    start = time.perf_counter()
    ttft: list[float] = []
    counts: list[int] = []

    async def one(i: int, prompt: list[int]) -> None:
        request = Request(f"{tag}-{i}", prompt, max_new_tokens, sampling, ignore_eos=True)
        count = 0
        async for output in engine.generate(request):
            if count == 0 and output.token_ids:
                ttft.append(time.perf_counter() - start)
            count += len(output.token_ids)
        counts.append(count)

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    makespan = time.perf_counter() - start
    return {"makespan_s": makespan, "output_tokens": sum(counts), "ttft_s": sorted(ttft)}


async def first_token_latency(engine: AsyncEngine, prompt: list[int], req_id: str) -> float:
    """TTFT of one request alone on an idle engine."""
    start = time.perf_counter()
    async for _ in engine.generate(Request(req_id, prompt, 1, GREEDY, ignore_eos=True)):
        pass
    return time.perf_counter() - start


async def run_tandem(model: str, prompts: Prompts, num_requests: int, max_new_tokens: int, repeats: int,
                     priority: str = DEFAULT_ENGINE_PRIORITY, device: str = "cpu", dtype: str | None = None,
                     cuda_graphs: bool | None = None, sampling: SamplingParams = GREEDY) -> dict:
    engine = build_engine(model, device, dtype,
                          scheduler=SchedulerConfig(max_active_requests=num_requests),
                          cuda_graphs=cuda_graphs)
    rates = engine.rates.rates()
    runner = AsyncEngine(engine, priority=priority)
    runner.start()
    try:
        # TTFT of single requests: prompts of the workload's shape with nothing cached, then with the prefix cached.
        cold_single = []
        for i, prompt in enumerate(prompts.unrelated(num_requests, len(prompts.prefix) + 20)):
            runner.reset_prefix_cache()
            cold_single.append(await first_token_latency(runner, prompt, f"cold-single-{i}"))
        runner.reset_prefix_cache()
        cold_burst = await tandem_burst(runner, prompts.batch(num_requests), max_new_tokens, "cold-burst", sampling)

        runner.reset_prefix_cache()
        await first_token_latency(runner, prompts.batch(1)[0], "warmup")
        warm_single = [
            await first_token_latency(runner, prompt, f"warm-single-{i}") for i, prompt in enumerate(prompts.batch(num_requests))
        ]
        warm_runs = [await tandem_burst(runner, prompts.batch(num_requests), max_new_tokens, f"warm{r}", sampling)
                     for r in range(repeats)]
    finally:
        runner.stop()
    median = sorted(warm_runs, key=lambda run: run["makespan_s"])[len(warm_runs) // 2]
    return {
        "makespan_s": median["makespan_s"],
        "output_tok_s": median["output_tokens"] / median["makespan_s"],
        "output_tokens": median["output_tokens"],
        "warm_runs_makespan_s": [run["makespan_s"] for run in warm_runs],
        "ttft_s": {
            "single_cold": cold_single,
            "single_warm": warm_single,
            "burst_cold": cold_burst["ttft_s"],
            "burst_warm": median["ttft_s"],
        },
        "cuda_graphs": engine.executor.decode_graphs is not None,
        "calibrated_rates": {"prefill_tok_s": rates.prefill_tok_s, "decode_tok_s": rates.decode_tok_s},
    }


def load_hf(model_dir: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as for tandem
    model.generation_config.pad_token_id = 0
    return model


def timed(fn) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = fn()
    return time.perf_counter() - start, outputs


def run_hf_sequential(model, prompts, max_new_tokens: int):
    def go():
        outputs = []
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False,
                                 max_new_tokens=max_new_tokens)
            outputs.append(out[0, len(prompt):].tolist())
        return outputs

    return timed(go)


def run_hf_padded_batch(model, prompts, max_new_tokens: int):
    def go():
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
        return [row[width:].tolist() for row in out]

    return timed(go)


def run_hf_continuous_batching(model, prompts, max_new_tokens: int):
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)

    def go():
        results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        return [list(result.generated_tokens) for result in results.values()]

    return timed(go)


PEERS = {
    "hf_sequential": run_hf_sequential,
    "hf_padded_batch": run_hf_padded_batch,
    "hf_continuous_batching": run_hf_continuous_batching,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=496)
    parser.add_argument("--suffix-tokens", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="warm tandem runs; the median is reported")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peers to run")
    parser.add_argument("--engine-priority", choices=ENGINE_PRIORITIES, default=DEFAULT_ENGINE_PRIORITY,
                        help="the engine thread's scheduling, as the workers' --engine-priority")
    parser.add_argument("--device", default="cpu", help="torch device of Tandem and every peer: cpu, cuda, cuda:1")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="weights and activations of all systems; auto: the device's natural dtype")
    parser.add_argument("--cuda-graphs", choices=list(CUDA_GRAPHS), default="auto",
                        help="Tandem replays steps of decodes from CUDA graphs; auto: on CUDA, as the workers")
    parser.add_argument("--logprobs", type=int, default=None, help="Tandem's burst requests ask for N top logprobs")
    parser.add_argument("--penalties", action="store_true",
                        help="Tandem's burst requests use " + ", ".join(f"{k}={v}" for k, v in PENALTIES.items()))
    parser.add_argument("--structured", action="store_true",
                        help="Tandem's burst requests hold their output to a JSON schema (STRUCTURED)")
    parser.add_argument("--output", type=Path, default=RESULTS / "engine.json")
    args = parser.parse_args()
    structured = StructuredOutput("json_schema", json.dumps(STRUCTURED)) if args.structured else None
    sampling = SamplingParams(temperature=0, logprobs=args.logprobs, structured_output=structured,
                              **(PENALTIES if args.penalties else {}))

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = resolve_dtype(torch.device(args.device), args.dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    model_dir = resolve_model(args.model)
    model = load_hf(model_dir, args.device, dtype)
    prompts = Prompts(model.config.vocab_size, args.prefix_tokens, args.suffix_tokens)
    peer_prompts = prompts.batch(args.requests)

    results: dict[str, dict] = {}
    tandem = asyncio.run(run_tandem(str(model_dir), prompts, args.requests, args.max_new_tokens, args.repeats,
                                    args.engine_priority, args.device, dtype_name, CUDA_GRAPHS[args.cuda_graphs], sampling))
    results["tandem"] = tandem
    print(f"tandem: {tandem['output_tok_s']:.1f} tok/s, makespan {tandem['makespan_s']:.2f} s", flush=True)
    for name in [p for p in args.peers.split(",") if p]:
        seconds, outputs = PEERS[name](model, peer_prompts, args.max_new_tokens)
        tokens = sum(len(o) for o in outputs)
        if tokens != args.requests * args.max_new_tokens:
            raise RuntimeError(f"{name} produced {tokens} tokens, expected {args.requests * args.max_new_tokens}")
        results[name] = {"makespan_s": seconds, "output_tok_s": tokens / seconds, "output_tokens": tokens}
        print(f"{name}: {tokens / seconds:.1f} tok/s, makespan {seconds:.2f} s", flush=True)

    peers = {name: r for name, r in results.items() if name != "tandem"}
    best_peer = max(peers, key=lambda name: peers[name]["output_tok_s"]) if peers else None
    ttft_ms = {}
    for key, values in tandem["ttft_s"].items():
        prefix = "" if key.startswith("single_") else "burst_"
        label = prefix + key.split("_")[1]
        ttft_ms[f"{label}_p50"] = 1000 * percentile(values, 50)
        ttft_ms[f"{label}_p95"] = 1000 * percentile(values, 95)
    report = {
        "benchmark": "engine",
        "workload": {
            "requests": args.requests,
            "prompt_tokens": args.prefix_tokens + args.suffix_tokens,
            "shared_prefix_tokens": args.prefix_tokens,
            "max_new_tokens": args.max_new_tokens,
            "ignore_eos": True,
            "max_active": args.requests,
            "tandem_logprobs": args.logprobs,
            "tandem_penalties": PENALTIES if args.penalties else None,
            "tandem_structured_output": STRUCTURED if args.structured else None,
        },
        "model": str(model_dir),
        "device": args.device,
        "dtype": dtype_name,
        "engine_priority": args.engine_priority,
        "cuda_graphs": tandem["cuda_graphs"],
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None},
        "results": results,
        "ttft_ms": ttft_ms,
        "best_peer": best_peer,
        "speedup_vs_best_peer": tandem["output_tok_s"] / peers[best_peer]["output_tok_s"] if best_peer else None,
        "warm_over_cold_ttft": ttft_ms["warm_p50"] / ttft_ms["cold_p50"],
    }
    report["targets"] = {
        "speedup_vs_best_peer >= 1.5": report["speedup_vs_best_peer"] is not None and report["speedup_vs_best_peer"] >= 1.5,
        "warm_ttft_p50 <= 0.15 * cold_ttft_p50": report["warm_over_cold_ttft"] <= 0.15,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))

    print(f"\n{'system':<24}{'output tok/s':>14}{'makespan s':>12}")
    for name, r in results.items():
        print(f"{name:<24}{r['output_tok_s']:>14.1f}{r['makespan_s']:>12.2f}")
    print(f"\nTTFT p50, one request alone: cold {ttft_ms['cold_p50']:.0f} ms, warm {ttft_ms['warm_p50']:.0f} ms "
          f"(ratio {report['warm_over_cold_ttft']:.3f}, target <= 0.15)")
    print(f"TTFT p50, burst of {args.requests}: cold {ttft_ms['burst_cold_p50']:.0f} ms, "
          f"warm {ttft_ms['burst_warm_p50']:.0f} ms")
    if best_peer:
        print(f"speedup vs best peer ({best_peer}): {report['speedup_vs_best_peer']:.2f}x (target >= 1.5x)")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
